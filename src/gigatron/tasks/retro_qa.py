"""`gigatron evaluate --task RETRO-QA`: InstructRetro's zero-shot question answering (Megatron's
tools/retro/text_generation and tools/retro/sft/dataset_conv.py, short-span QA as NQ and
TriviaQA): each question is put in Megatron's chat prompt, answered greedily (a Retro checkpoint
with `--retro-project-dir` retrieves as `generate` does; a GPT checkpoint answers without), and
scored by exact match and F1 (tasks/qa_metrics.py). Importing this module loads no torch."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gigatron.errors import GigatronError
from gigatron.inference.arguments import retrieval_flags_given
from gigatron.tasks import qa_metrics
from gigatron.tasks.text_files import read_utf8

TASK = "RETRO-QA"
# Megatron's reformat_prompt for short-span QA with context (template 0)
SYSTEM = (
    "System: This is a chat between a user and an artificial intelligence assistant. The "
    "assistant gives helpful, detailed, and polite answers to the user's questions based on the "
    "context. The assistant should also indicate when the answer cannot be found in the "
    "context.\n\n"
)
TURN = "User: Answer the following question with a short span. {}\n\nAssistant: The answer is"
NO_CONTEXT = "title: , source: "  # Megatron's neighbour text when an example brings none
FLAG_DEFAULTS = {"ft_neighbours": 1, "out_seq_length": 64}


@dataclass
class QAExample:
    question: str
    answers: list[str]
    contexts: list[str]  # "title: <title>, source: <text>" of each of its ctxs


def add_qa_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"--task {TASK} (Megatron's retro text generation)")
    group.add_argument(
        "--ft-neighbours", "--ft_neighbours", dest="ft_neighbours", type=int, default=1,
        help="context passages (an example's ctxs) put in the prompt",
    )  # fmt: skip
    group.add_argument(
        "--out-seq-length", "--max-tokens", dest="out_seq_length", type=int, default=64,
        help="tokens generated per answer at most (Megatron's Retro generation stops at 64)",
    )  # fmt: skip


def check_task_flags(args: argparse.Namespace, task: Any) -> None:
    """The flags of one task are refused for the others."""
    retrieval = {flag: True for flag in retrieval_flags_given(args)}
    qa = {f"--{k.replace('_', '-')}": getattr(args, k) != v for k, v in FLAG_DEFAULTS.items()}
    others = {
        "--overlapping-eval": task.overlapping_eval != 32,
        "--strict-lambada": task.strict_lambada,
    }
    refused = others if task.task == TASK else {**retrieval, **qa}
    given = [flag for flag, asked in refused.items() if asked]
    if given:
        which = f"--task {task.task}" if task.task == TASK else f"--task {TASK} only"
        raise GigatronError(f"{', '.join(given)}: not a flag of {which}; drop it")
    for flag, value, low in (
        ("--ft-neighbours", args.ft_neighbours, 0),
        ("--out-seq-length", args.out_seq_length, 1),
    ):
        if value < low:
            raise GigatronError(f"{flag} {value}: must be at least {low}")


def _example(record: Any, where: str) -> QAExample:
    if not isinstance(record, dict) or not isinstance(record.get("question"), str):
        raise GigatronError(f"{where}: not a JSON object with a string 'question'")
    answers = record.get("answers", record.get("answer"))
    answers = [answers] if isinstance(answers, str) else answers
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise GigatronError(f"{where}: 'answers' must be a non-empty list of strings")
    ctxs = record.get("ctxs", [])
    if not isinstance(ctxs, list) or not all(
        isinstance(c, dict) and isinstance(c.get("text"), str) for c in ctxs
    ):
        raise GigatronError(f"{where}: 'ctxs' must be a list of objects with a string 'text'")
    contexts = [f"title: {c.get('title') or ''}, source: {c['text']}" for c in ctxs]
    return QAExample(record["question"], answers, contexts)


def read_qa_file(path: str) -> list[QAExample]:
    """JSON lines, or a JSON array of objects (Megatron's NQ/TriviaQA files): {"question",
    "answers": [...] (or "answer"), optional "ctxs": [{"title", "text"}, ...]}."""
    text = read_utf8(path, 'a QA file: JSON lines of {"question", "answers"}')
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise GigatronError(f"--valid-data {path}: not valid JSON ({error})") from None
        places = [f"--valid-data {path}: item {i + 1}" for i in range(len(records))]
    else:
        lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        records, places = [], []
        for number, line in lines:
            where = f"--valid-data {path}: line {number}"
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise GigatronError(f"{where}: not JSON; write one JSON object per line") from None
            places.append(where)
    examples = [_example(record, where) for record, where in zip(records, places)]
    if not examples:
        raise GigatronError(f"--valid-data {path}: holds no questions")
    return examples


def qa_prompt(
    example: QAExample, ft_neighbours: int, tokenizer: Any, max_length: int, max_output: int
) -> list[int]:
    """Megatron's prompt: system, the first `ft_neighbours` contexts (cut so that prompt and
    answer fit `max_length` tokens), then the question's turn."""
    turn = TURN.format(example.question)
    if ft_neighbours == 0:
        return tokenizer.tokenize(SYSTEM + turn)
    contexts = example.contexts[:ft_neighbours] or [NO_CONTEXT]
    context_ids = tokenizer.tokenize("\n\n".join(contexts) + "\n\n")
    room = max_length - max_output - len(tokenizer.tokenize(turn)) - len(tokenizer.tokenize(SYSTEM))
    context = tokenizer.detokenize(context_ids[: max(room, 0)])
    return tokenizer.tokenize(SYSTEM + context + turn)


def score(examples: list[QAExample], texts: list[str], eod_text: str) -> dict[str, Any]:
    """Exact match and F1 (means over the examples) and each example's prediction."""
    rows = []
    for example, text in zip(examples, texts):
        prediction = qa_metrics.clean_prediction(text, eod_text)
        rows.append({
            "question": example.question, "prediction": prediction, "answers": example.answers,
            "exact_match": qa_metrics.exact_match(prediction, example.answers),
            "f1": qa_metrics.f1(prediction, example.answers),
        })  # fmt: skip
    count = len(rows)
    return {
        "num_examples": count,
        "exact_match": sum(r["exact_match"] for r in rows) / count,
        "f1": sum(r["f1"] for r in rows) / count,
        "predictions": rows,
    }


def answer_all(engine: Any, loaded: Any, args: argparse.Namespace, examples) -> list[str]:
    """Greedy answers of rank 0's engine (each prompt checked against the context first)."""
    from gigatron.inference.engine import SamplingParams  # why: torch after parsing

    tokenizer, limit = loaded.tokenizer, engine.max_sequence_length
    prompts = []
    for number, example in enumerate(examples, 1):
        ids = qa_prompt(example, args.ft_neighbours, tokenizer, limit, args.out_seq_length)
        try:
            engine.check_length(len(ids), args.out_seq_length)
        except ValueError as error:
            raise GigatronError(
                f"--valid-data question {number}: {error}; lower --out-seq-length or "
                "shorten the question"
            ) from None
        prompts.append(ids)
    params = SamplingParams(max_tokens=args.out_seq_length, temperature=0.0)
    return [completion.text for completion in engine.generate(prompts, params)]


def evaluate_qa(
    args: argparse.Namespace, task: Any, write_json: Callable[[Path, Any], None]
) -> dict[str, Any]:
    """Load, answer every question, score; rank 0 prints and writes --results-file (with
    `write_json`, evaluate's)."""
    # why here: torch-heavy modules after parsing
    from gigatron.inference.load import build_engine, load_for_inference
    from gigatron.parallel.context import destroy
    from gigatron.tasks.retro_retrieval import attach_retrieval

    (path,) = task.valid_data
    examples = read_qa_file(path)
    loaded = load_for_inference(args)
    try:
        attach_retrieval(loaded, args)
        engine = build_engine(loaded.chunks, loaded.pctx, loaded.tokenizer,
                              max_batch_size=args.micro_batch_size,
                              max_sequence_length=args.seq_length)  # fmt: skip
        if loaded.pctx.rank != 0:
            engine.runner.follow()
            return {}
        start = time.perf_counter()
        try:
            texts = answer_all(engine, loaded, args, examples)
        finally:
            engine.runner.stop_followers()
        eod = getattr(loaded.tokenizer, "eod", None)
        result = {"task": TASK, "valid_data": path, "load": args.load,
                  "iteration": loaded.iteration, "retrieval": args.retro_project_dir,
                  "ft_neighbours": args.ft_neighbours, "out_seq_length": args.out_seq_length,
                  **score(examples, texts, loaded.tokenizer.detokenize([eod]) if eod is not None else ""),
                  "time_s": time.perf_counter() - start}  # fmt: skip
    finally:
        destroy(loaded.pctx)
    print(
        f"validation results on {TASK} | exact match: {result['exact_match']:.4f} | F1: "
        f"{result['f1']:.4f} | examples: {result['num_examples']}",
        flush=True,
    )
    if args.results_file:
        write_json(Path(args.results_file), result)
    return result
