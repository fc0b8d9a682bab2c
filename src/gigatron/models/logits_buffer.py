"""The output layer's product on CPU into a buffer reused from one step to the next.

A GPT's logits are the largest tensor of a training step ([tokens, vocabulary] float32: 412 MB
at 2048 tokens and 50304 words). On a CPU every fresh buffer of that size is new memory from the
kernel, whose pages are faulted in and zeroed when first written: about a quarter of the
product's own time. `LogitsBuffer` keeps one such buffer: the forward product is written into
it, the cross entropy turns it into log-probabilities and then into their gradient in place
(tensor_parallel._CrossEntropy with `overwrite_logits`), and the backward of the product hands
it back for the next step. A buffer still held by a graph (several micro-batches in flight, a
graph dropped without backward) is never handed out twice: the next product gets a fresh one.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LogitsBuffer:
    """One reusable [tokens, vocabulary] buffer: `take` lends it, `give_back` returns it."""

    def __init__(self) -> None:
        self._free: Tensor | None = None
        self._lent_untracked: Tensor | None = None

    def take(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The free buffer if it has this shape and dtype, else a new one."""
        free, self._free = self._free, None
        if free is not None and free.shape == shape and free.dtype == dtype:
            return free
        return torch.empty(shape, dtype=dtype)

    def give_back(self, buffer: Tensor) -> None:
        """Lend `buffer` next time (nothing may read it any more)."""
        if buffer.is_contiguous():
            self._free = buffer.detach()  # the memory only, not the graph that wrote it

    def done(self, logits: Tensor) -> None:
        """The caller has read `logits`: if they are the buffer `linear` lent without a graph,
        it is free again (with a graph, the product's backward frees it)."""
        lent, self._lent_untracked = self._lent_untracked, None
        if lent is not None and logits.grad_fn is None and logits.data_ptr() == lent.data_ptr():
            self.give_back(lent)

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        """x @ weight^T (no bias) into the buffer, differentiable in x and weight. Without a
        graph (no gradient wanted) the caller gives the buffer back when done with it; with
        one, the product's backward does."""
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _LinearIntoBuffer.apply(x, weight, self)
        out = self.take(torch.Size((*x.shape[:-1], weight.shape[0])), x.dtype)
        self._lent_untracked = out
        return torch.matmul(x, weight.t(), out=out)


class _LinearIntoBuffer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, buffers):
        out = buffers.take(torch.Size((*x.shape[:-1], weight.shape[0])), x.dtype)
        # The memory, held until backward (detached: no cycle through the graph), so that no
        # other tensor can take its address meanwhile.
        ctx.buffers, ctx.lent = buffers, out.detach()
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight.t(), out=out)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = torch.matmul(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            flat_grad = grad.reshape(-1, grad.shape[-1])
            grad_weight = flat_grad.t().matmul(x.reshape(-1, x.shape[-1]))
        lent, ctx.lent = ctx.lent, None
        if lent is not None and grad.data_ptr() == lent.data_ptr():
            ctx.buffers.give_back(lent)  # the cross entropy's gradient, over the lent buffer
        return grad_x, grad_weight, None
