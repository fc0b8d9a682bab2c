"""Tensor-parallel layers: each rank holds a slice of a weight and the collectives that make the
sliced computation equal the full one.

- `ColumnParallelLinear`: weight [out/tp, in] (output features split); input replicated (or, with
  sequence parallelism, split along the sequence and all-gathered here).
- `RowParallelLinear`: weight [out, in/tp] (input features split); partial outputs summed over tp
  (all-reduce, or reduce-scatter along the sequence with sequence parallelism).
- `VocabParallelEmbedding`: rows of the vocabulary split over tp.
- `vocab_parallel_cross_entropy`: the loss on vocabulary-split logits, never gathering them.

Initialisation: every weight is first drawn in full from a generator seeded by the run seed and
the parameter's (layout-independent) name, then this rank keeps its slice; so any tp / pp layout
starts from exactly the tp = 1 model (`initialize_parameters`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.parallel.collectives import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from gigatron.parallel.context import ParallelContext

# Draws a full (tp = 1) float32 tensor of the given shape from the generator.
InitFunction = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's padding: the smallest multiple of divisible_by * tp not below vocab_size."""
    multiple = max(1, make_vocab_size_divisible_by) * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise GigatronError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
            "change the model shape or --tensor-model-parallel-size"
        )
    return numerator // denominator


def set_tensor_parallel_attributes(
    param: nn.Parameter,
    is_parallel: bool,
    partition_dim: int = -1,
    stride: Stride = 1,
    init: str | InitFunction = "zeros",
    init_std: float = 0.0,
) -> None:
    """Mark a parameter per the model contract (and how `initialize_parameters` fills it:
    "normal" with `init_std`, "ones", "zeros", or a function drawing the full tensor)."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim if is_parallel else -1
    param.partition_stride = stride
    param.init = init
    param.init_std = init_std


Stride = int | tuple[int, ...]


def _blocks(
    t: torch.Tensor, stride: Stride, dim: int, divisor: int = 1
) -> tuple[torch.Tensor, ...]:
    """Split t along dim into its blocks: `stride` equal ones, or blocks of the given full sizes
    (each divided by `divisor`: a rank's part holds 1/tp of every block)."""
    if isinstance(stride, int):
        return t.chunk(stride, dim=dim)
    return t.split([size // divisor for size in stride], dim=dim)


def slice_for_rank(
    full: torch.Tensor, partition_dim: int, stride: Stride, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This rank's part of a full tensor. The dimension may hold several blocks, each split over
    tp on its own: `stride` s means s equal blocks (e.g. [gate; up]); a tuple gives the blocks'
    sizes (e.g. Mamba's in_proj [z; x; B; C; dt]). The rank keeps its slice of each block,
    concatenated."""
    if partition_dim < 0 or tp_size == 1:
        return full
    blocks = _blocks(full, stride, partition_dim)
    return torch.cat([b.chunk(tp_size, dim=partition_dim)[tp_rank] for b in blocks], partition_dim)


def merge_partitions(parts: list[torch.Tensor], partition_dim: int, stride: Stride) -> torch.Tensor:
    """Inverse of `slice_for_rank`: the full tensor from every rank's slice (rank order)."""
    if partition_dim < 0 or len(parts) == 1:
        return parts[0]
    per_rank_blocks = [_blocks(p, stride, partition_dim, len(parts)) for p in parts]
    count = len(per_rank_blocks[0])
    blocks = [torch.cat([blk[i] for blk in per_rank_blocks], partition_dim) for i in range(count)]
    return torch.cat(blocks, partition_dim)


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed from the run seed and a parameter name (same on every layout)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def initialize_parameters(
    module: nn.Module,
    seed: int,
    tp_rank: int,
    tp_size: int,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Fill every parameter marked by `set_tensor_parallel_attributes`: draw the full tensor on
    the CPU in float32 from its own generator, keep this rank's slice, copy it in. Expert weights
    (`expert_parallel = True`, experts along dim 0) are drawn for all experts; this
    expert-parallel rank keeps its block of them, split over the expert-tensor-parallel ranks
    (`etp_rank`, `etp_size`; default the tensor-parallel ones)."""
    for name, param in module.named_parameters():
        kind = getattr(param, "init", None)
        if kind is None:
            continue
        if kind == "ones":
            param.fill_(1.0)
            continue
        if kind == "zeros":
            param.zero_()
            continue
        experts = getattr(param, "expert_parallel", False)
        rank, size = (tp_rank, tp_size)
        if experts and etp_size is not None:
            rank, size = etp_rank, etp_size
        full_shape = list(param.shape)
        if param.tensor_model_parallel:
            full_shape[param.partition_dim] *= size
        if experts:
            full_shape[0] *= ep_size
        generator = torch.Generator().manual_seed(
            parameter_seed(seed, getattr(param, "init_name", name))
        )
        if callable(kind):
            full = kind(tuple(full_shape), generator)
        else:
            full = torch.empty(full_shape, dtype=torch.float32).normal_(
                0.0, param.init_std, generator=generator
            )
        if experts:
            full = full.chunk(ep_size, dim=0)[ep_rank]
        if param.tensor_model_parallel:
            full = slice_for_rank(full, param.partition_dim, param.partition_stride, rank, size)
        param.copy_(full)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


# The local product of a parallel linear layer, `(x, weight, bias) -> y`; fp8 training
# (models/fp8.py) gives a layer its own.
Matmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over tp.

    `gather_output` all-gathers y (otherwise each rank keeps its slice of the features);
    `sequence_parallel` means x arrives split along dim 0 and is all-gathered here.
    `skip_weight` leaves the weight to the caller (`forward(x, weight)`; tied output layer).
    `matmul` computes the local product (F.linear; fp8 training swaps it).
    """

    matmul: Matmul = staticmethod(F.linear)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        pctx: ParallelContext,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        stride: Stride = 1,
        skip_weight: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        device = device or pctx.device
        local_out = divide(output_size, pctx.tp_size, "output size")
        if skip_weight:
            self.weight = None
        else:
            self.weight = _empty((local_out, input_size), dtype, device)
            set_tensor_parallel_attributes(self.weight, True, 0, stride, "normal", init_std)
        if bias:
            self.bias = _empty((local_out,), dtype, device)
            set_tensor_parallel_attributes(self.bias, True, 0, stride, "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        plain_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`plain_product(x, weight)`: computes x W^T in place of F.linear where that is all
        the layer computes (no bias, no fp8); the GPT's output layer passes one on CPU
        (models/logits_buffer.py)."""
        weight = self.weight if weight is None else weight
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.pctx)
        else:
            x = copy_to_tp_region(x, self.pctx)
        if plain_product is not None and self.bias is None and self.matmul is F.linear:
            y = plain_product(x, weight)
        else:
            y = self.matmul(x, weight, self.bias)
        if self.gather_output:
            y = gather_from_tp_region(y, self.pctx)
        return y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over tp; partial products summed over tp.

    `input_is_parallel`: x already holds this rank's slice of the features (else it is split
    here). `sequence_parallel`: the sum is a reduce-scatter along dim 0. The bias is replicated
    and added after the sum (marked `sequence_parallel` then: it sees a slice of the sequence).
    `matmul` computes the local product (F.linear; fp8 training swaps it).
    """

    matmul: Matmul = staticmethod(F.linear)

    def __init__(
        self,
        input_size: int,
        output_size: int,
        pctx: ParallelContext,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        device = device or pctx.device
        local_in = divide(input_size, pctx.tp_size, "input size")
        self.weight = _empty((output_size, local_in), dtype, device)
        set_tensor_parallel_attributes(self.weight, True, 1, 1, "normal", init_std)
        if bias:
            self.bias = _empty((output_size,), dtype, device)
            set_tensor_parallel_attributes(self.bias, False, init="zeros")
            if sequence_parallel:
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pctx.tp_size == 1:
            return self.matmul(x, self.weight, self.bias)  # one fused GEMM + bias
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.pctx)
        y = self.matmul(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.pctx)
        else:
            y = reduce_from_tp_region(y, self.pctx)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table with its rows (the vocabulary) split over tp.

    Each rank looks up the ids in its range (others give zeros) and the partial results are
    summed over tp: all-reduced, or with `sequence_parallel` reduce-scattered along dim 0 (ids
    then come in [seq, batch] layout and each rank keeps its slice of the sequence).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        pctx: ParallelContext,
        *,
        sequence_parallel: bool = False,
        init_std: float = 0.02,
        dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = num_embeddings
        local = divide(num_embeddings, pctx.tp_size, "padded vocabulary size")
        self.vocab_start = pctx.tp_rank * local
        self.vocab_end = self.vocab_start + local
        self.weight = _empty((local, embedding_dim), dtype, device or pctx.device)
        set_tensor_parallel_attributes(self.weight, True, 0, 1, "normal", init_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.pctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.pctx)
        return reduce_from_tp_region(out, self.pctx)


def _subtract_one_at_labels(grad: torch.Tensor, labels: torch.Tensor, scale) -> torch.Tensor:
    """grad - onehot(labels) where `scale` is 1 (0 where the label is on another rank), in place."""
    index = labels.unsqueeze(-1)
    grad.scatter_add_(-1, index, (-scale).unsqueeze(-1).expand_as(index).to(grad.dtype))
    return grad


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over the whole vocabulary (tp = 1), in float32.

    Forward keeps one [..., vocab] tensor, the log-probabilities (torch's fused log_softmax);
    backward turns it into the gradient in place (exp, minus the one-hot, times the incoming
    gradient), where torch's cross entropy allocates and fills two more of that size. A second
    backward through the same graph fails autograd's check on the modified saved tensor.
    `overwrite`: float32 logits that nothing else reads become the log-probabilities in place
    (no second buffer of the logits' size: on a CPU, fresh pages of that size cost as much as
    the pass that fills them).
    """

    @staticmethod
    def forward(ctx, logits, labels, overwrite=False):
        if overwrite and logits.dtype == torch.float32:
            log_probs = torch.log_softmax(logits, -1, out=logits)
        else:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
        loss = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1).neg()
        ctx.save_for_backward(log_probs, labels)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        log_probs, labels = ctx.saved_tensors
        grad = _subtract_one_at_labels(log_probs.exp_(), labels, torch.ones_like(grad_loss))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, tp_size, vocab_start):
        logits_dtype = logits.dtype
        logits = logits.float()
        local_vocab = logits.shape[-1]
        max_logits = logits.max(dim=-1).values
        if tp_size > 1:
            dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logits.unsqueeze(-1)

        outside = (labels < vocab_start) | (labels >= vocab_start + local_vocab)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        target_logits = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        target_logits = target_logits.masked_fill(outside, 0.0)

        # exp, then softmax, in the one [..., vocab/tp] tensor this Function keeps.
        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        if tp_size > 1:
            # One all-reduce for both sums (they are independent).
            both = torch.stack([target_logits, sum_exp])
            dist.all_reduce(both, group=group)
            target_logits, sum_exp = both[0], both[1]
        loss = sum_exp.log() - target_logits

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        ctx.logits_dtype = logits_dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_labels, outside = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(label); the onehot lives on one rank only. The
        # saved softmax becomes the gradient in place (a second backward fails autograd's check).
        grad = _subtract_one_at_labels(softmax, local_labels, (~outside).to(softmax.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    pctx: ParallelContext,
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """Per-token cross entropy (float32) of logits whose last dimension is this rank's slice of
    the vocabulary; only [..]-shaped statistics cross ranks, never the logits.
    `overwrite_logits`: the caller made the logits for this loss alone (an output layer's
    product, which its backward does not read), so at tp = 1 they may hold the
    log-probabilities."""
    if pctx.tp_size == 1:
        return _CrossEntropy.apply(logits, labels, overwrite_logits)
    vocab_start = pctx.tp_rank * logits.shape[-1]
    group = pctx.group("tp") if pctx.tp_size > 1 else None
    return _VocabParallelCrossEntropy.apply(logits, labels, group, pctx.tp_size, vocab_start)
