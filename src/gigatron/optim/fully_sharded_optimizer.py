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

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from gigatron.errors import GigatronError
from gigatron.optim.distributed_optimizer import DISTRIB_OPTIM_FILENAME
from gigatron.optim.optimizer import FP32Optimizer
from gigatron.parallel.checkpoint_writer import writes_checkpoint
from gigatron.torch_files import safe_load


class FullyShardedOptimizer(FP32Optimizer):
    """Steps FSDP2's sharded parameters directly (see module docstring)."""

    sharded_group = "dp"

    def _named_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, chunk in enumerate(self.model_chunks):
            for name, param in chunk.module.named_parameters():
                if param.requires_grad:
                    yield f"chunk{index}.{name}", param

    def _state_keys(self) -> list[str]:
        if isinstance(self.optimizer, torch.optim.SGD):
            return ["momentum_buffer"] if self.optimizer.defaults.get("momentum") else []
        return ["exp_avg", "exp_avg_sq"]

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        groups = [
            {key: value for key, value in group.items() if key != "params"}
            for group in self.optimizer.param_groups
        ]
        return {"param_groups": groups, "sharded_state": DISTRIB_OPTIM_FILENAME}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = state.get("param_groups")
        if groups is None or len(groups) != len(self.optimizer.param_groups):
            raise GigatronError(
                "optimizer state: not a sharded optimizer state (saved without "
                "--use-distributed-optimizer or FSDP, or with other parameter groups); pass "
                "--no-load-optim to load the weights only"
            )
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({key: value for key, value in saved.items() if key != "params"})

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
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        saved = {"version": 1, "step": step, "state_keys": keys, "params": full}
        tmp = directory / (DISTRIB_OPTIM_FILENAME + ".tmp")
        torch.save(saved, tmp)
        os.replace(tmp, directory / DISTRIB_OPTIM_FILENAME)

    def load_sharded_state(self, directory: str | Path) -> None:
        """Read `distrib_optim.pt` and keep this rank's shards (no communication)."""
        path = Path(directory) / DISTRIB_OPTIM_FILENAME
        if not path.is_file():
            raise GigatronError(
                f"{path} is missing: the checkpoint was saved without --use-distributed-optimizer "
                "or FSDP (or is incomplete); pass --no-load-optim to load the weights only"
            )
        saved = safe_load(path)
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
