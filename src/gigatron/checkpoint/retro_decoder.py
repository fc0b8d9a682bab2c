"""The InstructRetro decoder alone as a GPT (the paper's ablation): `gigatron convert --from
gigatron --to gigatron --family gpt` writes a retro checkpoint's decoder as a gpt checkpoint,
without the neighbour encoder, the chunked cross-attention and its norm.

The other weights keep their names (a Retro decoder is a GPT plus those parts), so the result
computes the Retro model's logits with the gate closed (`--retro-attention-gate 0`) and loads
wherever a gpt checkpoint does (`pretrain gpt --load`, `generate`, `evaluate`). Model weights
only, through the conversion pipeline (pipeline.py), at any tensor/pipeline layout.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.pipeline import FullModel, Log, Target, read_gigatron, write_gigatron
from gigatron.checkpoint.retrofit import RETRO_ONLY
from gigatron.config.retro import RetroConfig
from gigatron.errors import GigatronError


class DecoderSource:
    """A retro checkpoint's full tensors less the Retro-only ones."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.kept = [n for n in source.names() if not any(part in n for part in RETRO_ONLY)]

    def names(self) -> list[str]:
        return list(self.kept)

    def __contains__(self, name: object) -> bool:
        return name in self.kept

    def meta(self, name: str) -> torch.Tensor:
        return self.source.meta(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self.source.tensor(name)

    def stream(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, self.tensor(name)) for name in self.kept)


def retro_to_gpt(
    load: Path,
    save: Path,
    target: Target = Target(),
    log: Log = print,
    iteration: int | None = None,
) -> Path:
    """Write the decoder of `load`'s retro checkpoint to `save` as a gpt checkpoint; returns the
    written iteration directory."""
    with read_gigatron(load, iteration) as model:
        if model.family != "retro":
            raise GigatronError(
                f"--load {load}: holds a {model.family} checkpoint, not a retro one; --family "
                "gpt keeps the decoder of a `gigatron pretrain retro` checkpoint"
            )
        cfg = copy.deepcopy(model.cfg)
        cfg.retro = RetroConfig()  # a gpt run refuses the Retro flags
        source = DecoderSource(model.source)
        dropped = len(model.source.names()) - len(source.kept)
        log(f"dropping {dropped} Retro tensors (the encoder and the chunked cross-attention)")
        decoder = FullModel(
            source,
            cfg,
            "gpt",
            model.where,
            model.iteration,
            model.release,
            model.sizes,
            {**model.extra, "gigatron_family": "gpt"},
        )
        return write_gigatron(decoder, save, target, log)
