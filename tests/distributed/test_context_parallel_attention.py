"""Context-parallel attention equals attention over the whole sequence: the ring (p2p, both
kernels), the all-gather and the all-to-all variants, forward and backward, with causal, full and
explicit masks, grouped-query attention, at cp = 2 and 4. Also: the ring skips what the causal
mask hides and every rank does the same work; dropout in the ring has exact gradients."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gigatron.parallel import context_parallel as cpm
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.random import ModelParallelRNG

pytestmark = pytest.mark.distributed

SEQ, BATCH, HEADS, GROUPS, DIM = 32, 2, 4, 2, 8
SCALE = 1.0 / math.sqrt(DIM)


def _reference(q, k, v, hidden):
    """Whole-sequence attention in float64; q [s, b, h, d], k/v [s, b, g, d], hidden [b,1,s,s]."""
    rep = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
    qh, kh, vh = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    scores = (qh @ kh.transpose(-1, -2) * SCALE).masked_fill(hidden, -math.inf)
    probs = torch.nan_to_num(scores.softmax(-1))  # rows with no visible key: 0
    return (probs @ vh).permute(2, 0, 1, 3)


def _masks():
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)
    # Padding (bidirectional, like BERT): sample 0 pads its last 11 tokens, sample 1 none.
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keep[0, -11:] = False
    padding = ~(keep[:, None, :, None] & keep[:, None, None, :])
    # Two documents per sample (reset attention mask).
    docs = causal.clone()
    docs[:, :, 13:, :13] = True
    # BERT's: padded keys hidden from every query, [b, 1, 1, s].
    keys = ~keep[:, None, None, :]
    return {
        "causal": causal,
        "full": torch.zeros_like(causal),
        "padding": padding,
        "docs": docs,
        "keys": keys,
    }


def _all_gather_seq(x: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(pctx.cp_size)]
    dist.all_gather(parts, x.contiguous(), group=pctx.group("cp"))
    return cpm.restore_sequence_order(torch.cat(parts), 0, pctx.cp_size)


def _config(causal: bool):
    return SimpleNamespace(
        kv_channels=DIM,
        attention_dropout=0.0,
        use_flash_attn=False,
        causal_attention=causal,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        attention_softmax_in_fp32=False,
        apply_query_key_layer_scaling=False,
    )


def _build(kind: str, pctx: ParallelContext, causal: bool):
    config = _config(causal)
    rng = ModelParallelRNG(1, "cpu")
    if kind == "a2a":
        return cpm.UlyssesAttention(config, pctx, 1, rng, _WholeSequence(causal))
    return {"p2p": cpm.RingAttention, "allgather": cpm.AllGatherAttention}[kind](
        config, pctx, 1, rng
    )


class _WholeSequence(torch.nn.Module):
    """Ordinary attention on whole sequences (what a2a wraps)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, attention_mask):
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qh,
            kh,
            vh,
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None and self.causal,
            scale=SCALE,
            enable_gqa=True,
        )
        return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _check_case(pctx, kind, mask_name, groups, fused=True):
    masks = _masks()
    hidden = masks[mask_name]
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator)
    k = torch.randn(SEQ, BATCH, groups, DIM, generator=generator)
    v = torch.randn(SEQ, BATCH, groups, DIM, generator=generator)
    dout = torch.randn(SEQ, BATCH, HEADS, DIM, generator=generator)
    full = [t.double().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full, hidden)
    expected.backward(dout.double())

    n, r = pctx.cp_size, pctx.cp_rank
    local = [cpm.split_for_cp_rank(t, 0, n, r).requires_grad_() for t in (q, k, v)]
    # causal and full are given as flags (the model passes no mask); the others as masks.
    causal = mask_name == "causal"
    mask = None if mask_name in ("causal", "full") else hidden
    if kind == "p2p-math":
        out = cpm.ring_attention(
            *local, pctx, causal=causal, scale=SCALE, attention_mask=mask, fused=False
        )
        out = out.reshape(out.shape[0], BATCH, -1)
    else:
        out = _build(kind, pctx, causal)(*local, mask)
    out.backward(cpm.split_for_cp_rank(dout, 0, n, r).reshape(out.shape))
    got = _all_gather_seq(out.detach(), pctx).view_as(expected)
    where = f"{kind} {mask_name} groups={groups} cp={n}"
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=2e-5, msg=where)
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(
            _all_gather_seq(mine.grad, pctx).double(),
            ref.grad,
            atol=5e-5,
            rtol=5e-5,
            msg=f"d{name} {where}",
        )


def _work_balance(pctx):
    """Score elements computed per rank: causal skips the hidden halves, an explicit causal
    mask skips the same, and every rank does the same amount."""
    n = pctx.cp_size
    c = SEQ // (2 * n)
    q = torch.randn(SEQ // n, BATCH, HEADS, DIM)
    k = torch.randn(SEQ // n, BATCH, GROUPS, DIM)
    counts = {}
    for label, causal, mask in (
        ("causal", True, None),
        ("mask", False, _masks()["causal"]),
        ("full", False, None),
    ):
        stats: dict[str, float] = {}
        cpm.ring_attention(
            q, k, k, pctx, causal=causal, scale=SCALE, attention_mask=mask, stats=stats
        )
        counts[label] = stats["score_elements"]
    assert counts["causal"] == (2 * c) ** 2 + (n - 1) * (2 * c) * c
    assert counts["mask"] == counts["causal"]
    assert counts["full"] == n * (2 * c) ** 2
    per_rank = torch.tensor([counts["causal"]], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(n)]
    dist.all_gather(gathered, per_rank, group=pctx.group("cp"))
    assert len({t.item() for t in gathered}) == 1, "causal work is not balanced"


def _dropout_gradient(pctx):
    """Ring attention with dropout (explicit kernel): the backward is the exact derivative of the
    forward (a directional finite difference in float64, all ranks perturbing together), the
    masks repeat for a given seed and differ from no dropout."""
    generator = torch.Generator().manual_seed(3 + pctx.cp_rank)
    sl = SEQ // pctx.cp_size
    x = [
        torch.randn(sl, 1, h, DIM, generator=generator, dtype=torch.float64)
        for h in (HEADS, GROUPS, GROUPS)
    ]
    weights = torch.randn(sl, 1, HEADS, DIM, generator=generator, dtype=torch.float64)

    def total(inputs, p=0.25):
        out = cpm.ring_attention(
            *inputs, pctx, causal=True, scale=SCALE, dropout_p=p, dropout_seed=99
        )
        return (out * weights).sum().reshape(1)

    leaves = [t.clone().requires_grad_() for t in x]
    total(leaves).sum().backward()
    for trial in range(3):
        direction = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in x]
        eps = 1e-6
        plus = _global_sum(total([a + eps * d for a, d in zip(x, direction)]), pctx)
        minus = _global_sum(total([a - eps * d for a, d in zip(x, direction)]), pctx)
        numeric = (plus - minus) / (2 * eps)
        analytic = _global_sum(
            sum((leaf.grad * d).sum() for leaf, d in zip(leaves, direction)).reshape(1), pctx
        )
        assert abs(numeric - analytic) < 1e-6 * max(1.0, abs(analytic)), (trial, numeric, analytic)
    again = _global_sum(total(x), pctx)
    assert again == _global_sum(total(x), pctx)
    assert abs(again - _global_sum(total(x, p=0.0), pctx)) > 1e-3


def _global_sum(value: torch.Tensor, pctx) -> float:
    value = value.detach().clone()
    dist.all_reduce(value, group=pctx.group("cp"))
    return value.item()


def _worker(rank, world_size, cases):
    pctx = ParallelContext.from_sizes(cp=world_size)
    for kind, mask_name, groups in cases:
        _check_case(pctx, kind, mask_name, groups)
    _work_balance(pctx)
    _dropout_gradient(pctx)


_CASES_CP2 = [
    (kind, mask, groups)
    for kind in ("p2p", "p2p-math", "allgather", "a2a")
    for mask in ("causal", "full", "padding", "docs", "keys")
    for groups in (GROUPS, HEADS)
]
# At cp = 4 the GQA groups (2) do not divide over the ranks: a2a repeats them.
_CASES_CP4 = [
    (kind, mask, GROUPS)
    for kind in ("p2p", "p2p-math", "allgather", "a2a")
    for mask in ("causal", "full", "padding", "docs", "keys")
]


def test_cp2_equals_whole_sequence_attention():
    run_distributed(_worker, 2, _CASES_CP2)


def test_cp4_equals_whole_sequence_attention():
    run_distributed(_worker, 4, _CASES_CP4)
