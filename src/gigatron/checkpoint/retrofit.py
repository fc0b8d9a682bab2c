"""Retro-fitting (`gigatron pretrain retro --load <a gpt checkpoint>`): the Retro run starts
from a trained GPT, every decoder weight the GPT's of the same name, the new Retro weights (the
chunked cross-attention, its norm and the neighbour encoder) freshly initialised.

A GPT of the run's shape and layout loads the checkpoint (weights only); the run then starts at
iteration 0 with a fresh optimizer. With `--retro-attention-gate 0` the Retro model computes
the GPT's logits, so its first loss is the GPT's (tests/e2e/test_retro_pretrain.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gigatron.checkpoint.formats import load_checkpoint, saved_header
from gigatron.checkpoint.torch_format import locate_iteration
from gigatron.config.retro import RetroConfig
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

# The parameters a Retro decoder has and a GPT has not.
RETRO_ONLY = (".cross_attention.", ".pre_cross_attn_layernorm.")


def loads_gpt_into_retro(cfg: Any, family_name: str) -> bool:
    """Whether this run retro-fits: `pretrain retro` whose --load holds a gpt checkpoint."""
    load = cfg.checkpoint.load
    if family_name != "retro" or not load:
        return False
    found = locate_iteration(Path(load), cfg.checkpoint.ckpt_step)
    if found is None:
        return False
    if saved_header(found[0]).get("gigatron_family") != "gpt":
        return False
    if cfg.data.sft:  # InstructRetro tunes a pretrained Retro: its encoder must be trained
        raise GigatronError(
            f"--load {load}: a gpt checkpoint; instruction tuning (--sft) starts from a retro "
            "checkpoint: retro-fit and pretrain it first (gigatron pretrain retro --load "
            f"{load} --save ...), then --load that"
        )
    return True


def gpt_config(cfg: Any) -> Any:
    """The run's configuration for the GPT it starts from (weights only)."""
    gpt = copy.deepcopy(cfg)
    gpt.retro = RetroConfig()
    gpt.checkpoint.finetune = True
    gpt.checkpoint.no_load_optim = gpt.checkpoint.no_load_rng = True
    return gpt


@torch.no_grad()
def retrofit(cfg: Any, pctx: ParallelContext, retro_chunks: list[nn.Module], vocab: int) -> str:
    """Fill `retro_chunks` (wrapped or not) from the gpt checkpoint under --load; the line to
    print."""
    gpt = gpt_config(cfg)
    gpt_chunks = get_family("gpt").build_model(gpt, pctx, vocab_size=vocab)
    load_checkpoint(cfg.checkpoint.load, gpt_chunks, None, None, pctx, gpt)
    found = locate_iteration(Path(cfg.checkpoint.load), cfg.checkpoint.ckpt_step)
    copied = fresh = 0
    for retro_chunk, gpt_chunk in zip(retro_chunks, gpt_chunks, strict=True):
        sources = dict(gpt_chunk.named_parameters())
        for name, param in getattr(retro_chunk, "module", retro_chunk).named_parameters():
            source = sources.pop(name, None)
            if source is not None:
                param.copy_(source)
                copied += 1
            elif any(part in name for part in RETRO_ONLY):
                fresh += 1
            else:
                raise GigatronError(f"retro-fitting: the gpt checkpoint has no weight for {name}")
        if sources:
            raise GigatronError(
                f"--load {cfg.checkpoint.load}: the gpt checkpoint has weights the Retro model "
                f"lacks ({', '.join(sorted(sources)[:3])}); give the GPT's model flags"
            )
    return (
        f"retro-fitted the gpt checkpoint {cfg.checkpoint.load} (iteration "
        f"{found[1] if found else 0}): {copied} GPT tensors loaded, {fresh} new Retro "
        "tensors initialised; training starts at iteration 0"
    )
