"""`gigatron data <tool>`: the corpus tools as commands (wikipedia, clean, dedup,
decontaminate, blacklist). Each streams its input, counts what it drops by reason, and writes its
output atomically (nothing is left at --output when it fails)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np

from gigatron.config.fields import add_dataclass_arguments
from gigatron.config.parser import FlagParser, run_subcommand
from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.corpus import blacklist, clean, decontaminate, minhash, wikipedia
from gigatron.data.corpus.records import (
    atomic_output,
    check_output,
    open_text,
    parallel_map,
    read_records,
    text_lines,
    write_record,
)
from gigatron.errors import GigatronError

CHUNK = 256


def _chunks(items: Iterator[Any], size: int = CHUNK) -> Iterator[list[Any]]:
    while chunk := list(islice(items, size)):
        yield chunk


def _common(parser: FlagParser, json_key: bool = True) -> None:
    parser.add_argument("--input", required=True, help="input JSON lines (.jsonl, .json, .gz)")
    parser.add_argument("--output", required=True, help="output JSON lines (written atomically)")
    if json_key:
        parser.add_argument("--json-key", default="text", help="the field holding the text")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument("--report", help="also write the per-reason counts as JSON here")


def _finish(tool: str, counts: Counter, args: argparse.Namespace, seconds: float) -> int:
    """Print (and with --report, write) the counts of documents by what happened to them."""
    listed = {"kept": counts.get("kept", 0), **dict(sorted(counts.items()))}
    text = ", ".join(f"{reason} {n}" for reason, n in listed.items())
    print(f"data {tool}: {text} ({seconds:.1f} s)", file=sys.stderr)
    if args.report:
        with atomic_output(args.report) as stream:
            json.dump({"tool": tool, "counts": listed, "seconds": round(seconds, 3)}, stream)
    return 0


# --- wikipedia -------------------------------------------------------------------------------


def _articles(items: list[tuple[str, wikipedia.Page]]) -> list[dict[str, str]]:
    return [wikipedia.article_record(item) for item in items]


def _wikipedia(args: argparse.Namespace) -> Counter:
    counts: Counter = Counter()
    chunks = _chunks(wikipedia.read_dump(args.input), 32)
    with atomic_output(args.output) as stream:
        for records in parallel_map(_articles, chunks, args.workers):
            for record in records:
                reason = "too_short" if len(record["text"]) < args.min_chars else "kept"
                counts[reason] += 1
                if reason == "kept":
                    write_record(stream, record)
    if not counts:
        raise GigatronError(f"{args.input}: the dump holds no articles (main namespace)")
    return counts


# --- clean -----------------------------------------------------------------------------------


def _clean_chunk(
    records: list[dict], key: str, rules: clean.CleanRules, tokenizer: TokenizerConfig | None
) -> list[tuple[dict | None, str]]:
    if tokenizer is None:
        count: Callable[[str], int] = lambda text: len(text.split())  # noqa: E731
    else:
        from gigatron.data.tokenizers import build_tokenizer  # why: built once per chunk

        built = build_tokenizer(tokenizer)
        count = lambda text: len(built.tokenize(text))  # noqa: E731
    out = []
    for record in records:
        text, reason = clean.clean_document(record[key], rules, count)
        out.append((None if text is None else {**record, key: text}, reason))
    return out


def _tokenizer_config(args: argparse.Namespace) -> TokenizerConfig | None:
    """The tokenizer flags typed (only those: their defaults are suppressed), or None."""
    names = [f.name for f in dataclasses.fields(TokenizerConfig)]
    given = {name: getattr(args, name) for name in names if hasattr(args, name)}
    if given and "tokenizer_type" not in given:
        raise GigatronError(
            "tokenizer flags given without --tokenizer-type; name the tokenizer that counts "
            "--min-tokens, or drop the flags to count words"
        )
    return TokenizerConfig(**given) if given else None


def _clean(args: argparse.Namespace) -> Counter:
    language = None if args.lang == "any" else args.lang
    rules = clean.CleanRules(language, args.min_tokens, not args.no_ftfy)
    for module in ("ftfy",) * rules.fix_text + ("py3langid",) * (language is not None):
        clean.import_corpus_extra(module)
    tokenizer = _tokenizer_config(args)
    worker = functools.partial(_clean_chunk, key=args.json_key, rules=rules, tokenizer=tokenizer)
    chunks = _chunks(record for _, record in read_records(args.input, args.json_key))
    counts: Counter = Counter()
    with atomic_output(args.output) as stream:
        for results in parallel_map(worker, chunks, args.workers):
            for record, reason in results:
                counts[reason] += 1
                if record is not None:
                    write_record(stream, record)
    return counts


# --- dedup -----------------------------------------------------------------------------------


def _fingerprints(texts: list[str], num_perm: int, seed: int) -> tuple[np.ndarray, list[bytes]]:
    signatures = np.stack([minhash.signature(text, num_perm, seed) for text in texts])
    return signatures, [minhash.exact_key(text) for text in texts]


def _dedup_groups(args: argparse.Namespace) -> tuple[minhash.UnionFind, list[str], Counter]:
    worker = functools.partial(_fingerprints, num_perm=args.num_perm, seed=args.seed)
    texts = _chunks(r[args.json_key] for _, r in read_records(args.input, args.json_key))
    names = []
    for number, record in read_records(args.input, args.json_key):
        names.append(str(record.get(args.id_key, number)) if args.id_key else str(number))
    signatures, keys = [], []
    for chunk_signatures, chunk_keys in parallel_map(worker, texts, args.workers):
        signatures.append(chunk_signatures)
        keys.extend(chunk_keys)
    groups = minhash.UnionFind(len(keys))
    first: dict[bytes, int] = {}
    counts: Counter = Counter()
    for index, key in enumerate(keys):
        if key in first:
            groups.union(first[key], index)
            counts["exact_duplicate"] += 1
        first.setdefault(key, index)
    if not args.exact_only:
        minhash.near_duplicate_groups(
            np.concatenate(signatures), args.bands, args.threshold, groups
        )
    return groups, names, counts


def _dedup(args: argparse.Namespace) -> Counter:
    if args.num_perm not in (2**k for k in range(4, 11)):
        raise GigatronError(f"--num-perm {args.num_perm}: give a power of two from 16 to 1024")
    if args.num_perm % args.bands:
        raise GigatronError(
            f"--bands {args.bands}: must divide --num-perm {args.num_perm}; e.g. --bands 16"
        )
    if not 0 < args.threshold <= 1:
        raise GigatronError(f"--threshold {args.threshold}: give a Jaccard similarity in (0, 1]")
    groups, names, counts = _dedup_groups(args)
    members: dict[int, list[int]] = {}
    for index in range(len(names)):
        members.setdefault(groups.find(index), []).append(index)
    counts["near_duplicate"] = len(names) - len(members) - counts["exact_duplicate"]
    counts["kept"] = len(members)
    with atomic_output(args.output) as stream:
        for index, (_, record) in enumerate(read_records(args.input, args.json_key)):
            if groups.find(index) == index:
                write_record(stream, record)
    if args.groups_output:
        with atomic_output(args.groups_output) as stream:
            for root, group in members.items():
                if len(group) > 1:
                    removed = [names[i] for i in group if i != root]
                    write_record(stream, {"kept": names[root], "removed": removed})
    return counts


# --- decontaminate ---------------------------------------------------------------------------


def _evaluation_texts(paths: Sequence[str], key: str) -> Iterator[str]:
    for path in paths:
        if path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz")):
            yield from (record[key] for _, record in read_records(path, key))
            continue
        with open_text(path) as stream:
            yield from (line.strip() for line in text_lines(stream, path) if line.strip())


def _present(texts: list[str], ngrams: set, lengths: list[int]) -> list[set]:
    return [decontaminate.ngrams_present(text, ngrams, lengths) for text in texts]


def _decontaminate_chunk(chunk: list, key: str, ngrams: set, rules) -> list:
    """(reason, matches, output records) of each (line number, record) of `chunk`."""
    out = []
    for number, record in chunk:
        pieces, matches = decontaminate.decontaminate(record[key], ngrams, rules)
        reason = "removed" if not pieces else ("split" if matches else "kept")
        split = [{"split_id": f"{number}-{k}"} if matches else {} for k in range(len(pieces))]
        records = [{**record, key: piece, **extra} for piece, extra in zip(pieces, split)]
        out.append((reason, matches, records))
    return out


def _contaminating_ngrams(args: argparse.Namespace, rules) -> set:
    texts = _evaluation_texts(args.eval_data, args.eval_key)
    ngrams = decontaminate.evaluation_ngrams(texts, rules)
    if not ngrams:
        raise GigatronError(
            f"--eval-data: no text of {rules.min_ngram} or more words; check the files and "
            "--eval-key"
        )
    lengths = sorted({len(ngram) for ngram in ngrams})
    frequency: Counter = Counter()
    worker = functools.partial(_present, ngrams=ngrams, lengths=lengths)
    texts = _chunks(r[args.json_key] for _, r in read_records(args.input, args.json_key))
    for found in parallel_map(worker, texts, args.workers):
        for present in found:
            frequency.update(present)
    return {ngram for ngram in ngrams if frequency[ngram] < rules.key_threshold}


def _decontaminate(args: argparse.Namespace) -> Counter:
    rules = decontaminate.NgramRules.from_args(args)
    ngrams = _contaminating_ngrams(args, rules)
    worker = functools.partial(_decontaminate_chunk, key=args.json_key, ngrams=ngrams, rules=rules)
    # Large chunks: each one carries the n-gram set to its worker.
    chunks = _chunks(read_records(args.input, args.json_key), 16 * CHUNK)
    counts: Counter = Counter()
    with atomic_output(args.output) as stream:
        for results in parallel_map(worker, chunks, args.workers):
            for reason, matches, records in results:
                counts[reason] += 1
                counts["matches"] += matches
                for record in records:
                    write_record(stream, record)
    return counts


# --- blacklist -------------------------------------------------------------------------------


def _urls(args: argparse.Namespace) -> Iterator[tuple[str, Any]]:
    """(url, what to write) of each input line: a URL list (.txt) or JSON lines."""
    if args.input.endswith((".txt", ".txt.gz")):
        with open_text(args.input) as stream:
            for line in text_lines(stream, args.input):
                if url := line.strip():
                    yield url, url
        return
    for _, record in read_records(args.input, args.url_key):
        yield record[args.url_key], record


def _blacklist(args: argparse.Namespace) -> Counter:
    domains: frozenset[str] = frozenset()
    if args.domains:
        with open_text(args.domains) as stream:
            lines = list(text_lines(stream, args.domains))
        domains = blacklist.read_domains(lines)
    extensions = tuple(args.extensions.split(",")) if args.extensions else ()
    url_filter = blacklist.URLFilter(domains, extensions or blacklist.DEFAULT_EXTENSIONS)
    counts: Counter = Counter()
    with atomic_output(args.output) as stream:
        for url, item in _urls(args):
            reason = url_filter.reason(url)
            counts[reason] += 1
            if reason == "kept":
                stream.write(item + "\n") if isinstance(item, str) else write_record(stream, item)
    if not counts:
        raise GigatronError(f"{args.input}: holds no URLs; give a non-empty file")
    return counts


# --- the command -----------------------------------------------------------------------------


def _wikipedia_parser(parser: FlagParser) -> None:
    parser.add_argument("--input", required=True, help="a pages-articles.xml or .xml.bz2 dump")
    parser.add_argument("--output", required=True, help="output JSON lines (written atomically)")
    parser.add_argument("--min-chars", type=int, default=0, help="drop shorter articles")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument("--report", help="also write the per-reason counts as JSON here")


def _clean_parser(parser: FlagParser) -> None:
    _common(parser)
    parser.add_argument("--lang", default="en", help="ISO 639-1 code to keep, or 'any'")
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=128,
        help="drop documents with fewer tokens (of --tokenizer-type; words when none is given)",
    )
    parser.add_argument("--no-ftfy", action="store_true", help="skip ftfy's text repair")
    add_dataclass_arguments(parser, TokenizerConfig, title="tokenizer (for --min-tokens)")


def _dedup_parser(parser: FlagParser) -> None:
    _common(parser)
    parser.add_argument("--threshold", type=float, default=0.9, help="Jaccard similarity")
    parser.add_argument("--num-perm", type=int, default=128, help="MinHash bins (2^k)")
    parser.add_argument("--bands", type=int, default=16, help="LSH bands (divides --num-perm)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the hash functions")
    parser.add_argument("--exact-only", action="store_true", help="exact duplicates only")
    parser.add_argument("--id-key", help="field naming a document in --groups-output (a URL)")
    parser.add_argument("--groups-output", help="JSON lines of each group: kept and removed")


def _decontaminate_parser(parser: FlagParser) -> None:
    _common(parser)
    parser.add_argument(
        "--eval-data",
        nargs="+",
        required=True,
        help="evaluation sets: JSON lines (field --eval-key) or text files (one text a line)",
    )
    parser.add_argument("--eval-key", default="text", help="text field of JSON-lines eval sets")
    decontaminate.NgramRules.add_flags(parser)


def _blacklist_parser(parser: FlagParser) -> None:
    _common(parser, json_key=False)
    parser.add_argument("--url-key", default="url", help="URL field of JSON-lines input")
    parser.add_argument("--domains", help="file of blacklisted domains, one a line")
    parser.add_argument("--extensions", help="comma-separated extensions (default: media etc.)")


# tool -> (what it does, its flags, the function that runs it)
TOOLS: dict[str, tuple[str, Callable[[FlagParser], None], Callable[..., Counter]]] = {
    "wikipedia": ("a Wikipedia XML dump -> loose JSON articles", _wikipedia_parser, _wikipedia),
    "clean": ("ftfy, punctuation, language and length filters", _clean_parser, _clean),
    "dedup": ("exact and MinHash-LSH near-duplicate removal", _dedup_parser, _dedup),
    "decontaminate": (
        "13-gram overlap with evaluation sets cut out",
        _decontaminate_parser,
        _decontaminate,
    ),
    "blacklist": ("drop documents by URL domain and extension", _blacklist_parser, _blacklist),
}


def _run(run: Callable[..., Counter], tool: str) -> Callable[[argparse.Namespace], int]:
    """Checks common to every tool, the tool's run, and its counts printed."""

    def checked(args: argparse.Namespace) -> int:
        if args.workers < 1:
            raise GigatronError(f"--workers {args.workers}: give 1 or more")
        inputs = [args.input] + list(getattr(args, "eval_data", []) or [])
        for output in (args.output, args.report, getattr(args, "groups_output", None)):
            if output:
                check_output(output, inputs)
        start = time.perf_counter()
        counts = run(args)
        return _finish(tool, counts, args, time.perf_counter() - start)

    return checked


def main(argv: Sequence[str] | None = None) -> int:
    steps = {
        name: (summary, flags, _run(run, name)) for name, (summary, flags, run) in TOOLS.items()
    }
    return run_subcommand("data", steps, sys.argv[1:] if argv is None else argv)
