"""Token choice from logits: allowed sets of top-k / top-p, the sampled distribution, seeds."""

from __future__ import annotations

import torch

from gigatron.inference.sampling import RowSampling, choose_tokens, mask_vocabulary
from gigatron.parallel.context import ParallelContext

PCTX = ParallelContext.single()


def _draws(logits, row, count):
    return [
        int(choose_tokens(logits, [RowSampling(**{**row, "seed": 11, "step": i})], PCTX)[0])
        for i in range(count)
    ]


def test_top_k_never_leaves_the_k_best():
    torch.manual_seed(0)
    logits = torch.randn(1, 40) * 2
    allowed = set(logits[0].topk(4).indices.tolist())
    draws = _draws(logits, {"temperature": 2.0, "top_k": 4}, 400)
    assert set(draws) == allowed  # never outside, and every allowed token is reached


def test_top_p_never_leaves_the_nucleus():
    torch.manual_seed(1)
    logits = torch.randn(1, 40) * 2
    probs, order = torch.softmax(logits[0], -1).sort(descending=True)
    size = int((probs.cumsum(0) < 0.7).sum()) + 1  # smallest prefix reaching 0.7
    nucleus = set(order[:size].tolist())
    draws = _draws(logits, {"temperature": 1.0, "top_p": 0.7}, 400)
    assert set(draws) <= nucleus and len(set(draws)) > 1
    assert len(nucleus) < 40


def test_samples_follow_the_softmax_with_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    draws = torch.tensor(_draws(logits, {"temperature": 0.8}, 4000))
    observed = torch.bincount(draws, minlength=5).float() / len(draws)
    expected = torch.softmax(logits[0] / 0.8, -1)
    assert (observed - expected).abs().max() < 0.03


def test_greedy_seeds_and_padded_vocabulary():
    torch.manual_seed(2)
    logits = torch.randn(3, 16)
    logits[:, 12:] = 50.0  # padded vocabulary rows: never a real token
    masked = mask_vocabulary(logits, 12, PCTX)
    greedy = choose_tokens(masked, [RowSampling(temperature=0.0)] * 3, PCTX)
    assert greedy.tolist() == logits[:, :12].argmax(-1).tolist()
    rows = [RowSampling(temperature=1.0, seed=s, step=0) for s in (1, 2, 3)]
    first = choose_tokens(masked, rows, PCTX)
    assert torch.equal(first, choose_tokens(masked, rows, PCTX))
    assert int(first.max()) < 12
    banned = RowSampling(temperature=0.0, banned=(int(greedy[0]),))
    assert int(choose_tokens(masked[:1], [banned], PCTX)[0]) != int(greedy[0])
