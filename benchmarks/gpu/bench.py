"""Training throughput of one model under one implementation (a variant), for benchmarks/gpu.

Models (`MODELS`; `--dry-run` shrinks each to 2 layers, hidden 64, seq 32):
  gpt-1.3b   24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304, micro-batch 8 (GPT-3 XL)
  llama-1b   16 layers, hidden 2048, ffn 8192, 32 heads / 8 KV groups, RoPE (base 500000),
             SwiGLU, RMSNorm, no biases, vocab 128256, seq 2048, micro-batch 4 (Llama 3.2 1B)
  gpt2-124m  12 layers, hidden 768, 12 heads, seq 1024, vocab 50304, micro-batch 16
Variants (`VARIANTS`), all bf16 with fp32 master weights, dropout 0, AdamW, clip 1.0, one GPU,
random tokens of the same shape:
  gigatron_eager          `gigatron pretrain gpt --bf16 --cross-entropy-loss-fusion` (and the
                          default-on fused RMSNorm / RoPE / SwiGLU kernels when Liger is there)
  gigatron_compiled       the same with `--torch-compile`
  gigatron_compiled_fp8   the same with `--torch-compile --fp8-format hybrid --fp8-recipe
                          tensorwise`
  gigatron_unfused        (on request) eager with every fusion off: the PyTorch reference
  megatron_core           Megatron-Core's GPTModel, local (pure PyTorch) layer spec, bf16
                          parameters, fused torch AdamW on fp32 master copies (Megatron's
                          mixed-precision scheme)
  hf_compiled             Hugging Face transformers' GPT2LMHeadModel / LlamaForCausalLM (SDPA),
                          torch.compile, fp32 parameters under torch.autocast(bf16), fused AdamW
Each gives tokens/s (median step after warm-up), step time, peak memory and the model FLOPs
per token (gigatron's count of the same shape, for MFU). `--no-compile` drops torch.compile from
every variant (the CPU dry run).

    python benchmarks/gpu/bench.py --model gpt2-124m --variant hf_compiled --out r.json
        [--steps 10] [--warmup 5] [--device cuda] [--dry-run] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    llama: bool = False
    ffn: int | None = None
    kv_heads: int | None = None


MODELS = {
    "gpt-1.3b": ModelSpec("gpt-1.3b", 24, 2048, 16, 2048, 50304, 8),
    "llama-1b": ModelSpec("llama-1b", 16, 2048, 32, 2048, 128256, 4, True, 8192, 8),
    "gpt2-124m": ModelSpec("gpt2-124m", 12, 768, 12, 1024, 50304, 16),
}
GIGATRON_VARIANTS = {
    "gigatron_eager": [],
    "gigatron_compiled": ["--torch-compile"],
    "gigatron_compiled_fp8": [
        "--torch-compile",
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "tensorwise",
    ],
    "gigatron_unfused": [
        "--no-cross-entropy-loss-fusion",
        "--no-rope-fusion",
        "--no-bias-swiglu-fusion",
        "--transformer-impl",
        "local",
    ],
}
VARIANTS = (*GIGATRON_VARIANTS, "megatron_core", "hf_compiled")
DEFAULT_VARIANTS = (
    "gigatron_eager", "gigatron_compiled", "gigatron_compiled_fp8", "megatron_core", "hf_compiled",
)  # fmt: skip


def dry_run_shape(spec: ModelSpec) -> ModelSpec:
    """The same kind of model at a size a CPU steps in a moment."""
    return replace(
        spec, layers=2, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2,
        ffn=128 if spec.llama else None, kv_heads=2 if spec.llama else None,
    )  # fmt: skip


def gigatron_flags(spec: ModelSpec, device: str, iterations: int, log_interval: int) -> list[str]:
    flags = [
        "--mock-data", "--vocab-size", str(spec.vocab), "--padded-vocab-size", str(spec.vocab),
        "--num-layers", str(spec.layers), "--hidden-size", str(spec.hidden),
        "--num-attention-heads", str(spec.heads), "--seq-length", str(spec.seq),
        "--max-position-embeddings", str(spec.seq), "--micro-batch-size", str(spec.micro_batch),
        "--global-batch-size", str(spec.micro_batch), "--bf16", "--lr", "1e-4",
        "--weight-decay", "0.01", "--clip-grad", "1.0", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--train-iters", str(iterations), "--log-interval",
        str(log_interval), "--eval-iters", "0", "--num-workers", "0",
        "--no-create-attention-mask-in-dataloader", "--log-memory-to-tensorboard",
        "--device", device, "--cross-entropy-loss-fusion", "--seed", "1234",
        # no per-step result validation: no host synchronisation inside a step (what
        # Megatron-Core's side of the comparison does not do either)
        "--rerun-mode", "disabled",
    ]  # fmt: skip
    if spec.llama:
        flags += [
            "--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu",
            "--normalization", "RMSNorm", "--disable-bias-linear", "--group-query-attention",
            "--num-query-groups", str(spec.kv_heads), "--ffn-hidden-size", str(spec.ffn),
        ]  # fmt: skip
    return flags


def flops_per_token(spec: ModelSpec) -> float:
    """Model FLOPs per trained token (forward and backward), gigatron's count of the shape."""
    from gigatron.families.gpt.flops import model_flops_per_iteration
    from gigatron.training.pretrain import parse_pretrain_config

    cfg = parse_pretrain_config(gigatron_flags(spec, "cpu", 1, 1), world_size=1)
    return model_flops_per_iteration(cfg.model, 1, spec.vocab) / spec.seq


def run_gigatron(spec: ModelSpec, variant: str, args: argparse.Namespace) -> dict:
    """`gigatron pretrain gpt` in this process: one log window of warm-up, one measured."""
    from gigatron.training.pretrain import main as pretrain_main

    extra = list(GIGATRON_VARIANTS[variant])
    if args.no_compile:
        extra = [flag for flag in extra if flag != "--torch-compile"]
    # "--no-cross-entropy-loss-fusion" is this script's word for leaving the flag out.
    flags = gigatron_flags(spec, args.device, 2 * args.steps, args.steps)
    if "--no-cross-entropy-loss-fusion" in extra:
        extra.remove("--no-cross-entropy-loss-fusion")
        flags.remove("--cross-entropy-loss-fusion")
    metrics = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = pretrain_main(["gpt", *flags, *extra, "--metrics-file", str(metrics)])
    if code != 0:
        raise RuntimeError(f"gigatron pretrain exited {code}")
    train = [json.loads(line) for line in metrics.read_text().splitlines()]
    last = [r for r in train if r.get("type") == "train"][-1]
    return {
        "step_s": last["iteration_time_s"],
        "tokens_per_s": last["tokens_per_s"],
        "peak_memory_bytes": last.get("memory_max_allocated_bytes")
        or last.get("memory_max_rss_bytes"),
        "loss": last.get("lm_loss"),
        "flags": extra,
        "warnings": sorted({str(w.message) for w in caught})[:10],
    }


def random_batches(spec: ModelSpec, count: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (spec.micro_batch, spec.seq + 1)
    return [torch.randint(0, spec.vocab, shape, generator=g).to(device) for _ in range(count)]


def timed_steps(step, batches: list[torch.Tensor], warmup: int, device: str) -> dict:
    """Run `step(batch) -> loss` over the batches; the median time of those after `warmup`."""
    times, loss = [], None
    for index, batch in enumerate(batches):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"step_s": step_s, "loss": float(loss), "step_times_s": times}


def training_step(model, optimizer, vocab: int, device: str, forward, autocast: bool):
    """One training step: `forward(model, inputs, labels) -> logits or per-token losses`, the
    mean loss backward, clipping to norm 1 and the optimizer step; under torch.autocast(bf16)
    when `autocast` (an fp32 model), else in the model's dtype."""

    def step(batch: torch.Tensor) -> torch.Tensor:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = forward(model, inputs, labels)
        if out.dim() == 3:
            flat = out.float().reshape(-1, vocab)
            out = F.cross_entropy(flat, labels.reshape(-1), reduction="none")
        loss = out.float().mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


class MasterWeightsAdamW:
    """AdamW on fp32 copies of bf16 parameters (Megatron's mixed-precision optimizer): gradients
    copied to the copies, clipped to norm 1, stepped, and the parameters copied back."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=1e-4, weight_decay=0.01, fused=device == "cuda"
        )

    def step(self) -> None:
        for param, master in zip(self.params, self.masters):
            master.grad = param.grad.float()
            param.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                param.copy_(master)


class ClippedAdamW:
    """Fused AdamW on the (fp32) parameters with clipping to norm 1."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.01, fused=device == "cuda"
        )

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def hf_model(spec: ModelSpec):
    # why: transformers is heavy and only this variant needs it
    import transformers

    common = dict(vocab_size=spec.vocab, tie_word_embeddings=True, attn_implementation="sdpa")
    if spec.llama:
        config = transformers.LlamaConfig(
            hidden_size=spec.hidden, intermediate_size=spec.ffn, num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
            max_position_embeddings=spec.seq, rope_theta=500000.0, rms_norm_eps=1e-5,
            attention_dropout=0.0, **common,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, n_positions=spec.seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def run_hf(spec: ModelSpec, args: argparse.Namespace) -> dict:
    torch.manual_seed(1234)
    with torch.device(args.device):  # initialised where it trains (a 1.3B model: seconds)
        model = hf_model(spec).train()
    optimizer = ClippedAdamW(model, args.device)
    compiled = model if args.no_compile else torch.compile(model)
    step = training_step(
        compiled, optimizer, spec.vocab, args.device,
        lambda m, inputs, labels: m(input_ids=inputs, use_cache=False).logits, autocast=True,
    )  # fmt: skip
    result = timed_steps(
        step, random_batches(spec, args.warmup + args.steps, args.device), args.warmup, args.device
    )
    return {**result, "compiled": not args.no_compile}


def megatron_core_model(spec: ModelSpec, device: str):
    """Megatron-Core's GPTModel with the local spec, on a one-process model-parallel state."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    else:
        # The CPU dry run: the no-op RNG tracker and the attention-score buffer on the CPU.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
        cpu_attention_buffer()
    torch.manual_seed(1234)
    llama = dict(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn,
    ) if spec.llama else {}  # fmt: skip
    config = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02, bf16=True,
        params_dtype=torch.bfloat16, gradient_accumulation_fusion=False,
        use_cpu_initialization=device != "cuda", **llama,
    )  # fmt: skip
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=spec.vocab, max_sequence_length=spec.seq,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope" if spec.llama else "learned_absolute",
        rotary_base=500000 if spec.llama else 10000,
    )  # fmt: skip
    # Megatron's bf16 wrapper: every parameter and buffer in bf16, floating inputs cast.
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, model.to(device))


def cpu_attention_buffer() -> None:
    """Megatron-Core's global attention-score buffer, allocated on the CPU (dry run only)."""
    from megatron.core import utils as mcore_utils

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        size = int(torch.Size(tensor_shape).numel())
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < size:
            buffer = self.buffer[(name, dtype)] = torch.empty(size, dtype=dtype)
        return buffer[:size].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor


def run_megatron_core(spec: ModelSpec, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    try:
        return megatron_core_steps(spec, args)
    finally:  # the next variant in this process starts without Megatron's state
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def megatron_core_steps(spec: ModelSpec, args: argparse.Namespace) -> dict:
    model = megatron_core_model(spec, args.device).train()
    optimizer = MasterWeightsAdamW(model, args.device)
    positions = torch.arange(spec.seq, device=args.device).expand(spec.micro_batch, spec.seq)
    causal = torch.ones(spec.seq, spec.seq, dtype=torch.bool, device=args.device).triu(1)
    mask = causal.view(1, 1, spec.seq, spec.seq)
    step = training_step(
        model, optimizer, spec.vocab, args.device,
        lambda m, inputs, labels: m(inputs, positions, mask, labels=labels), autocast=False,
    )  # fmt: skip
    batches = random_batches(spec, args.warmup + args.steps, args.device)
    return timed_steps(step, batches, args.warmup, args.device)


def run_variant(spec: ModelSpec, variant: str, args: argparse.Namespace) -> dict:
    """The variant's figures, or `status` skipped (a library missing) / failed (the error)."""
    record = {"model": spec.name, "variant": variant, "shape": asdict(spec)}
    missing = missing_library(variant)
    if variant == "megatron_core" and spec.llama and args.device != "cuda":
        missing = "Megatron-Core's rotary embedding runs on CUDA only"
    if missing:
        return {**record, "status": "skipped", "reason": missing}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        if variant in GIGATRON_VARIANTS:
            figures = run_gigatron(spec, variant, args)
        elif variant == "hf_compiled":
            figures = run_hf(spec, args)
        else:
            figures = run_megatron_core(spec, args)
    except (Exception, SystemExit) as error:  # a failed variant is a result; others still run
        tail = traceback.format_exc().splitlines()[-12:]
        return {**record, "status": "failed", "reason": f"{type(error).__name__}: {error}",
                "traceback": tail}  # fmt: skip
    if variant not in GIGATRON_VARIANTS:
        figures["tokens_per_s"] = spec.micro_batch * spec.seq / figures["step_s"]
        if args.device == "cuda":
            figures["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    figures["flops_per_token"] = flops_per_token(spec)
    figures["achieved_tflops"] = figures["tokens_per_s"] * figures["flops_per_token"] / 1e12
    return {**record, "status": "ok", **figures}


def missing_library(variant: str) -> str | None:
    """Why a variant cannot run here (its library is not installed), or None."""
    needs = {"megatron_core": "megatron.core", "hf_compiled": "transformers"}
    if variant == "gigatron_compiled_fp8":
        needs[variant] = "torchao"
    module = needs.get(variant)
    if module is None:
        return None
    try:
        # why: only probing whether the optional library is installed
        __import__(module)
    except ImportError as error:
        return f"{module} is not installed ({error})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--model", choices=list(MODELS), required=True)
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--out", type=Path, required=True, help="the JSON result")
    parser.add_argument("--steps", type=int, default=10, help="measured steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile anywhere")
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    if args.dry_run:
        spec = dry_run_shape(spec)
    result = run_variant(spec, args.variant, args)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
