"""`gigatron convert-checkpoint`: re-split a `torch`-format checkpoint for another tp/pp/ep layout.

Model weights only (as Megatron-LM's tools/checkpoint/convert.py): optimizer, learning-rate
schedule and random states are dropped. The source shards of every parameter are merged into the
full tensor (`merge_partitions`) and sliced again for each target rank (`slice_for_rank`).
Parameter names carry global layer numbers, so the pipeline split only decides which names go
into which file. Partition dimensions and strides come from the model itself: the target layout's
model is built in-process (on the `meta` device, no process groups) for every target rank.
Expert weights (`expert_parallel`) hold the experts of one expert-parallel rank along dim 0: they
are concatenated over the source's ep ranks (each merged over its expert-tensor-parallel slices)
and cut again for the target's ep ranks.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.torch_format import (
    CHECKPOINT_FILENAME,
    CHECKPOINT_VERSION,
    TMP_SUFFIX,
    TRACKER_FILENAME,
    config_as_dict,
    iteration_dir_name,
    locate_iteration,
    mp_rank_dir_name,
    safe_load,
    saved_layout,
)
from gigatron.config import config_from_dict
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import GROUP_NAMES, Grid, ParallelContext
from gigatron.parallel.tensor_parallel import merge_partitions, slice_for_rank

WORD_EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "output_layer.weight"
# Tensors with one row per (padded) vocabulary entry: resized when the padding changes.
VOCAB_ROWS = (WORD_EMBEDDING, OUTPUT_WEIGHT, "output_layer.bias")
# Top-level values carried over unchanged from the source files.
CARRIED_KEYS = (
    "consumed_train_samples",
    "consumed_valid_samples",
    "skipped_iterations",
    "num_floating_point_operations_so_far",
    "gigatron_family",
)


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


def _chunk_keys(state: dict[str, Any]) -> list[str]:
    numbered = sorted(
        (k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[len("model") :])
    )
    return numbered or (["model"] if "model" in state else [])


def _resolve_iteration(load_dir: Path, iteration: int | None) -> tuple[Path, int, bool]:
    if not load_dir.is_dir():
        raise GigatronError(f"--load {load_dir}: no such directory; give a checkpoint directory")
    located = locate_iteration(load_dir, iteration)
    if located is None:
        raise GigatronError(
            f"--load {load_dir}: no {TRACKER_FILENAME} there, so no checkpoint to convert; "
            "point --load at a directory written with --save (or give --ckpt-step)"
        )
    return located


def read_source(
    iteration_dir: Path, mmap: bool = False
) -> tuple[tuple[int, int, int], dict[tuple[int, int, int], dict]]:
    """((tp, pp, ep) sizes, {(tp, pp, ep) rank: state} for every file there). With ep > 1 and
    expert-tensor-parallel size 1 only the (tp, ep) pairs that ranks hold exist."""
    first = next(
        (
            iteration_dir / name / CHECKPOINT_FILENAME
            for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000")
            if (iteration_dir / name / CHECKPOINT_FILENAME).is_file()
        ),
        None,
    )
    if first is None:
        raise GigatronError(
            f"{iteration_dir}: holds no mp_rank_00* file; it is not a torch-format checkpoint"
        )
    first_state = safe_load(first, mmap=mmap)
    args = first_state.get("args")
    parallel = args.get("parallel", {}) if isinstance(args, dict) else {}
    ep = int(parallel.get("expert_model_parallel_size") or 1)
    layout = saved_layout(iteration_dir, expert_parallel=ep > 1)
    tp, pp, _ = layout
    states = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):
                name = mp_rank_dir_name(tp_rank, pp_rank, pp, ep_rank, ep)
                path = iteration_dir / name / CHECKPOINT_FILENAME
                if path.is_file():
                    states[(tp_rank, pp_rank, ep_rank)] = (
                        first_state if path == first else safe_load(path, mmap=mmap)
                    )
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            if not any((tp_rank, pp_rank, e) in states for e in range(ep)):
                raise GigatronError(
                    f"{iteration_dir}: no file for tensor-parallel rank {tp_rank}, pipeline "
                    f"rank {pp_rank}; the checkpoint is incomplete"
                )
    return (tp, pp, ep), states


def _source_part(states: dict, tp_rank: int, pp_rank: int, ep_rank: int | None, key: str):
    """The `key` model state of a file at (tp_rank, pp_rank) and `ep_rank` (any ep if None)."""
    for (t, p, e), state in sorted(states.items()):
        if t == tp_rank and p == pp_rank and (ep_rank is None or e == ep_rank):
            return state[key]
    return None


def true_vocab_size(cfg: Any) -> int | None:
    """The tokenizer's (unpadded) vocabulary, or None when it cannot be built here."""
    if cfg.model.padded_vocab_size is not None:
        return None
    try:
        return int(build_run_tokenizer(copy.deepcopy(cfg)).vocab_size)
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
        return build_model(cfg, offline_context(grid, rank, "meta"), vocab_size=vocab)
    except GigatronError:
        raise
    except Exception:  # noqa: BLE001 - initialisation may not run on meta tensors: use the CPU
        return build_model(cfg, offline_context(grid, rank, "cpu"), vocab_size=vocab)


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
                if getattr(param, "tensor_model_parallel", False):
                    expert = bool(getattr(param, "expert_parallel", False))
                    attributes[name] = (param.partition_dim, param.partition_stride, expert)
    if WORD_EMBEDDING in attributes:
        attributes.setdefault(OUTPUT_WEIGHT, attributes[WORD_EMBEDDING])
    return TargetLayout(target_cfg, grid, tp, pp, ep, etp, positions, models, attributes)


def merge_name(
    states: dict,
    sizes: tuple[int, int, int],
    experts_split: bool,
    attributes: dict,
    where: Path,
    pp_rank: int,
    key: str,
    name: str,
) -> torch.Tensor:
    """The full tensor `name` (in chunk `key` of pipeline rank `pp_rank`): a dense weight merged
    over the source tp ranks; an expert weight merged over its expert-tp slices (when split) and
    concatenated over the ep ranks."""
    src_tp, _, src_ep = sizes
    dim, stride, expert = attributes.get(name, (-1, 1, False))
    if not expert:
        parts = [_source_part(states, t, pp_rank, None, key)[name] for t in range(src_tp)]
        return merge_partitions(parts, dim, stride) if dim >= 0 else parts[0]
    blocks = []
    for e in range(src_ep):
        ranks = range(src_tp) if experts_split else [None]
        parts = []
        for t in ranks:
            found = [
                state[key][name]
                for (ft, fp, fe), state in sorted(states.items())
                if fp == pp_rank and fe == e and (t is None or ft == t)
            ]
            if not found:
                raise GigatronError(
                    f"{where}: no file holds the experts of expert-parallel rank {e} (pipeline "
                    f"rank {pp_rank}); the checkpoint is incomplete"
                )
            parts.append(found[0])
        blocks.append(merge_partitions(parts, dim, stride) if experts_split else parts[0])
    return torch.cat(blocks, dim=0)


def source_names(
    states: dict, pp_size: int, repeats: list[tuple[str, int, str]] | None = None
) -> dict[str, tuple[int, str]]:
    """name -> (pipeline rank, chunk key) of every tensor in the source files (its first
    stage). A name on several stages (T5's embeddings) is an error unless `repeats` is given:
    its later (name, pipeline rank, chunk key) are appended there, for the caller to check."""
    names: dict[str, tuple[int, str]] = {}
    for pp_rank in range(pp_size):
        sample = next(state for (t, p, e), state in sorted(states.items()) if p == pp_rank)
        for key in _chunk_keys(sample):
            for name in sample[key]:
                if name == WORD_EMBEDDING and name in names:
                    continue  # the multi-token prediction stage's copy (kept equal in training)
                if name in names:
                    if repeats is None:
                        raise GigatronError(f"parameter {name} appears twice in the checkpoint")
                    repeats.append((name, pp_rank, key))
                    continue
                names[name] = (pp_rank, key)
    return names


def _merge_source(
    states: dict, sizes: tuple[int, int, int], experts_split: bool, attributes: dict, where: Path
) -> dict[str, torch.Tensor]:
    """Every full tensor of the source (see `merge_name`). A weight held on several stages must
    be the same on each."""
    repeats: list[tuple[str, int, str]] = []
    full = {
        name: merge_name(states, sizes, experts_split, attributes, where, pp_rank, key, name)
        for name, (pp_rank, key) in source_names(states, sizes[1], repeats).items()
    }
    for name, pp_rank, key in repeats:
        again = merge_name(states, sizes, experts_split, attributes, where, pp_rank, key, name)
        if not torch.equal(again, full[name]):
            raise GigatronError(
                f"{where}: parameter {name} appears on several pipeline stages with different "
                "values; the checkpoint is inconsistent"
            )
    return full


def convert_checkpoint(
    load_dir: str | Path,
    save_dir: str | Path,
    target_tp: int,
    target_pp: int,
    iteration: int | None = None,
    target_vp: int | None = None,
    log: Any = None,
    target_ep: int = 1,
) -> Path:
    """Write the model weights of `load_dir`'s checkpoint (latest, or `iteration`) to `save_dir`
    split for tensor-parallel `target_tp`, pipeline-parallel `target_pp` (`target_vp` virtual
    stages per rank) and expert-parallel `target_ep`. Returns the new iteration directory."""

    say = log or (lambda text: None)
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    iteration_dir, iteration, release = _resolve_iteration(load_dir, iteration)
    if save_dir.resolve() == load_dir.resolve():
        raise GigatronError(f"--save {save_dir}: is the --load directory; give a new directory")
    final = save_dir / iteration_dir_name(iteration, release)
    if final.exists():
        raise GigatronError(
            f"--save {save_dir}: already holds {final.name}; give a new directory or remove it"
        )
    (src_tp, src_pp, src_ep), states = read_source(iteration_dir)
    first = states[min(states)]
    args = first.get("args")
    if isinstance(args, argparse.Namespace):
        raise GigatronError(
            f"{iteration_dir}: was written by Megatron-LM (flat argparse arguments); convert it "
            "with `gigatron convert --from megatron --to gigatron` (which also re-splits it)"
        )
    if not isinstance(args, dict) or not args:
        raise GigatronError(f"{iteration_dir}: holds no saved configuration ('args')")
    cfg = config_from_dict(args, source=f"{iteration_dir} args")
    family = first.get("gigatron_family", "gpt")
    check_target(cfg, target_tp, target_pp, target_vp, target_ep, family)
    say(
        f"converting {iteration_dir} (tensor-parallel {src_tp}, pipeline-parallel {src_pp}"
        + (f", expert-parallel {src_ep}" if src_ep > 1 else "")
        + f") to tensor-parallel {target_tp}, pipeline-parallel {target_pp}"
        + (f", expert-parallel {target_ep}" if target_ep > 1 else "")
        + (f", {target_vp} virtual stages per rank" if target_vp and target_vp > 1 else "")
    )

    layout = build_target_layout(
        cfg, target_tp, target_pp, target_vp, target_ep, true_vocab_size(cfg), family
    )
    attributes = layout.attributes
    src_etp = cfg.parallel.expert_tensor_parallel_size or src_tp
    full = _merge_source(states, (src_tp, src_pp, src_ep), src_etp > 1, attributes, iteration_dir)
    del states

    tied = not getattr(cfg.model, "untie_embeddings_and_output_weights", False)
    used: set[str] = set()
    written = 0
    tmp = save_dir / (final.name + TMP_SUFFIX)
    save_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    target_args = config_as_dict(layout.cfg)
    for (tp_rank, pp_rank, ep_rank), rank in layout.positions.items():
        chunks = layout.models[rank]
        state: dict[str, Any] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "args": target_args,
            # Loading names the conversion when asked for the states it dropped.
            "converted_from": str(iteration_dir),
        }
        state.update({k: first[k] for k in CARRIED_KEYS if k in first})
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        for key, chunk in zip(keys, chunks):
            model_state = {}
            for name, expected in chunk.state_dict(keep_vars=True).items():
                source_name = name
                if name not in full and name == OUTPUT_WEIGHT and tied and WORD_EMBEDDING in full:
                    source_name = WORD_EMBEDDING  # pp = 1 source: the output layer is the embedding
                if source_name not in full:
                    raise GigatronError(
                        f"{iteration_dir}: has no '{name}', which the target layout needs; "
                        "the checkpoint does not match its saved configuration"
                    )
                used.add(source_name)
                tensor = layout.slice(name, full[source_name], tuple(expected.shape), rank)
                model_state[name] = tensor.clone().contiguous()
            state[key] = model_state
        directory = mp_rank_dir_name(tp_rank, pp_rank, target_pp, ep_rank, target_ep)
        path = tmp / directory / CHECKPOINT_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        written += 1
    unused = sorted(set(full) - used - ({OUTPUT_WEIGHT} if tied else set()))
    if unused:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GigatronError(
            f"{iteration_dir}: holds parameters the target model has no place for: "
            f"{', '.join(unused[:5])}; the checkpoint does not match its saved configuration"
        )
    os.replace(tmp, final)
    tracker_tmp = save_dir / (TRACKER_FILENAME + TMP_SUFFIX)
    tracker_tmp.write_text("release\n" if release else f"{iteration}\n")
    os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)
    say(f"wrote {written} file(s) to {final}")
    return final


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,  # Megatron refuses abbreviated flags too
        prog="gigatron convert-checkpoint",
        description="Re-split a torch-format checkpoint for another tensor/pipeline/expert-parallel "
        "layout (model weights only; optimizer and random states are dropped).",
    )
    parser.add_argument("--load", required=True, help="checkpoint directory to read")
    parser.add_argument("--save", required=True, help="new directory to write")
    parser.add_argument(
        "--target-tensor-parallel-size",
        type=int,
        required=True,
        help="tensor-parallel size of the new checkpoint",
    )
    parser.add_argument(
        "--target-pipeline-parallel-size",
        type=int,
        required=True,
        help="pipeline-parallel size of the new checkpoint",
    )
    parser.add_argument(
        "--target-num-virtual-stages-per-pipeline-rank",
        type=int,
        default=None,
        help="virtual pipeline stages per rank in the target (default: none)",
    )
    parser.add_argument(
        "--target-expert-parallel-size",
        type=int,
        default=1,
        help="expert-parallel size of the target (MoE models; default 1)",
    )
    parser.add_argument(
        "--ckpt-step", type=int, default=None, help="iteration to convert (default: the latest)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """`gigatron convert-checkpoint --load DIR --save NEW_DIR --target-... N ...`."""
    args = _parser().parse_args(list(argv))
    final = convert_checkpoint(
        args.load,
        args.save,
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        iteration=args.ckpt_step,
        target_vp=args.target_num_virtual_stages_per_pipeline_rank,
        log=lambda text: print(text, flush=True),
        target_ep=args.target_expert_parallel_size,
    )
    print(
        f"done: {final} holds model weights only (optimizer, learning-rate schedule and random "
        "states were dropped); load it with --no-load-optim --no-load-rng, or with --finetune",
        file=sys.stdout,
        flush=True,
    )
    return 0
