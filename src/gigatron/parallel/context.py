"""ParallelContext: where this rank sits in the tp x cp x dp x pp grid, and the groups it talks in.

Rank order follows Megatron-LM: tensor-parallel rank varies fastest, then context, then data, then
pipeline:  rank = tp + TP * (cp + CP * (dp + DP * pp)).
Expert layers see the tp x cp x dp ranks of a pipeline stage as a second grid, expert-tensor-
parallel (etp) fastest, then expert-parallel (ep), then expert-data-parallel (edp):
    position in the stage = etp + ETP * (ep + EP * edp).
With ETP = TP (the default) the ep ranks are consecutive among the dp x cp ranks of one tp rank;
with ETP = 1 they are consecutive ranks of the stage (spanning tp).

A context is built once (`ParallelContext.from_config`) and passed to whatever needs it; nothing
is looked up globally, so tests can build several in one process (`ParallelContext.single()`).
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gigatron.errors import GigatronError


@dataclass(frozen=True)
class Grid:
    """Sizes of the four dimensions and the arithmetic between ranks and coordinates."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: the tensor-parallel size

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def rank_of(self, tp: int, cp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords_of(self, rank: int) -> dict[str, int]:
        tp = rank % self.tp
        rest = rank // self.tp
        cp = rest % self.cp
        rest //= self.cp
        dp = rest % self.dp
        pp = rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}

    def groups_varying(self, dims: Iterable[str]) -> list[list[int]]:
        """All groups of ranks that differ only in `dims` (every rank is in exactly one)."""
        dims = list(dims)
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        fixed = [d for d in sizes if d not in dims]
        groups = []
        for fixed_values in itertools.product(*(range(sizes[d]) for d in fixed)):
            coords = dict(zip(fixed, fixed_values))
            members = []
            for varying in itertools.product(*(range(sizes[d]) for d in dims)):
                coords.update(zip(dims, varying))
                members.append(self.rank_of(coords["tp"], coords["cp"], coords["dp"], coords["pp"]))
            groups.append(sorted(members))
        return sorted(groups)

    def expert_coords_of(self, rank: int) -> dict[str, int]:
        """The rank's place in the expert grid: etp, ep, edp (see the module docstring)."""
        etp = self.expert_tp
        position = rank % (self.tp * self.cp * self.dp)
        return {
            "etp": position % etp,
            "ep": position // etp % self.ep,
            "edp": position // (etp * self.ep),
        }

    def expert_groups(self) -> dict[str, list[list[int]]]:
        """Groups of the expert grid (see the module docstring): "ep", "expert_dp" and
        "expert_tp", each a list of rank lists."""
        etp, ep = self.expert_tp, self.ep
        block = self.tp * self.cp * self.dp
        edp = block // (etp * ep)
        groups: dict[str, list[list[int]]] = {"ep": [], "expert_dp": [], "expert_tp": []}
        for pp in range(self.pp):

            def rank(t: int, e: int, d: int, pp: int = pp) -> int:
                return pp * block + t + etp * (e + ep * d)

            for t in range(etp):
                for d in range(edp):
                    groups["ep"].append([rank(t, e, d) for e in range(ep)])
                for e in range(ep):
                    groups["expert_dp"].append([rank(t, e, d) for d in range(edp)])
            for e in range(ep):
                for d in range(edp):
                    groups["expert_tp"].append([rank(t, e, d) for t in range(etp)])
        return {name: sorted(members) for name, members in groups.items()}


def describe_layout_error(
    world_size: int, tp: int, cp: int, pp: int, ep: int, etp: int | None = None
) -> str | None:
    model_parallel = tp * cp * pp
    if world_size % model_parallel:
        return (
            f"world size {world_size} is not divisible by tensor-parallel {tp} x context-parallel "
            f"{cp} x pipeline-parallel {pp} = {model_parallel}; launch a multiple of {model_parallel} "
            "processes or change --tensor-model-parallel-size / --context-parallel-size / "
            "--pipeline-model-parallel-size"
        )
    dp = world_size // model_parallel
    etp = tp if etp is None else etp
    if etp not in (1, tp):
        return (
            f"expert-tensor-parallel size {etp} must be 1 or the tensor-parallel size {tp}; "
            "change --expert-tensor-parallel-size"
        )
    if etp == tp and (dp * cp) % ep:
        return (
            f"expert-parallel size {ep} does not divide data-parallel {dp} x context-parallel {cp} = "
            f"{dp * cp}; change --expert-model-parallel-size"
        )
    if (tp * cp * dp) % (ep * etp):
        return (
            f"expert-parallel size {ep} does not divide the {tp * cp * dp} tensor x context x "
            "data-parallel ranks of a pipeline stage; change --expert-model-parallel-size"
        )
    return None


@dataclass
class ParallelContext:
    """Sizes, ranks and process groups of one process. Groups are None when their size is 1 and
    torch.distributed is not initialised (single-process runs and tests)."""

    grid: Grid
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    groups: dict[str, Any] = field(default_factory=dict)
    group_ranks: dict[str, list[int]] = field(default_factory=dict)
    # --distributed-timeout-minutes: every group's collectives fail after this long (None: torch's
    # default, 30 minutes on Gloo and NCCL).
    timeout: datetime.timedelta | None = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        """A one-process context: every size is 1, every collective a no-op."""
        ctx = cls(grid=Grid(), rank=0, device=torch.device(device))
        for name in GROUP_NAMES:
            ctx.group_ranks[name] = [0]
            ctx.groups[name] = None
        return ctx

    @classmethod
    def from_sizes(
        cls,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        etp: int | None = None,
        device: str | torch.device | None = None,
        backend: str | None = None,
        timeout_minutes: float = 10,
        split_rank: int | None = None,
    ) -> ParallelContext:
        """Build the context for this process from the torchrun environment (or an already
        initialised default process group). Every group it creates gets `timeout_minutes`.
        `split_rank` (encoder-decoder models, --pipeline-model-parallel-split-rank): the first
        decoder stage, which also holds the word (and position) embedding."""
        world_size = (
            dist.get_world_size()
            if dist.is_initialized()
            else int(os.environ.get("WORLD_SIZE", "1"))
        )
        error = describe_layout_error(world_size, tp, cp, pp, ep, etp)
        if error:
            raise GigatronError(error)
        grid = Grid(tp=tp, cp=cp, dp=world_size // (tp * cp * pp), pp=pp, ep=ep, etp=etp)
        device = resolve_device(device or "auto")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if world_size == 1 and not dist.is_initialized():
            ctx = cls.single(device)
            return ctx
        if not dist.is_initialized():
            backend = resolve_backend(backend or "auto", device)
            if device.type == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
                device = torch.device("cuda", torch.cuda.current_device())
            init_default_group(backend, timeout)
        elif device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        rank = dist.get_rank()
        ctx = cls(grid=grid, rank=rank, device=device, backend=dist.get_backend(), timeout=timeout)
        ctx._create_groups(split_rank if pp > 1 else None)
        return ctx

    @classmethod
    def from_config(cls, cfg: Any) -> ParallelContext:
        p = cfg.parallel
        return cls.from_sizes(
            tp=p.tensor_model_parallel_size,
            pp=p.pipeline_model_parallel_size,
            cp=p.context_parallel_size,
            ep=p.expert_model_parallel_size,
            etp=p.expert_tensor_parallel_size,
            device=p.device,
            backend=p.distributed_backend,
            timeout_minutes=p.distributed_timeout_minutes,
            split_rank=p.pipeline_model_parallel_split_rank,
        )

    def _create_groups(self, split_rank: int | None = None) -> None:
        g = self.grid
        pp_groups = g.groups_varying(["pp"])
        embedding_groups = []
        position_embedding_groups = []
        for ranks in pp_groups:
            # Megatron's groups: the stages holding the word embedding (first, the decoder's
            # first with a split rank, last) and the position embedding (first, split).
            split = [ranks[split_rank]] if split_rank is not None else []
            embedding_groups.append(sorted({ranks[0], *split, ranks[-1]}))
            position_embedding_groups.append(sorted({ranks[0], *split}))
        expert_layouts = g.expert_groups()
        for name in GROUP_NAMES:
            # A rank outside every group of a kind (a middle pipeline stage and the embedding
            # group) is alone in it.
            self.groups[name] = None
            self.group_ranks[name] = [self.rank]
        layouts: dict[str, list[list[int]]] = {
            "tp": g.groups_varying(["tp"]),
            "cp": g.groups_varying(["cp"]),
            "dp": g.groups_varying(["dp"]),
            "dp_cp": g.groups_varying(["cp", "dp"]),
            "pp": pp_groups,
            "tp_cp": g.groups_varying(["tp", "cp"]),
            "model": g.groups_varying(["tp", "pp"]),
            "embedding": embedding_groups,
            "position_embedding": position_embedding_groups,
            **expert_layouts,
        }
        # Every rank must create every group, in the same order (a torch.distributed rule).
        for name in GROUP_NAMES:
            for ranks in layouts[name]:
                # Without a timeout, torch gives new groups its 30-minute default, not the
                # world group's: a stopped peer would block the others that long.
                group = dist.new_group(ranks=ranks, timeout=self.timeout)
                if self.rank in ranks:
                    self.groups[name] = group
                    self.group_ranks[name] = ranks

    # ---- sizes and ranks ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.grid.world_size

    def _coord(self, dim: str) -> int:
        return self.grid.coords_of(self.rank)[dim]

    tp_size = property(lambda self: self.grid.tp)
    cp_size = property(lambda self: self.grid.cp)
    dp_size = property(lambda self: self.grid.dp)
    pp_size = property(lambda self: self.grid.pp)
    ep_size = property(lambda self: self.grid.ep)
    tp_rank = property(lambda self: self._coord("tp"))
    cp_rank = property(lambda self: self._coord("cp"))
    dp_rank = property(lambda self: self._coord("dp"))
    pp_rank = property(lambda self: self._coord("pp"))

    @property
    def ep_rank(self) -> int:
        return self.grid.expert_coords_of(self.rank)["ep"]

    @property
    def etp_size(self) -> int:
        return self.grid.expert_tp

    @property
    def etp_rank(self) -> int:
        return self.grid.expert_coords_of(self.rank)["etp"]

    @property
    def dp_cp_rank(self) -> int:
        return self.group_ranks["dp_cp"].index(self.rank)

    def group(self, name: str) -> Any:
        """The process group `name` (see GROUP_NAMES) this rank belongs to."""
        return self.groups[name]

    def size(self, name: str) -> int:
        return len(self.group_ranks[name])

    def rank_in(self, name: str) -> int:
        return self.group_ranks[name].index(self.rank)

    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pipeline_rank_to_global(self, pp_rank: int) -> int:
        return self.group_ranks["pp"][pp_rank % self.pp_size]

    @property
    def next_pipeline_rank(self) -> int:
        return self.pipeline_rank_to_global(self.pp_rank + 1)

    @property
    def prev_pipeline_rank(self) -> int:
        return self.pipeline_rank_to_global(self.pp_rank - 1)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, group_name: str, op: Any = None) -> torch.Tensor:
        """In-place all-reduce in a named group; a no-op when that group has one member."""
        if self.size(group_name) > 1:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, group=self.groups[group_name])
        return tensor

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
            f"cp {self.cp_rank}/{self.cp_size}, dp {self.dp_rank}/{self.dp_size}, "
            f"pp {self.pp_rank}/{self.pp_size}, ep {self.ep_rank}/{self.ep_size}, "
            f"etp {self.etp_rank}/{self.etp_size}"
        )


GROUP_NAMES = (
    "tp",
    "cp",
    "dp",
    "dp_cp",
    "pp",
    "tp_cp",
    "model",
    "embedding",
    "position_embedding",
    "ep",
    "expert_dp",
    "expert_tp",
)


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise GigatronError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    return torch.device(device)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise GigatronError("--distributed-backend nccl needs GPUs; use gloo (or auto) on CPU")
    return backend


def destroy(ctx: ParallelContext | None = None) -> None:
    """Tear down the default process group once every rank has arrived (end of a command): a
    rank that exits while a peer still finishes closes the connections under it, and Gloo
    aborts that peer (SIGABRT)."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def init_default_group(backend: str, timeout: datetime.timedelta) -> None:
    """The default process group from the launcher's environment. Under torchrun the keys go
    under a prefix of the restart round (TORCHELASTIC_RESTART_COUNT): the agent's store outlives
    a failed round, and workers of a new round must not read the dead round's addresses (Gloo
    then connects to a process that is gone, or hangs)."""
    restart_round = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart_round is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"gigatron/round{restart_round}", store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "gigatron.parallel.context")


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, port: int | None = None
) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes on Gloo (tests, tools).

    Each process gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set and an initialised default
    group; a failure in any process raises here with its traceback.
    """

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    # Forked from a server that imported torch once: a spawned interpreter would import torch
    # (and torch._dynamo, which AdamW pulls in) again in every rank, about 2.5 s of CPU each.
    mp.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    mp.start_processes(
        _spawned_entry, args=(fn, world_size, port, args), nprocs=world_size, join=True,
        start_method="forkserver",
    )  # fmt: skip


def _spawned_entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, args: tuple
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
