"""`--save-hf DIR`: a Hugging Face folder written straight from the training model, at every
--save-interval and at the end (`DIR/iter_NNNNNNN`: config.json, model.safetensors, tokenizer
files when the run's tokenizer has them), with no gigatron checkpoint in between.

Any tp/pp/ep layout: every rank lists its tensors (name, full shape, partition); rank 0 runs the
family's Hugging Face map (`to_hf`, streamed a layer at a time by `WindowedMap`) over a source
whose `tensor(name)` is collective: rank 0 broadcasts the name, the one rank of each (tp, pp, ep)
position that writes checkpoints (`writes_checkpoint`) sends its piece, rank 0 merges the pieces
into the full tensor and writes it at its place in the safetensors file (`write_safetensors`).
So rank 0 holds about one layer, every other rank nothing extra; the other ranks serve requests
until rank 0 says it is done (and whether it failed: then every rank raises the same error).
A LoRA model is written with its adapters merged into the weights.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.checkpoint.hf_adapter import WindowedMap, call_map
from gigatron.checkpoint.hf_tokenizer_export import plan_tokenizer_export
from gigatron.checkpoint.safetensors_io import write_safetensors
from gigatron.checkpoint.torch_format import iteration_dir_name
from gigatron.errors import GigatronError
from gigatron.models.lora import adapted_layers, merged_weights
from gigatron.parallel.checkpoint_writer import writes_checkpoint
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import merge_partitions

CONFIG_FILE = "config.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default shard size


@dataclass(frozen=True)
class Entry:
    """A tensor of the whole model: full shape and dtype, how its pieces join, the first
    pipeline stage holding it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int  # -1: replicated over tp
    stride: Any
    expert: bool
    stage: int


def hf_adapter_of(family: Any) -> Any:
    """The family's Hugging Face adapter, if it can write a config.json (else an error)."""
    adapter = family.hf_adapter
    if adapter is None or not hasattr(adapter, "config_to_hf"):
        raise GigatronError(
            f"--save-hf: the {family.name} family cannot write a Hugging Face config.json; "
            "leave --save-hf out (convert a --save checkpoint later, if its adapter reads it)"
        )
    return adapter


def _local_tensors(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's tensors by name (a LoRA model's with its adapters merged: models/lora.py)."""
    tensors: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        lora = any(True for _ in adapted_layers(module))
        state = merged_weights(module) if lora else module.state_dict(keep_vars=True)
        for name, tensor in state.items():
            if not name.endswith("_extra_state"):
                tensors.setdefault(name, tensor)
    return tensors


def _entry(tensor: torch.Tensor, pctx: ParallelContext) -> Entry:
    expert = bool(getattr(tensor, "expert_parallel", False))
    parallel = bool(getattr(tensor, "tensor_model_parallel", False))
    shape = list(tensor.shape)
    dim = tensor.partition_dim if parallel else -1
    if parallel:
        shape[dim] *= pctx.etp_size if expert else pctx.tp_size
    if expert:
        shape[0] *= pctx.ep_size
    stride = getattr(tensor, "partition_stride", 1)
    return Entry(tuple(shape), tensor.dtype, dim, stride, expert, pctx.pp_rank)


def gather_entries(local: dict[str, torch.Tensor], pctx: ParallelContext) -> dict[str, Entry]:
    """Every rank's tensors (name -> Entry), the same on every rank."""
    mine = {name: _entry(tensor, pctx) for name, tensor in local.items()}
    every = [mine]
    if pctx.world_size > 1:
        every = [None] * pctx.world_size
        dist.all_gather_object(every, mine)
    merged: dict[str, Entry] = {}
    for entries in every:
        for name, entry in entries.items():
            if name not in merged or entry.stage < merged[name].stage:
                merged[name] = entry
    return merged


def _piece(name: str, entry: Entry, local: dict, pctx: ParallelContext, writer: bool) -> Any:
    """This rank's part of `name` for rank 0: ((ep, tp or etp), tensor), or None."""
    tensor = local.get(name)
    if tensor is None or not writer or pctx.pp_rank != entry.stage:
        return None
    if not entry.expert and pctx.ep_rank != 0:
        return None  # dense weights: the copy of expert-parallel rank 0
    key = (pctx.ep_rank if entry.expert else 0, pctx.etp_rank if entry.expert else pctx.tp_rank)
    return key, tensor.detach().to("cpu", copy=True)


def join_pieces(pieces: list[Any], entry: Entry) -> torch.Tensor:
    """The full tensor from the ranks' pieces (experts: each ep rank's block, in order)."""
    by_key = dict(sorted(p for p in pieces if p is not None))
    blocks = []
    for ep in sorted({ep for ep, _ in by_key}):
        parts = [t for (e, _), t in by_key.items() if e == ep]
        if entry.partition_dim < 0:
            blocks.append(parts[0])
        else:
            blocks.append(merge_partitions(parts, entry.partition_dim, entry.stride))
    full = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 0)
    if tuple(full.shape) != entry.shape:
        raise GigatronError(f"--save-hf: {tuple(full.shape)} pieces for a {entry.shape} tensor")
    return full


class LiveSource:
    """The training model's full tensors (the TensorSource of hf_adapter.py), gathered on
    demand: `tensor(name)` is a collective of every rank (`serve` on the others)."""

    def __init__(self, entries: dict[str, Entry], local: dict, pctx: ParallelContext) -> None:
        self.entries, self.local, self.pctx = entries, local, pctx
        self.writer = writes_checkpoint(pctx)

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def meta(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        return torch.empty(entry.shape, dtype=entry.dtype, device="meta")

    def tensor(self, name: str) -> torch.Tensor:
        return self.fetch(name)

    def fetch(self, name: str | None) -> torch.Tensor | None:
        """Rank 0: the full tensor `name` (None: tell the other ranks it is done)."""
        if self.pctx.world_size == 1:
            return None if name is None else self.local[name].detach().to("cpu", copy=True)
        return self._exchange(name)

    def serve(self) -> None:
        """Other ranks: answer rank 0's requests until it is done."""
        while self._exchange(None) is not None:
            pass

    def _exchange(self, name: str | None) -> Any:
        """One request: rank 0 broadcasts its `name` (None: done), the writing ranks send their
        pieces; rank 0 gets the joined tensor, the others True (None once done)."""
        request = [name]
        dist.broadcast_object_list(request, src=0)
        if request[0] is None:
            return None
        entry = self.entries[request[0]]
        piece = _piece(request[0], entry, self.local, self.pctx, self.writer)
        pieces = [None] * self.pctx.world_size if self.pctx.rank == 0 else None
        dist.gather_object(piece, pieces, dst=0)
        return join_pieces(pieces, entry) if self.pctx.rank == 0 else True


def save_hf(
    save_dir: str | Path,
    iteration: int,
    chunks: list[nn.Module],
    pctx: ParallelContext,
    cfg: Any,
    family: Any,
    vocab_size: int,
) -> Path:
    """Write `<save_dir>/iter_NNNNNNN` (replacing an older one); every rank calls it."""
    adapter = hf_adapter_of(family)
    local = _local_tensors(chunks)
    source = LiveSource(gather_entries(local, pctx), local, pctx)
    final = Path(save_dir) / iteration_dir_name(iteration)
    error = None
    if pctx.rank == 0:
        try:
            _write_folder(final, source, adapter, cfg, vocab_size)
        except GigatronError as problem:
            error = str(problem)
        except OSError as problem:
            error = (
                f"--save-hf {save_dir}: cannot write {final} ({problem.strerror}); give a "
                "directory this user can write, with space left"
            )
        finally:
            source.fetch(None)  # done: the other ranks stop serving
    else:
        source.serve()
    if pctx.world_size > 1:
        status = [error]
        dist.broadcast_object_list(status, src=0)
        error = status[0]
    if error is not None:
        raise GigatronError(error)
    return final


def _write_folder(final: Path, source: LiveSource, adapter: Any, cfg: Any, vocab: int) -> None:
    """Rank 0: the folder, written aside and renamed when complete."""
    hf_config = adapter.config_to_hf(cfg, vocab)
    model = cfg.model
    to_files = getattr(adapter, "to_hf_files", None)

    def export(view: Any) -> dict[str, Any]:
        out = call_map(
            adapter.to_hf, view, model.num_layers, model.num_attention_heads, vocab,
            hf_config=hf_config,
        )  # fmt: skip
        return to_files(out, hf_config) if to_files else out

    partial = final.parent / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer = plan_tokenizer_export(partial, cfg.tokenizer, None, "if-any", "--save-hf")
    mapping = WindowedMap(export, source)
    write_safetensors(partial, mapping.plan, mapping.outputs(), MAX_SHARD_BYTES)
    (partial / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    tokenizer.write(partial)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
