"""What MoE layers report: their auxiliary losses and how evenly they load their experts.

Each router accumulates, over the micro-batches of one iteration (training forward passes only),
its share of every auxiliary loss value and its tokens per expert (`RoutingStats`, kept on the
router; nothing global). Once per iteration `collect_moe_reports(model_chunks, pctx, spec)`
(every rank calls it: it is collective) gathers them into one table, one row per MoE layer of the
whole model, sums it over all ranks, clears the accumulators, and returns named reports
`{name: tensor([sum, count])}` whose sum / count is:

- `load_balancing_loss` / `seq_load_balancing_loss` / `z_loss`: the loss without its coefficient,
  averaged over micro-batches, data-parallel replicas and MoE layers (Megatron's logged value);
- `tokens_per_expert_mean`, `tokens_per_expert_max`: tokens an expert received over the global
  batch (after drops), averaged over layers;
- `load_imbalance`: max / mean of those counts (1.0 = perfectly balanced), averaged over layers;
- `dropped_token_fraction` (with a capacity factor): routed assignments dropped.

With `--moe-per-layer-logging` each also appears per layer as `<name>_layer_<i>` (i = the layer's
0-based index, as in parameter names). Every rank returns the same values, so summing the reports
over data-parallel ranks (as the loop does) keeps every ratio.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from gigatron.parallel.context import ParallelContext

LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")
# Table columns: micro-batch weight, the losses, assignments before drops, tokens per expert.
_WEIGHT, _LOSSES, _ROUTED = 0, 1, 1 + len(LOSS_NAMES)
_EXPERTS = _ROUTED + 1


class RoutingStats:
    """One router's accumulators for the current iteration (its share of the token group)."""

    def __init__(
        self, num_experts: int, token_group_size: int, device: torch.device | None = None
    ) -> None:
        """`device`: where the row is allocated now (else at the first use); a row that exists
        from the start keeps a compiled layer (--torch-compile) to one variant of its graph."""
        self.num_experts = num_experts
        self.token_group_size = token_group_size
        self.row: torch.Tensor | None = None
        if device is not None and torch.device(device).type != "meta":
            self.row = self._zeros(device)

    def _zeros(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(_EXPERTS + self.num_experts, dtype=torch.float64, device=device)

    def _row(self, device: torch.device) -> torch.Tensor:
        if self.row is None:
            self.row = self._zeros(device)
        return self.row

    def add_loss(self, name: str, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        """This rank's share of one micro-batch's loss (shares sum to it over the token group),
        times `weight` (the router's float64 0-d tensor: 0 in a recomputed forward)."""
        row = self._row(value.device)
        row[_LOSSES + LOSS_NAMES.index(name)] += value.detach().to(torch.float64) * weight

    def add_routing(
        self, routing_map: torch.Tensor, routed_before_drop: int, weight: torch.Tensor | float = 1.0
    ) -> None:
        row = self._row(routing_map.device)
        # Each rank of the token group holds 1 / size of the micro-batch.
        row[_WEIGHT] += weight / self.token_group_size
        row[_ROUTED] += weight * routed_before_drop
        row[_EXPERTS:] += routing_map.sum(dim=0).to(torch.float64) * weight

    def pop(self) -> torch.Tensor | None:
        """The iteration's row (None if never allocated); the next iteration starts at zero."""
        row = self.row
        self.row = None if row is None else torch.zeros_like(row)
        return row


def _routers(model_chunks: Iterable[nn.Module]) -> list[nn.Module]:
    return [
        module
        for chunk in model_chunks
        for module in chunk.modules()
        if isinstance(getattr(module, "stats", None), RoutingStats)
    ]


def collect_moe_reports(
    model_chunks: Iterable[nn.Module], pctx: ParallelContext, spec
) -> dict[str, torch.Tensor]:
    """The iteration's MoE reports (see the module docstring); collective over all ranks."""
    layers = spec.moe_layer_numbers
    table = torch.zeros(
        len(layers), _EXPERTS + spec.num_experts, dtype=torch.float64, device=pctx.device
    )
    for router in _routers(model_chunks):
        row = router.stats.pop()
        if row is not None:
            table[layers.index(router.layer_number)] += row.to(pctx.device)
    if pctx.world_size > 1 and dist.is_initialized():
        dist.all_reduce(table)
    return reports_from_table(table, layers, spec)


def reports_from_table(table: torch.Tensor, layers: list[int], spec) -> dict[str, torch.Tensor]:
    """Named [sum, count] reports from the all-rank table (one row per MoE layer)."""
    weights = table[:, _WEIGHT]
    ran = weights > 0
    if not bool(ran.any()):
        return {}
    per_layer: dict[str, torch.Tensor] = {}  # name -> [layers, 2]
    enabled = [name for name in LOSS_NAMES if _loss_enabled(spec, name)]
    for name in enabled:
        column = table[:, _LOSSES + LOSS_NAMES.index(name)]
        per_layer[name] = torch.stack([column, weights], dim=1)
    counts = table[:, _EXPERTS:]
    mean = counts.mean(dim=1)
    peak = counts.max(dim=1).values
    one = ran.to(table.dtype)
    per_layer["tokens_per_expert_mean"] = torch.stack([mean, one], dim=1)
    per_layer["tokens_per_expert_max"] = torch.stack([peak, one], dim=1)
    imbalance = torch.where(mean > 0, peak / mean.clamp(min=1e-12), torch.ones_like(mean))
    per_layer["load_imbalance"] = torch.stack([imbalance * one, one], dim=1)
    if spec.capacity_factor is not None:
        routed = table[:, _ROUTED]
        dropped = (routed - counts.sum(dim=1)).clamp(min=0) / routed.clamp(min=1)
        per_layer["dropped_token_fraction"] = torch.stack([dropped * one, one], dim=1)
    reports = {name: values[ran].sum(dim=0).float() for name, values in per_layer.items()}
    if spec.per_layer_logging:
        for name, values in per_layer.items():
            for row, layer_number in enumerate(layers):
                if ran[row]:
                    reports[f"{name}_layer_{layer_number - 1}"] = values[row].float()
    return reports


def report_names(spec) -> tuple[str, ...]:
    """Every name `collect_moe_reports` may return for this MoE configuration."""
    names = [name for name in LOSS_NAMES if _loss_enabled(spec, name)]
    names += ["tokens_per_expert_mean", "tokens_per_expert_max", "load_imbalance"]
    if spec.capacity_factor is not None:
        names.append("dropped_token_fraction")
    if spec.per_layer_logging:
        names += [
            f"{name}_layer_{number - 1}"
            for name in list(names)
            for number in spec.moe_layer_numbers
        ]
    return tuple(names)


def _loss_enabled(spec, name: str) -> bool:
    if name == "z_loss":
        return spec.z_loss_coeff is not None
    return spec.aux_loss_name == name
