"""Fine-grained activation offloading (`--fine-grained-activation-offloading --offload-modules`):
losses and gradients equal the run without it exactly, the chosen modules' saved activations
(and not their parameters) go to host copies, evaluation offloads nothing, and Megatron's rules."""

from __future__ import annotations

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.optim.build import build_optimizer
from gigatron.optim.lr_schedule import build_lr_scheduler
from gigatron.parallel.context import ParallelContext

VOCAB, BATCH, SEQ, HIDDEN, LAYERS = 128, 4, 16, 64, 2
ALL = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


def _argv(*extra: str) -> list[str]:
    return [
        "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size",
        str(VOCAB), "--position-embedding-type", "rope", "--swiglu", "--lr", "1e-2",
        "--lr-decay-style", "constant", "--train-iters", "10", "--micro-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH), *extra,
    ]  # fmt: skip


def _train(*extra: str, steps: int = 3):
    """Losses, final parameters and the offload counter of `steps` Adam steps (dropout on)."""
    cfg = parse_config(_argv(*extra))
    pctx = ParallelContext.single()
    torch.manual_seed(0)
    chunks = get_family("gpt").build_model(cfg, pctx, VOCAB)
    opt = build_optimizer(cfg, chunks, pctx)
    schedule = build_lr_scheduler(cfg, opt)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        schedule.step(BATCH)
        logits = chunks[0](tokens[:, :-1], None)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}
    return losses, params, getattr(chunks[0], "activation_offload", None), chunks[0]


def test_offload_equals_no_offload_and_moves_activations():
    offload = ["--fine-grained-activation-offloading", "--min-offloaded-tensor-size", "0"]
    losses, params, counter, _ = _train()
    assert counter is None
    off_losses, off_params, counter, model = _train(*offload, "--offload-modules", *ALL)
    assert off_losses == losses  # exactly
    for name, value in params.items():
        assert torch.equal(off_params[name], value), name
    assert sorted(counter.tensors) == sorted(ALL)
    # qkv_linear keeps its input [s, b, h] (fp32) per layer and step, never its weight.
    assert counter.bytes["qkv_linear"] == 3 * LAYERS * SEQ * BATCH * HIDDEN * 4
    # Evaluation (no autograd graph) offloads nothing.
    before = dict(counter.bytes)
    with torch.no_grad():
        model(torch.zeros(BATCH, SEQ, dtype=torch.long), None)
    assert counter.bytes == before
    # A size threshold above every activation offloads nothing; the losses stay equal.
    big_losses, _, big, _ = _train(*offload[:1], "--offload-modules", "core_attn", steps=1)
    assert big_losses == losses[:1] and big.bytes == {}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--offload-modules", "core_attn"], "needs --fine-grained-activation-offloading"),
        (["--fine-grained-activation-offloading"], "needs --offload-modules"),
        (["--fine-grained-activation-offloading", "--offload-modules", "expert_fc1"], "choose"),
        (["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"], "add core"),
        (
            [
                "--fine-grained-activation-offloading",
                "--offload-modules",
                "core_attn",
                "--recompute-activations",
            ],
            "choose one",
        ),  # fmt: skip
        (
            [
                "--fine-grained-activation-offloading",
                "--offload-modules",
                "core_attn",
                "--torch-compile",
            ],
            "with --torch-compile",
        ),  # fmt: skip
    ],
)
def test_refusals(extra, message):
    with pytest.raises(GigatronError, match=message):
        get_family("gpt").build_model(parse_config(_argv(*extra)), ParallelContext.single(), VOCAB)
