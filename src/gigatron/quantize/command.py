"""`gigatron quantize`: its flags (parsed before torch is imported).

gigatron quantize --load CKPT --method int8-weight|int4-weight [--group-size 128] --save OUT
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gigatron.config.parser import command_parser
from gigatron.quantize.methods import METHODS


def build_parser() -> Any:
    parser = command_parser(
        "quantize",
        "Weight-only round-to-nearest quantization of a GPT/Llama checkpoint's linear layers "
        "(symmetric, one scale per group of input features); writes a fake-quantized gigatron "
        "checkpoint plus the packed codes and scales (docs/quantization.md).",
    )
    add = parser.add_argument
    add("--load", required=True, help="gigatron checkpoint directory to quantize")
    add("--save", required=True, help="new directory to write the quantized checkpoint to")
    add("--method", required=True, choices=sorted(METHODS), help="quantization method")
    add("--group-size", type=int, default=128, help="input features sharing one scale")
    add("--ckpt-step", type=int, default=None, help="iteration to quantize (default: the latest)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    from gigatron.quantize.checkpoint import quantize_checkpoint  # why: --help without torch

    quantize_checkpoint(args.load, args.save, args.method, args.group_size, args.ckpt_step)
    return 0
