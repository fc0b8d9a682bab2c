"""LoRA: low-rank adapters on the linear layers a run names, the rest of the model frozen.

An adapted layer computes `y = base(x) + (alpha / rank) * B(A(dropout(x)))`, A = `linear_in`
[rank, in], B = `linear_out` [out, rank] (Megatron-Bridge's names), B initialised to zero, so a
new adapter leaves the model unchanged. Adapters follow the base layer's tensor parallelism
(the rule Megatron-Bridge and PEFT use):
- column-parallel base (linear_qkv, linear_fc1): A is whole on every tp rank, B is split by
  output rows as the base weight is (same stride). The input is gathered as the base does; A's
  gradient is a partial sum on each rank, summed over tp by `finalize_model_grads` (A is marked
  `sequence_parallel`, the mark of replicated weights with partial gradients);
- row-parallel base (linear_proj, linear_fc2): A is split by input columns as the base weight
  is, its partial products summed over tp (reduce-scattered under sequence parallelism), B is
  whole (marked `sequence_parallel` under sequence parallelism, where it sees a slice).
So every tp layout computes the tp = 1 adapter, and the full A and B are `merge_partitions` of
the slices. An MoE layer's stacked expert weights (`mlp.experts.linear_fc1` / `linear_fc2`) get
an `ExpertLoRAAdapter`: one A and B per expert, split over ep as the experts are (GroupedExperts
adds its output). Names: `<layer>.adapter.linear_in.weight`, `<layer>.adapter.linear_out.weight`; the
base parameters keep their names, frozen. A chunk with adapters saves only them
(`state_dict`) and loads a checkpoint that has only the adapters or only the base (docs/lora.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from gigatron.errors import GigatronError
from gigatron.parallel.collectives import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    initialize_parameters,
    merge_partitions,
    set_tensor_parallel_attributes,
)

# The linear layers LoRA can adapt (Megatron-Core's module names).
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER = "adapter"  # the attribute (and name part) holding a layer's adapter


@dataclass(frozen=True)
class LoRASpec:
    """A run's adapters: which layers, rank, alpha, dropout (`--lora-*`)."""

    targets: tuple[str, ...]
    rank: int
    alpha: float
    dropout: float = 0.0
    dora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, cfg: Any) -> LoRASpec | None:
        """The spec of a configuration (None without --lora-target-modules)."""
        m = cfg.model
        if not m.lora_target_modules:
            return None
        unknown = sorted(set(m.lora_target_modules) - set(TARGETS))
        if unknown:
            raise GigatronError(
                f"--lora-target-modules {' '.join(unknown)}: not a layer LoRA adapts; choose "
                f"from {', '.join(TARGETS)}"
            )
        return cls(
            tuple(m.lora_target_modules), m.lora_rank, m.lora_alpha, m.lora_dropout,
            getattr(m, "lora_dora", False),
        )  # fmt: skip


class LoRAAdapter(nn.Module):
    """The low-rank branch of one tensor-parallel linear layer (module docstring)."""

    def __init__(self, base: nn.Module, spec: LoRASpec, pctx: ParallelContext, rng: Any) -> None:
        super().__init__()
        self.row = isinstance(base, RowParallelLinear)
        self.pctx, self.rng, self.spec = pctx, rng, spec
        self.sequence_parallel = base.sequence_parallel
        weight = base.weight
        local_out, local_in = weight.shape
        # skip_init: the weights are drawn below from their own generators (any layout alike)
        options = dict(bias=False, dtype=weight.dtype, device=weight.device)
        self.linear_in = skip_init(nn.Linear, local_in, spec.rank, **options)
        self.linear_out = skip_init(nn.Linear, spec.rank, local_out, **options)
        a, b = self.linear_in.weight, self.linear_out.weight
        tp = pctx.tp_size > 1
        # A ~ N(0, 1 / fan_in), as PEFT's and Bridge's uniform inits scale it.
        std = (local_in * (pctx.tp_size if self.row else 1)) ** -0.5
        if self.row:
            set_tensor_parallel_attributes(a, True, 1, 1, "normal", std)
            set_tensor_parallel_attributes(b, False, init="zeros")
            b.sequence_parallel = tp and self.sequence_parallel
        else:
            set_tensor_parallel_attributes(a, False, init="normal", init_std=std)
            set_tensor_parallel_attributes(b, True, 0, weight.partition_stride, "zeros")
            a.sequence_parallel = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The branch's output for the base layer's input `x`, laid out as the base's output."""
        if self.row:
            h = self.linear_in(self._dropout(x))
            if self.sequence_parallel:
                h = reduce_scatter_to_sequence_parallel_region(h, self.pctx)
            else:
                h = reduce_from_tp_region(h, self.pctx)
            return self.linear_out(h) * self.spec.scale
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.pctx)
        else:  # the input's gradient from this branch is partial on each rank: summed over tp
            x = copy_to_tp_region(x, self.pctx)
        return self.linear_out(self.linear_in(self._dropout(x))) * self.spec.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.spec.dropout == 0.0:
            return x
        if self.row and self.rng is not None:  # a slice of the features: a per-rank mask
            with self.rng.fork():
                return F.dropout(x, self.spec.dropout)
        return F.dropout(x, self.spec.dropout)

    def delta_weight(self) -> torch.Tensor:
        """This rank's slice of `scale * B @ A`, shaped as the base weight's slice."""
        a, b = self.linear_in.weight.float(), self.linear_out.weight.float()
        return (b @ a) * self.spec.scale

    def add_to(self, layer: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """The adapted layer's output from the base layer's input and output."""
        return output + self(x)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the adapted weight (`weight`: the base's slice)."""
        return weight + self.delta_weight().to(weight.dtype)


class DoRAAdapter(LoRAAdapter):
    """LoRA with DoRA's weight decomposition (`--lora-dora`, PEFT's `use_dora`): the adapted
    weight is m V / ||V||, V = W + scale B A, ||V|| the norm of each output row (a constant in
    backward, as the DoRA paper and PEFT treat it) and m = `magnitude` [out], learned, starting
    at ||W|| (a new adapter changes nothing). m follows the output rows: split with those of a
    column-parallel weight; whole beside a row-parallel one, whose row norms sum over tp."""

    def __init__(self, base: nn.Module, spec: LoRASpec, pctx: ParallelContext, rng: Any) -> None:
        super().__init__(base, spec, pctx, rng)
        weight = base.weight
        options = dict(dtype=weight.dtype, device=weight.device)
        self.magnitude = nn.Parameter(torch.empty(weight.shape[0], **options))
        m = self.magnitude
        if self.row:
            set_tensor_parallel_attributes(m, False)
            m.sequence_parallel = pctx.tp_size > 1 and self.sequence_parallel
        else:
            set_tensor_parallel_attributes(m, True, 0, weight.partition_stride)
        m.init = None  # ||W|| (below), not drawn by initialize_parameters
        if weight.device.type != "meta":  # (meta: an offline layout, shapes only)
            with torch.no_grad():
                m.copy_(self._row_norms(weight.float()))

    @torch.no_grad()
    def _row_norms(self, v: torch.Tensor) -> torch.Tensor:
        """The norm of each output row of a weight whose slice on this rank is `v` (fp32)."""
        squares = v.pow(2).sum(1)
        group = self.pctx.group("tp") if self.row and self.pctx.tp_size > 1 else None
        if group is not None:
            dist.all_reduce(squares, group=group)
        return squares.sqrt()

    def _factor(self, weight: torch.Tensor) -> torch.Tensor:
        norms = self._row_norms(weight.float() + self.delta_weight().detach())
        return self.magnitude / norms.to(self.magnitude.dtype)

    def add_to(self, layer: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """PEFT's DoRA output: base + (m/||V|| - 1) x W^T + (m/||V||) scale B A x."""
        factor = self._factor(layer.weight)
        plain = output if layer.bias is None else output - layer.bias
        return output + (factor - 1) * plain + factor * self(x)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        v = weight.float() + self.delta_weight()
        factor = self.magnitude.float() / self._row_norms(v)
        return (factor[:, None] * v).to(weight.dtype)


class ExpertLoRAAdapter(nn.Module):
    """Per-expert low-rank branches of an MoE layer's stacked expert weight [E, out, in]
    (`mlp.experts.linear_fc1` / `linear_fc2`): A = `linear_in.weight` [E, rank, in], B =
    `linear_out.weight` [E, out, rank], split over expert parallelism as the weight is (this
    rank's experts along dim 0; gradients reduced over the expert-data-parallel group). Its
    forward takes the experts' input rows sorted by local expert (GroupedExperts' contract)."""

    def __init__(self, holder: nn.Module, spec: LoRASpec, pctx: ParallelContext) -> None:
        super().__init__()
        if spec.dora:
            raise GigatronError(
                "--lora-dora on MoE experts: DoRA adapts tensor-parallel linear layers only; "
                "drop --lora-dora or leave linear_fc1/linear_fc2 out of an MoE model's targets"
            )
        if pctx.etp_size > 1:
            raise GigatronError(
                f"--lora-target-modules on MoE experts with --expert-tensor-parallel-size "
                f"{pctx.etp_size}: expert adapters need whole experts; pass "
                "--expert-tensor-parallel-size 1"
            )
        self.spec = spec
        weight = holder.weight
        experts, local_out, local_in = weight.shape
        options = dict(dtype=weight.dtype, device=weight.device)
        self.linear_in = _Stacked(torch.empty(experts, spec.rank, local_in, **options))
        self.linear_out = _Stacked(torch.empty(experts, local_out, spec.rank, **options))
        a, b = self.linear_in.weight, self.linear_out.weight
        set_tensor_parallel_attributes(a, False, init="normal", init_std=local_in**-0.5)
        set_tensor_parallel_attributes(b, False, init="zeros")
        a.expert_parallel = b.expert_parallel = True

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.training and self.spec.dropout > 0.0:
            x = F.dropout(x, self.spec.dropout)
        a, b = self.linear_in.weight, self.linear_out.weight
        blocks = x.split(tokens_per_expert.tolist())
        out = [F.linear(F.linear(block, a[e]), b[e]) for e, block in enumerate(blocks)]
        return torch.cat(out) * self.spec.scale

    def delta_weight(self) -> torch.Tensor:
        """This rank's experts' `scale * B @ A` [E, out, in], shaped as the stacked weight."""
        a, b = self.linear_in.weight.float(), self.linear_out.weight.float()
        return torch.matmul(b, a) * self.spec.scale

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta_weight().to(weight.dtype)


class _Stacked(nn.Module):
    """Holds one stacked adapter weight, so that names read `linear_in.weight`."""

    def __init__(self, data: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(data)


ADAPTERS = (LoRAAdapter, ExpertLoRAAdapter)


def _add_adapter_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return getattr(module, ADAPTER).add_to(module, args[0], output)


def adapted_layers(chunk: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """(name, layer) of every layer of `chunk` holding an adapter."""
    for name, module in chunk.named_modules():
        if isinstance(getattr(module, ADAPTER, None), ADAPTERS):
            yield name, module


def is_adapter_name(name: str) -> bool:
    """Whether a parameter name (a state-dict key) belongs to an adapter."""
    return f".{ADAPTER}." in f".{name}"


def add_lora_adapters(
    chunks: list[nn.Module], spec: LoRASpec, pctx: ParallelContext, seed: int
) -> None:
    """Give every target layer of the chunks an adapter (initialised from the seed and its
    name, so the same on any layout) and freeze every other parameter."""
    found = 0
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        handles = []
        for name, module in list(chunk.named_modules()):
            if name.rsplit(".", 1)[-1] not in spec.targets:
                continue
            adapter = _new_adapter(name, module, spec, pctx, getattr(chunk, "rng", None))
            setattr(module, ADAPTER, adapter)
            if isinstance(adapter, LoRAAdapter):  # expert adapters: GroupedExperts adds them
                handles.append(module.register_forward_hook(_add_adapter_output))
            for pname, param in adapter.named_parameters():
                param.init_name = f"{name}.{ADAPTER}.{pname}"
            initialize_parameters(
                adapter, seed, pctx.tp_rank, pctx.tp_size, pctx.ep_rank, pctx.ep_size
            )
            found += 1
        handles.append(chunk.register_state_dict_post_hook(_keep_adapters))
        handles.append(chunk.register_load_state_dict_post_hook(_allow_adapter_or_base_only))
        chunk.lora_handles = handles
    if found == 0:
        raise GigatronError(
            f"--lora-target-modules {' '.join(spec.targets)}: the model has no such layer; "
            f"choose from {', '.join(TARGETS)}"
        )


def _new_adapter(name: str, module: nn.Module, spec: LoRASpec, pctx: ParallelContext, rng: Any):
    """The adapter of target layer `module`: a tensor-parallel linear layer's, or the per-expert
    one of an MoE layer's stacked expert weight."""
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        return (DoRAAdapter if spec.dora else LoRAAdapter)(module, spec, pctx, rng)
    parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
    weight = getattr(module, "weight", None)
    if parent == "experts" and isinstance(weight, nn.Parameter) and weight.dim() == 3:
        return ExpertLoRAAdapter(module, spec, pctx)
    raise GigatronError(
        f"--lora-target-modules: {name} is a {type(module).__name__}, not a tensor-parallel "
        "linear layer nor an MoE layer's expert weights; leave it out"
    )


def _keep_adapters(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: an adapted chunk saves its adapters (and buffers), not the frozen base."""
    for name, param in module.named_parameters(prefix=prefix.rstrip(".")):
        if not param.requires_grad and not is_adapter_name(name):
            state.pop(name, None)


@torch.no_grad()
def merged_weights(chunk: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and saved buffer of an adapted chunk, the base weights of adapted layers
    with their adapters folded in (this rank's slices), the adapters left out."""
    tensors = dict(chunk.named_parameters())
    tensors.update(chunk.state_dict(keep_vars=True))
    for name, layer in adapted_layers(chunk):
        merged = getattr(layer, ADAPTER).merged_weight(layer.weight)
        for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            setattr(merged, attribute, getattr(layer.weight, attribute))
        merged.expert_parallel = getattr(layer.weight, "expert_parallel", False)
        tensors[f"{name}.weight"] = merged
    return {name: t for name, t in tensors.items() if not is_adapter_name(name)}


def _allow_adapter_or_base_only(module: nn.Module, incompatible: Any) -> None:
    """Load hook: a checkpoint of the adapters alone, or of the base alone, loads (what it lacks
    keeps its value: the base from --pretrained-checkpoint, new adapters their init)."""
    missing = incompatible.missing_keys
    adapters = [k for k in missing if is_adapter_name(k)]
    if len(adapters) == len(missing) or not adapters:
        missing.clear()


def full_adapter_weights(layer: nn.Module, gather: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of a layer's adapter as the tp = 1 tensors; `gather(tensor) -> [every tp rank's
    slice]` collects the slices (None at tp = 1)."""
    adapter = getattr(layer, ADAPTER)
    pieces = []
    for param in (adapter.linear_in.weight, adapter.linear_out.weight):
        if gather is None or not param.tensor_model_parallel:
            pieces.append(param.detach())
        else:
            parts = gather(param.detach())
            pieces.append(merge_partitions(parts, param.partition_dim, param.partition_stride))
    return pieces[0], pieces[1]


@torch.no_grad()
def merge_adapters(chunks: list[nn.Module]) -> None:
    """Fold every adapter into its base weight (W += scale B A on this rank's slice) and remove
    it: the chunks compute what they computed, without adapters, and save every weight."""
    for chunk in chunks:
        for _, layer in list(adapted_layers(chunk)):
            layer.weight.copy_(getattr(layer, ADAPTER).merged_weight(layer.weight))
            delattr(layer, ADAPTER)
        for handle in getattr(chunk, "lora_handles", []):
            handle.remove()
        chunk.lora_handles = []
