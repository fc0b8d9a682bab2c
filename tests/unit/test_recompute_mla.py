"""--recompute-modules mla_up_proj: multi-latent attention's up projections and RoPE run again
in backward, with the loss and gradients of the run without recomputation."""

from __future__ import annotations

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "100",
         "--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", "16",
         "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
         "--position-embedding-type", "rope", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1"]  # fmt: skip


def _run(flags: list[str], recompute: bool):
    extra = ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]
    cfg = parse_config([*flags, *(extra if recompute else [])])
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), 100)
    model.train()
    calls = []
    for layer in model.decoder.layers.values():
        up = layer.self_attention.linear_kv_up_proj
        up.register_forward_pre_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)  # the same dropout masks in both runs
    logits = model(tokens, torch.arange(16).expand(2, 16))
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, len(calls)


@pytest.mark.parametrize("query_latent", [True, False])
def test_mla_up_proj_recompute_gives_the_same_gradients(query_latent):
    flags = [*FLAGS, *(["--q-lora-rank", "24"] if query_latent else [])]
    logits, grads, calls = _run(flags, False)
    got_logits, got_grads, got_calls = _run(flags, True)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=0)
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert calls == 2 and got_calls == 4  # once per layer, and again in backward


def test_mla_up_proj_needs_multi_latent_attention():
    with pytest.raises(GigatronError, match="add --multi-latent-attention"):
        parse_config(["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"])
