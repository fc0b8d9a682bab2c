"""The target layout of a conversion: the model of every rank that writes a file, built offline.

Partition dimensions and strides come from the model itself: the target layout's model is built
in-process (on the `meta` device, no process groups) for every target rank; `TargetLayout.slice`
cuts a full (tp = 1) tensor for one of them. Expert weights (`expert_parallel`) hold the experts
of one expert-parallel rank along dim 0.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.lora import LoRASpec, add_lora_adapters
from gigatron.parallel.context import GROUP_NAMES, Grid, ParallelContext
from gigatron.parallel.tensor_parallel import slice_for_rank

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
# Tensors with one row per (padded) vocabulary entry: resized when the padding changes.
VOCAB_ROWS = (WORD_EMBEDDING, OUTPUT_WEIGHT, "output_layer.bias")


def offline_context(grid: Grid, rank: int, device: str = "cpu") -> ParallelContext:
    """A context for `rank` of `grid` with no process groups: enough to build that rank's model
    (weight initialisation needs no collectives)."""
    ctx = ParallelContext(grid=grid, rank=rank, device=torch.device(device))
    layouts = {"tp": ["tp"], "pp": ["pp"], "dp": ["dp"], "cp": ["cp"], "dp_cp": ["cp", "dp"]}
    layouts.update({"tp_cp": ["tp", "cp"], "model": ["tp", "pp"]})
    groups = {name: grid.groups_varying(dims) for name, dims in layouts.items()}
    groups.update(grid.expert_groups())
    for name in GROUP_NAMES:
        ctx.groups[name] = None
        ctx.group_ranks[name] = [rank]
        for ranks in groups.get(name, []):
            if rank in ranks:
                ctx.group_ranks[name] = ranks
    return ctx


def true_vocab_size(cfg: Any) -> int | None:
    """The tokenizer's (unpadded) vocabulary, or None when it cannot be built here."""
    if cfg.model.padded_vocab_size is not None:
        return None
    tok = copy.deepcopy(cfg.tokenizer)
    if tok.tokenizer_type is None and cfg.data.mock_data and tok.vocab_size is not None:
        tok.tokenizer_type = "NullTokenizer"  # as the run chose it (--mock-data --vocab-size)
    try:
        return int(build_tokenizer(tok).vocab_size)
    except Exception:  # noqa: BLE001 - any failure: fall back to keeping the padded size
        return cfg.tokenizer.vocab_size


def _target_config(cfg: Any, tp: int, pp: int, vp: int | None, ep: int = 1) -> Any:
    target = copy.deepcopy(cfg)
    p = target.parallel
    # Experts stay split over expert-tp like the dense weights over tp, or stay whole.
    if p.expert_tensor_parallel_size not in (None, p.tensor_model_parallel_size) or (
        cfg.moe.num_experts and getattr(cfg.model, "add_bias_linear", False)
    ):
        p.expert_tensor_parallel_size = 1  # (experts with biases are never split: gpt-oss)
    else:
        p.expert_tensor_parallel_size = tp if cfg.moe.num_experts else None
    p.tensor_model_parallel_size = tp
    p.pipeline_model_parallel_size = pp
    p.expert_model_parallel_size = ep
    p.num_virtual_stages_per_pipeline_rank = vp if vp and vp > 1 else None
    p.num_layers_per_virtual_pipeline_stage = None
    # An uneven first/last split (and an encoder-decoder split rank) belongs to the source
    # pipeline size.
    p.decoder_first_pipeline_num_layers = None
    p.decoder_last_pipeline_num_layers = None
    if pp != cfg.parallel.pipeline_model_parallel_size:
        p.pipeline_model_parallel_split_rank = None
    target.checkpoint.ckpt_format = "torch"  # the files of a target layout (also from torch_dist)
    return target


def _own_layout_family(family: str | None):
    """The family record when it places layers on stages itself (T5: `pipeline_stage_shapes`),
    else None; its `validate` then checks (and completes) a target layout."""
    if family is None:
        return None
    record = get_family(family)
    return record if record.pipeline_stage_shapes is not None else None


def check_target(
    cfg: Any, tp: int, pp: int, vp: int | None, ep: int = 1, family: str | None = None
) -> None:
    if tp < 1 or pp < 1 or ep < 1 or (vp is not None and vp < 1):
        raise GigatronError("target sizes must be positive integers")
    experts = cfg.moe.num_experts
    if ep > 1 and (not experts or experts % ep):
        raise GigatronError(
            f"--target-expert-parallel-size {ep}: the model has {experts or 'no'} experts; "
            "pick a divisor of --num-experts"
        )
    m = cfg.model
    heads = m.num_attention_heads
    pattern = getattr(m, "hybrid_layer_pattern", None)
    if pattern and "*" not in pattern:
        heads = None  # no attention layer (a pure Mamba stack): the head count sizes nothing
    if heads is not None and heads % tp:
        raise GigatronError(
            f"--target-tensor-parallel-size {tp} does not divide the {heads} attention heads; "
            "pick a divisor of the head count"
        )
    groups = getattr(m, "num_query_groups", None)
    if getattr(m, "group_query_attention", False) and groups and groups % tp:
        raise GigatronError(
            f"--target-tensor-parallel-size {tp} does not divide the {groups} query groups; "
            "pick a divisor of --num-query-groups"
        )
    if vp and vp > 1 and pp == 1:
        raise GigatronError(
            "--target-num-virtual-stages-per-pipeline-rank needs "
            "--target-pipeline-parallel-size > 1"
        )
    stages = pp * (vp or 1)
    if _own_layout_family(family) is None and m.num_layers % stages:
        raise GigatronError(
            f"the model's {m.num_layers} layers do not split evenly over pipeline size {pp}"
            + (f" x {vp} virtual stages" if vp and vp > 1 else "")
            + "; pick sizes whose product divides the layer count"
        )


def _build_rank_model(
    cfg: Any, grid: Grid, rank: int, vocab: int | None, family: str = "gpt"
) -> list[Any]:
    build_model = get_family(family).build_model
    try:
        pctx = offline_context(grid, rank, "meta")
        chunks = build_model(cfg, pctx, vocab_size=vocab)
    except GigatronError:
        raise
    except Exception:  # noqa: BLE001 - initialisation may not run on meta tensors: use the CPU
        pctx = offline_context(grid, rank, "cpu")
        chunks = build_model(cfg, pctx, vocab_size=vocab)
    spec = LoRASpec.from_config(cfg)
    if spec is not None:  # a LoRA run's checkpoint: its adapters' layout too (docs/lora.md)
        add_lora_adapters(chunks, spec, pctx, cfg.training.seed)
    return chunks


def _resize_vocab(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Drop or add padding rows (added rows are zeros; they hold no real token)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows].clone()
    pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], 0)


def _target_grid(tp: int, pp: int, ep: int, etp: int) -> Grid:
    """The smallest grid holding every (tp, pp, ep) position of the target layout."""
    dp = ep * etp // math.gcd(tp, ep * etp)
    return Grid(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)


@dataclass
class TargetLayout:
    """The models of a target layout's writing ranks (on `meta`), and how to cut full tensors
    for them."""

    cfg: Any
    grid: Grid
    tp: int
    pp: int
    ep: int
    etp: int
    positions: dict[tuple[int, int, int], int]  # (tp, pp, ep) position -> the rank that writes
    models: dict[int, list[Any]]
    attributes: dict[str, tuple[int, int, bool]]  # name -> (partition dim, stride, expert)

    def slice(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], rank: int):
        """`rank`'s part of the full tensor `name`, checked against the model's `shape`."""
        coords = self.grid.coords_of(rank)
        expert_coords = self.grid.expert_coords_of(rank)
        dim, stride, expert = self.attributes.get(name, (-1, 1, False))
        if name in VOCAB_ROWS:
            tensor = _resize_vocab(tensor, shape[0] * self.tp)
        if expert:
            tensor = tensor.chunk(self.ep, dim=0)[expert_coords["ep"]]
            tensor = slice_for_rank(tensor, dim, stride, expert_coords["etp"], self.etp)
        elif dim >= 0:
            tensor = slice_for_rank(tensor, dim, stride, coords["tp"], self.tp)
        if tuple(tensor.shape) != tuple(shape):
            raise GigatronError(
                f"'{name}' has shape {tuple(tensor.shape)} for target rank tp {coords['tp']} pp "
                f"{coords['pp']} ep {expert_coords['ep']}, expected {tuple(shape)}; the weights "
                "do not match the model configuration"
            )
        return tensor


def build_target_layout(
    cfg: Any, tp: int, pp: int, vp: int | None, ep: int, vocab: int | None, family: str
) -> TargetLayout:
    """Build (on `meta`) the model of every rank that writes a file in the target layout."""
    target_cfg = _target_config(cfg, tp, pp, vp, ep)
    own_layout = _own_layout_family(family)
    if own_layout is not None and own_layout.validate is not None:
        own_layout.validate(target_cfg)  # the family's stage rules (fills T5's split rank)
    etp = target_cfg.parallel.expert_tensor_parallel_size or tp
    grid = _target_grid(tp, pp, ep, etp)
    positions: dict[tuple[int, int, int], int] = {}
    for rank in range(grid.world_size):
        coords = grid.coords_of(rank)
        positions.setdefault((coords["tp"], coords["pp"], grid.expert_coords_of(rank)["ep"]), rank)
    models = {
        rank: _build_rank_model(target_cfg, grid, rank, vocab, family)
        for rank in positions.values()
    }
    attributes: dict[str, tuple[int, int, bool]] = {}
    for chunks in models.values():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                expert = bool(getattr(param, "expert_parallel", False))
                if getattr(param, "tensor_model_parallel", False):
                    attributes[name] = (param.partition_dim, param.partition_stride, expert)
                elif expert:  # whole on every expert-tp rank (LoRA's expert adapters)
                    attributes[name] = (-1, 1, True)
    if WORD_EMBEDDING in attributes:
        attributes.setdefault(OUTPUT_WEIGHT, attributes[WORD_EMBEDDING])
    return TargetLayout(target_cfg, grid, tp, pp, ep, etp, positions, models, attributes)
