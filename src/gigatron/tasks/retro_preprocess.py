"""`gigatron retro-preprocess`: Retro's database, index and neighbours (docs/retro.md).

Megatron's tools/retro/preprocess_data.py tasks: db-build (chunks, then their BERT embeddings),
index-train, index-add, query-neighbors; `build` runs all four, `index-build` the two index
ones. gigatron's query-sft (tasks/retro_sft_neighbours.py) runs alone: instruction lines'
neighbours from a built project. The GPT side is given with the flags of `pretrain gpt`
(--data-path, --split, --seed, --seq-length, tokenizer, --train-samples/--train-iters,
--global-batch-size, --eval-iters, --eval-interval), so the neighbours belong to the very
samples `pretrain retro` reads.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from gigatron.config.parser import FlagParser, command_parser
from gigatron.config.root import add_config_arguments, config_from_namespace, field_section
from gigatron.errors import GigatronError

TASKS = {
    "build": ["db-build", "index-train", "index-add", "query-neighbors"],
    "index-build": ["index-train", "index-add"],
    "db-build": ["db-build"],
    "index-train": ["index-train"],
    "index-add": ["index-add"],
    "query-neighbors": ["query-neighbors"],
    "query-sft": ["query-sft"],
}
# query-sft's flags (read by it alone): the instruction file in, the file out, what to retrieve
SFT_FLAGS = ("sft_data", "sft_output", "retro_num_neighbors", "retro_num_retrieved_chunks")


def add_retro_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's RetroPreprocessingConfig flags (names and defaults) and --retro-bert-load."""
    g = parser.add_argument_group("retro preprocessing")
    g.add_argument("--retro-project-dir", required=True, help="where every step writes")
    g.add_argument(
        "--retro-tasks",
        default="build",
        help=f"comma-separated tasks, run in the order given: {', '.join(TASKS)}",
    )
    g.add_argument(
        "--retro-block-size",
        type=int,
        default=100000,
        help="chunks per saved block when embedding and querying",
    )
    g.add_argument(
        "--retro-doc-block-size",
        type=int,
        default=100000,
        help="documents per saved block when building the chunk database",
    )
    g.add_argument("--retro-gpt-chunk-length", type=int, default=64, help="GPT tokens per chunk")
    g.add_argument(
        "--retro-bert-load",
        default=None,
        help="gigatron BERT checkpoint that embeds the chunks (pretrain bert, or "
        "`gigatron convert` of a Hugging Face BERT)",
    )
    g.add_argument(
        "--retro-bert-tokenizer-type",
        default=None,
        help="BERT tokenizer type (default: the checkpoint's)",
    )
    g.add_argument(
        "--retro-bert-vocab-file", default=None, help="BERT vocab file (default: the checkpoint's)"
    )
    g.add_argument("--retro-bert-batch-size", type=int, default=128, help="chunks per BERT batch")
    g.add_argument(
        "--retro-bert-max-chunk-length",
        type=int,
        default=256,
        help="BERT tokens per chunk at most, [CLS] and [SEP] included",
    )
    g.add_argument(
        "--retro-index-str",
        default=None,
        help="faiss.index_factory string, e.g. Flat, IVF4096,Flat, IVF65536_HNSW32,PQ32",
    )
    g.add_argument(
        "--retro-index-ntrain",
        type=int,
        default=None,
        help="database chunks the index is trained on (spread over the database)",
    )
    g.add_argument(
        "--retro-index-train-load-fraction",
        type=float,
        default=1.0,
        help="fraction of the --retro-index-ntrain chunks actually used",
    )
    g.add_argument(
        "--retro-index-add-load-fraction",
        type=float,
        default=1.0,
        help="fraction of the database (its first chunks) added to the index",
    )
    g.add_argument("--retro-query-ef-search", type=int, default=256, help="HNSW efSearch")
    g.add_argument("--retro-query-nprobe", type=int, default=65536, help="IVF lists searched")
    g.add_argument(
        "--retro-query-num-neighbors-query",
        type=int,
        default=200,
        help="neighbours asked of the index per chunk, before the document filter",
    )
    g.add_argument("--retro-query-num-neighbors-save", type=int, default=20,
                   help="neighbours saved per chunk (-1 where fewer remain)")  # fmt: skip
    add_sft_arguments(parser)


def add_sft_arguments(parser: argparse.ArgumentParser) -> None:
    """The query-sft task's flags (docs/retro.md 5.1)."""
    g = parser.add_argument_group("retro instruction data (--retro-tasks query-sft)")
    g.add_argument("--sft-data", default=None, help="SFT JSON-lines file whose prompts are queried")
    g.add_argument(
        "--sft-output",
        default=None,
        help='where --sft-data is written with each line\'s "neighbours" (never over the input)',
    )
    g.add_argument(
        "--retro-num-neighbors", type=int, default=None, help="neighbours per line (None: 2)"
    )
    g.add_argument(
        "--retro-num-retrieved-chunks",
        type=int,
        default=None,
        help="chunks per neighbour: the neighbour and its continuation (None: 2)",
    )


# The configuration fields retro-preprocess reads (the whole tokenizer section too); any other
# flag of `pretrain gpt` is refused, since nothing here would read it.
READ_FIELDS = {
    "model": {"seq_length"},
    "training": {
        "seed", "train_iters", "train_samples", "global_batch_size", "micro_batch_size",
        "rampup_batch_size", "eval_iters", "eval_interval", "eval_at_start",
    },
    "data": {
        "data_path", "split", "train_data_path", "valid_data_path", "test_data_path",
        "data_cache_path", "mid_level_dataset_surplus",
    },
    "parallel": {"device", "distributed_backend", "distributed_timeout_minutes"},
}  # fmt: skip


def refuse_unread(args: argparse.Namespace) -> None:
    """A GPT flag that retro-preprocess does not read is an error, not silently ignored."""
    for name in vars(args):
        try:
            section = field_section(name)
        except KeyError:
            continue  # a retro-preprocess flag, or --config
        # The retro section (config/retro.py) is not parsed here: its names are this command's.
        if section not in ("tokenizer", "retro") and name not in READ_FIELDS.get(section, set()):
            raise GigatronError(
                f"--{name.replace('_', '-')}: not used by retro-preprocess (it reads the data, "
                "split, seed, sequence length, sample counts and tokenizer flags of pretrain "
                "gpt; the embedding model comes from --retro-bert-load); leave it out"
            )


def build_parser() -> FlagParser:
    parser = command_parser(
        "retro-preprocess",
        "Retro preprocessing: chunk database, BERT embeddings, Faiss index, neighbours",
    )
    add_retro_arguments(parser)
    add_config_arguments(parser, ["model", "training", "data", "tokenizer", "parallel"])
    return parser


def expand_tasks(text: str) -> list[str]:
    tasks = []
    for name in (piece.strip() for piece in text.split(",")):
        if name not in TASKS:
            raise GigatronError(
                f"--retro-tasks {text}: unknown task {name!r}; choose from {', '.join(TASKS)}"
            )
        tasks += TASKS[name]
    return tasks


def check_retro_args(args: argparse.Namespace, tasks: list[str]) -> None:
    """The flags the chosen tasks need, and their ranges."""
    positive = ["retro_block_size", "retro_doc_block_size", "retro_gpt_chunk_length",
                "retro_bert_batch_size", "retro_query_num_neighbors_query",
                "retro_query_num_neighbors_save"]  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise GigatronError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.retro_bert_max_chunk_length < 3:
        raise GigatronError(
            f"--retro-bert-max-chunk-length {args.retro_bert_max_chunk_length}: must be >= 3 "
            "([CLS], a token, [SEP])"
        )
    for name in ("retro_index_train_load_fraction", "retro_index_add_load_fraction"):
        if not 0 < getattr(args, name) <= 1:
            raise GigatronError(f"--{name.replace('_', '-')} {getattr(args, name)}: not in (0, 1]")
    if args.retro_bert_load is None and {"db-build", "query-neighbors"} & set(tasks):
        raise GigatronError(
            "--retro-bert-load is required by db-build and query-neighbors: a gigatron BERT "
            "checkpoint (docs/retro.md shows how to make one from Hugging Face's bert-base)"
        )
    if args.retro_index_str is None and set(tasks) - {"db-build"}:
        raise GigatronError(
            "--retro-index-str is required by index-train, index-add and query-neighbors "
            "(e.g. Flat for a small database, IVF4096,Flat for a large one)"
        )
    if args.retro_index_ntrain is None and "index-train" in tasks:
        raise GigatronError(
            "--retro-index-ntrain is required by index-train: how many database chunks to "
            "train the index on (at most the database's chunk count)"
        )


def sample_counts(cfg: Any) -> tuple[int, int | None, int | None]:
    """(train, valid, test) samples `pretrain gpt` asks of its datasets with these flags."""
    from gigatron.optim.batch_schedule import build_num_microbatches_calculator  # why: --help
    from gigatron.training.pretrain import dataset_sample_counts  # why: keeps --help fast

    t = cfg.training
    if t.train_iters is None and t.train_samples is None:
        raise GigatronError(
            "give --train-samples or --train-iters as `pretrain retro` will: the neighbours "
            "are computed for exactly the samples that run reads"
        )
    if t.micro_batch_size is None:
        t.micro_batch_size = t.global_batch_size or 1  # only the sample arithmetic uses it
    calculator = build_num_microbatches_calculator(cfg, 1)
    iters = t.train_iters if t.train_iters is not None else (
        calculator.train_iters_for_samples(t.train_samples)
    )  # fmt: skip
    train, valid, test = dataset_sample_counts(cfg, iters, calculator.global_batch_size)
    return train, (valid if t.eval_iters else None), (test if t.eval_iters else None)


def check_sft_task(args: argparse.Namespace, tasks: list[str], argv: list[str]) -> bool:
    """Whether query-sft runs (alone); its flags are refused elsewhere, the flags it does not
    read are refused with it."""
    if "query-sft" not in tasks:
        given = [name for name in SFT_FLAGS if getattr(args, name) is not None]
        if given:
            raise GigatronError(
                f"--{given[0].replace('_', '-')}: read by --retro-tasks query-sft only; leave "
                "it out, or run query-sft"
            )
        return False
    if tasks != ["query-sft"]:
        raise GigatronError(
            f"--retro-tasks {args.retro_tasks}: query-sft runs alone, on a project already "
            "built (db-build, index-build first)"
        )
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    unread = [flag for flag in flags if not_query_sft_flag(flag)]
    if unread:
        raise GigatronError(
            f"{unread[0]}: not used by --retro-tasks query-sft (it reads the project, its "
            "index flags, the GPT tokenizer flags and the --sft-* flags; the chunk length and "
            "BERT are the project's); leave it out"
        )
    for name in ("retro_num_neighbors", "retro_num_retrieved_chunks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise GigatronError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    return True


QUERY_SFT_READS = {"--retro-project-dir", "--retro-tasks", "--retro-index-str",
                   "--retro-query-nprobe", "--retro-query-ef-search", "--sft-data",
                   "--sft-output", "--retro-num-neighbors", "--retro-num-retrieved-chunks",
                   "--device"}  # fmt: skip


def not_query_sft_flag(flag: str) -> bool:
    """A flag query-sft would ignore: another retro-preprocess flag, a GPT data, model or
    training flag (the tokenizer flags are read)."""
    if flag in QUERY_SFT_READS:
        return False
    if flag.startswith("--retro-"):
        return True
    try:
        return field_section(flag[2:].replace("-", "_")) != "tokenizer"
    except KeyError:
        return False  # --config


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    refuse_unread(args)
    tasks = expand_tasks(args.retro_tasks)
    if check_sft_task(args, tasks, list(argv)):
        from gigatron.tasks.retro_sft_neighbours import query_sft  # why: torch after --help

        query_sft(args, config_from_namespace(args))
        return 0
    check_retro_args(args, tasks)
    cfg = config_from_namespace(args)
    if cfg.model.seq_length is None:
        raise GigatronError("--seq-length is required: the GPT sequence length of pretraining")
    if cfg.model.seq_length % args.retro_gpt_chunk_length:
        raise GigatronError(
            f"--seq-length {cfg.model.seq_length}: not a multiple of --retro-gpt-chunk-length "
            f"{args.retro_gpt_chunk_length}; Retro splits each sample into whole chunks"
        )
    if cfg.data.mock_data:
        raise GigatronError("--mock-data: Retro retrieves from real documents; give --data-path")
    from gigatron.tasks.retro_pipeline import run_tasks  # why: torch only after --help

    run_tasks(args, cfg, tasks, sample_counts)
    return 0
