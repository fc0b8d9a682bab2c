"""`gigatron quantize`: its flags (parsed before torch is imported).

gigatron quantize --load CKPT --method METHOD [--group-size 128] --save OUT
    [--calib-data DATA [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]]
    [--hf-save DIR [--export-format compressed-tensors|trtllm]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gigatron.config.parser import command_parser
from gigatron.errors import GigatronError
from gigatron.quantize.methods import METHODS


def build_parser() -> Any:
    parser = command_parser(
        "quantize",
        "Post-training quantization of a GPT/Llama (or hybrid Mamba) checkpoint's linear "
        "layers: int8/int4 weights (round-to-nearest, GPTQ, AWQ), SmoothQuant W8A8 or fp8 "
        "weights and inputs; writes a fake-quantized gigatron checkpoint plus the packed codes "
        "and scales, and optionally a compressed-tensors or TensorRT-LLM export "
        "(docs/quantization.md).",
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
        "--tensor-model-parallel-size", type=int, default=1,
        help="split the calibration's model over this many tensor-parallel processes "
        "(torchrun; with --calib-data)",
    )  # fmt: skip
    add(
        "--pipeline-model-parallel-size", type=int, default=1,
        help="split the calibration's model over this many pipeline stages (torchrun; with "
        "--calib-data); the processes left over split the calibration samples",
    )  # fmt: skip
    add(
        "--kv-cache-dtype", default=None, choices=["fp8"],
        help="also quantize the KV cache: e4m3 keys and values, one static scale each per "
        "attention from the calibration (needs --calib-data) (default: not quantized)",
    )  # fmt: skip
    add(
        "--hf-save", default=None,
        help="also export the quantized model here, in --export-format (default: no export)",
    )  # fmt: skip
    add(
        "--export-format", default=None, choices=["compressed-tensors", "trtllm"],
        help="what --hf-save writes: a Hugging Face folder in the compressed-tensors format "
        "(Llama, Mistral, Qwen2; transformers and vLLM load it; the default), or a "
        "TensorRT-LLM checkpoint (Llama; trtllm-build builds it)",
    )  # fmt: skip
    add(
        "--max-shard-size", default=None,
        help="largest safetensors shard of a compressed-tensors --hf-save (default 5GB)",
    )  # fmt: skip
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    # why: parse the flags (and answer --help) before torch is imported
    from gigatron.checkpoint.hf_convert import parse_size
    from gigatron.parallel.context import ParallelContext, destroy
    from gigatron.quantize.checkpoint import check_new_directory, quantize_checkpoint
    from gigatron.quantize.export import export_compressed, require_export_libraries
    from gigatron.quantize.trtllm import export_trtllm

    trtllm = _check_export_flags(args)
    shard = parse_size(args.max_shard_size or "5GB")
    if args.hf_save:
        check_new_directory("--hf-save", args.hf_save)
        if not trtllm:
            require_export_libraries()
    calibration = None
    if args.calib_data is not None:
        calibration = {"data": args.calib_data, "size": args.calib_size, "seed": args.seed}
        if args.kv_cache_dtype:
            calibration["kv_cache_dtype"] = args.kv_cache_dtype
    # Under torchrun the processes share the calibration samples (split over the data-parallel
    # ones; each model copy over tp x pp processes); the first one writes.
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    pctx = ParallelContext.from_sizes(tp=tp, pp=pp, device="cpu")
    try:
        quantize_checkpoint(args.load, args.save, args.method, args.group_size, args.ckpt_step,
                            calibration=calibration, pctx=pctx)  # fmt: skip
        if args.hf_save and trtllm and pctx.rank == 0:
            export_trtllm(args.save, args.hf_save)
        elif args.hf_save and pctx.rank == 0:
            export_compressed(args.save, args.hf_save, shard)
    finally:
        destroy(pctx)
    return 0


def _check_export_flags(args: Any) -> bool:
    """Whether the export is TensorRT-LLM's; refuses flags that would go unused."""
    if args.kv_cache_dtype and args.calib_data is None:
        raise GigatronError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: needs --calib-data (its scales come from "
            "the calibration)"
        )
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    sizes = f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
    if min(tp, pp) < 1:
        raise GigatronError(f"{sizes}: each must be at least 1; e.g. 2")
    if max(tp, pp) > 1 and args.calib_data is None:
        raise GigatronError(
            f"{sizes}: they split the calibration's model, and round-to-nearest (no --calib-data) "
            "runs no model; give --calib-data or drop them"
        )
    if args.export_format and not args.hf_save:
        raise GigatronError(f"--export-format {args.export_format}: give --hf-save DIR too")
    trtllm = args.export_format == "trtllm"
    if args.max_shard_size and (trtllm or not args.hf_save):
        raise GigatronError(
            f"--max-shard-size {args.max_shard_size}: shards a compressed-tensors --hf-save "
            "only (a TensorRT-LLM checkpoint is one rank0.safetensors); drop it"
        )
    return trtllm
