"""`gigatron merge`: concatenate indexed datasets (.bin/.idx pairs) into one.

The output equals what preprocessing the concatenated inputs would have written: documents and
sequences keep their order, the .bin files are byte-copied.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gigatron.config.parser import command_parser
from gigatron.data.indexed import (
    IndexedDataset,
    IndexedDatasetBuilder,
    data_file_path,
    index_file_path,
)
from gigatron.errors import GigatronError


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser(
        "merge",
        "Concatenate indexed datasets made with the same tokenizer into one.",
    )
    sources = parser.add_mutually_exclusive_group(required=True)
    sources.add_argument(
        "--input",
        nargs="+",
        metavar="PREFIX",
        help="dataset prefixes (PREFIX.bin + PREFIX.idx), merged in the order given; a single "
        "directory is read like --input-dir (Megatron's merge_datasets.py takes a directory)",
    )
    sources.add_argument(
        "--input-dir", help="merge every PREFIX.bin/PREFIX.idx pair in this directory, by name"
    )
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    parser.add_argument(
        "--multimodal", action="store_true", help="the datasets carry per-sequence modes"
    )
    return parser


def prefixes_in_directory(directory: str) -> list[str]:
    """Sorted prefixes of the complete .bin/.idx pairs in `directory`."""
    if not os.path.isdir(directory):
        raise GigatronError(f"--input-dir {directory}: not a directory")
    names = sorted(os.listdir(directory))
    prefixes = []
    for name in names:
        if name.endswith(".idx") and not name.startswith("."):
            prefix = os.path.join(directory, name[: -len(".idx")])
            if not os.path.isfile(prefix + ".bin"):
                raise GigatronError(f"{prefix}.idx: its {prefix}.bin is missing")
            prefixes.append(prefix)
    if not prefixes:
        raise GigatronError(f"--input-dir {directory}: no .idx/.bin dataset pairs in it")
    return prefixes


def merge_datasets(prefixes: Sequence[str], output_prefix: str, multimodal: bool = False) -> None:
    """Write `output_prefix`.bin/.idx holding every dataset of `prefixes` in order."""

    output = os.path.abspath(output_prefix)
    for prefix in prefixes:
        if os.path.abspath(prefix) == output:
            raise GigatronError(
                f"--output-prefix {output_prefix}: is also an input; choose another output name"
            )
    # Open every input first so that a bad file or a dtype mismatch stops before any write.
    datasets = [IndexedDataset(prefix, multimodal=multimodal) for prefix in prefixes]
    dtypes = {str(dataset.dtype) for dataset in datasets}
    if len(dtypes) > 1:
        listing = ", ".join(f"{p} ({d.dtype})" for p, d in zip(prefixes, datasets))
        raise GigatronError(
            f"--input: datasets have different token dtypes ({listing}); merge only datasets "
            "preprocessed with the same tokenizer"
        )
    dtype = datasets[0].dtype
    del datasets
    with IndexedDatasetBuilder(
        data_file_path(output_prefix), dtype=dtype, multimodal=multimodal
    ) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(index_file_path(output_prefix))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.input_dir is not None:
        prefixes = prefixes_in_directory(args.input_dir)
    elif len(args.input) == 1 and os.path.isdir(args.input[0]):
        prefixes = prefixes_in_directory(args.input[0])
    else:
        prefixes = [p[: -len(".bin")] if p.endswith((".bin", ".idx")) else p for p in args.input]
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(output_dir):
        raise GigatronError(
            f"--output-prefix {args.output_prefix}: directory {output_dir} does not exist"
        )
    merge_datasets(prefixes, args.output_prefix, multimodal=args.multimodal)
    merged = IndexedDataset(args.output_prefix, multimodal=args.multimodal)
    print(
        f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx: "
        f"{len(merged.document_indices) - 1} documents, {len(merged)} sequences, "
        f"{merged.num_tokens} tokens ({merged.dtype})",
        file=sys.stdout,
    )
    return 0
