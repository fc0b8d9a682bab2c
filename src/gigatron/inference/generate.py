"""`gigatron generate --load CKPT --prompt TEXT | --prompts-file FILE [sampling flags]`.

Prompts are generated as one batch (as many at once as --max-batch-size slots, the rest join as
slots free up). Prints each prompt with its continuation, or writes JSON lines with --output.
Under torchrun with the checkpoint's tensor/pipeline layout, rank 0 prints and the other ranks
follow its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError
from gigatron.inference.arguments import (
    add_engine_arguments,
    add_load_arguments,
    check_engine_arguments,
)

if TYPE_CHECKING:
    from gigatron.inference.engine import Completion, SamplingParams
    from gigatron.inference.load import Attach


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens",
        "--tokens-to-generate",
        "--out-seq-length",
        dest="max_tokens",
        type=int,
        default=64,
        help="tokens to generate per prompt (default 64)",
    )
    group.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    group.add_argument("--top-k", "--top_k", dest="top_k", type=int, default=0, help="0 = off")
    group.add_argument("--top-p", "--top_p", dest="top_p", type=float, default=0.0, help="0 = off")
    group.add_argument("--greedy", action="store_true", help="always the likeliest token")
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of every prompt's sampling"
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--stop-on-eol", action="store_true", help="stop after a newline")
    group.add_argument("--stop-on-double-eol", action="store_true", help="stop at an empty line")
    group.add_argument("--ignore-eos", action="store_true", help="go on past end-of-document")
    group.add_argument("--add-bos", action="store_true", help="start each prompt with BOS/EOD")
    group.add_argument("--logprobs", action="store_true", help="log-probs of generated tokens")
    group.add_argument("--prompt-logprobs", action="store_true", help="log-probs of the prompt")
    group.add_argument("--top-logprobs", type=int, default=0, help="n likeliest tokens per step")


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "generate",
        "Generate text from a training checkpoint (KV cache, batched prompts).",
    )
    add_load_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    source.add_argument(
        "--prompts-file",
        help="one prompt per line, or JSON lines with a 'prompt' field (.jsonl)",
    )
    add_sampling_arguments(parser)
    add_engine_arguments(parser, mtp=True)
    parser.add_argument("--output", default=None, help="write JSON lines here instead of text")
    return parser


def read_prompts(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise GigatronError(f"--prompts-file {path}: file not found")
    try:
        with open(path, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()]
    except UnicodeDecodeError as error:
        raise GigatronError(
            f"--prompts-file {path}: not UTF-8 text ({error.reason} at byte {error.start}); "
            "save the prompts as UTF-8"
        ) from None
    if not path.endswith(".jsonl"):
        return [line.replace("\\n", "\n") for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            prompts.append(record["prompt"] if isinstance(record, dict) else None)
        except (json.JSONDecodeError, KeyError):
            prompts.append(None)
        if not isinstance(prompts[-1], str):
            raise GigatronError(
                f"--prompts-file {path}: line {number} is not a JSON object with a string "
                '\'prompt\'; write one {"prompt": "..."} per line'
            )
    return prompts


# The sampling flags named as their SamplingParams fields.
_SAMPLING_FLAGS = (
    "max_tokens top_k top_p stop_on_eol stop_on_double_eol ignore_eos logprobs prompt_logprobs "
    "top_logprobs"
).split()


def sampling_params(args: argparse.Namespace, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    from gigatron.inference.engine import SamplingParams  # why: torch only after parsing

    params = SamplingParams(
        **{name: getattr(args, name) for name in _SAMPLING_FLAGS},
        temperature=0.0 if args.greedy else args.temperature,
        seed=args.sampling_seed,
        stop=tuple(args.stop),
    )
    try:
        params.validate()
    except ValueError as error:
        raise GigatronError(f"sampling flags: {error}") from None
    return params


def record(prompt: str, completion: Completion, tokenizer) -> dict:
    out = {
        "prompt": prompt,
        "text": completion.text,
        "prompt_tokens": completion.prompt_ids,
        "tokens": completion.output_ids,
        "finish_reason": completion.finish_reason,
    }
    if completion.log_probs:
        out["logprobs"] = completion.log_probs
    if completion.prompt_log_probs is not None:
        out["prompt_logprobs"] = completion.prompt_log_probs
    if completion.top_log_probs:
        out["top_logprobs"] = [
            {tokenizer.detokenize([t]): lp for t, lp in step} for step in completion.top_log_probs
        ]
    if completion.drafted:
        out["speculative"] = {"drafted": completion.drafted, "accepted": completion.accepted}
    return out


def main(argv: Sequence[str], attach: Attach | None = None) -> int:
    """`gigatron generate --load DIR --prompt TEXT [...]`; `attach` (tasks/retro_generate.py)
    adds a Retro checkpoint's retrieval to the loaded model."""
    args = build_parser().parse_args(list(argv))
    check_engine_arguments(args, mtp=True)
    prompts = args.prompt or read_prompts(args.prompts_file)
    if not prompts:
        raise GigatronError(f"--prompts-file {args.prompts_file}: holds no prompts")
    params = sampling_params(args)  # bad flags fail before the model is loaded
    # why here: torch-heavy modules load after the flags are parsed (a quick --help)
    from gigatron.inference.load import load_for_inference
    from gigatron.parallel.context import destroy

    loaded = load_for_inference(args)
    try:
        if attach is not None:
            attach(loaded, args)
        return _generate(args, loaded, prompts, params)
    finally:
        destroy(loaded.pctx)


def _generate(args, loaded, prompts: list[str], params) -> int:
    from gigatron.inference.load import engine_from_args
    from gigatron.models.t5 import T5Model  # why: torch only after parsing

    if isinstance(loaded.chunks[0], T5Model):
        return _generate_t5(args, loaded, prompts, params)
    if args.num_speculative_tokens and not args.speculative_draft_load:
        return _generate_speculative(args, loaded, prompts, params)
    engine = engine_from_args(loaded, args)
    if loaded.pctx.rank != 0:
        engine.runner.follow()
        return 0
    tokenizer = loaded.tokenizer
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
    prompt_ids = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.tokenize(prompt)
        if args.add_bos and bos is not None:
            ids = [bos, *ids]
        try:
            engine.check_length(len(ids), params.max_tokens)
        except ValueError as error:
            engine.runner.stop_followers()
            message = f"prompt {index + 1}: {error}; shorten it or lower --max-tokens"
            raise GigatronError(message) from None
        prompt_ids.append(ids)
    try:
        completions = engine.generate(prompt_ids, params)
    finally:
        engine.runner.stop_followers()
    if args.output:
        temporary = args.output + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            for prompt, completion in zip(prompts, completions):
                handle.write(json.dumps(record(prompt, completion, tokenizer)) + "\n")
        os.replace(temporary, args.output)
        print(f"wrote {len(completions)} completion(s) to {args.output}")
        return 0
    for prompt, completion in zip(prompts, completions):
        print(prompt + completion.text)
        print(f"--- ({len(completion.output_ids)} tokens, {completion.finish_reason})", flush=True)
    sys.stdout.flush()
    return 0


def _generate_t5(args, loaded, prompts: list[str], params) -> int:
    """A T5 checkpoint: every rank runs the same steps, rank 0 writes; prompt i samples with
    seed --sampling-seed (else --seed) + i."""
    # why here: torch only after parsing
    from gigatron.inference import t5_generation
    from gigatron.inference.sampling import RowSampling

    t5_generation.refuse_unsupported(params, args)
    tokenizer = loaded.tokenizer
    start, eos = t5_generation.special_ids(tokenizer)
    ids = [tokenizer.tokenize(prompt) for prompt in prompts]
    seed = params.seed if params.seed is not None else args.seed
    rows = [RowSampling(params.temperature, params.top_k, params.top_p, seed + i)
            for i in range(len(ids))]  # fmt: skip
    completions = []
    for first in range(0, len(ids), args.max_batch_size):
        batch = slice(first, first + args.max_batch_size)
        completions += t5_generation.t5_generate(
            loaded.chunks[0], loaded.pctx, ids[batch], params.max_tokens, start,
            None if params.ignore_eos else eos, tokenizer.vocab_size, rows[batch],
        )  # fmt: skip
    if loaded.pctx.rank != 0:
        return 0
    return _emit(args, tokenizer, prompts, ids, completions)


def _emit(args, tokenizer, prompts: list[str], ids: list[list[int]], completions) -> int:
    """Print or write (--output) the T5 or speculative completions."""
    records = [
        {"prompt": prompt, "text": tokenizer.detokenize(c.output_ids), "prompt_tokens": p,
         "tokens": c.output_ids, "finish_reason": c.finish_reason}
        for prompt, p, c in zip(prompts, ids, completions)
    ]  # fmt: skip
    for r, c in zip(records, completions):
        if hasattr(c, "drafted"):
            r["speculative"] = {"drafted": c.drafted, "accepted": c.accepted}
    if args.output:
        temporary = args.output + ".tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(temporary, args.output)
        print(f"wrote {len(records)} completion(s) to {args.output}")
        return 0
    for r in records:
        print(f"{r['prompt']} -> {r['text']}")
        print(f"--- ({len(r['tokens'])} tokens, {r['finish_reason']})", flush=True)
    return 0


def _generate_speculative(args, loaded, prompts: list[str], params) -> int:
    """--num-speculative-tokens without a draft model: one prompt at a time, drafted by the MTP
    heads."""
    from gigatron.inference.speculative import MTPSpeculator  # why: torch only after parsing

    _refuse_with_speculation(args, loaded, params)
    tokenizer = loaded.tokenizer
    speculator = MTPSpeculator(loaded.chunks[0], args.num_speculative_tokens, tokenizer.vocab_size)
    bos = tokenizer.bos if tokenizer.bos is not None else tokenizer.eod
    ids = [
        ([bos] if args.add_bos and bos is not None else []) + tokenizer.tokenize(p) for p in prompts
    ]
    eos = None if params.ignore_eos else tokenizer.eod
    seed = params.seed if params.seed is not None else args.seed
    completions = [
        speculator.generate(p, params.max_tokens, params.temperature, params.top_k, seed + i, eos)
        for i, p in enumerate(ids)
    ]
    return _emit(args, tokenizer, prompts, ids, completions)


def _refuse_with_speculation(args, loaded, params) -> None:
    """Flags speculative decoding does not take."""
    asked = {
        "--num-speculative-tokens: one process only (no tensor or pipeline parallelism)": (
            loaded.pctx.tp_size * loaded.pctx.pp_size > 1
        ),
        "--top-p": params.top_p > 0,
        "--stop / --stop-on-eol / --stop-on-double-eol": bool(
            params.stop or params.stop_on_eol or params.stop_on_double_eol
        ),
        "--logprobs / --prompt-logprobs / --top-logprobs": bool(
            params.logprobs or params.prompt_logprobs or params.top_logprobs
        ),
        "--inference-dynamic-batching": bool(getattr(args, "inference_dynamic_batching", False)),
        "--max-sequence-length": args.max_sequence_length is not None,
    }
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise GigatronError(
            f"{', '.join(refused)}: not available with --num-speculative-tokens; drop them"
        )
