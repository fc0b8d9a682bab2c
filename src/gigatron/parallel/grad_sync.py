"""Finishing the gradients of one iteration before the optimizer step.

Three reductions, each in the group where a weight is replicated:
1. data parallel: every chunk wrapped in DistributedDataParallel finishes its bucket reductions;
2. sequence parallel: weights that see only this rank's slice of the sequence (norms, and biases
   of row-parallel layers) are marked `param.sequence_parallel = True`; their gradients are summed
   over the tensor-parallel group;
3. tied embeddings: the word embedding on the first pipeline stage and the output layer weight on
   the last are the same weight held twice; both are marked `param.shared_embedding = True` and
   their gradients are summed over the embedding group. Encoder-decoder models (T5) hold the
   embeddings on the decoder's first stage too: its word embedding joins the embedding group,
   and the position embeddings of the first and split stages (`shared_position_embedding =
   True`) are summed over the position-embedding group.
The reductions are linear, so their order does not change the result.
With `--calculate-per-token-loss` the losses are sums over tokens (not means) and nothing is
averaged over data-parallel replicas; the gradients are then divided once by the global token
count of the iteration (`num_tokens`), which gives the mean over every token of the global batch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from gigatron.parallel.context import ParallelContext


def gradient_of(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer will read: the DDP buffer view when there is one; this rank's
    shard of a sharded (FSDP2, DTensor) gradient."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    grad = param.grad
    return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


def _marked_grads(model_chunks: Iterable[nn.Module], attribute: str) -> list[torch.Tensor]:
    grads = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param.requires_grad and getattr(param, attribute, False):
                grad = gradient_of(param)
                if grad is not None:
                    grads.append(grad)
    return grads


def finalize_model_grads(
    model_chunks: list[nn.Module], pctx: ParallelContext, num_tokens: float | None = None
) -> None:
    """Make every gradient the full-model, full-batch gradient (see the module docstring);
    `num_tokens`: the global token count to divide by (per-token loss), else None."""
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)
        if finish is not None:
            finish()
    if pctx.tp_size > 1:
        _all_reduce_coalesced(_marked_grads(model_chunks, "sequence_parallel"), pctx.group("tp"))
    if pctx.pp_size > 1 and pctx.size("embedding") > 1:
        _all_reduce_coalesced(
            _marked_grads(model_chunks, "shared_embedding"), pctx.group("embedding")
        )
    if pctx.pp_size > 1 and pctx.size("position_embedding") > 1:
        _all_reduce_coalesced(
            _marked_grads(model_chunks, "shared_position_embedding"),
            pctx.group("position_embedding"),
        )
    if num_tokens is not None:
        scale_gradients(model_chunks, 1.0 / max(num_tokens, 1.0))


def scale_gradients(model_chunks: Iterable[nn.Module], factor: float) -> None:
    """Multiply every gradient the optimizer will read by `factor`."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            grad = gradient_of(param) if param.requires_grad else None
            if grad is not None:
                grad.mul_(factor)
