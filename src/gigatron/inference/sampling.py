"""Choosing tokens and log-probs from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary, [b, V/tp].
Everything here exchanges only per-row scalars or top-k candidates over the tp group:
- greedy: each rank's best (value, index), the best of those wins (ties: the lowest index, as
  `torch.argmax` over the whole vocabulary);
- top-k: each rank's k best values are gathered; the k-th best overall is the threshold;
- top-p: the softmax normaliser is all-reduced; the smallest probability still inside the
  nucleus is found by bisection over float32 bit patterns (positive floats order like their bit
  patterns), one all-reduce of [b] sums per bisection step;
- sampling: the Gumbel-max trick, argmax(logits / T + Gumbel noise), which draws exactly from
  softmax(logits / T). The noise of a row is drawn for the real (unpadded) vocabulary from a
  generator seeded by (request seed, step), and each rank keeps its slice: tp = 1 and tp > 1
  draw the same token, and a fixed seed repeats.
At tp = 1 every collective is a no-op: the same code is the single-device path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gigatron.parallel.context import ParallelContext

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its next token. `temperature` 0 (or `top_k` 1) is greedy; `top_p` 0 or
    1 is off; `banned` are token ids that may not be chosen this step."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    step: int = 0
    banned: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _tp_gather(tensor: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """[tp, *shape]: every tp rank's `tensor`, in rank order."""
    if pctx.tp_size == 1:
        return tensor.unsqueeze(0)
    parts = [torch.empty_like(tensor) for _ in range(pctx.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=pctx.group("tp"))
    return torch.stack(parts)


def gather_vocabulary(logits: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """[..., V]: the whole (padded) vocabulary of vocab-parallel logits [..., V/tp]."""
    if pctx.tp_size == 1:
        return logits
    return torch.cat(list(_tp_gather(logits, pctx)), dim=-1)


def _all_reduce(tensor: torch.Tensor, pctx: ParallelContext, op=None) -> torch.Tensor:
    return pctx.all_reduce(tensor, "tp", op)


def mask_vocabulary(logits: torch.Tensor, vocab_size: int, pctx: ParallelContext) -> torch.Tensor:
    """float32 copy of the local logits [b, V/tp] with padded-vocabulary entries at -inf."""
    logits = logits.float().clone()
    start = pctx.tp_rank * logits.shape[-1]
    real = max(0, min(logits.shape[-1], vocab_size - start))
    logits[:, real:] = NEG_INF
    return logits


def vocab_parallel_argmax(scores: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """Global argmax [b] of vocab-parallel scores [b, V/tp]."""
    values, indices = scores.max(dim=-1)
    indices = indices + pctx.tp_rank * scores.shape[-1]
    if pctx.tp_size == 1:
        return indices
    all_values = _tp_gather(values, pctx)  # [tp, b]
    all_indices = _tp_gather(indices, pctx)
    # max over ranks; ties go to the lowest rank, i.e. the lowest global index
    best_rank = all_values.argmax(dim=0)
    return all_indices.gather(0, best_rank.unsqueeze(0)).squeeze(0)


def log_normalizer(logits: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """logsumexp over the whole vocabulary, [b] (logits float32, padded entries -inf)."""
    local_max = logits.max(dim=-1).values
    global_max = _all_reduce(local_max.clone(), pctx, dist.ReduceOp.MAX)
    sums = torch.exp(logits - global_max[:, None]).sum(dim=-1)
    return global_max + torch.log(_all_reduce(sums, pctx))


def token_logits(logits: torch.Tensor, tokens: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    """logits[r, tokens[r]] [b] from vocab-parallel logits (the owning rank contributes)."""
    width = logits.shape[-1]
    local = tokens - pctx.tp_rank * width
    owned = (local >= 0) & (local < width)
    picked = logits.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    picked = torch.where(owned, picked, torch.zeros_like(picked))
    return _all_reduce(picked, pctx)


def top_candidates(
    logits: torch.Tensor, count: int, pctx: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest logits of each row over the whole vocabulary: (values, global ids),
    each [b, count], best first."""
    count = min(count, logits.shape[-1] * pctx.tp_size)
    local = min(count, logits.shape[-1])
    values, indices = logits.topk(local, dim=-1)
    indices = indices + pctx.tp_rank * logits.shape[-1]
    all_values = _tp_gather(values, pctx).permute(1, 0, 2).reshape(values.shape[0], -1)
    all_indices = _tp_gather(indices, pctx).permute(1, 0, 2).reshape(values.shape[0], -1)
    best_values, order = all_values.topk(count, dim=-1)
    return best_values, all_indices.gather(1, order)


def _apply_top_k(scores: torch.Tensor, top_k: list[int], pctx: ParallelContext) -> torch.Tensor:
    k_max = max(top_k)
    values, _ = top_candidates(scores, k_max, pctx)
    k = torch.tensor(top_k, device=scores.device).clamp(1, values.shape[-1])
    threshold = values.gather(1, (k - 1).unsqueeze(1))  # [b, 1]
    active = torch.tensor([k > 0 for k in top_k], device=scores.device).unsqueeze(1)
    return torch.where(active & (scores < threshold), torch.full_like(scores, NEG_INF), scores)


def _apply_top_p(scores: torch.Tensor, top_p: list[float], pctx: ParallelContext) -> torch.Tensor:
    """Keep the smallest set of likeliest tokens whose probability reaches top_p (ties at the
    boundary are kept)."""
    probs = torch.exp(scores - log_normalizer(scores, pctx)[:, None])  # [b, V/tp], float32
    bits = probs.view(torch.int32)  # probabilities are >= 0: bit order is value order
    target = torch.tensor(top_p, dtype=torch.float32, device=scores.device)
    low = torch.zeros(scores.shape[0], dtype=torch.int64, device=scores.device)
    high = torch.full_like(low, 0x7F800000)  # +inf: nothing is kept above it
    # Invariant: mass(p >= low) >= target and mass(p >= high) < target.
    while bool((high - low > 1).any()):
        middle = (low + high) // 2
        mass = torch.where(bits >= middle[:, None].to(torch.int32), probs, 0.0).sum(dim=-1)
        mass = _all_reduce(mass, pctx)
        inside = mass >= target
        low = torch.where(inside, middle, low)
        high = torch.where(inside, high, middle)
    active = ((target > 0) & (target < 1)).unsqueeze(1)
    drop = active & (bits < low[:, None].to(torch.int32))
    return torch.where(drop, torch.full_like(scores, NEG_INF), scores)


def gumbel_noise(seed: int, step: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise for `vocab` tokens, a function of (seed, step) only."""
    generator = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + step) % (2**63))
    uniform = torch.rand(vocab, generator=generator, dtype=torch.float64)
    uniform = uniform.clamp(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(uniform))).float().to(device)


def choose_tokens(
    logits: torch.Tensor,
    rows: list[RowSampling],
    pctx: ParallelContext,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Next token [b] per row from masked float32 vocab-parallel logits [b, V/tp]
    (`vocab_size`: the real, unpadded vocabulary; default: all of it)."""
    width = logits.shape[-1]
    offset = pctx.tp_rank * width
    scores = logits.clone()
    for r, row in enumerate(rows):
        for token in row.banned:
            if offset <= token < offset + width:
                scores[r, token - offset] = NEG_INF
    greedy = [row.greedy for row in rows]
    if all(greedy):
        return vocab_parallel_argmax(scores, pctx)
    temperature = torch.tensor(
        [1.0 if row.greedy else row.temperature for row in rows], device=scores.device
    )
    scores = scores / temperature[:, None]
    if any(row.top_k > 1 for row in rows):
        scores = _apply_top_k(scores, [0 if row.greedy else row.top_k for row in rows], pctx)
    if any(0 < row.top_p < 1 for row in rows):
        scores = _apply_top_p(scores, [0.0 if row.greedy else row.top_p for row in rows], pctx)
    real = vocab_size if vocab_size is not None else width * pctx.tp_size
    noise = torch.zeros_like(scores)
    for r, row in enumerate(rows):
        if not row.greedy:
            # Drawn for the real vocabulary (the same at every tp size), sliced to this rank.
            full = gumbel_noise(row.seed, row.step, real, scores.device)
            part = full[offset : offset + width]
            noise[r, : part.numel()] = part
    return vocab_parallel_argmax(scores + noise, pctx)


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, pctx: ParallelContext
) -> torch.Tensor:
    """log softmax(logits)[r, tokens[r]] [b] (masked float32 vocab-parallel logits)."""
    return token_logits(logits, tokens, pctx) - log_normalizer(logits, pctx)


def top_log_probs(
    logits: torch.Tensor, count: int, pctx: ParallelContext
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` most likely tokens per row: (log-probs, ids), each [b, count]."""
    values, ids = top_candidates(logits, count, pctx)
    return values - log_normalizer(logits, pctx)[:, None], ids
