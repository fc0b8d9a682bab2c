"""`gigatron convert-checkpoint`: re-split a checkpoint for another tp/pp/ep layout.

A front end of the conversion pipeline (checkpoint/pipeline.py): model weights only (as
Megatron-LM's tools/checkpoint/convert.py), so optimizer, learning-rate schedule and random
states are dropped. It also takes that script's flags, so its README command runs with the
program name replaced:

    gigatron convert-checkpoint --model-type GPT --loader core --saver core \
        --load-dir A --save-dir B --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2

`--loader core|legacy`: a gigatron (torch or torch_dist) or Megatron-LM torch checkpoint
directory; `--loader llama_mistral|mixtral_hf`: a Hugging Face folder. `--saver core`: gigatron's
torch layout; `--saver legacy`: Megatron-LM's own files (as `gigatron convert --to megatron`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gigatron.checkpoint.hf_adapter import adapter_for
from gigatron.checkpoint.hf_convert import decoded, hf_to_gigatron, read_hf_config
from gigatron.checkpoint.layout import offline_context
from gigatron.checkpoint.pipeline import Target, convert, locate
from gigatron.checkpoint.torch_format import CHECKPOINT_FILENAME, safe_load
from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError

__all__ = ["convert_checkpoint", "main", "offline_context"]

MODEL_TYPES = {"GPT": "gpt", "BERT": "bert"}
LOADERS = ("core", "legacy", "llama_mistral", "mixtral_hf")
SAVERS = ("core", "legacy")
# The Hugging Face model types each of Megatron's Hugging Face loaders reads.
HF_LOADERS = {"llama_mistral": ("llama", "mistral", "qwen2"), "mixtral_hf": ("mixtral",)}


def convert_checkpoint(
    load_dir: str | Path,
    save_dir: str | Path,
    target_tp: int | None,
    target_pp: int | None,
    iteration: int | None = None,
    target_vp: int | None = None,
    log: Any = None,
    target_ep: int | None = 1,
) -> Path:
    """Write the model weights of `load_dir`'s checkpoint (latest, or `iteration`) to `save_dir`
    split for tensor-parallel `target_tp`, pipeline-parallel `target_pp` (`target_vp` virtual
    stages per rank) and expert-parallel `target_ep` (None: the saved size). Returns the new
    iteration directory."""
    target = Target(target_tp, target_pp, target_vp, target_ep)
    return convert("gigatron", load_dir, "gigatron", save_dir, target, log, iteration)


def _is_megatron(load: Path, iteration: int | None) -> bool:
    """Whether the checkpoint in `load` was written by Megatron-LM (flat argparse args)."""
    iteration_dir = locate(load, iteration)[0]
    first = next(iter(sorted(iteration_dir.glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))), None)
    return first is not None and isinstance(
        safe_load(first, mmap=True).get("args"), argparse.Namespace
    )


def _convert_hf(args: argparse.Namespace, family: str | None, log: Any) -> Path:
    """`--loader llama_mistral|mixtral_hf`: a Hugging Face folder, through the HF reader."""
    if args.saver == "legacy" or args.ckpt_step is not None:
        flag = "--saver legacy" if args.saver == "legacy" else "--ckpt-step"
        raise GigatronError(
            f"{flag}: no meaning with --loader {args.loader} (a Hugging Face folder)"
        )
    load = Path(args.load)
    model_type = decoded(read_hf_config(load)).get("model_type")
    if model_type not in HF_LOADERS[args.loader]:
        raise GigatronError(
            f"--loader {args.loader}: reads model_type {', '.join(HF_LOADERS[args.loader])}, but "
            f"{load}/config.json says {model_type!r}; use `gigatron convert --from hf --to "
            "gigatron` for other Hugging Face models"
        )
    hf_family = adapter_for(str(model_type))[0]
    if family is not None and hf_family != family:
        raise GigatronError(
            f"--model-type {args.model_type}: {load} holds a {model_type} model (gigatron "
            f"family {hf_family}); give the model type of the checkpoint"
        )
    t = args
    final = hf_to_gigatron(
        load, Path(args.save), t.target_tensor_parallel_size or 1,
        t.target_pipeline_parallel_size or 1, t.target_num_virtual_stages_per_pipeline_rank,
        t.target_expert_parallel_size or 1, None, log,
    )  # fmt: skip
    return final


def run(args: argparse.Namespace, log: Any) -> Path:
    """Convert as the parsed flags say."""
    family = MODEL_TYPES[args.model_type] if args.model_type else None
    if args.loader in HF_LOADERS:
        return _convert_hf(args, family, log)
    load = Path(args.load)
    reader = "megatron" if _is_megatron(load, args.ckpt_step) else "gigatron"
    if args.loader is None and reader == "megatron":
        raise GigatronError(
            f"--load {load}: was written by Megatron-LM (flat argparse arguments); pass "
            "--loader core (or convert it with `gigatron convert --from megatron --to gigatron`)"
        )
    target = Target(
        args.target_tensor_parallel_size,
        args.target_pipeline_parallel_size,
        args.target_num_virtual_stages_per_pipeline_rank,
        args.target_expert_parallel_size,
    )
    writer = "megatron" if args.saver == "legacy" else "gigatron"
    return convert(reader, load, writer, args.save, target, log, args.ckpt_step, family)


def _parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "convert-checkpoint",
        "Re-split a checkpoint for another tensor/pipeline/expert-parallel layout "
        "(model weights only; optimizer and random states are dropped). Takes Megatron-LM's "
        "tools/checkpoint/convert.py flags too.",
    )
    add = parser.add_argument
    add("--load", "--load-dir", dest="load", required=True, help="checkpoint directory to read")
    add("--save", "--save-dir", dest="save", required=True, help="new directory to write")
    for flag, what in (
        ("--target-tensor-parallel-size", "tensor-parallel size"),
        ("--target-pipeline-parallel-size", "pipeline-parallel size"),
    ):
        add(flag, type=int, default=None, help=f"{what} of the new checkpoint (default: the "
            "saved one; 1 from Hugging Face)")  # fmt: skip
    add(
        "--target-expert-parallel-size", type=int, default=1,
        help="expert-parallel size of the target (MoE models; default %(default)s)",
    )  # fmt: skip
    add(
        "--target-num-virtual-stages-per-pipeline-rank", type=int, default=None,
        help="virtual pipeline stages per rank in the target (default: none)",
    )  # fmt: skip
    add("--ckpt-step", type=int, default=None, help="iteration to convert (default: the latest)")
    add(
        "--model-type", choices=sorted(MODEL_TYPES), default=None,
        help="GPT or BERT: the checkpoint's model, checked (default: whatever it holds)",
    )  # fmt: skip
    add(
        "--loader", choices=LOADERS, default=None,
        help="core/legacy: a gigatron or Megatron-LM checkpoint directory; llama_mistral/"
        "mixtral_hf: a Hugging Face folder (default: a gigatron checkpoint directory)",
    )  # fmt: skip
    add(
        "--saver", choices=SAVERS, default="core",
        help="core: gigatron's torch layout; legacy: Megatron-LM's own files (default: %(default)s)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str]) -> int:
    """`gigatron convert-checkpoint --load DIR --save NEW_DIR --target-... N ...`."""
    args = _parser().parse_args(list(argv))
    final = run(args, lambda text: print(text, flush=True))
    print(
        f"done: {final} holds model weights only (optimizer, learning-rate schedule and random "
        "states were dropped); load it with --no-load-optim --no-load-rng, or with --finetune",
        file=sys.stdout,
        flush=True,
    )
    return 0
