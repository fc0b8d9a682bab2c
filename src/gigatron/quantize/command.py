"""`gigatron quantize`: its flags (parsed before torch is imported).

gigatron quantize --load CKPT --method int8-weight|int4-weight|int4-awq [--group-size 128]
    --save OUT [--calib-data DATA]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gigatron.config.parser import command_parser
from gigatron.quantize.methods import METHODS


def build_parser() -> Any:
    parser = command_parser(
        "quantize",
        "Weight-only quantization (round-to-nearest, GPTQ, AWQ) of a GPT/Llama checkpoint's linear layers "
        "(symmetric, one scale per group of input features); writes a fake-quantized gigatron "
        "checkpoint plus the packed codes and scales (docs/quantization.md).",
    )
    add = parser.add_argument
    add("--load", required=True, help="gigatron checkpoint directory to quantize")
    add("--save", required=True, help="new directory to write the quantized checkpoint to")
    add("--method", required=True, choices=sorted(METHODS), help="quantization method")
    add(
        "--group-size", type=int, default=None,
        help="input features sharing one weight scale (default 128; int8-smoothquant has one "
        "scale per output row and refuses it)",
    )  # fmt: skip
    add("--ckpt-step", type=int, default=None, help="iteration to quantize (default: the latest)")
    add(
        "--calib-data", default=None,
        help="calibrate on this text (GPTQ; AWQ with --method int4-awq, which needs it): JSON "
        "lines with a 'text' field, or a .bin/.idx prefix of the model's tokenizer (default: "
        "round-to-nearest, no calibration)",
    )  # fmt: skip
    add("--calib-size", type=int, default=128, help="calibration windows of --seq-length tokens")
    add("--seed", type=int, default=1234, help="seed of the calibration windows' choice")
    add(
        "--hf-save", default=None,
        help="also export a Hugging Face folder in the compressed-tensors format here "
        "(Llama, Mistral, Qwen2; transformers and vLLM load it) (default: no export)",
    )  # fmt: skip
    add("--max-shard-size", default="5GB", help="largest safetensors shard of --hf-save")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    # why: parse the flags (and answer --help) before torch is imported
    from gigatron.checkpoint.hf_convert import parse_size
    from gigatron.quantize.checkpoint import check_new_directory, quantize_checkpoint
    from gigatron.quantize.export import export_compressed, require_export_libraries

    shard = parse_size(args.max_shard_size)
    if args.hf_save:
        check_new_directory("--hf-save", args.hf_save)
        require_export_libraries()
    calibration = None
    if args.calib_data is not None:
        calibration = {"data": args.calib_data, "size": args.calib_size, "seed": args.seed}
    quantize_checkpoint(args.load, args.save, args.method, args.group_size, args.ckpt_step,
                        calibration=calibration)  # fmt: skip
    if args.hf_save:
        export_compressed(args.save, args.hf_save, shard)
    return 0
