"""Flags of the commands that load a training checkpoint to generate (`generate`, `serve`):
where the checkpoint is, how many sequences run at once, and the Megatron flags checked against
the checkpoint (config/checkpoint_args.py). Importing this module loads no torch, so `--help` is
quick."""

from __future__ import annotations

import argparse

from gigatron.config.checkpoint_args import add_checkpoint_arguments

DEFAULT_MAX_BATCH_SIZE = 8


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """--load and the flags that adjust how a checkpoint is loaded for generation."""
    group = parser.add_argument_group("checkpoint")
    group.add_argument("--load", required=True, help="checkpoint directory (written by --save)")
    group.add_argument("--ckpt-step", type=int, default=None, help="iteration (default: latest)")
    group.add_argument(
        "--lora-checkpoint",
        default=None,
        help="a LoRA run's checkpoint directory (its --save): its adapters are added to the "
        "--load model (docs/lora.md)",
    )
    group.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    group.add_argument(
        "--tokenizer-model", default=None, help="tokenizer file, if it moved since training"
    )
    group.add_argument("--vocab-file", default=None, help="vocabulary file, if it moved")
    group.add_argument("--merge-file", default=None, help="BPE merges file, if it moved")
    group.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="sequences generated at once (cache slots; default: --micro-batch-size, else "
        f"{DEFAULT_MAX_BATCH_SIZE})",
    )
    group.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="Megatron's flag: sequences per forward pass, here the --max-batch-size when that "
        "is not given",
    )
    group.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="tokens per sequence, prompt included (default: the model's context)",
    )
    group.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    add_checkpoint_arguments(parser, skip=("log_interval",))


def resolve_batch_size(args: argparse.Namespace) -> None:
    """--max-batch-size from --micro-batch-size (Megatron's flag) when it is not given."""
    from gigatron.errors import GigatronError

    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise GigatronError(f"--micro-batch-size {args.micro_batch_size}: must be at least 1")
    if args.max_batch_size is None:
        args.max_batch_size = args.micro_batch_size or DEFAULT_MAX_BATCH_SIZE
