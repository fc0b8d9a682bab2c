"""The optimizer of FSDP2-sharded chunks (parallel/fully_sharded.py).

FSDP2 keeps each parameter as a DTensor holding this rank's fp32 shard: those shards are the main
parameters, and torch's optimizer steps them in place (its state, Adam's moments, is sharded the
same way). Grad-norm statistics sum the shards over dp (`sharded_group`).

Checkpoints use the distributed optimizer's layout (optim/distributed_optimizer.py): the rank
file's `optimizer` entry holds the group hyper-parameters and `save_sharded_state` writes
`distrib_optim.pt` with full fp32 parameters and moments per parameter name, gathered over dp.
So a checkpoint resumes at any data-parallel size, with FSDP or with the distributed optimizer.
(`--ckpt-format torch_dist` reads the DTensor shards and their moments directly instead:
checkpoint/dist_format.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from gigatron.errors import GigatronError
from gigatron.optim.distributed_optimizer import (
    load_param_groups,
    read_distrib_optim,
    sharded_state_dict,
    state_keys,
    write_distrib_optim,
)
from gigatron.optim.optimizer import FP32Optimizer
from gigatron.parallel.checkpoint_writer import writes_checkpoint


class FullyShardedOptimizer(FP32Optimizer):
    """Steps FSDP2's sharded parameters directly (see module docstring)."""

    sharded_group = "dp"

    def _named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, chunk in enumerate(self.model_chunks):
            for name, param in chunk.module.named_parameters():
                if param.requires_grad:
                    yield f"chunk{index}.{name}", param

    def _state_keys(self) -> list[str]:
        return state_keys(self.optimizer)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return sharded_state_dict(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_param_groups(
            self.optimizer,
            state,
            "optimizer state: not a sharded optimizer state (saved without "
            "--use-distributed-optimizer or FSDP, or with other parameter groups); pass "
            "--no-load-optim to load the weights only",
        )

    def save_sharded_state(self, directory: str | Path) -> None:
        """Write `distrib_optim.pt` (collective over dp: full tensors; dp rank 0 writes)."""
        keys = self._state_keys()
        step = 0.0
        full: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self._named_params():
            state = self.optimizer.state.get(param, {})
            if "step" in state:
                step = max(step, float(state["step"]))
            entry = {"param": _full(param.detach())}
            for key in keys:
                if key in state:
                    entry[key] = _full(state[key])
            full[name] = entry
        if not writes_checkpoint(self.pctx):
            return
        write_distrib_optim(directory, step, keys, full)

    def load_sharded_state(self, directory: str | Path) -> None:
        """Read `distrib_optim.pt` and keep this rank's shards (no communication)."""
        path, saved = read_distrib_optim(directory, "--use-distributed-optimizer or FSDP")
        keys = self._state_keys()
        with torch.no_grad():
            for name, param in self._named_params():
                entry = saved["params"].get(name)
                if entry is None or entry["param"].shape != param.shape:
                    raise GigatronError(
                        f"{path}: no state of the right shape for parameter {name}; the "
                        "checkpoint was saved from a different model (pass --no-load-optim)"
                    )
                param.copy_(_shard_like(entry["param"], param))
                state: dict[str, Any] = {}
                if "exp_avg" in keys:
                    state["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
                for key in keys:
                    if key in entry:
                        state[key] = _shard_like(entry[key], param)
                if any(key in state for key in keys):
                    self.optimizer.state[param] = state


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole fp32 tensor (all-gathered over dp when sharded)."""
    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().float().cpu().clone()


def _shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` (a DTensor: this rank's shard, cut locally)."""
    full = full.to(device=like.device, dtype=torch.float32)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full
