"""Muon (`--optimizer muon`): momentum, orthogonalised by a Newton-Schulz iteration, for the 2-D
weights of the hidden layers; AdamW for everything else (embeddings, output layer, norms, biases).

The update of a weight matrix W with gradient G (Megatron's Muon, emerging_optimizers' algorithm):
    W <- W (1 - lr wd)                          decoupled weight decay
    M <- beta M + (1 - beta) G                  momentum (an EMA; `--muon-momentum`)
    U <- (1 - beta) G + beta M  if --muon-nesterov  else  M
    W <- W - lr * scale(rows, cols) * extra * NS(U)
NS normalises U by its Frobenius norm, then runs `--muon-num-ns-steps` quintic steps
X <- a X + (b A + c A^2) X with A = X X^T on the wide orientation (the coefficients per step:
`--muon-coefficient-type`); under `--muon-fp32-matmul-prec` low or medium the steps run in bf16.
A fused QKV weight is orthogonalised per component (queries, keys, values; `--muon-no-split-qkv`
turns that off). MoE expert weights [experts, rows, cols] are orthogonalised per expert.

Tensor parallelism (`--muon-tp-mode`): `duplicated` gathers the shards, orthogonalises the full
matrix and keeps this rank's part (the same numbers as one process); `distributed` runs the
iteration on the shards with the Gram matrix summed over tp (the same update up to summation
order); `blockwise` orthogonalises each shard on its own (Megatron's cheaper variant: another
update). The distributed optimizer hands its flat shards to `orthogonalize_updates`, which it
replaces with a gather over the data-parallel group first (distributed_optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext

# Coefficients (a, b, c) of each Newton-Schulz step (Megatron's emerging_optimizers sets).
COEFFICIENTS: dict[str, list[tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
}
NS_EPS = 1e-7
# --muon-fp32-matmul-prec -> (steps in bf16, torch's float32 matmul precision for the rest).
MATMUL_PRECISION = {"low": (True, "medium"), "medium": (True, "medium"), "high": (False, "high")}
TP_MODES = ("duplicated", "distributed", "blockwise")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` steps: `simple` repeats its one set, `polar_express`
    repeats its last, the others repeat the whole list (steps a multiple of its length)."""
    if kind not in COEFFICIENTS:
        raise GigatronError(
            f"--muon-coefficient-type {kind}: unknown; choose one of {', '.join(COEFFICIENTS)}"
        )
    sets = COEFFICIENTS[kind]
    if kind == "simple":
        return sets * steps
    if kind == "polar_express":
        if steps < len(sets):
            raise GigatronError(
                f"--muon-num-ns-steps {steps}: polar_express needs at least {len(sets)} steps"
            )
        return sets + [sets[-1]] * (steps - len(sets))
    if steps < 1 or steps % len(sets):
        raise GigatronError(
            f"--muon-num-ns-steps {steps}: the {kind} coefficients need a positive multiple of "
            f"{len(sets)} steps"
        )
    return sets * (steps // len(sets))


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a full [rows, cols] matrix (`--muon-scale-mode`)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise GigatronError(f"--muon-scale-mode {mode}: unknown; choose one of {SCALE_MODES}")


def newton_schulz(
    x: torch.Tensor,
    coefficients: list[tuple[float, float, float]],
    bf16: bool,
    transpose: bool | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The orthogonalisation of the fp32 matrices `x` [..., rows, cols] (batched over leading
    dims). With `group`, `x` is a shard and the Gram matrix (over the sharded dimension, which
    `transpose` must make the column one) and the norm are summed over the group."""
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    squares = (x * x).sum(dim=(-2, -1), keepdim=True)
    if group is not None:
        dist.all_reduce(squares, group=group)
    # Frobenius norm >= spectral norm: every singular value starts in [0, 1].
    x = x / squares.sqrt().clamp_min(NS_EPS)
    if bf16:
        x = x.to(torch.bfloat16)
    # addmm / baddbmm: one rounding per step's product in bf16 (as torch.optim.Muon).
    fused = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in coefficients:
        gram = x @ x.mT
        if group is not None:
            dist.all_reduce(gram, group=group)
        x = fused(x, fused(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.to(torch.float32)
    return x.mT if transpose else x


@dataclass(frozen=True)
class MuonSettings:
    """The Muon flags, read once from the configuration."""

    momentum: float = 0.9
    nesterov: bool = False
    coefficients: tuple[tuple[float, float, float], ...] = tuple(COEFFICIENTS["quintic"])
    bf16: bool = True
    matmul_precision: str = "medium"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    tp_mode: str = "duplicated"

    @classmethod
    def from_config(cls, cfg: Any) -> MuonSettings:
        o = cfg.optimizer
        bf16, precision = MATMUL_PRECISION[o.muon_fp32_matmul_prec]
        return cls(
            momentum=o.muon_momentum,
            nesterov=o.muon_nesterov,
            coefficients=tuple(coefficient_schedule(o.muon_coefficient_type, o.muon_num_ns_steps)),
            bf16=bf16,
            matmul_precision=precision,
            scale_mode=o.muon_scale_mode,
            extra_scale_factor=o.muon_extra_scale_factor,
            tp_mode=o.muon_tp_mode,
        )


# A fused QKV weight's rows per query group: (queries, key, value) rows, set on the parameter
# by `mark_qkv_weights` and copied to fp32 main copies (optimizer.PARAM_ATTRIBUTES).
QKV_ATTRIBUTE = "muon_qkv_split"


def mark_qkv_weights(cfg: Any, model_chunks: Iterable[nn.Module]) -> None:
    """Mark every fused QKV weight with its per-group row split (`--muon-no-split-qkv`: none)."""
    if not cfg.optimizer.muon_split_qkv:
        return
    m = cfg.model
    heads = m.num_attention_heads
    groups = m.num_query_groups if m.group_query_attention else heads
    kv = m.kv_channels or m.hidden_size // heads
    split = (heads // groups * kv, kv, kv)
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if name.endswith("linear_qkv.weight") and param.dim() == 2:
                setattr(param, QKV_ATTRIBUTE, split)


class MatrixOrthogonalizer:
    """NS(update) times its scale for one parameter's update, this rank's shard of the full
    matrix's (module docstring: the tensor-parallel modes, QKV split, experts)."""

    def __init__(self, settings: MuonSettings, pctx: ParallelContext) -> None:
        self.settings = settings
        self.pctx = pctx

    def __call__(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        split = getattr(param, QKV_ATTRIBUTE, None)
        if split is None:
            return self._orthogonalize(param, update)
        cols = update.size(-1)
        groups = update.size(0) // sum(split)
        parts = update.view(groups, sum(split), cols).split(list(split), dim=1)
        done = [
            self._orthogonalize(param, part.reshape(-1, cols)).view(groups, -1, cols)
            for part in parts
        ]
        return torch.cat(done, dim=1).view(update.shape)

    def _partition(self, param: torch.Tensor) -> tuple[int | None, str]:
        """(the sharded matrix dim, -2 or -1, or None; the tensor-parallel group's name)."""
        group = "expert_tp" if getattr(param, "expert_parallel", False) else "tp"
        dim = getattr(param, "partition_dim", -1)
        if not getattr(param, "tensor_model_parallel", False) or dim < 0:
            return None, group
        if self.pctx.size(group) == 1 or self.settings.tp_mode == "blockwise":
            return None, group
        return dim - param.dim(), group

    def _orthogonalize(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        s = self.settings
        coefficients = list(s.coefficients)
        dim, group_name = self._partition(param)
        shape = list(update.shape[-2:])
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(s.matmul_precision)
        try:
            if dim is None:
                out = newton_schulz(update.float(), coefficients, s.bf16)
            else:
                size, group = self.pctx.size(group_name), self.pctx.group(group_name)
                shape[dim] *= size
                if s.tp_mode == "duplicated":
                    parts = [torch.empty_like(update, dtype=torch.float32) for _ in range(size)]
                    dist.all_gather(parts, update.float().contiguous(), group=group)
                    full = newton_schulz(torch.cat(parts, dim=dim), coefficients, s.bf16)
                    out = full.chunk(size, dim=dim)[self.pctx.rank_in(group_name)]
                else:
                    out = newton_schulz(update.float(), coefficients, s.bf16, dim == -2, group)
        finally:
            torch.set_float32_matmul_precision(previous)
        return out * (scale_factor(shape[0], shape[1], s.scale_mode) * s.extra_scale_factor)


Orthogonalize = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]]


def per_matrix(orthogonalizer: MatrixOrthogonalizer) -> Orthogonalize:
    """`Muon`'s orthogonalisation when every update is a whole (tp-sharded) matrix."""
    return lambda pairs: [orthogonalizer(param, update) for param, update in pairs]


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `"muon": True`, torch's AdamW on the others (one optimizer:
    one param_groups list for the schedule, one state dict for checkpoints).

    `orthogonalize(pairs)` turns the (parameter, momentum update) pairs of a step into scaled
    orthogonalised updates; it is collective under tensor or data parallelism, so every rank
    calls it at every step, with its own (possibly empty) list."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        settings: MuonSettings,
        orthogonalize: Orthogonalize,
        adam_kwargs: dict[str, Any],
    ) -> None:
        defaults = {"lr": adam_kwargs["lr"], "weight_decay": adam_kwargs["weight_decay"]}
        super().__init__(param_groups, defaults)
        self.settings = settings
        self.orthogonalize = orthogonalize
        self.adam_kwargs = adam_kwargs
        self.adam: torch.optim.AdamW | None = None
        self._link_adam()

    def _link_adam(self) -> None:
        """An AdamW over the same group dicts and the same state (so the schedule's lr and the
        checkpoints reach it)."""
        groups = [group for group in self.param_groups if not group.get("muon")]
        if not groups:
            self.adam = None
            return
        if self.adam is None:
            self.adam = torch.optim.AdamW(groups, **self.adam_kwargs)
        self.adam.param_groups = groups
        self.adam.state = self.state

    def state_keys_of(self, param: torch.Tensor) -> list[str]:
        """The per-element state tensors `param` gets: Muon's momentum or Adam's moments."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                return ["momentum_buffer"] if group.get("muon") else ["exp_avg", "exp_avg_sq"]
        return []

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link_adam()  # torch rebuilt the group dicts and the state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise GigatronError("Muon.step: closures are not supported")
        if self.adam is not None:
            self.adam.step()
        beta = self.settings.momentum
        pending = []
        for group in self.param_groups:
            if not group.get("muon"):
                continue
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param.grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(param.grad, 1 - beta)
                update = param.grad.lerp(buffer, beta) if self.settings.nesterov else buffer
                pending.append((param, update, group))
        updates = self.orthogonalize([(param, update) for param, update, _ in pending])
        for (param, _, group), update in zip(pending, updates):
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(update, alpha=-group["lr"])


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon updates the hidden layers' matrices; embeddings and the output layer take AdamW."""
    return param.dim() >= 2 and "embedding" not in name and "output_layer" not in name
