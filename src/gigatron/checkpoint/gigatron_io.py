"""gigatron `torch`-format checkpoints read and written one tensor at a time: the reader and the
writer of the conversion pipeline (checkpoint/pipeline.py) for Megatron's per-rank layout.

`CheckpointSource` serves the full (tp = 1) tensors of a checkpoint: the rank files are opened
memory-mapped and a tensor is merged over its tp/ep shards (`merge_partitions`) only when asked
for. `write_checkpoint` writes a checkpoint for any target tp/pp/ep layout from a stream of full
tensors: each is cut for the ranks that hold it (`TargetLayout.slice`) and the slices go to
scratch files at once, then each rank's file is saved from memory-mapped scratch tensors, so the
model is never held whole. Parameter names carry global layer numbers, so the pipeline split only
decides which names go into which file.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.layout import (
    OUTPUT_WEIGHT,
    WORD_EMBEDDING,
    TargetLayout,
    build_target_layout,
)
from gigatron.checkpoint.megatron_format import saved_args
from gigatron.checkpoint.torch_format import (
    CHECKPOINT_FILENAME,
    CHECKPOINT_VERSION,
    TMP_SUFFIX,
    TRACKER_FILENAME,
    config_as_dict,
    iteration_dir_name,
    mp_rank_dir_name,
    safe_load,
    saved_layout,
)
from gigatron.errors import GigatronError
from gigatron.parallel.tensor_parallel import merge_partitions

# Top-level values carried over unchanged from the source files.
CARRIED_KEYS = (
    "consumed_train_samples",
    "consumed_valid_samples",
    "skipped_iterations",
    "num_floating_point_operations_so_far",
    "gigatron_family",
)


# ---- reading ------------------------------------------------------------------------------------
def chunk_keys(state: dict[str, Any]) -> list[str]:
    numbered = sorted(
        (k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[len("model") :])
    )
    return numbered or (["model"] if "model" in state else [])


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
        split = experts_split and dim >= 0  # (dim -1: whole on every expert-tp rank)
        blocks.append(merge_partitions(parts, dim, stride) if split else parts[0])
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
        for key in chunk_keys(sample):
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


class CheckpointSource:
    """The full tensors of one iteration of a torch-format checkpoint, merged on demand."""

    def __init__(self, iteration_dir: Path, cfg: Any, family: str) -> None:
        self.where = iteration_dir
        self.sizes, self.states = read_source(iteration_dir, mmap=True)
        tp, pp, ep = self.sizes
        self.first = self.states[min(self.states)]
        # A weight on several stages (T5's embeddings) is read from its first stage; the other
        # copies must hold the same values.
        self.repeats: list[tuple[str, int, str]] = []
        self.locations = {
            name: where
            for name, where in source_names(self.states, pp, self.repeats).items()
            if not name.endswith("_extra_state")
        }
        if not cfg.model.untie_embeddings_and_output_weights:
            # pp > 1 keeps a copy of the tied embedding on the last stage: not a weight of its own
            self.locations.pop(OUTPUT_WEIGHT, None)
        vocab = None
        for state in self.states.values():
            embedding = state.get("model", {}).get(WORD_EMBEDDING)
            if embedding is not None:
                vocab = embedding.shape[0] * tp
        vp = cfg.parallel.num_virtual_stages_per_pipeline_rank
        layout = build_target_layout(cfg, tp, pp, vp, ep, vocab, family)
        self.attributes = layout.attributes
        self.experts_split = (cfg.parallel.expert_tensor_parallel_size or tp) > 1

    @staticmethod
    def first_state(iteration_dir: Path) -> dict[str, Any]:
        """The first rank file's contents (memory-mapped): its saved configuration and family."""
        first = next(iter(sorted(iteration_dir.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))), None)
        if first is None:
            raise GigatronError(
                f"{iteration_dir}: holds no mp_rank_*/{CHECKPOINT_FILENAME}; it is not a "
                "torch-format checkpoint"
            )
        return safe_load(first, mmap=True)

    def names(self) -> list[str]:
        return list(self.locations)

    def __contains__(self, name: object) -> bool:
        return name in self.locations

    def carried(self) -> dict[str, Any]:
        """The top-level values a conversion keeps (consumed samples, family, ...)."""
        return {k: self.first[k] for k in CARRIED_KEYS if k in self.first}

    def _merge(self, name: str, states: dict, where: tuple[int, str] | None = None) -> torch.Tensor:
        pp_rank, key = where or self.locations[name]
        return merge_name(
            states, self.sizes, self.experts_split, self.attributes, self.where, pp_rank, key, name
        )

    def tensor(self, name: str) -> torch.Tensor:
        full = self._merge(name, self.states).clone()
        for again, pp_rank, key in self.repeats:
            if again == name and not torch.equal(
                self._merge(name, self.states, (pp_rank, key)), full
            ):
                raise GigatronError(
                    f"{self.where}: parameter {name} appears on several pipeline stages with "
                    "different values; the checkpoint is inconsistent"
                )
        return full

    def meta(self, name: str) -> torch.Tensor:
        pp_rank, key = self.locations[name]
        metas = {
            position: {key: {name: state[key][name].to("meta")}}
            for position, state in self.states.items()
            if position[1] == pp_rank and name in state.get(key, {})
        }
        return self._merge(name, metas)

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Every full tensor, one at a time."""
        return ((name, self.tensor(name)) for name in self.names())


# ---- writing ------------------------------------------------------------------------------------
Holders = dict[str, list[tuple[int, str, tuple[int, ...]]]]


def rank_chunk_keys(chunks: list[Any]) -> list[str]:
    """The keys a rank file gives its model chunks: `model`, or `model0`, `model1`, ..."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _holders(layout: TargetLayout) -> Holders:
    """name -> [(rank, chunk key, shape)] of every writing rank that holds it."""
    holders: Holders = {}
    for rank, chunks in layout.models.items():
        for key, chunk in zip(rank_chunk_keys(chunks), chunks):
            for name, value in chunk.state_dict(keep_vars=True).items():
                holders.setdefault(name, []).append((rank, key, tuple(value.shape)))
    return holders


def _check_fit(holders: Holders, produced: set[str], tied_copy: bool) -> None:
    missing = sorted(set(holders) - produced - ({OUTPUT_WEIGHT} if tied_copy else set()))
    unused = sorted(produced - set(holders))
    if missing or unused:
        raise GigatronError(
            "the converted weights do not fit the gigatron model: "
            + (f"missing {', '.join(missing[:5])}; " if missing else "")
            + (f"no place for {', '.join(unused[:5])}; " if unused else "")
            + "check that the model family and configuration match the weights"
        )


def _write_scratch(
    scratch: Path,
    layout: TargetLayout,
    holders: Holders,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tied_copy: bool,
) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """Cut each streamed tensor for its ranks into scratch files; rank -> key -> name -> meta."""
    written: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for name, full in tensors:
        targets = [(name, *holder) for holder in holders[name]]
        if tied_copy and name == WORD_EMBEDDING:
            targets += [(OUTPUT_WEIGHT, *holder) for holder in holders[OUTPUT_WEIGHT]]
        for target_name, rank, key, shape in targets:
            part = layout.slice(target_name, full, shape, rank).contiguous()
            with open(scratch / f"{rank}.{key}.{target_name}", "wb") as out:
                if part.numel():  # a view of the tensor's bytes: written without a copy
                    part.reshape(-1).view(torch.uint8).numpy().tofile(out)
            meta = torch.empty(part.shape, dtype=part.dtype, device="meta")
            written.setdefault(rank, {}).setdefault(key, {})[target_name] = meta
        del full
    return written


def _scratch_tensor(path: Path, meta: torch.Tensor) -> torch.Tensor:
    if meta.numel() == 0:
        return torch.empty(meta.shape, dtype=meta.dtype)
    flat = torch.from_file(str(path), shared=False, size=meta.numel(), dtype=meta.dtype)
    return flat.view(meta.shape)


def _save_rank_files(
    tmp: Path, layout: TargetLayout, written: dict, header: dict[str, Any]
) -> None:
    """Each writing rank's file, its tensors memory-mapped from the scratch files."""
    scratch = tmp / "scratch"
    for (tp_rank, pp_rank, ep_rank), rank in layout.positions.items():
        state = dict(header)
        chunks = layout.models[rank]
        for key, chunk in zip(rank_chunk_keys(chunks), chunks):
            metas = written.get(rank, {}).get(key, {})
            state[key] = {
                name: _scratch_tensor(scratch / f"{rank}.{key}.{name}", metas[name])
                for name in chunk.state_dict(keep_vars=True)
            }
        directory = mp_rank_dir_name(tp_rank, pp_rank, layout.pp, ep_rank, layout.ep)
        path = tmp / directory / CHECKPOINT_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        del state


def publish(save_dir: Path, tmp: Path, final: Path, tracker: str) -> None:
    """Make the finished `tmp` directory `final`, then point the tracker file at it."""
    os.replace(tmp, final)
    tracker_tmp = save_dir / (TRACKER_FILENAME + TMP_SUFFIX)
    tracker_tmp.write_text(f"{tracker}\n")
    os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)


def new_iteration_dir(save_dir: Path, iteration: int, release: bool) -> Path:
    """The iteration directory a conversion writes; refused when it exists."""
    final = save_dir / iteration_dir_name(iteration, release)
    if final.exists():
        raise GigatronError(
            f"--save {save_dir}: already holds {final.name}; give a new directory or remove it"
        )
    return final


def write_checkpoint(
    save_dir: Path,
    layout: TargetLayout,
    tensors: Iterable[tuple[str, torch.Tensor]],
    produced: set[str],
    extra: dict[str, Any],
    check: Any = None,
    iteration: int = 0,
    release: bool = True,
) -> Path:
    """Write the stream `tensors` (full tensors; `produced`: every name it will yield) as the
    checkpoint of `layout` in `save_dir` (`release`, or `iteration`), model weights only;
    `check` runs once everything was read. Returns the written directory."""
    final = new_iteration_dir(save_dir, iteration, release)
    holders = _holders(layout)
    tied_copy = OUTPUT_WEIGHT in holders and OUTPUT_WEIGHT not in produced
    _check_fit(holders, produced, tied_copy)
    tmp = save_dir / (final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "scratch").mkdir(parents=True)
    try:
        written = _write_scratch(tmp / "scratch", layout, holders, tensors, tied_copy)
        header = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "args": config_as_dict(layout.cfg),
            **extra,
        }
        header["args"] = saved_args(header["args"], header)  # Megatron-LM reads its attributes
        _save_rank_files(tmp, layout, written, header)
        shutil.rmtree(tmp / "scratch")
        if check is not None:
            check()
    except GigatronError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(save_dir, tmp, final, "release" if release else str(iteration))
    return final
