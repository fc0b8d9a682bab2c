"""--recompute-modules moe, moe_act, shared_experts: the same loss and gradients as without
recomputation, and the recomputed parts really run again in backward."""

from __future__ import annotations

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "100",
         "--swiglu", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "64",
         "--moe-aux-loss-coeff", "0.01"]  # fmt: skip


def _run(*modules: str):
    extra = ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    cfg = parse_config([*FLAGS, *(extra if modules else [])])
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), 100)
    model.train()
    layer = model.decoder.layers["0"].mlp
    calls = {"moe": 0, "shared": 0, "act": 0}
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__("moe", calls["moe"] + 1))
    layer.shared_experts.register_forward_pre_hook(
        lambda *_: calls.__setitem__("shared", calls["shared"] + 1)
    )
    activation = layer.experts.activation

    def counted(h):
        calls["act"] += 1
        return activation(h)

    layer.experts.activation = counted
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens, torch.arange(16).expand(2, 16))
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads, calls


@pytest.mark.parametrize(
    "modules, again",
    [(("moe",), {"moe", "shared", "act"}), (("moe_act",), {"act"}),
     (("shared_experts",), {"shared"})],
)  # fmt: skip
def test_recomputed_moe_parts_give_the_same_gradients(modules, again):
    logits, grads, calls = _run()
    assert calls["moe"] == calls["shared"] == 1 and calls["act"] > 0
    got_logits, got_grads, got_calls = _run(*modules)
    torch.testing.assert_close(got_logits, logits, rtol=0, atol=0)
    assert got_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    for part in ("moe", "shared", "act"):
        factor = 2 if part in again else 1
        assert got_calls[part] == factor * calls[part], (modules, part, got_calls, calls)
