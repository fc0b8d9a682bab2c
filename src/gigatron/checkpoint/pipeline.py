"""One conversion pipeline: a reader gives the full (tp = 1) model one tensor at a time, a writer
cuts it for the target layout and writes it. `convert-checkpoint` (re-split a layout) and
`convert` (between formats) are front ends of `convert`.

Readers (`READERS`, by source format): `gigatron` (a torch or torch_dist checkpoint gigatron
wrote), `megatron` (Megatron-LM's torch files: renamed to gigatron's names, then read as
gigatron's). Writers (`WRITERS`, by target format): `gigatron` (the torch layout for any
tp/pp/vp/ep), `megatron` (the same, then rewritten with Megatron-LM's arguments and names).
Hugging Face folders go through the same writer and source classes in hf_convert.py.
Model weights only: optimizer, learning-rate schedule and random states are dropped.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint import dcp_io, dist_format
from gigatron.checkpoint.gigatron_io import CARRIED_KEYS, CheckpointSource, write_checkpoint
from gigatron.checkpoint.layout import (
    OUTPUT_WEIGHT,
    build_target_layout,
    check_target,
    true_vocab_size,
)
from gigatron.checkpoint.megatron_convert import gigatron_to_megatron, stage_megatron
from gigatron.checkpoint.torch_format import TRACKER_FILENAME, locate_iteration, safe_load
from gigatron.config import config_from_dict
from gigatron.errors import GigatronError

Log = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """The layout to write; None keeps the source's size."""

    tp: int | None = None
    pp: int | None = None
    vp: int | None = None
    ep: int | None = None


@dataclass
class FullModel:
    """What a reader gives a writer: the configuration, family and full tensors of a model."""

    source: Any  # names(), tensor(name), meta(name), stream(): full tensors on demand
    cfg: Any
    family: str
    where: Path  # the iteration directory read
    iteration: int
    release: bool
    sizes: tuple[int, int, int]  # the source's (tp, pp, ep)
    extra: dict[str, Any] = field(default_factory=dict)  # top-level values carried over


class DistSource:
    """The full tensors of a torch_dist checkpoint (stored whole: read one at a time)."""

    def __init__(self, iteration_dir: Path, tied: bool) -> None:
        self.where = iteration_dir
        metadata = dcp_io.read_metadata(iteration_dir)
        self.keys = {
            key[len("model.") :]: key
            for key in metadata.state_dict_metadata
            if key.startswith("model.") and not key.endswith("_extra_state")
        }
        if tied:
            self.keys.pop(OUTPUT_WEIGHT, None)

    def names(self) -> list[str]:
        return list(self.keys)

    def __contains__(self, name: object) -> bool:
        return name in self.keys

    def tensor(self, name: str) -> torch.Tensor:
        return dcp_io.read_tensors(self.where, [self.keys[name]])[self.keys[name]]

    def meta(self, name: str) -> torch.Tensor:
        return self.tensor(name).to("meta")

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, self.tensor(name)) for name in self.names())


def locate(load: Path, iteration: int | None) -> tuple[Path, int, bool]:
    """(iteration directory, iteration, release) of `load` to convert."""
    if not load.is_dir():
        raise GigatronError(f"--load {load}: no such directory; give a checkpoint directory")
    located = locate_iteration(load, iteration)
    if located is None:
        hint = (
            " (a Hugging Face folder: --loader llama_mistral)"
            if (load / "config.json").is_file()
            else ""
        )
        raise GigatronError(
            f"--load {load}: no {TRACKER_FILENAME} there, so no checkpoint to convert{hint}; "
            "point --load at a directory written with --save (or give --ckpt-step)"
        )
    return located


def _saved_config(args: Any, where: Path) -> Any:
    if not isinstance(args, dict) or not args:
        if args is not None and not isinstance(args, dict):  # an argparse.Namespace
            raise GigatronError(
                f"{where}: was written by Megatron-LM (flat argparse arguments); convert it with "
                "`gigatron convert --from megatron --to gigatron` or `convert-checkpoint "
                "--loader core` (both also re-split it)"
            )
        raise GigatronError(f"{where}: holds no saved configuration ('args')")
    return config_from_dict(args, source=f"{where} args")


def _read_dist(iteration_dir: Path, iteration: int, release: bool) -> FullModel:
    common = safe_load(iteration_dir / dist_format.COMMON_FILENAME)
    cfg = _saved_config(common.get("args"), iteration_dir)
    tied = not cfg.model.untie_embeddings_and_output_weights
    p = cfg.parallel
    sizes = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size or 1,
    )
    extra = {k: common[k] for k in CARRIED_KEYS if k in common}
    family = common.get("gigatron_family", "gpt")
    source = DistSource(iteration_dir, tied)
    return FullModel(source, cfg, family, iteration_dir, iteration, release, sizes, extra)


@contextlib.contextmanager
def read_gigatron(load: Path, iteration: int | None = None, **_: Any) -> Iterator[FullModel]:
    """A checkpoint gigatron wrote, in either of its formats."""
    iteration_dir, iteration, release = locate(load, iteration)
    if dist_format.is_dist_checkpoint(iteration_dir):
        yield _read_dist(iteration_dir, iteration, release)
        return
    problem = dist_format.missing_marker(iteration_dir)
    if problem is not None:
        raise GigatronError(problem)
    first = CheckpointSource.first_state(iteration_dir)
    cfg = _saved_config(first.get("args"), iteration_dir)
    family = first.get("gigatron_family", "gpt")
    source = CheckpointSource(iteration_dir, cfg, family)
    yield FullModel(
        source, cfg, family, iteration_dir, iteration, release, source.sizes, source.carried()
    )


@contextlib.contextmanager
def read_megatron(
    load: Path,
    iteration: int | None = None,
    family: str | None = None,
    model_flags: tuple[str, ...] = (),
    **_: Any,
) -> Iterator[FullModel]:
    """Megatron-LM's torch files, renamed to gigatron's names in a scratch directory
    (`model_flags`: the model's flags when its files saved no args)."""
    located = locate(load, iteration)
    with tempfile.TemporaryDirectory(prefix="gigatron-megatron-") as tmp:
        staged = stage_megatron(located, Path(tmp), family, list(model_flags))
        with read_gigatron(staged) as model:
            model.where = located[0]
            yield model


def write_gigatron(model: FullModel, save: Path, target: Target, log: Log) -> Path:
    """The gigatron torch layout of `target` (model weights only)."""
    tp, pp, ep = (
        mine or theirs for mine, theirs in zip((target.tp, target.pp, target.ep), model.sizes)
    )
    cfg = model.cfg
    check_target(cfg, tp, pp, target.vp, ep, model.family)
    src_tp, src_pp, src_ep = model.sizes
    log(
        f"converting {model.where} (tensor-parallel {src_tp}, pipeline-parallel {src_pp}"
        + (f", expert-parallel {src_ep}" if src_ep > 1 else "")
        + f") to tensor-parallel {tp}, pipeline-parallel {pp}"
        + (f", expert-parallel {ep}" if ep > 1 else "")
        + (f", {target.vp} virtual stages per rank" if target.vp and target.vp > 1 else "")
    )
    layout = build_target_layout(cfg, tp, pp, target.vp, ep, true_vocab_size(cfg), model.family)
    # Loading names the conversion when asked for the states it dropped.
    extra = {**model.extra, "converted_from": str(model.where)}
    names = set(model.source.names())
    final = write_checkpoint(
        save, layout, model.source.stream(), names, extra,
        iteration=model.iteration, release=model.release,
    )  # fmt: skip
    log(f"wrote {len(layout.positions)} file(s) to {final}")
    return final


def write_megatron(
    model: FullModel, save: Path, target: Target, log: Log, te_names: bool = False
) -> Path:
    """Megatron-LM's own files (argparse arguments, its parameter names) for `target`."""
    with tempfile.TemporaryDirectory(prefix="gigatron-resplit-") as tmp:
        write_gigatron(model, Path(tmp), target, log)
        return gigatron_to_megatron(Path(tmp), save, None, te_names, log)


READERS: dict[str, Callable[..., contextlib.AbstractContextManager[FullModel]]] = {
    "gigatron": read_gigatron,
    "megatron": read_megatron,
}
WRITERS: dict[str, Callable[..., Path]] = {"gigatron": write_gigatron, "megatron": write_megatron}


def convert(
    reader: str,
    load: str | Path,
    writer: str,
    save: str | Path,
    target: Target = Target(),
    log: Log | None = None,
    iteration: int | None = None,
    family: str | None = None,
    model_flags: tuple[str, ...] = (),
    **writer_options: Any,
) -> Path:
    """Read `load` with `READERS[reader]`, write `save` with `WRITERS[writer]`; returns the
    written iteration directory (or folder). `model_flags`: a Megatron-LM file's model flags
    when it saved no args."""
    load, save = Path(load), Path(save)
    if save.resolve() == load.resolve():
        raise GigatronError(f"--save {save}: is the --load directory; give a new directory")
    say = log or (lambda text: None)
    with READERS[reader](
        load, iteration=iteration, family=family, model_flags=model_flags
    ) as model:
        if family is not None and model.family != family:
            raise GigatronError(
                f"--load {load}: holds a {model.family} model, not {family}; give the model "
                f"type of the checkpoint ({model.family.upper()})"
            )
        return WRITERS[writer](model, save, target, say, **writer_options)
