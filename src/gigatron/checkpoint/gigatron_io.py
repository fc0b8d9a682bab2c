"""gigatron `torch`-format checkpoints read and written one tensor at a time (`gigatron convert`).

`CheckpointSource` serves the full (tp = 1) tensors of a checkpoint: the rank files are opened
memory-mapped and a tensor is merged over its tp/ep shards only when asked for.
`write_checkpoint` writes a `release` checkpoint for any target tp/pp/ep layout from a stream of
full tensors: each is cut for the ranks that hold it and the slices go to scratch files at once,
then each rank's file is saved from memory-mapped scratch tensors, so the model is never held
whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.convert import (
    OUTPUT_WEIGHT,
    WORD_EMBEDDING,
    TargetLayout,
    build_target_layout,
    merge_name,
    read_source,
    source_names,
)
from gigatron.checkpoint.torch_format import (
    CHECKPOINT_FILENAME,
    CHECKPOINT_VERSION,
    TMP_SUFFIX,
    TRACKER_FILENAME,
    config_as_dict,
    mp_rank_dir_name,
)
from gigatron.errors import GigatronError


class CheckpointSource:
    """The full tensors of one iteration of a torch-format checkpoint, merged on demand."""

    def __init__(self, iteration_dir: Path, cfg: Any, family: str) -> None:
        self.where = iteration_dir
        self.sizes, self.states = read_source(iteration_dir, mmap=True)
        tp, pp, ep = self.sizes
        self.first = self.states[min(self.states)]
        self.locations = {
            name: where
            # A weight on several stages (T5's embeddings): its first stage's copy.
            for name, where in source_names(self.states, pp, repeats=[]).items()
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

    def names(self) -> list[str]:
        return list(self.locations)

    def __contains__(self, name: object) -> bool:
        return name in self.locations

    def _merge(self, name: str, states: dict) -> torch.Tensor:
        pp_rank, key = self.locations[name]
        return merge_name(
            states, self.sizes, self.experts_split, self.attributes, self.where, pp_rank, key, name
        )

    def tensor(self, name: str) -> torch.Tensor:
        return self._merge(name, self.states).clone()

    def meta(self, name: str) -> torch.Tensor:
        pp_rank, key = self.locations[name]
        metas = {
            position: {key: {name: state[key][name].to("meta")}}
            for position, state in self.states.items()
            if position[1] == pp_rank and name in state.get(key, {})
        }
        return self._merge(name, metas)


def _scratch_tensor(path: Path, meta: torch.Tensor) -> torch.Tensor:
    if meta.numel() == 0:
        return torch.empty(meta.shape, dtype=meta.dtype)
    flat = torch.from_file(str(path), shared=False, size=meta.numel(), dtype=meta.dtype)
    return flat.view(meta.shape)


def write_checkpoint(
    save_dir: Path,
    layout: TargetLayout,
    tensors: Iterable[tuple[str, torch.Tensor]],
    produced: set[str],
    extra: dict[str, Any],
    check: Any = None,
) -> Path:
    """Write the stream `tensors` (full tensors; `produced`: every name it will yield) as the
    `release` checkpoint of `layout` in `save_dir`. Returns the written directory."""
    final = save_dir / "release"
    if final.exists():
        raise GigatronError(
            f"--save {save_dir}: already holds {final.name}; give a new directory or remove it"
        )
    tmp = save_dir / (final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    scratch = tmp / "scratch"
    scratch.mkdir(parents=True)
    # name -> [(rank, chunk key, shape)] of every writing rank that holds it
    holders: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for rank, chunks in layout.models.items():
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        for key, chunk in zip(keys, chunks):
            for name, value in chunk.state_dict(keep_vars=True).items():
                holders.setdefault(name, []).append((rank, key, tuple(value.shape)))
    tied_copy = OUTPUT_WEIGHT in holders and OUTPUT_WEIGHT not in produced
    missing = sorted(set(holders) - produced - ({OUTPUT_WEIGHT} if tied_copy else set()))
    unused = sorted(produced - set(holders))
    if missing or unused:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GigatronError(
            "the converted weights do not fit the gigatron model: "
            + (f"missing {', '.join(missing[:5])}; " if missing else "")
            + (f"no place for {', '.join(unused[:5])}; " if unused else "")
            + "check that the model family and configuration match the weights"
        )
    written: dict[int, dict[str, dict[str, torch.Tensor]]] = {}  # rank -> key -> name -> meta
    for name, full in tensors:
        targets = [(name, *holder) for holder in holders[name]]
        if tied_copy and name == WORD_EMBEDDING:
            targets += [(OUTPUT_WEIGHT, *holder) for holder in holders[OUTPUT_WEIGHT]]
        for target_name, rank, key, shape in targets:
            part = layout.slice(target_name, full, shape, rank).contiguous()
            path = scratch / f"{rank}.{key}.{target_name}"
            with open(path, "wb") as out:
                if part.numel():  # a view of the tensor's bytes: written without a copy
                    part.reshape(-1).view(torch.uint8).numpy().tofile(out)
            meta = torch.empty(part.shape, dtype=part.dtype, device="meta")
            written.setdefault(rank, {}).setdefault(key, {})[target_name] = meta
        del full
    for (tp_rank, pp_rank, ep_rank), rank in layout.positions.items():
        state: dict[str, Any] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": 0,
            "args": config_as_dict(layout.cfg),
            **extra,
        }
        chunks = layout.models[rank]
        keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
        for key, chunk in zip(keys, chunks):
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
    shutil.rmtree(scratch)
    if check is not None:
        try:
            check()
        except GigatronError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    os.replace(tmp, final)
    tracker_tmp = save_dir / (TRACKER_FILENAME + TMP_SUFFIX)
    tracker_tmp.write_text("release\n")
    os.replace(tracker_tmp, save_dir / TRACKER_FILENAME)
    return final
