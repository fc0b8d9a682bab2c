"""Flags of the commands that load a training checkpoint to generate (`generate`, `serve`):
where the checkpoint is, how many sequences run at once, and the Megatron flags checked against
the checkpoint (config/checkpoint_args.py). Importing this module loads no torch, so `--help` is
quick."""

from __future__ import annotations

import argparse

from gigatron.config.checkpoint_args import add_checkpoint_arguments
from gigatron.errors import GigatronError
from gigatron.inference.scheduler import DynamicSettings

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
    add_dynamic_arguments(parser)
    add_checkpoint_arguments(parser, skip=("log_interval",))


DYNAMIC_FLAGS = {
    "inference_dynamic_batching_buffer_size_gb": None,
    "inference_dynamic_batching_block_size": 256,
    "inference_dynamic_batching_max_tokens": 2048,
    "enable_chunked_prefill": False,
    "inference_dynamic_batching_prefix_caching": False,
}


def add_dynamic_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's dynamic engine flags: the paged KV cache and its scheduler."""
    group = parser.add_argument_group("dynamic engine (paged KV cache)")
    group.add_argument(
        "--inference-dynamic-batching", action="store_true",
        help="the dynamic engine: KV memory in blocks admitted per request, chunked prefill, "
        "prefix caching, preemption (--max-batch-size: requests at once)",
    )  # fmt: skip
    group.add_argument(
        "--inference-dynamic-batching-buffer-size-gb", type=float, default=None,
        help="GiB of KV blocks per rank (default: as many positions as the static cache)",
    )  # fmt: skip
    group.add_argument(
        "--inference-dynamic-batching-block-size", type=int, default=256,
        help="token positions per KV block",
    )  # fmt: skip
    group.add_argument(
        "--inference-dynamic-batching-max-tokens", type=int, default=2048,
        help="tokens fed per step (decode tokens first, then prefill)",
    )  # fmt: skip
    group.add_argument(
        "--enable-chunked-prefill", action="store_true",
        help="feed prompts longer than what is left of a step's tokens in chunks",
    )  # fmt: skip
    group.add_argument(
        "--inference-dynamic-batching-prefix-caching", action=argparse.BooleanOptionalAction,
        default=False, help="reuse the KV blocks of prompts' shared leading tokens",
    )  # fmt: skip


def add_speculative_arguments(parser: argparse.ArgumentParser, mtp: bool) -> None:
    """Speculative decoding's flags (`mtp`: the command also drafts with MTP heads)."""
    group = parser.add_argument_group("speculative decoding")
    heads = "the model's MTP heads (<= --mtp-num-layers; one process) or " if mtp else ""
    group.add_argument(
        "--num-speculative-tokens", type=int, default=0,
        help=f"draft this many tokens with {heads}the --speculative-draft-load model, verified "
        "in one forward (default 0: off)",
    )  # fmt: skip
    group.add_argument(
        "--speculative-draft-load", default=None,
        help="checkpoint of a small GPT draft model with the --load model's tokenizer (torch "
        "format, tensor- and pipeline-parallel 1): it drafts the --num-speculative-tokens",
    )  # fmt: skip


def check_speculative(args: argparse.Namespace, mtp: bool) -> None:
    """Refuse speculative flags that cannot go together (before the model loads, on every rank)."""
    draft, k = args.speculative_draft_load, args.num_speculative_tokens
    if draft and k < 1:
        raise GigatronError(
            f"--speculative-draft-load {draft}: give --num-speculative-tokens K >= 1, the tokens "
            "the draft model proposes per round"
        )
    if draft and args.inference_dynamic_batching:
        raise GigatronError(
            "--speculative-draft-load: speculative decoding runs on the static engine; drop "
            "--inference-dynamic-batching"
        )
    if k and not draft and not mtp:
        raise GigatronError(
            f"--num-speculative-tokens {k}: here only with --speculative-draft-load (drafts of "
            "the model's MTP heads run in `gigatron generate`); add a draft model or drop it"
        )


def dynamic_settings(args: argparse.Namespace) -> DynamicSettings | None:
    """The dynamic engine's settings from the flags (None without --inference-dynamic-batching;
    its other flags need it)."""
    if not args.inference_dynamic_batching:
        for name, default in DYNAMIC_FLAGS.items():
            if getattr(args, name) != default:
                flag = "--" + name.replace("_", "-")
                raise GigatronError(
                    f"{flag}: a flag of the dynamic engine; add --inference-dynamic-batching"
                )
        return None
    size_gb = args.inference_dynamic_batching_buffer_size_gb
    for flag, value in (
        ("--inference-dynamic-batching-block-size", args.inference_dynamic_batching_block_size),
        ("--inference-dynamic-batching-max-tokens", args.inference_dynamic_batching_max_tokens),
        ("--inference-dynamic-batching-buffer-size-gb", 1 if size_gb is None else size_gb),
    ):
        if value <= 0:
            raise GigatronError(f"{flag} {value}: must be positive")
    return DynamicSettings(
        block_size=args.inference_dynamic_batching_block_size,
        buffer_bytes=None if size_gb is None else int(size_gb * 2**30),
        max_tokens=args.inference_dynamic_batching_max_tokens,
        chunked_prefill=args.enable_chunked_prefill,
        prefix_caching=args.inference_dynamic_batching_prefix_caching,
    )


def resolve_batch_size(args: argparse.Namespace) -> None:
    """--max-batch-size from --micro-batch-size (Megatron's flag) when it is not given; the
    dynamic engine's flags checked."""
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise GigatronError(f"--micro-batch-size {args.micro_batch_size}: must be at least 1")
    if args.max_batch_size is None:
        args.max_batch_size = args.micro_batch_size or DEFAULT_MAX_BATCH_SIZE
    dynamic_settings(args)  # the dynamic engine's flags fail before the model loads


# add_retrieval_arguments' flags and their defaults
RETRIEVAL_FLAGS = (
    ("retro_project_dir", None),
    ("retro_index_str", None),
    ("retro_num_neighbors", None),
    ("retro_query_nprobe", 65536),
    ("retro_query_ef_search", 256),
)


def add_retrieval_arguments(parser: argparse.ArgumentParser) -> None:
    """A Retro checkpoint's retrieval at generation time (tasks/retro_retrieval.py reads them;
    docs/retro.md 5.2). Megatron's names and defaults."""
    group = parser.add_argument_group("Retro retrieval (a retro checkpoint)")
    group.add_argument(
        "--retro-project-dir", default=None,
        help="the Retro project (`gigatron retro-preprocess`): its chunk database, BERT "
        "embedder and index answer each complete chunk of the text",
    )  # fmt: skip
    group.add_argument(
        "--retro-index-str", default=None,
        help="which of the project's indexes (its --retro-index-str; default: its only one)",
    )  # fmt: skip
    group.add_argument(
        "--retro-num-neighbors", type=int, default=None,
        help="neighbours per chunk (default: the checkpoint's; it must be that one)",
    )  # fmt: skip
    group.add_argument("--retro-query-nprobe", type=int, default=65536, help="IVF lists searched")
    group.add_argument("--retro-query-ef-search", type=int, default=256, help="HNSW efSearch")


def retrieval_flags_given(args: argparse.Namespace) -> list[str]:
    """The retrieval flags given other values than their defaults."""
    return [
        f"--{name.replace('_', '-')}"
        for name, default in RETRIEVAL_FLAGS
        if getattr(args, name) != default
    ]


def add_engine_arguments(parser: argparse.ArgumentParser, mtp: bool) -> None:
    """The flags of `generate` and `serve` beside --load: speculative decoding, retrieval."""
    add_speculative_arguments(parser, mtp=mtp)
    add_retrieval_arguments(parser)


def check_engine_arguments(args: argparse.Namespace, mtp: bool) -> None:
    """Settle the batch size and check the speculative flags of `generate` and `serve`."""
    resolve_batch_size(args)
    check_speculative(args, mtp=mtp)
