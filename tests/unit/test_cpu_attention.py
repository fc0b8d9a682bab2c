"""models/cpu_attention.py: causal attention with dropout on CPU, block by block: its output and
gradients against softmax by hand with its own mask, the core attention's draws on the
model-parallel stream, and the same operator inside compiled graphs (also under dynamo's
checkpoint, and in a compiled GPT layer, with no inductor random numbers left there)."""

from __future__ import annotations

import math

import pytest
import torch
from test_transformer import tiny_config
from torch.utils.checkpoint import checkpoint

from gigatron.models import build_model
from gigatron.models.compile import transformer_layers
from gigatron.models.cpu_attention import BLOCK_ROWS, cpu_causal_attention, row_blocks
from gigatron.models.dropout import dropout_keep_scale, keep_mask
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG

SEQ = 2 * BLOCK_ROWS + 44  # three blocks, the last one short


def _qkv(b: int, n: int, s: int, d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, s, d, generator=g).requires_grad_() for _ in range(3)]


def _full_mask(keep: torch.Tensor, heads: int, seq: int) -> torch.Tensor:
    """The operator's flat keep buffer as a [heads, seq, seq] mask (False above the diagonal)."""
    full = torch.zeros(heads, seq, seq, dtype=torch.bool)
    for start, end, offset in row_blocks(seq):
        size = heads * (end - start) * end
        block = keep[heads * offset : heads * offset + size].view(heads, end - start, end)
        full[:, start:end, :end] = block
    return full.tril()


def _by_hand(q, k, v, keep, scale, p):
    s = q.shape[-2]
    scores = (q * scale) @ k.transpose(-1, -2)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) * keep * dropout_keep_scale(p)) @ v


def test_output_and_gradients_are_softmax_by_hand_with_its_mask():
    b, n, d, p, scale = 2, 3, 8, 0.2, 0.3
    q, k, v = _qkv(b, n, SEQ, d)
    torch.manual_seed(4)
    out, _, keep = cpu_causal_attention(q, k, v, p, scale)
    mask = _full_mask(keep, b * n, SEQ).view(b, n, SEQ, SEQ)
    lower = mask.new_ones(SEQ, SEQ).tril()
    assert abs(1 - mask.sum().item() / (b * n * lower.sum().item()) - p) < 0.01
    reference = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    by_hand = _by_hand(*reference, mask, scale, p)
    torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    by_hand.backward(grad)
    for mine, theirs in zip((q, k, v), reference, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq", [16, SEQ])
def test_core_attention_draws_its_blocks_from_the_model_parallel_stream(seq):
    cfg = tiny_config(attention_dropout=0.3, num_query_groups=2, group_query_attention=True)
    cfg.model.seq_length = cfg.model.max_position_embeddings = seq
    (model,) = build_model(cfg, ParallelContext.single())
    core = model.get_submodule("decoder.layers.0.self_attention.core_attention").train()
    b, heads, dim = 2, 4, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, b, heads, dim, generator=g)
    k, v = (torch.randn(seq, b, 2, dim, generator=g) for _ in range(2))
    state = core.rng.get_state()
    out = core(q, k, v, None)
    rng = ModelParallelRNG(0)
    rng.set_state(state)
    mask = torch.zeros(b * heads, seq, seq, dtype=torch.bool)
    with rng.fork():  # block by block, in order, as the operator draws them
        for start, end, _ in row_blocks(seq):
            mask[:, start:end, :end] = keep_mask(torch.Size((b * heads, end - start, end)), 0.3)[0]
    qb = q.permute(1, 2, 0, 3)
    kb, vb = (t.permute(1, 2, 0, 3).repeat_interleave(2, dim=1) for t in (k, v))
    by_hand = _by_hand(qb, kb, vb, mask.view(b, heads, seq, seq), 1 / math.sqrt(dim), 0.3)
    torch.testing.assert_close(out, by_hand.permute(2, 0, 1, 3).reshape(seq, b, -1))


def _attention(q, k, v):
    return cpu_causal_attention(q.sin(), k, v, 0.3, 0.25)[0].cos()


def _checkpointed_attention(q, k, v):
    return checkpoint(_attention, q, k, v, use_reentrant=False)


def _run(fn, seed: int = 5) -> list[torch.Tensor]:
    q, k, v = _qkv(2, 2, 200, 8)
    torch.manual_seed(seed)
    out = fn(q, k, v)
    out.pow(2).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("fn", [_attention, _checkpointed_attention])
def test_a_compiled_graph_runs_the_operator_with_the_eager_mask(fn):
    eager = _run(fn)
    torch._dynamo.reset()
    compiled = _run(torch.compile(fn, backend="inductor"))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_run(fn, seed=6)[0], eager[0])  # the mask acts


def test_a_compiled_gpt_layer_calls_the_cpu_operators_and_draws_nothing_itself():
    cfg = tiny_config(attention_dropout=0.1, hidden_dropout=0.1)
    (model,) = build_model(cfg, ParallelContext.single())
    layer = transformer_layers([model.train()])[0]
    targets: list[str] = []

    def record(graph_module, _inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    x = torch.randn(cfg.model.seq_length, 2, 64, requires_grad=True)
    torch._dynamo.reset()
    torch.compile(layer.forward, backend=record)(x, None, None)
    assert targets.count("gigatron.cpu_causal_attention.default") == 1
    assert targets.count("gigatron.cpu_dropout.default") == 2  # the two residual branches
    assert not [t for t in targets if "dropout" in t and "gigatron" not in t]
