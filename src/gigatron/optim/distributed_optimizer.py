"""The distributed optimizer (`--use-distributed-optimizer`): optimizer state and fp32 main
parameters sharded over the data-parallel ranks (ZeRO stage 1, Megatron's layout).

Layout. DistributedDataParallel (built with `use_distributed_optimizer`) pads every gradient
bucket to a multiple of the data-parallel size; rank r owns the r-th equal slice of each bucket.
A parameter may straddle slices, so a rank owns, per parameter, the part of it that falls into its
slices. For each owned part this optimizer keeps
- an fp32 main copy (for bf16/fp16 parameters; fp32 parameters are stepped in place through a view
  of the parameter buffer, so they need no copy),
- the inner optimizer's state (Adam's exp_avg, exp_avg_sq),
- its gradient: a view of the reduce-scattered gradient buffer when that is fp32, else an fp32
  copy made at each step.

Step. DDP reduce-scatters the buckets (each rank receives the summed slice it owns); the shared
template of `GigatronOptimizer.step` unscales and checks overflow over model + dp ranks, computes
the global norm (squared sums reduced over model + dp, since the grads are sharded), clips, and
runs torch's AdamW/SGD on the shards; the updated shards are copied into the model's parameter
buffer and all-gathered per bucket (left in flight and waited for by each module's pre-forward
hook with `--overlap-param-gather`).

Bytes per parameter (Megatron's table; measured by `memory_bytes_per_rank`):
    params / grads   plain   distributed (d = dp size)
    fp16 / fp16        20      4 + 16/d
    bf16 / fp32        18      6 + 12/d
    fp32 / fp32        16      8 +  8/d
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.optim.grad_scaler import GradScaler
from gigatron.optim.muon import (
    MatrixOrthogonalizer,
    Muon,
    MuonSettings,
    Orthogonalize,
    mark_qkv_weights,
)
from gigatron.optim.optimizer import (
    GigatronOptimizer,
    copy_param_attributes,
    make_torch_optimizer,
    param_groups_for,
)
from gigatron.parallel.checkpoint_writer import writes_checkpoint
from gigatron.parallel.context import ParallelContext
from gigatron.torch_files import safe_load

# Dense gradients are sharded over dp x cp, expert gradients over expert-dp (DDP's buffer groups);
# the global statistics (optim/clip_grads.py) reduce the expert part over expert-dp.
SHARDED_GROUP = "dp_cp"
DISTRIB_OPTIM_FILENAME = "distrib_optim.pt"


def state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """Per-element state tensors of the inner optimizer (same on every rank)."""
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if optimizer.defaults.get("momentum") else []
    if isinstance(optimizer, Muon):
        return ["exp_avg", "exp_avg_sq", "momentum_buffer"]
    return ["exp_avg", "exp_avg_sq"]


def sharded_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The checkpoint entry of a sharded optimizer: its param-group settings and the name of the
    file holding the state itself."""
    groups = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    return {"param_groups": groups, "sharded_state": DISTRIB_OPTIM_FILENAME}


def load_param_groups(optimizer: torch.optim.Optimizer, state: dict[str, Any], error: str) -> None:
    """Restore the param-group settings of `sharded_state_dict`; GigatronError(`error`) when
    `state` has none or another number of groups."""
    groups = state.get("param_groups")
    if groups is None or len(groups) != len(optimizer.param_groups):
        raise GigatronError(error)
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({key: value for key, value in saved.items() if key != "params"})


def write_distrib_optim(
    directory: str | Path, step: float, state_keys: list[str], full: dict[str, Any]
) -> None:
    """Write `distrib_optim.pt` (whole optimizer state by parameter name) into `directory`,
    atomically (a temporary file renamed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {"version": 1, "step": step, "state_keys": state_keys, "params": full}
    tmp = directory / (DISTRIB_OPTIM_FILENAME + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, directory / DISTRIB_OPTIM_FILENAME)


def read_distrib_optim(directory: str | Path, saved_by: str) -> tuple[Path, dict[str, Any]]:
    """(path, contents) of `distrib_optim.pt` in `directory`; `saved_by` names the flags that
    write it, for the error when it is missing."""
    path = Path(directory) / DISTRIB_OPTIM_FILENAME
    if not path.is_file():
        raise GigatronError(
            f"{path} is missing: the checkpoint was saved without {saved_by} (or is incomplete); "
            "pass --no-load-optim to load the weights only"
        )
    return path, safe_load(path)


@dataclass
class ShardedParam:
    """The part [start, end) (flat indices) of one model parameter owned by this rank."""

    model_param: nn.Parameter
    start: int
    end: int
    main: torch.Tensor  # fp32; a view of the model parameter when that is fp32

    @property
    def model_view(self) -> torch.Tensor:
        return self.model_param.detach().view(-1)[self.start : self.end]

    @property
    def grad_view(self) -> torch.Tensor:
        return self.model_param.main_grad.view(-1)[self.start : self.end]


class DistributedOptimizer(GigatronOptimizer):
    """Same interface as the other optimizers (see gigatron.optim.optimizer)."""

    sharded_group = SHARDED_GROUP

    def __init__(
        self,
        cfg: Any,
        model_chunks: list[nn.Module],
        pctx: ParallelContext,
        grad_scaler: GradScaler | None = None,
    ) -> None:
        if cfg.training.fp16 and grad_scaler is None:
            raise GigatronError("--fp16 needs a loss scaler (dynamic by default, or --loss-scale)")
        for chunk in model_chunks:
            buffers = getattr(chunk, "grad_buffers", None)
            if buffers is None or not all(b.sharded for b in buffers):
                raise GigatronError(
                    "--use-distributed-optimizer: every model chunk must be wrapped in "
                    "DistributedDataParallel built with the same parallel config "
                    "(use_distributed_optimizer=True)"
                )
        self.shards: list[ShardedParam] = []
        owned: dict[int, list[ShardedParam]] = {}
        for chunk in model_chunks:
            for buffer in chunk.grad_buffers:
                for bucket in buffer.buckets:
                    begin, end = bucket.shard_range(buffer.group_rank)
                    for param in bucket.params:
                        p_begin, p_end = buffer.param_range[id(param)]
                        lo, hi = max(p_begin, begin), min(p_end, end)
                        if lo >= hi:
                            continue
                        shard = self._make_shard(param, lo - p_begin, hi - p_begin)
                        self.shards.append(shard)
                        owned.setdefault(id(param), []).append(shard)
        # Same groups (weight decay on matrices only) as the plain optimizer, over the shards.
        groups = []
        model_groups = param_groups_for(cfg, model_chunks)
        for group in model_groups:
            mains = [s.main for p in group["params"] for s in owned.get(id(p), [])]
            groups.append({**group, "params": mains})
        # Every rank keeps the same groups (possibly empty) so that the schedule and the
        # checkpoint layout agree across ranks.
        orthogonalize = None
        if cfg.optimizer.optimizer == "muon":
            orthogonalize = self._muon_orthogonalize(cfg, model_chunks, pctx, model_groups)
        optimizer = make_torch_optimizer(cfg, groups, orthogonalize)
        super().__init__(optimizer, cfg, model_chunks, pctx, grad_scaler)

    def _muon_orthogonalize(
        self,
        cfg: Any,
        model_chunks: list[nn.Module],
        pctx: ParallelContext,
        model_groups: list[dict[str, Any]],
    ) -> Orthogonalize:
        """Muon's orthogonalisation over flat shards: each update is summed into its whole
        parameter over the buffer's group (every rank, every Muon parameter, in buffer order),
        orthogonalised whole, and this rank's part kept."""
        mark_qkv_weights(cfg, model_chunks)
        matrix = MatrixOrthogonalizer(MuonSettings.from_config(cfg), pctx)
        muon = {id(p) for group in model_groups if group.get("muon") for p in group["params"]}
        order = [
            (buffer, param)
            for chunk in model_chunks
            for buffer in chunk.grad_buffers
            for param in buffer.params
            if id(param) in muon
        ]

        def orthogonalize(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
            updates = {id(main): update for main, update in pairs}
            shards = {id(s.model_param): s for s in self.shards if id(s.main) in updates}
            done = {}
            for buffer, param in order:
                flat = torch.zeros(param.numel(), dtype=torch.float32, device=pctx.device)
                shard = shards.get(id(param))
                if shard is not None:
                    flat[shard.start : shard.end] = updates[id(shard.main)]
                if buffer.group_size > 1:
                    torch.distributed.all_reduce(flat, group=buffer.group)
                # Tensor-parallel peers own the same flat ranges: they skip the same matrices.
                if shard is not None:
                    whole = matrix(param, flat.view(param.shape)).reshape(-1)
                    done[id(shard.main)] = whole[shard.start : shard.end]
            return [done[id(main)] for main, _ in pairs]

        return orthogonalize

    @staticmethod
    def _make_shard(param: nn.Parameter, start: int, end: int) -> ShardedParam:
        view = param.detach().view(-1)[start:end]
        main = view if param.dtype == torch.float32 else view.float().clone()
        copy_param_attributes(param, main)
        return ShardedParam(param, start, end, main)

    # ---- the step template's pieces --------------------------------------------------------
    def prepare_grads(self) -> bool:
        for chunk in self.model_chunks:
            # The next update writes the parameter buffer: no all-gather may still be running.
            chunk.finish_param_sync()
        for shard in self.shards:
            # An fp32 grad buffer is used in place; fp16/bf16 grads get an fp32 copy.
            shard.main.grad = shard.grad_view.float()
        return self.unscale_and_check_overflow()

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        for shard in self.shards:
            if shard.main is not shard.model_param and shard.main.dtype != shard.model_param.dtype:
                shard.model_view.copy_(shard.main)
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        return True

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for shard in self.shards:
                if shard.model_param.dtype != torch.float32:
                    shard.main.copy_(shard.model_view.float())

    # ---- checkpoints -----------------------------------------------------------------------
    # The checkpoint code (checkpoint/torch_format.py) writes `state_dict()` from data-parallel
    # rank 0 only, and calls `save_sharded_state(dir)` on every rank. So `state_dict()` holds
    # what all ranks share (hyper-parameters, loss scale), and the sharded part (fp32 main params,
    # Adam moments) is gathered into full per-parameter tensors written once per (tp, pp)
    # position as `distrib_optim.pt`: a file that loads at any data-parallel size or bucket size.
    def state_dict(self) -> dict[str, Any]:
        """What every data-parallel rank shares: group hyper-parameters and the loss scale."""
        state = sharded_state_dict(self.optimizer)
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_param_groups(
            self.optimizer,
            state,
            "optimizer state: not a distributed-optimizer state (or one for a different "
            "number of parameter groups); resume with --use-distributed-optimizer as saved, "
            "or pass --no-load-optim",
        )
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

    def _state_keys(self) -> list[str]:
        return state_keys(self.optimizer)

    def full_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], float] | None:
        """(name -> {"param", moments...} full fp32 tensors, step) on the rank writing this
        position's checkpoint file, None elsewhere. Collective over the data-parallel group."""
        keys = self._state_keys()
        step = torch.zeros(1, dtype=torch.float64)
        for shard in self.shards:
            entry = self.optimizer.state.get(shard.main, {})
            if "step" in entry:
                step = torch.maximum(step, torch.as_tensor(entry["step"], dtype=torch.float64))
        self.pctx.all_reduce(step, SHARDED_GROUP, op=torch.distributed.ReduceOp.MAX)
        full: dict[str, dict[str, torch.Tensor]] = {}
        # The rank that writes this (tp, pp, ep) position's checkpoint file; every rank of a
        # buffer's group gets the full tensors from the all-reduce below.
        is_writer = writes_checkpoint(self.pctx)
        for chunk_index, chunk in enumerate(self.model_chunks):
            for buffer in chunk.grad_buffers:
                mine = [s for s in self.shards if id(s.model_param) in buffer.param_range]
                for key in ["param", *keys]:
                    flat = torch.zeros(buffer.numel, dtype=torch.float32, device=self.pctx.device)
                    for shard in mine:
                        begin = buffer.param_range[id(shard.model_param)][0]
                        value = self._shard_value(shard, key)
                        if value is not None:
                            flat[begin + shard.start : begin + shard.end] = value
                    # Each element is owned by exactly one rank (the others hold zeros there).
                    if buffer.group_size > 1:
                        torch.distributed.all_reduce(flat, group=buffer.group)
                    if not is_writer:
                        continue
                    for param in buffer.params:
                        begin, end = buffer.param_range[id(param)]
                        name = f"chunk{chunk_index}.{chunk.param_name(param)}"
                        full.setdefault(name, {})[key] = flat[begin:end].view(param.shape).clone()
        return (full, float(step.item())) if is_writer else None

    def _shard_value(self, shard: ShardedParam, key: str) -> torch.Tensor | None:
        if key == "param":
            return shard.main.detach()
        return self.optimizer.state.get(shard.main, {}).get(key)

    def save_sharded_state(self, directory: str | Path) -> None:
        """Write `distrib_optim.pt` into `directory` (collective; data-parallel rank 0 writes)."""
        gathered = self.full_state()
        if gathered is None:
            return
        full, step = gathered
        write_distrib_optim(directory, step, self._state_keys(), full)

    def load_sharded_state(self, directory: str | Path) -> None:
        """Read `distrib_optim.pt` from `directory` and keep this rank's shards of it."""
        path, saved = read_distrib_optim(directory, "--use-distributed-optimizer")
        self.load_full_state(saved, str(path))

    def load_full_state(self, state: dict[str, Any], source: str = "optimizer state") -> None:
        """Take this rank's shards from a gathered state (see `full_state`)."""
        params = state["params"]
        keys = self._state_keys()
        if list(state.get("state_keys", keys)) != keys:
            raise GigatronError(
                f"{source}: holds optimizer state {state.get('state_keys')} but --optimizer "
                f"{self.cfg.optimizer.optimizer} needs {keys}; resume with the same optimizer "
                "or pass --no-load-optim"
            )
        names = {}
        for chunk_index, chunk in enumerate(self.model_chunks):
            for buffer in chunk.grad_buffers:
                for param in buffer.params:
                    names[id(param)] = f"chunk{chunk_index}.{chunk.param_name(param)}"
        with torch.no_grad():
            for shard in self.shards:
                name = names[id(shard.model_param)]
                saved = params.get(name)
                if saved is None or saved["param"].numel() != shard.model_param.numel():
                    raise GigatronError(
                        f"{source}: no state of the right size for parameter {name}; the "
                        "checkpoint was saved from a different model (pass --no-load-optim)"
                    )
                shard.main.copy_(saved["param"].reshape(-1)[shard.start : shard.end])
                entry: dict[str, torch.Tensor] = {}
                if "exp_avg" in keys:
                    entry["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                for key in keys:
                    value = saved.get(key)
                    if value is not None:
                        entry[key] = (
                            value.reshape(-1)[shard.start : shard.end]
                            .to(device=shard.main.device, dtype=torch.float32)
                            .clone()
                        )
                if len(entry) > 1 or (entry and "step" not in entry):
                    self.optimizer.state[shard.main] = entry
                if shard.model_param.dtype != torch.float32:
                    shard.model_view.copy_(shard.main)
        for chunk in self.model_chunks:
            chunk.start_param_sync(force_sync=True)
