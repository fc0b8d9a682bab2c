"""Data parallelism: contiguous gradient buffers, buckets, and reductions overlapped with backward.

`DistributedDataParallel` wraps one model chunk (also at dp = 1, so the optimizer always reads
`param.main_grad`):

- Every trainable parameter gets `param.main_grad`, a view into one contiguous buffer per
  (parameter dtype, reduction group). Parameters are laid out in reverse registration order, which
  is roughly the order in which backward produces their gradients.
- A post-accumulate-grad hook adds `param.grad` into `param.main_grad` and frees `param.grad`, so
  gradient accumulation over micro-batches happens in the buffer (in `grad_dtype`, fp32 by default).
- The buffer is cut into buckets of about `--ddp-bucket-size` elements. With
  `--overlap-grad-reduce` a bucket's reduction is launched asynchronously as soon as the last of
  its gradients is ready during the last micro-batch's backward; otherwise every bucket is reduced
  in `finish_grad_sync()`.
- Gradients are summed over the data-parallel group including context parallelism ("dp_cp"), or
  over "expert_dp" for expert parameters, after scaling by 1/dp: an average over data-parallel
  replicas and a sum over context-parallel ranks, whose losses are parts of one loss (each is
  already divided by the token count of the whole sequences). No scaling with
  `--calculate-per-token-loss` (the loop then divides by the global token count).
- With `--use-distributed-optimizer` buckets are padded so that each splits into equal shards,
  one per data-parallel rank; the reduction is a reduce-scatter (each rank keeps the reduced
  shard it will step), the parameters also live in a contiguous buffer, and after the optimizer
  step each bucket's parameters are all-gathered, lazily (waited for in the next forward, per
  module) with `--overlap-param-gather`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import ChunkWrapper

# torch >= 2.13 names the flat-tensor collectives *_single; older releases only have *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Megatron's default bucket size: max(40M, 1M x dp) elements, used with --overlap-grad-reduce.
DEFAULT_BUCKET_ELEMENTS = 40_000_000
# Shard boundaries of the distributed optimizer stay aligned to this many elements.
SHARD_ALIGNMENT = 64


def default_bucket_size(dp_size: int) -> int:
    return max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * dp_size)


def is_expert_parameter(param: nn.Parameter) -> bool:
    """Expert weights are replicated over the expert-data-parallel group, not over dp x cp."""
    return (
        bool(getattr(param, "expert_parallel", False)) or getattr(param, "allreduce", True) is False
    )


@dataclass
class BucketEvent:
    """One entry of a DDP's event log (kept for the current iteration; tests inspect it)."""

    seq: int
    kind: str  # "grad_ready" | "reduce_launch" | "reduce_done" | "gather_launch" | "gather_done"
    bucket: int
    detail: Any = None


@dataclass
class GradBucket:
    """A contiguous slice [start, end) of one GradBuffer, reduced with one collective."""

    index: int
    buffer: GradBuffer
    params: list[nn.Parameter]
    start: int
    end: int
    ready: set[int] = field(default_factory=set)
    reduce_handle: Any = None
    reduce_launched: bool = False
    gather_handle: Any = None
    # Counters over the bucket's life: tests check one reduction per iteration, never early.
    num_reductions: int = 0
    ready_counts_at_launch: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def grad_data(self) -> torch.Tensor:
        return self.buffer.grad_data[self.start : self.end]

    @property
    def param_data(self) -> torch.Tensor | None:
        data = self.buffer.param_data
        return None if data is None else data[self.start : self.end]

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        """Buffer range [start, end) owned by `shard_rank` under the distributed optimizer."""
        size = self.numel // self.buffer.group_size
        begin = self.start + shard_rank * size
        return begin, begin + size


class GradBuffer:
    """Contiguous gradient storage (and, for the distributed optimizer, parameter storage) for
    parameters of one dtype reduced in one group."""

    def __init__(
        self,
        params: list[nn.Parameter],
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        group_name: str,
        pctx: ParallelContext,
        bucket_size: int | None,
        shard: bool,
        first_bucket_index: int,
    ) -> None:
        self.params = params
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.group_name = group_name
        self.group = pctx.group(group_name)
        self.group_size = pctx.size(group_name)
        self.group_rank = pctx.rank_in(group_name)
        self.sharded = shard
        device = params[0].device
        # Lay out parameters in order; a bucket closes once it holds at least bucket_size elements
        # (parameters are never split across buckets).
        pad_to = math.lcm(self.group_size, SHARD_ALIGNMENT) if shard else 1
        self.param_range: dict[int, tuple[int, int]] = {}
        bucket_bounds: list[tuple[int, int, list[nn.Parameter]]] = []
        offset = bucket_start = 0
        members: list[nn.Parameter] = []
        for param in params:
            # A tied embedding (pp > 1) gets a bucket of its own when sharded, as in Megatron:
            # the first and last stages then shard it alike, so the embedding group's sum of
            # their reduce-scattered gradients adds the same elements.
            alone = shard and getattr(param, "shared_embedding", False)
            if alone and members:
                offset = _round_up(offset, pad_to)
                bucket_bounds.append((bucket_start, offset, members))
                bucket_start, members = offset, []
            self.param_range[id(param)] = (offset, offset + param.numel())
            offset += param.numel()
            members.append(param)
            if alone or bucket_size is not None and offset - bucket_start >= bucket_size:
                offset = _round_up(offset, pad_to)
                bucket_bounds.append((bucket_start, offset, members))
                bucket_start, members = offset, []
        if members:
            offset = _round_up(offset, pad_to)
            bucket_bounds.append((bucket_start, offset, members))
        self.numel = offset
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data: torch.Tensor | None = None
        if shard:
            # Parameters move into one flat buffer so a bucket's all-gather lands in place.
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self.buckets = [
            GradBucket(first_bucket_index + i, self, members, begin, end)
            for i, (begin, end, members) in enumerate(bucket_bounds)
        ]
        self.bucket_of: dict[int, GradBucket] = {}
        for bucket in self.buckets:
            for param in bucket.params:
                self.bucket_of[id(param)] = bucket
        for param in params:
            begin, end = self.param_range[id(param)]
            if self.param_data is not None:
                view = self.param_data[begin:end].view(param.shape)
                view.copy_(param.data)
                param.data = view
            param.main_grad = self.grad_data[begin:end].view(param.shape)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class DistributedDataParallel(ChunkWrapper):
    """Wraps a model chunk with gradient buffers and data-parallel gradient reduction.

    The wrapper is transparent: `forward`, `state_dict`, `load_state_dict` and unknown attributes
    (`pre_process`, `post_process`, `set_input_tensor`, ...) go to `self.module`.
    """

    def __init__(
        self,
        module: nn.Module,
        pctx: ParallelContext,
        parallel_cfg: Any,
        grad_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__()
        self.module = module
        self.pctx = pctx
        self.overlap_grad_reduce = bool(getattr(parallel_cfg, "overlap_grad_reduce", False))
        self.use_distributed_optimizer = bool(
            getattr(parallel_cfg, "use_distributed_optimizer", False)
        )
        self.overlap_param_gather = bool(getattr(parallel_cfg, "overlap_param_gather", False))
        # --no-align-param-gather: an overlapped all-gather starts at this chunk's next forward
        # instead of with every chunk's at the end of the optimizer step.
        self.align_param_gather = bool(getattr(parallel_cfg, "align_param_gather", True))
        self._gather_deferred = False
        self.per_token_loss = bool(getattr(parallel_cfg, "calculate_per_token_loss", False))
        dp_cp_size = pctx.size("dp_cp")
        bucket_size = getattr(parallel_cfg, "ddp_bucket_size", None)
        if bucket_size is None and self.overlap_grad_reduce:
            bucket_size = default_bucket_size(dp_cp_size)
        # Without overlap nothing is gained by small buckets: one reduction per buffer.
        self.bucket_size = bucket_size
        # Average over data-parallel replicas; context-parallel ranks hold parts of the same
        # sequences, so their gradients add up. Per-token loss is normalised by the loop instead.
        self.grad_scaling_factor = 1.0 if self.per_token_loss else 1.0 / pctx.dp_size

        self._sync_enabled = True
        self._seq = itertools.count()
        self.events: list[BucketEvent] = []

        # Group parameters by (dtype, reduction group), each group in reverse registration order.
        grouped: dict[tuple[torch.dtype, str], list[nn.Parameter]] = {}
        self._param_names: dict[int, str] = {}
        for name, param in reversed(list(module.named_parameters())):
            if not param.requires_grad:
                continue
            self._param_names[id(param)] = name
            group_name = "expert_dp" if is_expert_parameter(param) else "dp_cp"
            grouped.setdefault((param.dtype, group_name), []).append(param)
        self.buffers_: list[GradBuffer] = []
        bucket_index = 0
        for (param_dtype, group_name), params in grouped.items():
            buffer = GradBuffer(
                params,
                param_dtype,
                grad_dtype or param_dtype,
                group_name,
                pctx,
                bucket_size,
                self.use_distributed_optimizer,
                bucket_index,
            )
            bucket_index += len(buffer.buckets)
            self.buffers_.append(buffer)
        self._bucket_of: dict[int, GradBucket] = {}
        for buffer in self.buffers_:
            self._bucket_of.update(buffer.bucket_of)

        self._hook_handles = []
        for buffer in self.buffers_:
            for param in buffer.params:
                self._hook_handles.append(
                    param.register_post_accumulate_grad_hook(self._grad_accumulated)
                )
        if self.use_distributed_optimizer and self.overlap_param_gather:
            for submodule in module.modules():
                if any(True for _ in submodule.parameters(recurse=False)):
                    self._hook_handles.append(
                        submodule.register_forward_pre_hook(self._wait_param_gather)
                    )

    def release(self) -> None:
        """Remove the gradient hooks and forget the process groups and pending collectives: a
        failed run's Gloo groups then close their connections as soon as the run's objects go
        (in-process restart), so that peers still waiting on this rank fail at once."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        for buffer in self.buffers_:
            buffer.group = None
            for bucket in buffer.buckets:
                bucket.reduce_handle = bucket.gather_handle = None

    # ---- transparency (attribute reads go to .module: ChunkWrapper) ----------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    @property
    def buckets(self) -> list[GradBucket]:
        return [bucket for buffer in self.buffers_ for bucket in buffer.buckets]

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        return list(self.buffers_)

    def param_name(self, param: nn.Parameter) -> str:
        return self._param_names[id(param)]

    # ---- gradient hooks ----------------------------------------------------------------
    def _log(self, kind: str, bucket: GradBucket, detail: Any = None) -> None:
        self.events.append(BucketEvent(next(self._seq), kind, bucket.index, detail))

    def _grad_accumulated(self, param: nn.Parameter) -> None:
        if param.grad is None:
            return
        param.main_grad.add_(param.grad)
        # The buffer holds the gradient from now on; free autograd's copy.
        param.grad = None
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in bucket.ready:
            raise RuntimeError(
                f"gradient of {self._param_names[id(param)]} became ready twice in one "
                "iteration: run every backward but the last inside no_sync(), and call "
                "finish_grad_sync() and zero_grad_buffer() between iterations"
            )
        bucket.ready.add(id(param))
        self._log("grad_ready", bucket, self._param_names[id(param)])
        if self.overlap_grad_reduce and len(bucket.ready) == len(bucket.params):
            self._launch_reduce(bucket, async_op=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all micro-batches but the last)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # ---- reductions --------------------------------------------------------------------
    def _launch_reduce(self, bucket: GradBucket, async_op: bool) -> None:
        if bucket.reduce_launched:
            raise RuntimeError(f"bucket {bucket.index} reduced twice in one iteration")
        bucket.reduce_launched = True
        bucket.num_reductions += 1
        bucket.ready_counts_at_launch.append(len(bucket.ready))
        self._log("reduce_launch", bucket, len(bucket.ready))
        buffer = bucket.buffer
        data = bucket.grad_data
        if self.grad_scaling_factor != 1.0:
            data.mul_(self.grad_scaling_factor)
        if buffer.group_size == 1:
            return
        if buffer.sharded:
            begin, end = bucket.shard_range(buffer.group_rank)
            local = buffer.grad_data[begin:end]
            bucket.reduce_handle = _reduce_scatter(
                local, data, group=buffer.group, async_op=async_op
            )
        else:
            bucket.reduce_handle = dist.all_reduce(data, group=buffer.group, async_op=async_op)

    def start_grad_sync(self) -> None:
        """Launch the reduction of every bucket not yet launched (asynchronously)."""
        for bucket in self.buckets:
            if not bucket.reduce_launched:
                self._launch_reduce(bucket, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait until every bucket is reduced (launching what is not in flight yet)."""
        for bucket in self.buckets:
            if not bucket.reduce_launched:
                # Not overlapped, or some parameter got no gradient this iteration.
                self._launch_reduce(bucket, async_op=self.overlap_grad_reduce)
        for bucket in self.buckets:
            if bucket.reduce_handle is not None:
                bucket.reduce_handle.wait()
                bucket.reduce_handle = None
            self._log("reduce_done", bucket)
            bucket.ready.clear()
            bucket.reduce_launched = False

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers before the next iteration's first micro-batch."""
        for bucket in self.buckets:
            if bucket.reduce_handle is not None:
                bucket.reduce_handle.wait()
                bucket.reduce_handle = None
            bucket.ready.clear()
            bucket.reduce_launched = False
        for buffer in self.buffers_:
            buffer.grad_data.zero_()
            for param in buffer.params:
                param.grad = None
        self.events.clear()

    # ---- parameter all-gather (distributed optimizer) ----------------------------------
    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every bucket's updated parameter shards into the parameter buffer; left in
        flight (waited for in the next forward) with --overlap-param-gather, and then, with
        --no-align-param-gather, started only by this chunk's next forward."""
        if not self.use_distributed_optimizer:
            return
        async_op = self.overlap_param_gather and not force_sync
        self._gather_deferred = async_op and not self.align_param_gather
        if not self._gather_deferred:
            self._launch_param_gathers(async_op)

    def _launch_param_gathers(self, async_op: bool) -> None:
        for bucket in self.buckets:
            buffer = bucket.buffer
            if buffer.group_size == 1:
                continue
            begin, end = bucket.shard_range(buffer.group_rank)
            self._log("gather_launch", bucket)
            handle = _all_gather(
                bucket.param_data,
                buffer.param_data[begin:end],
                group=buffer.group,
                async_op=async_op,
            )
            if async_op:
                bucket.gather_handle = handle
            else:
                self._log("gather_done", bucket)

    def finish_param_sync(self) -> None:
        """Wait for every all-gather still in flight (starting the deferred ones)."""
        if self._gather_deferred:
            self._gather_deferred = False
            self._launch_param_gathers(async_op=True)
        for bucket in self.buckets:
            self._wait_bucket_gather(bucket)

    def _wait_bucket_gather(self, bucket: GradBucket) -> None:
        if bucket.gather_handle is not None:
            bucket.gather_handle.wait()
            bucket.gather_handle = None
            self._log("gather_done", bucket)

    def _wait_param_gather(self, submodule: nn.Module, args: Any) -> None:
        if self._gather_deferred:  # this chunk's first forward after the step starts them all
            self._gather_deferred = False
            self._launch_param_gathers(async_op=True)
        for param in submodule.parameters(recurse=False):
            bucket = self._bucket_of.get(id(param))
            if bucket is not None:
                self._wait_bucket_gather(bucket)
