"""The in-place cross entropies (tp = 1 and the vocab-parallel one) against torch's
F.cross_entropy: the same losses and gradients, in float32 and from bf16 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import (
    _CrossEntropy,
    _VocabParallelCrossEntropy,
    vocab_parallel_cross_entropy,
)

SEQ, BATCH, VOCAB = 7, 3, 50


def reference(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    leaf = logits.detach().float().clone().requires_grad_()
    loss = F.cross_entropy(leaf.view(-1, VOCAB), labels.reshape(-1), reduction="none")
    loss = loss.view(labels.shape)
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


def run(fn, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, labels)
    (loss * weights).sum().backward()
    return loss.detach(), leaf.grad


FUNCTIONS = {
    "tp1": lambda x, y: vocab_parallel_cross_entropy(x, y, ParallelContext.single()),
    "vocab_parallel": lambda x, y: _VocabParallelCrossEntropy.apply(x, y, None, 1, 0),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_matches_torch_in_float32(name):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=generator) * 4
    # Labels as the model passes them: a transposed (non-contiguous) [seq, batch] view.
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).t()
    weights = torch.rand(SEQ, BATCH, generator=generator)
    weights[0, 0] = 0.0  # a masked token: zero gradient on its row
    loss, grad = run(FUNCTIONS[name], logits, labels, weights)
    ref_loss, ref_grad = reference(logits, labels, weights)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    assert torch.count_nonzero(grad[0, 0]) == 0
    if name == "tp1":
        # The same fused log_softmax as torch's: bit-identical losses.
        assert torch.equal(loss, ref_loss)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_bf16_logits_get_float32_loss_and_bf16_gradient(name):
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(SEQ, BATCH, VOCAB, generator=generator) * 3).bfloat16()
    labels = torch.randint(0, VOCAB, (SEQ, BATCH), generator=generator)
    weights = torch.rand(SEQ, BATCH, generator=generator)
    loss, grad = run(FUNCTIONS[name], logits, labels, weights)
    ref_loss, ref_grad = reference(logits, labels, weights)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("function", [_CrossEntropy, _VocabParallelCrossEntropy])
def test_second_backward_is_refused_not_wrong(function):
    logits = torch.randn(4, 2, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (4, 2))
    extra = (None, 1, 0) if function is _VocabParallelCrossEntropy else ()
    loss = function.apply(logits, labels, *extra).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_logits_are_left_untouched():
    logits = torch.randn(4, 2, VOCAB, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, VOCAB, (4, 2))
    for fn in FUNCTIONS.values():
        fn(logits, labels).sum().backward()
        assert torch.equal(logits.detach(), before)


def test_overwritten_logits_give_the_same_losses_and_gradients():
    """`overwrite_logits`: an output layer's float32 product becomes the log-probabilities in
    place (its matmul's backward reads the inputs only); bf16 logits are left alone."""
    labels = torch.randint(0, VOCAB, (SEQ, BATCH))
    weights = torch.rand(SEQ, BATCH)
    results = []
    for overwrite in (False, True):
        hidden = torch.linspace(-1, 1, SEQ * BATCH * 16).view(SEQ, BATCH, 16).requires_grad_()
        weight = torch.linspace(-2, 2, VOCAB * 16).view(VOCAB, 16).requires_grad_()
        logits = hidden @ weight.t()
        before = logits.detach().clone()
        pctx = ParallelContext.single()
        loss = vocab_parallel_cross_entropy(logits, labels, pctx, overwrite_logits=overwrite)
        expected = before.log_softmax(-1) if overwrite else before
        torch.testing.assert_close(logits.detach(), expected)
        (loss * weights).sum().backward()
        results.append((loss.detach(), hidden.grad, weight.grad))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    bf16 = torch.randn(SEQ, BATCH, VOCAB).bfloat16()
    before = bf16.clone()
    vocab_parallel_cross_entropy(bf16, labels, ParallelContext.single(), overwrite_logits=True)
    assert torch.equal(bf16, before)
