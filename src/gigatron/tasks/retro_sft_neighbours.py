"""`gigatron retro-preprocess --retro-tasks query-sft`: InstructRetro's instruction data with
neighbours retrieved from the user's own Retro project (docs/retro.md 5.1).

Each JSON line of `--sft-data` (gigatron's SFT lines: prompt/response or messages) is queried
with its prompt: the messages before the last assistant turn, tokenized with the GPT tokenizer
and joined as `pretrain retro --sft` joins them; the query is the prompt's last
`--retro-gpt-chunk-length` tokens (all of it when shorter), the end where an instruction prompt
puts its question. The project's BERT embeds that chunk and its index returns the
`--retro-num-neighbors` nearest database chunks, each read with its continuation
(`--retro-num-retrieved-chunks` chunks), exactly as generation retrieves (tasks/
retro_retrieval.py). Their texts (eod padding dropped) become the line's `"neighbours"`, which
`pretrain retro --sft` reads (families/retro/sft.py); any `"neighbours"` the line had are
replaced, every other field is kept. The output is written under a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from gigatron.data.json_lines import json_lines
from gigatron.data.retro.project import read_json
from gigatron.data.sft_dataset import record_messages
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families.retro.sft import FIELD
from gigatron.parallel.context import ParallelContext, resolve_device
from gigatron.tasks.retro_pipeline import tokenizer_identity
from gigatron.tasks.retro_retrieval import ChunkRetriever, project_database, project_retriever

DEFAULT_NEIGHBORS, DEFAULT_RETRIEVED_CHUNKS = 2, 2  # Megatron's --retro-num-neighbors/-chunks
BATCH_LINES = 256  # lines retrieved together (one BERT pass over their queries)


def prompt_tokens(record: Any, tokenizer: Any, where: str) -> list[int]:
    """The GPT tokens of a line's prompt: its messages before the last assistant turn."""
    messages = record_messages(record, where)
    roles = [m["role"] for m in messages]
    end = len(roles) - 1 - roles[::-1].index("assistant") if "assistant" in roles else len(roles)
    tokens = [t for m in messages[:end] for t in tokenizer.tokenize(m["content"])]
    if not tokens:
        raise GigatronError(
            f"{where}: no prompt text to retrieve for (nothing before the last assistant "
            "message); give the line a prompt or leave it out of --sft-data"
        )
    return tokens


def neighbour_text(tokens: np.ndarray, tokenizer: Any) -> str:
    """A retrieved neighbour (chunk + continuation) as text, its eod padding dropped."""
    return tokenizer.detokenize([int(t) for t in tokens if t != tokenizer.eod])


def fill_batch(
    batch: list[Any], queries: list[list[int]], retriever: ChunkRetriever, tokenizer: Any
) -> list[Any]:
    """The batch's records with `"neighbours"` set from their queries' retrieval."""
    found = retriever([np.asarray(q, dtype=np.int64) for q in queries])
    for record, neighbours in zip(batch, found):
        record[FIELD] = [neighbour_text(row, tokenizer) for row in neighbours]
    return batch


def fill_file(source: str, target: str, retriever: ChunkRetriever, tokenizer: Any, m: int) -> int:
    """Write `source`'s lines with their neighbours to `target` (temp name, then rename);
    returns the number of lines."""
    temp = Path(f"{target}.tmp{os.getpid()}")
    count = 0
    try:
        with open(source, encoding="utf-8") as handle, open(temp, "w", encoding="utf-8") as out:
            batch: list[Any] = []
            queries: list[list[int]] = []
            for number, record in json_lines(handle, source):
                queries.append(prompt_tokens(record, tokenizer, f"{source}: line {number}")[-m:])
                batch.append(record)
                if len(batch) == BATCH_LINES:
                    write_lines(out, fill_batch(batch, queries, retriever, tokenizer))
                    count, batch, queries = count + len(batch), [], []
            if batch:
                write_lines(out, fill_batch(batch, queries, retriever, tokenizer))
                count += len(batch)
        os.replace(temp, target)
    finally:
        temp.unlink(missing_ok=True)
    return count


def write_lines(out: Any, records: list[Any]) -> None:
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False) + "\n")


def check_files(args: argparse.Namespace) -> None:
    """--sft-data exists and is not --sft-output."""
    source, target = args.sft_data, args.sft_output
    if source is None or target is None:
        raise GigatronError(
            "--retro-tasks query-sft needs --sft-data IN.jsonl and --sft-output OUT.jsonl (the "
            "instruction lines, and where they are written with their neighbours)"
        )
    if not Path(source).is_file():
        raise GigatronError(f"--sft-data {source}: not found; give an SFT JSON-lines file")
    if not Path(target).parent.is_dir() or Path(target).is_dir():
        raise GigatronError(
            f"--sft-output {target}: not a file in an existing directory; give the path of the "
            "JSON-lines file to write"
        )
    if Path(target).exists() and Path(target).resolve() == Path(source).resolve():
        raise GigatronError(
            f"--sft-output {target}: is the --sft-data file; give another path (the input is "
            "never overwritten)"
        )


def check_tokenizer(project: Any, tokenizer: Any) -> None:
    """The GPT tokenizer flags are those the project's database was built with."""
    recorded = read_json(project.config, "").get("gpt_tokenizer")
    if recorded != tokenizer_identity(tokenizer):
        raise GigatronError(
            f"{project.config}: the project's database was built with the GPT tokenizer "
            f"{recorded}; give its tokenizer flags (--tokenizer-type, --vocab-file, ...)"
        )


def query_sft(args: argparse.Namespace, cfg: Any) -> int:
    """The query-sft task in this process; returns the number of lines written."""
    check_files(args)
    k = args.retro_num_neighbors or DEFAULT_NEIGHBORS
    chunks = args.retro_num_retrieved_chunks or DEFAULT_RETRIEVED_CHUNKS
    project, database = project_database(args)
    tokenizer = build_run_tokenizer(cfg)
    check_tokenizer(project, tokenizer)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise GigatronError("--retro-tasks query-sft: runs in one process; run it without torchrun")
    pctx = ParallelContext.single(resolve_device(cfg.parallel.device))
    retriever = project_retriever(args, project, database, pctx, tokenizer, (k, chunks))
    count = fill_file(args.sft_data, args.sft_output, retriever, tokenizer, database.chunk_length)
    print(f"retro-preprocess: {count} lines with {k} neighbours -> {args.sft_output}", flush=True)
    return count
