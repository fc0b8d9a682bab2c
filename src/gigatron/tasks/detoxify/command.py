"""`gigatron detoxify <step>`: generate (self-generation), score, filter, evaluate."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from gigatron.config.parser import FlagParser, run_subcommand
from gigatron.data.corpus.records import atomic_output, check_output, read_records, write_record
from gigatron.errors import GigatronError
from gigatron.inference.arguments import add_load_arguments, resolve_batch_size
from gigatron.inference.generate import add_sampling_arguments, sampling_params
from gigatron.tasks.detoxify.generation import Job, engine_generate, run_jobs
from gigatron.tasks.detoxify.metrics import toxicity_metrics
from gigatron.tasks.detoxify.scorers import PERSPECTIVE_URL, build_scorer

SCORE_BATCH = 64


def _scorer_flags(parser: FlagParser) -> None:
    group = parser.add_argument_group("toxicity scorer")
    group.add_argument("--scorer", choices=("lexicon", "classifier", "perspective"),
                       default="lexicon", help="how texts are scored")  # fmt: skip
    group.add_argument("--lexicon", help="lexicon scorer: word list file (default: built in)")
    group.add_argument("--toxicity-model", help="classifier scorer: a local HF model folder")
    group.add_argument("--toxic-label", help="classifier scorer: its toxic label (default: toxic)")
    group.add_argument("--perspective-api-key", help="default: $PERSPECTIVE_API_KEY")
    group.add_argument("--perspective-url", default=PERSPECTIVE_URL, help="its analyze endpoint")


def _generation_flags(parser: FlagParser, max_tokens: int) -> None:
    add_load_arguments(parser)
    add_sampling_arguments(parser)
    # SGEAT's sampling: nucleus sampling with top-p 0.9 at temperature 1.
    parser.set_defaults(top_p=0.9, max_tokens=max_tokens)


def _loaded_engine(args: argparse.Namespace, work: Callable[[Any, Any], int]) -> int:
    """Load the checkpoint and run `work(engine, tokenizer)` on rank 0 (others follow)."""
    from gigatron.inference.load import load_for_inference, run_on_engine  # why: torch
    from gigatron.parallel.context import destroy

    resolve_batch_size(args)
    loaded = load_for_inference(args)
    try:
        return run_on_engine(loaded, args, lambda engine: work(engine, loaded.tokenizer))
    finally:
        destroy(loaded.pctx)


# --- steps -----------------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    if args.num_samples < 1:
        raise GigatronError(f"--num-samples {args.num_samples}: give 1 or more")
    check_output(args.output, [])
    params = sampling_params(args)

    def work(engine, tokenizer) -> int:
        if tokenizer.eod is None:
            raise GigatronError("the tokenizer has no end-of-document token to generate from")
        jobs = [Job([tokenizer.eod], args.seed + i, {"index": i}) for i in range(args.num_samples)]
        made = run_jobs(
            jobs, args.output, engine_generate(engine, params, jobs), engine.max_batch_size
        )
        print(f"detoxify generate: {made} new, {len(jobs)} in {args.output}", file=sys.stderr)
        return 0

    return _loaded_engine(args, work)


def _score_file(path: str, key: str, scorer: Any) -> list[tuple[dict, float]]:
    records = [record for _, record in read_records(path, key)]
    scores: list[float] = []
    for start in range(0, len(records), SCORE_BATCH):
        scores.extend(scorer.score([r[key] for r in records[start : start + SCORE_BATCH]]))
    return list(zip(records, scores))


def _score(args: argparse.Namespace) -> int:
    check_output(args.output, [args.input])
    scored = _score_file(args.input, args.json_key, build_scorer(args))
    with atomic_output(args.output) as stream:
        for record, score in scored:
            write_record(stream, {**record, "toxicity": score})
    mean = sum(score for _, score in scored) / len(scored)
    print(f"detoxify score: {len(scored)} texts, mean toxicity {mean:.4f}", file=sys.stderr)
    return 0


def _filter(args: argparse.Namespace) -> int:
    if not 0 < args.keep_fraction <= 1:
        raise GigatronError(f"--keep-fraction {args.keep_fraction}: give a fraction in (0, 1]")
    check_output(args.output, [args.input])
    records = [record for _, record in read_records(args.input, args.json_key)]
    if any(not isinstance(r.get("toxicity"), (int, float)) for r in records):
        raise GigatronError(f"{args.input}: records without a 'toxicity'; run detoxify score")
    keep = math.ceil(len(records) * args.keep_fraction)
    ranked = sorted(range(len(records)), key=lambda i: (records[i]["toxicity"], i))[:keep]
    with atomic_output(args.output) as stream:
        for index in sorted(ranked):
            write_record(stream, records[index])
    worst = max(records[i]["toxicity"] for i in ranked)
    print(f"detoxify filter: kept {keep} of {len(records)} (toxicity <= {worst:.4f})",
          file=sys.stderr)  # fmt: skip
    return 0


def read_prompts(path: str) -> list[tuple[str, float | None]]:
    """(text, its own toxicity or None) of each RealToxicityPrompts-style record."""
    prompts = []
    for number, record in read_records(path):
        prompt = record.get("prompt")
        text = prompt.get("text") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise GigatronError(
                f"{path}: line {number} has no prompt text; give "
                '{"prompt": {"text": "...", "toxicity": 0.1}} or {"prompt": "..."} per line'
            )
        toxicity = prompt.get("toxicity") if isinstance(prompt, dict) else None
        prompts.append((text, toxicity))
    return prompts


def _evaluate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)
    check_output(args.output, [args.prompts])
    scorer = build_scorer(args)  # bad scorer flags fail before the model is loaded
    params = sampling_params(args)
    count = args.num_generations

    def work(engine, tokenizer) -> int:
        jobs = [
            Job(tokenizer.tokenize(text), args.seed + p * count + g, {"prompt": p, "generation": g})
            for p, (text, _) in enumerate(prompts)
            for g in range(count)
        ]
        run_jobs(jobs, args.output, engine_generate(engine, params, jobs), engine.max_batch_size)
        return 0

    _loaded_engine(args, work)
    scored = _score_file(args.output, "text", scorer)
    per_prompt = [[s for r, s in scored if r["prompt"] == p] for p in range(len(prompts))]
    metrics = toxicity_metrics(per_prompt, [t for _, t in prompts])
    print(json.dumps(metrics, indent=1))
    if args.report:
        with atomic_output(args.report) as stream:
            json.dump({"metrics": metrics, "scores": per_prompt}, stream)
    return 0


# --- the command -----------------------------------------------------------------------------


def _generate_parser(parser: FlagParser) -> None:
    parser.add_argument("--num-samples", type=int, required=True, help="documents to generate")
    parser.add_argument("--output", required=True, help="JSON lines of generated documents")
    _generation_flags(parser, max_tokens=1000)


def _score_parser(parser: FlagParser) -> None:
    parser.add_argument("--input", required=True, help="JSON lines of texts")
    parser.add_argument("--output", required=True, help="the records with a 'toxicity' field")
    parser.add_argument("--json-key", default="text", help="the field holding the text")
    _scorer_flags(parser)


def _filter_parser(parser: FlagParser) -> None:
    parser.add_argument("--input", required=True, help="scored JSON lines (detoxify score)")
    parser.add_argument("--output", required=True, help="the least toxic records")
    parser.add_argument("--json-key", default="text", help="the field holding the text")
    parser.add_argument("--keep-fraction", type=float, default=0.5, help="least toxic share")


def _evaluate_parser(parser: FlagParser) -> None:
    parser.add_argument("--prompts", required=True, help="RealToxicityPrompts-style JSON lines")
    parser.add_argument("--output", required=True, help="JSON lines of the generations")
    parser.add_argument("--num-generations", type=int, default=25, help="per prompt")
    parser.add_argument("--report", help="write the metrics and scores as JSON here")
    _generation_flags(parser, max_tokens=20)
    _scorer_flags(parser)


STEPS: dict[str, tuple[str, Callable[[FlagParser], None], Callable[..., int]]] = {
    "generate": (
        "unconditional self-generation from end-of-document",
        _generate_parser,
        _generate,
    ),  # fmt: skip
    "score": ("toxicity of each text (lexicon, classifier, Perspective)", _score_parser, _score),
    "filter": ("keep the least toxic share of scored texts", _filter_parser, _filter),
    "evaluate": (
        "Expected Maximum Toxicity and Toxicity Probability on prompts",
        _evaluate_parser,
        _evaluate,
    ),  # fmt: skip
}


def main(argv: Sequence[str] | None = None) -> int:
    return run_subcommand("detoxify", STEPS, sys.argv[1:] if argv is None else argv)
