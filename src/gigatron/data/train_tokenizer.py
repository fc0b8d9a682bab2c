"""`gigatron train-tokenizer`: train a GPT-2 style byte-level BPE or a BERT WordPiece vocabulary
on JSON lines with HF `tokenizers`, written in the files `--vocab-file`/`--merge-file` read."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from gigatron.config.parser import command_parser
from gigatron.data.preprocess import parse_line, reading, resolve_inputs
from gigatron.errors import GigatronError

TYPES = ["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"]
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_END_OF_TEXT = "<|endoftext|>"


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "train-tokenizer",
        "Train a tokenizer on JSON lines and write the files `gigatron preprocess` "
        "and `gigatron pretrain` read with the same --tokenizer-type.",
    )
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSON-lines files, globs or directories (.gz ok)"
    )
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys holding the text")
    parser.add_argument(
        "--tokenizer-type",
        required=True,
        choices=TYPES,
        help="GPT2BPETokenizer: byte-level BPE (writes vocab.json and merges.txt); "
        "BertWordPiece(Lower)Case: WordPiece (writes vocab.txt)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="tokens in the vocabulary, special tokens included (fewer when the corpus is small)",
    )
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="minimum count of a merge or word piece"
    )
    parser.add_argument("--output-dir", required=True, help="where the vocabulary files go")
    parser.add_argument(
        "--skip-invalid", action="store_true", help="skip malformed lines instead of stopping"
    )
    return parser


def iterate_texts(files: Sequence[str], keys: Sequence[str], skip_invalid: bool) -> Iterator[str]:
    """The texts of every key of every line, streamed; bad lines stop with file:line."""

    for path in files:
        with reading(path) as stream:
            for line_number, raw in enumerate(stream, start=1):
                if not raw.strip():
                    continue
                values, reason = parse_line(raw, keys)
                if reason is not None:
                    if skip_invalid:
                        continue
                    raise GigatronError(
                        f"{path}:{line_number}: {reason}; fix the line, or pass --skip-invalid"
                    )
                for pieces in values:
                    yield from pieces


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = resolve_inputs(args.input)
    is_bpe = args.tokenizer_type == "GPT2BPETokenizer"
    minimum = 257 if is_bpe else len(BERT_SPECIAL_TOKENS) + 1
    if args.vocab_size < minimum:
        raise GigatronError(
            f"--vocab-size {args.vocab_size}: too small for {args.tokenizer_type}; "
            f"use at least {minimum} (256 bytes + <|endoftext|> for byte-level BPE)"
        )
    os.makedirs(args.output_dir, exist_ok=True)
    counted = {"texts": 0}

    def count(texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            counted["texts"] += 1
            yield text

    texts = count(iterate_texts(files, args.json_keys, args.skip_invalid))
    show_progress = sys.stderr.isatty()
    # Written to a scratch directory first: the output directory never holds half a vocabulary.
    scratch = tempfile.mkdtemp(prefix=".train-tokenizer-", dir=args.output_dir)
    try:
        tokenizer, outputs = _train(args, texts, scratch, is_bpe, show_progress)
        for name in outputs:
            os.replace(os.path.join(scratch, name), os.path.join(args.output_dir, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    size = tokenizer.get_vocab_size()
    if counted["texts"] == 0:
        warnings.warn(
            f"--input {' '.join(args.input)}: no text found under --json-keys "
            f"{' '.join(args.json_keys)}; the vocabulary holds only {size} base and special tokens",
            stacklevel=2,
        )
    elif size < args.vocab_size:
        warnings.warn(
            f"--vocab-size {args.vocab_size}: trained only {size} tokens; the corpus has too few "
            f"distinct pieces seen at least --min-frequency {args.min_frequency} times (give more "
            "text or a lower --min-frequency)",
            stacklevel=2,
        )
    paths = [os.path.join(args.output_dir, name) for name in outputs]
    print(f"trained {args.tokenizer_type} with {size} tokens: {' '.join(paths)}")
    if is_bpe:
        flags = f"--tokenizer-type GPT2BPETokenizer --vocab-file {paths[0]} --merge-file {paths[1]}"
    else:
        flags = f"--tokenizer-type {args.tokenizer_type} --vocab-file {paths[0]}"
    print(f"use it with: {flags}")
    return 0


def _train(
    args: argparse.Namespace, texts: Iterator[str], scratch: str, is_bpe: bool, show: bool
) -> tuple[Any, list[str]]:
    """Train the tokenizer on `texts` and save it in `scratch`: (tokenizer, file names)."""
    if is_bpe:
        from tokenizers.implementations import ByteLevelBPETokenizer

        tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
        tokenizer.train_from_iterator(
            texts,
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
            special_tokens=[GPT2_END_OF_TEXT],
            show_progress=show,
        )
        tokenizer.save_model(scratch)
        outputs = ["vocab.json", "merges.txt"]
    else:
        from tokenizers.implementations import BertWordPieceTokenizer

        lower_case = args.tokenizer_type == "BertWordPieceLowerCase"
        tokenizer = BertWordPieceTokenizer(
            lowercase=lower_case, strip_accents=None if lower_case else False
        )
        tokenizer.train_from_iterator(
            texts,
            vocab_size=args.vocab_size,
            min_frequency=args.min_frequency,
            special_tokens=BERT_SPECIAL_TOKENS,
            show_progress=show,
        )
        tokenizer.save_model(scratch)
        outputs = ["vocab.txt"]
    return tokenizer, outputs
