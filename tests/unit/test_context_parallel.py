"""Context parallelism without processes: the load-balanced split and the log-sum-exp merge."""

from __future__ import annotations

import math
import re

import pytest
import torch

from gigatron.errors import GigatronError
from gigatron.parallel import context_parallel as cpm
from gigatron.parallel.context import Grid, ParallelContext


def test_rank_positions_pair_early_and_late_chunks():
    assert cpm.cp_rank_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cpm.cp_rank_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cpm.cp_rank_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    order = cpm.cp_rank_order(16, 4)
    assert sorted(order.tolist()) == list(range(16))
    # Causal work per rank (sum of visible keys over its queries) is the same on every rank.
    work = [int((cpm.cp_rank_positions(32, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_split_and_restore_round_trip():
    x = torch.arange(2 * 24).view(2, 24)
    parts = [cpm.split_for_cp_rank(x, 1, 3, r) for r in range(3)]
    assert parts[2].tolist()[0] == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(cpm.restore_sequence_order(torch.cat(parts, 1), 1, 3), x)
    with pytest.raises(GigatronError, match="not divisible by 2 x --context-parallel-size"):
        cpm.split_for_cp_rank(torch.zeros(1, 10), 1, 3, 0)


def test_batch_split_keeps_attention_mask_whole():
    pctx = ParallelContext(grid=Grid(cp=2), rank=1)
    batch = {
        "tokens": torch.arange(8).view(1, 8),
        "labels": torch.arange(1, 9).view(1, 8),
        "loss_mask": torch.ones(1, 8),
        "position_ids": torch.arange(8).view(1, 8),
        "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool).triu(1),
    }
    local = cpm.get_batch_on_this_cp_rank(batch, pctx)
    assert local["tokens"].tolist() == [[2, 3, 4, 5]]
    assert local["labels"].tolist() == [[3, 4, 5, 6]]
    assert local["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert local["attention_mask"] is batch["attention_mask"]


def _full_attention(q, k, v, hidden, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    scores = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(hidden, -math.inf)
    return torch.nan_to_num(scores.softmax(-1)) @ v.double()


@pytest.mark.parametrize("fused", [True, False])
def test_merge_of_key_blocks_equals_full_attention(fused):
    """Keys cut into three blocks, each attended alone and merged: the full attention, forward
    and backward (per-block gradients from the final output and log-sum-exp), including rows
    that one block hides entirely and a row that every block hides."""
    torch.manual_seed(0)
    b, h, g, sq, d = 2, 4, 2, 6, 8
    blocks = [5, 4, 7]
    sk = sum(blocks)
    scale = 0.3
    q = torch.randn(b, h, sq, d)
    k = torch.randn(b, g, sk, d)
    v = torch.randn(b, g, sk, d)
    hidden = torch.rand(b, 1, sq, sk) < 0.3
    hidden[:, :, 1, :5] = True  # row 1 sees nothing of block 0
    hidden[1, :, 2, :] = True  # row 2 of sample 1 sees nothing at all
    kernel = cpm._Kernel(scale, fused=fused)

    out = torch.zeros(b, h, sq, d)
    lse = torch.full((b, h, sq), -math.inf)
    starts = [0, 5, 9]
    for index, (start, size) in enumerate(zip(starts, blocks)):
        keys = slice(start, start + size)
        block_out, block_lse = kernel.forward(
            q, k[:, :, keys], v[:, :, keys], hidden[..., keys], False, index
        )
        cpm.merge_partial(out, lse, block_out, block_lse)

    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    expected = _full_attention(*leaves, hidden, scale)
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[1, :, 2]).all() and torch.isfinite(lse[0]).all()

    dout = torch.randn(b, h, sq, d)
    expected.backward(dout.double())
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for index, (start, size) in enumerate(zip(starts, blocks)):
        keys = slice(start, start + size)
        parts = kernel.backward(
            dout, q, k[:, :, keys], v[:, :, keys], out, lse, hidden[..., keys], False, index
        )
        dq += parts[0]
        dk[:, :, keys] += parts[1]
        dv[:, :, keys] += parts[2]
    for mine, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(mine.double(), leaf.grad, atol=1e-5, rtol=1e-5)


def test_causal_diagonal_block_matches_math_kernel():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    results = []
    for fused in (True, False):
        kernel = cpm._Kernel(0.25, fused=fused)
        out, lse = kernel.forward(q, k, v, None, True, 0)
        grads = kernel.backward(torch.ones_like(out), q, k, v, out, lse, None, True, 0)
        results.append((out, lse, *grads))
    for fused_value, math_value in zip(*results):
        torch.testing.assert_close(fused_value.float(), math_value.float(), atol=1e-5, rtol=1e-5)


def _parse(*flags: str, world_size: int = 4):
    from gigatron.config import parse_config

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    return parse_config([*base, *flags], world_size=world_size)


def test_flag_rules():
    cfg = _parse("--seq-length", "32", "--context-parallel-size", "2", "--cp-comm-type", "a2a")
    assert cfg.parallel.cp_comm_type == ["a2a"]
    assert _parse("--seq-length", "32").parallel.cp_comm_type == ["p2p"]  # Megatron's default
    for flags, message in (
        (["--seq-length", "30", "--context-parallel-size", "2"], "not divisible by 2 x"),
        (["--seq-length", "32", "--context-parallel-size", "4", "--cp-comm-type", "a2a",
          "--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "heads per tensor-parallel rank do not divide"),
        (["--seq-length", "36", "--context-parallel-size", "2", "--tensor-model-parallel-size",
          "4", "--sequence-parallel"], "(--sequence-parallel splits"),
        (["--cp-comm-type", "p2p", "a2a", "p2p"], "give one, or one per layer"),
    ):  # fmt: skip
        with pytest.raises(GigatronError, match=re.escape(message)):
            _parse(*flags, world_size=8)


def test_flash_attn_is_refused_where_it_cannot_run():
    from types import SimpleNamespace

    config = SimpleNamespace(
        use_flash_attn=True, kv_channels=16, attention_dropout=0.0, causal_attention=True
    )
    pctx = ParallelContext.single()
    for part, comm in ((cpm.RingAttention, "p2p"), (cpm.AllGatherAttention, "allgather")):
        with pytest.raises(GigatronError, match=f"--use-flash-attn with --cp-comm-type {comm}"):
            part(config, pctx, 1, None)
    with pytest.raises(GigatronError, match="--cp-comm-type ring: unknown"):
        cpm.context_parallel_core_attention(["ring"], None)


def test_packed_batch_is_split_per_document():
    """Documents of 8, 4 and 4 positions at cp 2: every document is cut into 4 chunks and rank r
    holds chunks r and 3 - r of each; the mask is reordered with its queries and keys."""
    starts = torch.tensor([[0] * 8 + [8] * 4 + [12] * 4])
    held = {0: [0, 1, 6, 7, 8, 11, 12, 15], 1: [2, 3, 4, 5, 9, 10, 13, 14]}
    order = cpm.document_split_order(starts, 2)
    assert sorted(order[0].tolist()) == list(range(16))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]
    for rank, positions in held.items():
        batch = {
            "tokens": torch.arange(16)[None] + 100,
            "loss_mask": torch.arange(16.0)[None, :, None],  # a trailing dimension is kept
            "attention_mask": mask,
            "document_start": starts,
        }
        local = cpm.get_batch_on_this_cp_rank(batch, ParallelContext(grid=Grid(cp=2), rank=rank))
        assert local["tokens"][0].tolist() == [100 + p for p in positions]
        assert local["loss_mask"][0, :, 0].tolist() == positions
        assert "document_start" not in local and "document_start" in batch
        # The mask follows the reordering: entry (i, j) is the original (order[i], order[j]).
        reordered = local["attention_mask"][0, 0]
        assert torch.equal(reordered, mask[0, 0][order[0]][:, order[0]])
    # One process: the key is dropped, nothing else changes.
    single = cpm.get_batch_on_this_cp_rank({"document_start": starts}, ParallelContext.single())
    assert single == {}
    with pytest.raises(GigatronError, match="multiple of 2 x --context-parallel-size 2"):
        cpm.document_split_order(torch.tensor([[0] * 6 + [6] * 10]), 2)
