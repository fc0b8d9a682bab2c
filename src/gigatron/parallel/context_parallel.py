"""Context parallelism: every sequence is split across the cp ranks, attention crosses them.

The split (load-balanced for causal attention). The sequence is cut into 2N chunks of
c = seq / 2N tokens and cp rank r holds chunks r and 2N-1-r (in that order). Under a causal mask
an early chunk attends to little and a late chunk to much, so pairing them gives every rank the
same attention work. `get_batch_on_this_cp_rank` applies the split to tokens, labels, loss mask
and position ids (positions follow their chunks, so learned and rotary embeddings are right);
masks of keys (an attention mask [b, 1, s or 1, s], BERT's padding mask) stay whole, in sequence
order: each rank picks the rows of its own queries and the columns of the keys it attends to.
Gathered tensors are in "rank order" (rank 0's two chunks, rank 1's, ...); `cp_rank_order`
gives the sequence position of each gathered row. A packed sample (several documents, each
padded to a multiple of 2N positions) is split per document instead, as Megatron does for the
THD layout: rank r holds chunks r and 2N-1-r of every document (`document_split_order`), so
each rank's attention work is balanced document by document. This is done by reordering the
sample (masks included) so that the whole-sequence split gives those positions: the attention
parts, which follow the mask, need nothing else.

The attention, three ways (`--cp-comm-type`); each is a core-attention part with the interface
`(q [sl, b, np, hn], k [sl, b, ng, hn], v, attention_mask) -> [sl, b, np * hn]` where sl = seq / cp:
- `p2p` (`RingAttention`): key/value blocks travel around the ring; each rank attends with its
  queries to one block at a time and merges the partial results with the log-sum-exp rule in
  float32. The next block's send/receive is posted before the current block's compute, so the
  communication hides behind it. Blocks (or halves of blocks) that the mask hides entirely are
  skipped. The backward pass runs the ring the other way: key/value blocks travel again, with an
  accumulator of their gradients that every rank adds its part to; after N steps each
  accumulator arrives home.
- `a2a` (`UlyssesAttention`): an all-to-all trades heads for sequence (each rank gets the whole
  sequence for np / cp heads), ordinary attention runs, and a second all-to-all trades back.
- `allgather` (`AllGatherAttention`): keys and values are all-gathered, each rank attends with
  its own queries. The simplest: the reference for the other two.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.parallel.collectives import (
    all_to_all_context_parallel,
    gather_from_context_parallel_region,
)
from gigatron.parallel.context import ParallelContext

CP_COMM_TYPES = ("p2p", "a2a", "allgather")

# ---- the load-balanced split ----------------------------------------------------------------


def check_cp_seq_length(seq_length: int, cp_size: int) -> None:
    """The sequence must cut into 2 x cp equal chunks."""
    if seq_length % (2 * cp_size):
        raise GigatronError(
            f"sequence length {seq_length}: not divisible by 2 x --context-parallel-size "
            f"{cp_size} = {2 * cp_size} (the load-balanced split cuts it into that many chunks); "
            "pick a multiple of it"
        )


def cp_rank_positions(
    seq_length: int, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks cp_rank and 2 cp - 1 - cp_rank."""
    check_cp_seq_length(seq_length, cp_size)
    c = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange(
        (2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c, device=device
    )
    return torch.cat([first, second])


def cp_rank_order(
    seq_length: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Sequence position of each row of a tensor gathered over cp (rank 0's rows first)."""
    return torch.cat([cp_rank_positions(seq_length, cp_size, r, device) for r in range(cp_size)])


def split_for_cp_rank(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (a copy: seq / cp rows)."""
    if cp_size == 1:
        return x
    seq = x.shape[dim]
    check_cp_seq_length(seq, cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def restore_sequence_order(gathered: torch.Tensor, dim: int, cp_size: int) -> torch.Tensor:
    """Undo the split: rows gathered in rank order along `dim` back in sequence order."""
    if cp_size == 1:
        return gathered
    order = cp_rank_order(gathered.shape[dim], cp_size, gathered.device)
    return gathered.index_select(dim, torch.argsort(order))


def sequence_positions(
    local_length: int, pctx: ParallelContext, device: torch.device | str | None = None
) -> torch.Tensor:
    """Sequence positions of this rank's `local_length` tokens (0..n-1 without cp)."""
    if pctx.cp_size == 1:
        return torch.arange(local_length, device=device)
    return cp_rank_positions(local_length * pctx.cp_size, pctx.cp_size, pctx.cp_rank, device)


# Batch entries that mask keys over the whole sequence: not split (see the module docstring).
# `padding_mask` [b, s] is BERT's: it becomes the key mask of every query.
WHOLE_SEQUENCE_KEYS = ("attention_mask", "padding_mask")
# A packed batch's [b, s] first position of each position's document (data/packing.py): with it
# the split is per document. Read here, not passed on.
DOCUMENT_START = "document_start"


def document_split_order(document_start: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The load-balanced split per document, as an order of positions [b, s]: each document
    (its length a multiple of 2 cp) is cut into 2 cp chunks and rank r holds chunks r and
    2 cp - 1 - r of every document, in sequence order. Reordering a sample by the result makes
    the whole-sequence split (`split_for_cp_rank`) give each rank exactly those positions."""
    b, s = document_start.shape
    start = document_start.long()
    ones = torch.ones_like(start)
    length = torch.zeros_like(start).scatter_add_(1, start, ones).gather(1, start)
    if bool((length % (2 * cp_size)).any()):
        raise GigatronError(
            f"packed documents: each must fill a multiple of 2 x --context-parallel-size "
            f"{cp_size} positions for the split per document; pack them with the run's "
            "--context-parallel-size"
        )
    offset = torch.arange(s, device=start.device).expand(b, s) - start
    chunk = offset // (length // (2 * cp_size))
    owner = torch.where(chunk < cp_size, chunk, 2 * cp_size - 1 - chunk)
    by_rank = torch.argsort(owner, dim=1, stable=True)  # rank 0's positions, rank 1's, ...
    return by_rank[:, torch.argsort(cp_rank_order(s, cp_size, start.device))]


def _reorder(key: str, value: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`value` with its sequence dimension(s) in `order` [b, s]: both of a square mask."""
    if value is None or value.dim() < 2:
        return value
    if key not in WHOLE_SEQUENCE_KEYS:
        index = order.reshape(*order.shape, *([1] * (value.dim() - 2)))
        return value.gather(1, index.expand(*order.shape, *value.shape[2:]))
    b, h, q, s = value.shape
    if q > 1:
        value = value.gather(2, order[:, None, :, None].expand(b, h, s, s))
    return value.gather(3, order[:, None, None, :].expand(b, h, q, s))


def get_batch_on_this_cp_rank(
    batch: dict[str, torch.Tensor], pctx: ParallelContext
) -> dict[str, torch.Tensor]:
    """This rank's chunks of every [batch, seq, ...] entry (tokens, labels, loss_mask,
    position_ids, token types); masks of keys (WHOLE_SEQUENCE_KEYS) and per-sample entries
    ([batch], e.g. BERT's is_random) stay whole. A packed batch (DOCUMENT_START) is split per
    document: every entry, masks included, is first reordered by `document_split_order`, so
    the attention parts (which follow the mask) see a sequence in the order of the split."""
    batch = dict(batch)
    starts = batch.pop(DOCUMENT_START, None)
    if pctx.cp_size == 1:
        return batch
    if starts is not None:
        order = document_split_order(starts, pctx.cp_size)
        batch = {key: _reorder(key, value, order) for key, value in batch.items()}
    return {
        key: value
        if key in WHOLE_SEQUENCE_KEYS or value is None or value.dim() < 2
        else split_for_cp_rank(value, 1, pctx.cp_size, pctx.cp_rank)
        for key, value in batch.items()
    }


# ---- per-block attention with its log-sum-exp -----------------------------------------------
# q [b, h, sq, d], k / v [b, g, sk, d] (h a multiple of g: grouped-query attention), an optional
# bool mask [b, 1, sq, sk] with True = hidden. Forward returns (out [b, h, sq, d] in q's dtype,
# lse [b, h, sq] in the accumulation dtype); rows the mask hides entirely have lse = -inf.
# Two kernels: PyTorch's fused CPU flash kernel (memory-efficient, no dropout) and explicit
# math in float32 (any device, dropout; the scores of one block exist only for the call).

_FUSED_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FUSED_CPU_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that attend to nothing) replaced by 0, so exp(score - lse) is 0."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)


@dataclass(frozen=True)
class _Kernel:
    """How one block is attended: scale, causal (square blocks on the diagonal), dropout."""

    scale: float
    dropout_p: float = 0.0
    dropout_seed: int = 0
    fused: bool = True

    def use_fused(self, q: torch.Tensor) -> bool:
        return (
            self.fused
            and _FUSED_CPU is not None
            and q.device.type == "cpu"
            and self.dropout_p == 0.0
        )

    def keep(self, shape, device, block_id: int) -> torch.Tensor | None:
        """Dropout's keep mask of one block, scaled by 1 / (1 - p); the same in the backward."""
        if self.dropout_p == 0.0:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.dropout_seed + 7919 * block_id)
        draws = torch.rand(shape, generator=generator, device=device)
        return (draws >= self.dropout_p).float() / (1.0 - self.dropout_p)

    def forward(self, q, k, v, mask, causal, block_id):
        acc = _acc_dtype(q.dtype)
        if self.use_fused(q):
            out, lse = _FUSED_CPU(
                q, k, v, 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=self.scale
            )
            lse = lse.to(acc)
            if mask is not None:  # the kernel reports 0 for a row it could not attend with
                lse = lse.masked_fill(mask.all(-1), -math.inf)
            return out, lse
        scores = self._scores(q, k, mask, causal)  # [b, g, h/g, sq, sk]
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
        keep = self.keep(probs.shape, q.device, block_id)
        if keep is not None:
            probs = probs * keep
        out = torch.matmul(probs, v.to(acc).unsqueeze(2))
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)

    def backward(self, dout, q, k, v, out, lse, mask, causal, block_id):
        """(dq, dk, dv) of one block from the final output and log-sum-exp of the queries."""
        if self.use_fused(q):
            return _FUSED_CPU_BACKWARD(
                dout, q, k, v, out, _finite(lse), 0.0, causal,
                attn_mask=_additive(mask, q.dtype), scale=self.scale,
            )  # fmt: skip
        acc = _acc_dtype(q.dtype)
        b, h, sq, d = q.shape
        g = k.shape[1]
        scores = self._scores(q, k, mask, causal)
        probs = torch.exp(scores - _finite(lse).view(b, g, h // g, sq, 1))
        dout = dout.to(acc).view(b, g, h // g, sq, d)
        v_acc = v.to(acc).unsqueeze(2)
        dprobs = torch.matmul(dout, v_acc.transpose(-1, -2))
        keep = self.keep(probs.shape, q.device, block_id)
        kept = probs if keep is None else probs * keep
        if keep is not None:
            dprobs = dprobs * keep
        # softmax backward with the final output: sum_j p_ij dP_ij = dO_i . O_i
        delta = (dout * out.to(acc).view(b, g, h // g, sq, d)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta) * self.scale
        dq = torch.matmul(dscores, k.to(acc).unsqueeze(2)).flatten(1, 2)
        dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc).view(b, g, h // g, sq, d)).sum(2)
        dv = torch.matmul(kept.transpose(-1, -2), dout).sum(2)
        return dq, dk, dv

    def _scores(self, q, k, mask, causal):
        acc = _acc_dtype(q.dtype)
        b, h, sq, d = q.shape
        g, sk = k.shape[1], k.shape[2]
        qg = q.to(acc).view(b, g, h // g, sq, d)
        scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * self.scale
        if causal:
            upper = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(upper, -math.inf)
        if mask is not None:
            scores = scores.masked_fill(mask.unsqueeze(2), -math.inf)
        return scores


def merge_partial(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Fold one block's (output, log-sum-exp) into the running ones, in place.

    softmax over the union of two key sets: L = log(e^l1 + e^l2), o = o1 e^(l1-L) + o2 e^(l2-L);
    rows with no key in either set keep L = -inf and o = 0.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    safe = _finite(new_lse)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.add_(block_out.to(out.dtype) * torch.exp(block_lse - safe).unsqueeze(-1))
    lse.copy_(new_lse)


# ---- the ring (p2p) -------------------------------------------------------------------------


@dataclass(frozen=True)
class Ring:
    """The cp group seen as a ring: its size, this rank in it, its neighbours (global ranks)."""

    group: Any
    size: int
    rank: int
    next_rank: int
    prev_rank: int

    @classmethod
    def of(cls, pctx: ParallelContext) -> Ring:
        ranks = pctx.group_ranks["cp"]
        r, n = pctx.cp_rank, pctx.cp_size
        return cls(pctx.group("cp"), n, r, ranks[(r + 1) % n], ranks[(r - 1) % n])


_KV_TAG, _DKV_TAG = 11, 12


class _Exchange:
    """Send a tensor to one neighbour while receiving one from the other (posted now, waited
    for later); the time spent waiting goes into stats["comm_wait_s"]."""

    def __init__(self, ring: Ring, send, recv, to: int, source: int, tag: int, stats) -> None:
        self.recv, self.stats = recv, stats
        ops = [
            dist.P2POp(dist.isend, send, to, ring.group, tag),
            dist.P2POp(dist.irecv, recv, source, ring.group, tag),
        ]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for request in self.requests:
            request.wait()
        self.requests = []  # waiting twice on a finished Gloo receive would block
        if self.stats is not None:
            self.stats["comm_wait_s"] = self.stats.get("comm_wait_s", 0.0) + (
                time.perf_counter() - start
            )
        return self.recv


def _block_plan(ring: Ring, src: int, local_len: int, causal: bool, mask: torch.Tensor | None):
    """Which queries of this rank attend to which keys of rank `src`'s block, or None when the
    block is hidden entirely: (query rows, key rows, causal kernel, block mask)."""
    c = local_len // 2
    halves = (slice(0, c), slice(c, 2 * c))
    whole = slice(0, 2 * c)
    if mask is None:
        if not causal:
            return whole, whole, False, None
        # Chunks ascend within a rank, so the own block is an ordinary causal square; rank src
        # holds chunks src and 2N-1-src: for src < r all queries see the first and none the
        # second, for src > r only the second query chunk sees anything, and all of it.
        if src == ring.rank:
            return whole, whole, True, None
        if src < ring.rank:
            return whole, halves[0], False, None
        return halves[1], whole, False, None
    visible = ~mask  # [b, 1, 2c, 2c]: this rank's queries x src's keys
    rows = [i for i, h in enumerate(halves) if visible[:, :, h].any()]
    cols = [j for j, h in enumerate(halves) if visible[:, :, :, h].any()]
    if not rows or not cols:
        return None
    q_rows = slice(rows[0] * c, (rows[-1] + 1) * c)
    k_rows = slice(cols[0] * c, (cols[-1] + 1) * c)
    return q_rows, k_rows, False, mask[:, :, q_rows, k_rows]


def _block_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """The part of a whole-sequence mask [b, 1, s or 1, s] for these query and key positions,
    [b, 1, len(q_pos), len(k_pos)] (a mask of keys only is expanded over the queries)."""
    if mask is None:
        return None
    rows = mask if mask.shape[2] == 1 else mask.index_select(2, q_pos)
    block = rows.index_select(3, k_pos)
    return block.expand(block.shape[0], block.shape[1], len(q_pos), len(k_pos))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.permute(1, 2, 0, 3)  # [s, b, n, d] -> [b, n, s, d]


def _count(stats, key: str, value: float) -> None:
    if stats is not None:
        stats[key] = stats.get(key, 0) + value


def _begin_step(ring, step, src, kv, spare, route, q, q_pos, causal, mask, stats):
    """One ring step's start: post the next key/value block's transfer along `route` (send to,
    receive from) first, so it travels while this block is attended, then plan this block (from
    rank `src`). Returns (the pending exchange or None, the compute start time, the plan)."""
    n, sl = ring.size, q.shape[0]
    pending = None
    if step < n - 1:
        pending = _Exchange(ring, kv, spare, *route, _KV_TAG, stats)
    start = time.perf_counter()
    mask_blk = _block_mask(mask, q_pos, cp_rank_positions(sl * n, n, src, q.device))
    return pending, start, _block_plan(ring, src, sl, causal, mask_blk)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, kernel, causal, mask, stats):
        n, r, sl = ring.size, ring.rank, q.shape[0]
        seq = sl * n
        qh = _heads_first(q)
        acc = _acc_dtype(q.dtype)
        # Accumulated in the [sl, b, np, hn] memory layout: the result is then a view the
        # output projection reads without a copy (a copy would be one more saved activation).
        out = _heads_first(torch.zeros(q.shape, dtype=acc, device=q.device))
        lse = torch.full(qh.shape[:3], -math.inf, dtype=acc, device=q.device)
        q_pos = cp_rank_positions(seq, n, r, q.device)
        kv = torch.stack([k, v])  # one message per step: [2, sl, b, ng, hn]
        spare = torch.empty_like(kv) if n > 1 else None
        for step in range(n):
            src = (r - step) % n
            route = (ring.next_rank, ring.prev_rank)
            pending, start, plan = _begin_step(
                ring, step, src, kv, spare, route, q, q_pos, causal, mask, stats
            )
            if plan is not None:
                rows, keys, block_causal, sub_mask = plan
                block_k, block_v = (_heads_first(t[keys]) for t in kv.unbind(0))
                block_out, block_lse = kernel.forward(
                    qh[:, :, rows], block_k, block_v, sub_mask, block_causal, src
                )
                merge_partial(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
                _count(stats, "score_elements", (rows.stop - rows.start) * (keys.stop - keys.start))
            _count(stats, "compute_s", time.perf_counter() - start)
            if pending is not None:
                kv, spare = pending.wait(), kv
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.ring, ctx.kernel, ctx.causal, ctx.stats = ring, kernel, causal, stats
        return out.permute(2, 0, 1, 3)  # [sl, b, np, hn]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        ring, kernel, causal, stats = ctx.ring, ctx.kernel, ctx.causal, ctx.stats
        n, r, sl = ring.size, ring.rank, q.shape[0]
        seq = sl * n
        acc = _acc_dtype(q.dtype)
        qh, dout = _heads_first(q), _heads_first(grad).to(q.dtype)
        dq = _heads_first(torch.zeros(q.shape, dtype=acc, device=q.device))
        q_pos = cp_rank_positions(seq, n, r, q.device)
        kv = torch.stack([k, v])
        spare = torch.empty_like(kv) if n > 1 else None
        # Gradient accumulators travel with their blocks; two buffers: one being sent while the
        # next arrives in the other.
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
        dkv_spare = torch.empty_like(dkv) if n > 1 else None
        pending_dkv = None
        for step in range(n):
            src = (r + step) % n  # the other way round: blocks arrive from the next rank
            route = (ring.prev_rank, ring.next_rank)
            pending, start, plan = _begin_step(
                ring, step, src, kv, spare, route, q, q_pos, causal, mask, stats
            )
            parts = None
            if plan is not None:
                rows, keys, block_causal, sub_mask = plan
                block_k, block_v = (_heads_first(t[keys]) for t in kv.unbind(0))
                dq_blk, dk_blk, dv_blk = kernel.backward(
                    dout[:, :, rows], qh[:, :, rows], block_k, block_v,
                    out[:, :, rows], lse[:, :, rows], sub_mask, block_causal, src,
                )  # fmt: skip
                dq[:, :, rows] += dq_blk
                parts = keys, dk_blk, dv_blk
            _count(stats, "compute_s", time.perf_counter() - start)
            if pending_dkv is not None:  # the accumulator of this block, from the next rank
                dkv, dkv_spare = pending_dkv.wait(), dkv
            if parts is not None:
                keys, dk_blk, dv_blk = parts
                dkv[0, keys] += dk_blk.permute(2, 0, 1, 3)
                dkv[1, keys] += dv_blk.permute(2, 0, 1, 3)
            if n > 1:
                pending_dkv = _Exchange(
                    ring, dkv, dkv_spare, ring.prev_rank, ring.next_rank, _DKV_TAG, stats
                )
            if pending is not None:
                kv, spare = pending.wait(), kv
        if pending_dkv is not None:
            dkv = pending_dkv.wait()  # after n hops every accumulator is home
        dq = dq.permute(2, 0, 1, 3).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pctx: ParallelContext,
    *,
    causal: bool,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    fused: bool = True,
    stats: dict[str, float] | None = None,
) -> torch.Tensor:
    """softmax(q k^T scale + mask) v over the whole sequence, with q, k, v [sl, b, n, hn] this
    rank's chunks; returns [sl, b, np, hn]. `attention_mask` [b, 1, s, s] (True = hidden, sequence
    order) replaces `causal`. `fused=False` forces the explicit-math kernel. `stats`, when given,
    accumulates comm_wait_s, compute_s and score_elements (attention scores computed)."""
    kernel = _Kernel(scale, dropout_p, dropout_seed, fused)
    mask = None if attention_mask is None else attention_mask.to(torch.bool)
    return _RingAttention.apply(q, k, v, Ring.of(pctx), kernel, causal, mask, stats)


# ---- the core-attention parts ---------------------------------------------------------------


class _ContextParallelCore(nn.Module):
    """What the three parts share: the options they read from the model config."""

    def __init__(self, config: Any, pctx: ParallelContext, layer_number: int, rng: Any) -> None:
        super().__init__()
        self.pctx = pctx
        self.rng = rng
        self.layer_number = layer_number
        self.causal = getattr(config, "causal_attention", True)
        self.scale = 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout
        # Benchmarks set a dict here to read the ring's timings.
        self.stats: dict[str, float] | None = None


def _refuse_flash_attn(config: Any, comm_type: str) -> None:
    if config.use_flash_attn:
        raise GigatronError(
            f"--use-flash-attn with --cp-comm-type {comm_type}: this attention runs on PyTorch's "
            "kernels; drop --use-flash-attn or use --cp-comm-type a2a"
        )


class RingAttention(_ContextParallelCore):
    """`--cp-comm-type p2p`: ring attention (see the module docstring)."""

    def __init__(self, config: Any, pctx: ParallelContext, layer_number: int, rng: Any) -> None:
        _refuse_flash_attn(config, "p2p")
        super().__init__(config, pctx, layer_number, rng)

    def forward(self, q, k, v, attention_mask=None):
        dropout_p = self.dropout if self.training else 0.0
        seed = 0
        if dropout_p > 0:
            # Drawn from the model-parallel stream: recomputation replays the same masks.
            with self.rng.fork():
                seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
        out = ring_attention(
            q, k, v, self.pctx,
            causal=self.causal, scale=self.scale, attention_mask=attention_mask,
            dropout_p=dropout_p, dropout_seed=seed + 1_000_003 * self.pctx.cp_rank,
            stats=self.stats,
        )  # fmt: skip
        return out.reshape(out.shape[0], out.shape[1], -1)


class AllGatherAttention(_ContextParallelCore):
    """`--cp-comm-type allgather`: keys and values all-gathered, local queries attend."""

    def __init__(self, config: Any, pctx: ParallelContext, layer_number: int, rng: Any) -> None:
        _refuse_flash_attn(config, "allgather")
        super().__init__(config, pctx, layer_number, rng)

    def forward(self, q, k, v, attention_mask=None):
        n, sl = self.pctx.cp_size, q.shape[0]
        seq = sl * n
        k_all = gather_from_context_parallel_region(k, self.pctx)  # rank order
        v_all = gather_from_context_parallel_region(v, self.pctx)
        q_pos = cp_rank_positions(seq, n, self.pctx.cp_rank, q.device)
        k_pos = cp_rank_order(seq, n, q.device)
        if attention_mask is None:
            hidden = (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)) if self.causal else None
        else:
            hidden = _block_mask(attention_mask.to(torch.bool), q_pos, k_pos)
        qh, kh, vh = (_heads_first(t) for t in (q, k_all, v_all))
        with self.rng.fork():
            out = F.scaled_dot_product_attention(
                qh, kh, vh,
                attn_mask=None if hidden is None else ~hidden,
                dropout_p=self.dropout if self.training else 0.0,
                scale=self.scale,
                enable_gqa=kh.shape[1] != qh.shape[1],
            )  # fmt: skip
        return out.permute(2, 0, 1, 3).reshape(sl, q.shape[1], -1)


class UlyssesAttention(_ContextParallelCore):
    """`--cp-comm-type a2a`: heads traded for sequence, ordinary attention, traded back."""

    def __init__(self, config, pctx, layer_number, rng, core_attention) -> None:
        super().__init__(config, pctx, layer_number, rng)
        n = pctx.cp_size
        heads = config.num_attention_heads // pctx.tp_size
        if heads % n:
            raise GigatronError(
                f"--cp-comm-type a2a: the {heads} attention heads of each tensor-parallel rank "
                f"do not divide over --context-parallel-size {n}; use --cp-comm-type p2p"
            )
        self.groups_divide = (config.num_query_groups // pctx.tp_size) % n == 0
        # The attention on whole sequences: the model's ordinary core attention.
        self.inner = core_attention

    def forward(self, q, k, v, attention_mask=None):
        n, sl, b = self.pctx.cp_size, q.shape[0], q.shape[1]
        if not self.groups_divide:
            # Fewer key/value groups than ranks: give every query head its own copy first.
            repeats = q.shape[2] // k.shape[2]
            k, v = (t.repeat_interleave(repeats, dim=2) for t in (k, v))
        to_sequence = torch.argsort(cp_rank_order(sl * n, n, q.device))
        q, k, v = (
            all_to_all_context_parallel(t, self.pctx, scatter_dim=2, gather_dim=0).index_select(
                0, to_sequence
            )
            for t in (q, k, v)
        )
        out = self.inner(q, k, v, attention_mask)  # [s, b, np / cp * hn], sequence order
        out = out.view(sl * n, b, q.shape[2], -1)
        out = out.index_select(0, cp_rank_order(sl * n, n, q.device))
        out = all_to_all_context_parallel(out, self.pctx, scatter_dim=0, gather_dim=2)
        return out.reshape(sl, b, -1)


def context_parallel_core_attention(comm_types: list[str] | tuple[str, ...], default: Any):
    """The core-attention factory `(config, pctx, layer_number, rng) -> nn.Module` for
    `--cp-comm-type` (one type for every layer, or one per layer); `default` builds the ordinary
    whole-sequence attention (what a2a runs between its exchanges)."""
    for comm_type in comm_types:
        if comm_type not in CP_COMM_TYPES:
            raise GigatronError(
                f"--cp-comm-type {comm_type}: unknown; choose one of {', '.join(CP_COMM_TYPES)}"
            )

    def build(config, pctx, layer_number, rng):
        comm_type = comm_types[layer_number - 1] if len(comm_types) > 1 else comm_types[0]
        if comm_type == "p2p":
            return RingAttention(config, pctx, layer_number, rng)
        if comm_type == "allgather":
            return AllGatherAttention(config, pctx, layer_number, rng)
        inner = default(config, pctx, layer_number, rng)
        return UlyssesAttention(config, pctx, layer_number, rng, inner)

    return build
