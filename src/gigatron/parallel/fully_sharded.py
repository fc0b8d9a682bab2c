"""Fully sharded data parallelism on PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

`--use-torch-fsdp2`, or `--use-megatron-fsdp` with `--data-parallel-sharding-strategy`, wraps each
model chunk in `FullyShardedDataParallel` instead of `DistributedDataParallel`:

- every layer of the chunk (a module with a `layer_number`) and then the chunk itself is one
  `fully_shard` unit over a device mesh of the data-parallel group: each parameter becomes a
  DTensor holding this rank's dim-0 shard (tensor-parallel slices are sharded again over dp);
- parameters are kept in fp32 (they are the optimizer's main parameters); under --bf16/--fp16
  FSDP2's MixedPrecisionPolicy gathers them in that dtype for forward and backward, and reduces
  gradients in fp32 (bf16 with --grad-reduce-in-bf16 or --megatron-fsdp-grad-comm-dtype bf16);
- gradients are reduce-scattered in backward (each rank keeps the shard it steps), averaged over
  the data-parallel ranks like DistributedDataParallel's (summed with --calculate-per-token-loss);
  `no_sync()` defers the reduction to the last micro-batch;
- strategies: `optim_grads_params` (ZeRO-3, the default and --use-torch-fsdp2) reshards the
  parameters after forward and gathers them again in backward; `optim_grads` (ZeRO-2) keeps them
  gathered from forward to the end of backward. (`optim` and `no_shard` are served by the
  distributed optimizer and DistributedDataParallel: see `data_parallel_wrapper`.)
The optimizer steps the sharded parameters directly (optim/build.py), with grad-norm statistics
summed over the dp shards. The wrapper is transparent like DistributedDataParallel; its
`state_dict()` holds full tensors (gathered on every dp rank, so every rank must call it).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import ChunkWrapper

# Megatron's sharding strategies -> FSDP2's reshard_after_forward.
RESHARD_AFTER_FORWARD = {"optim_grads_params": True, "optim_grads": False}
COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_strategy(parallel_cfg: Any) -> str | None:
    """The sharding strategy the flags ask for, or None without FSDP."""
    if parallel_cfg.use_torch_fsdp2:
        return "optim_grads_params"
    if parallel_cfg.use_megatron_fsdp:
        return parallel_cfg.data_parallel_sharding_strategy
    return None


def uses_fully_sharded(parallel_cfg: Any, dp_size: int) -> bool:
    """True when the chunks are wrapped in FullyShardedDataParallel (FSDP2 shards params and
    grads only at dp > 1; at dp = 1 there is nothing to shard)."""
    return fsdp_strategy(parallel_cfg) in RESHARD_AFTER_FORWARD and dp_size > 1


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _outermost_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of a chunk (modules with a `layer_number`; their attention and MLP parts
    carry one too, but they belong to their layer's unit)."""
    layers: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside or sub is module:
            continue
        if hasattr(sub, "layer_number"):
            layers.append(sub)
            inside.update(id(m) for m in sub.modules())
    return layers


class FullyShardedDataParallel(ChunkWrapper):
    """One model chunk sharded with FSDP2 over the data-parallel group (see module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        pctx: ParallelContext,
        parallel_cfg: Any,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        strategy = fsdp_strategy(parallel_cfg)
        mesh = DeviceMesh.from_group(pctx.group("dp"), pctx.device.type, mesh_dim_names=("dp",))
        attributes = {name: dict(vars(p)) for name, p in module.named_parameters()}
        module.float()  # sharded parameters are the fp32 main parameters
        policy = MixedPrecisionPolicy(
            param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
            reduce_dtype=reduce_dtype,
        )
        reshard = RESHARD_AFTER_FORWARD[strategy]
        for layer in _outermost_layers(module):
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        if parallel_cfg.calculate_per_token_loss:
            for unit in module.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(1.0)  # summed: the loop divides by tokens
                    # A plain sum (Gloo has no pre-multiplied sum).
                    unit.set_force_sum_reduction_for_comms(True)
        # fully_shard makes new Parameter objects: give them the layout attributes back
        # (tensor_model_parallel, partition_dim, sequence_parallel, ...).
        for name, param in module.named_parameters():
            for key, value in attributes.get(name, {}).items():
                setattr(param, key, value)
        self.module = module
        self.pctx = pctx
        self.strategy = strategy
        self.compute_dtype = compute_dtype
        self._gathered: dict[str, Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            # The last stage returns its logits as a transposed view; nothing modifies them in
            # place (the loss works on its own fp32 copy), which is what FSDP2 warns about.
            warnings.filterwarnings("ignore", message=".*returned a view tensor")
            return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates unsharded gradients without reducing them."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self) -> None:
        """FSDP2 reduce-scatters during backward; nothing to start."""

    def finish_grad_sync(self) -> None:
        """FSDP2 waits for its reductions at the end of backward; nothing to finish."""

    def zero_grad_buffer(self) -> None:
        for param in self.module.parameters():
            param.grad = None

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Parameters are gathered by FSDP2 before each use; nothing to do after a step."""

    def finish_param_sync(self) -> None:
        """See start_param_sync."""

    def gather_for_save(self) -> None:
        """Gather the full state now, on every dp rank (a checkpoint then writes it from the
        rank that writes this position's file, which calls `state_dict()` alone)."""
        self._gathered = self._full_state()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Full tensors, floating ones in the model's dtype (the fp32 main values go to the
        optimizer's `distrib_optim.pt`). Without `gather_for_save()` first this all-gathers over
        dp: every dp rank must call it."""
        gathered, self._gathered = self._gathered, None
        return gathered if gathered is not None else self._full_state(*args, **kwargs)

    def _full_state(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        state = {}
        for name, value in self.module.state_dict(*args, **kwargs).items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if torch.is_floating_point(value):
                value = value.to(self.compute_dtype)
            state[name] = value
        return state

    def load_state_dict(self, state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        """Loads full tensors: each parameter takes its shard."""
        own = self.module.state_dict()
        sharded = {}
        for name, value in state_dict.items():
            target = own.get(name)
            if isinstance(target, DTensor):
                # Each rank cuts its own shard (the full tensor is on every rank).
                value = distribute_tensor(
                    value.to(target.device, target.dtype),
                    target.device_mesh,
                    target.placements,
                    src_data_rank=None,
                )
            sharded[name] = value
        return self.module.load_state_dict(sharded, strict=strict, **kwargs)
