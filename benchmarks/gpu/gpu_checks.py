"""The GPU-relevant checks that benchmarks/gpu/run.py runs (with pytest) before the benchmarks:
bf16, fp16 with loss scaling, each fused kernel against the PyTorch path, a fused model against
the unfused one, torch.compile, fp8 (the real fp8 products against torchao's emulation, and
training), checkpoint save and resume, and the inference engine.

The device is $GIGATRON_CHECK_DEVICE (default: cuda when there is one). A check that needs what
this machine lacks (CUDA, Liger-Kernel, `--torch-compile`; $GIGATRON_CHECK_NO_COMPILE=1 leaves
compile out) is skipped with the reason, which run.py reports: the CPU dry run skips the
CUDA-only ones. Tiny models (2 layers, hidden 64): seconds on a GPU.

    GIGATRON_CHECK_DEVICE=cuda python -m pytest -q benchmarks/gpu/gpu_checks.py
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.models.activations import mlp_activation
from gigatron.models.fp8 import Float8Matmul, float8_config
from gigatron.models.fused import PYTORCH, liger_kernels
from gigatron.models.gpt import build_model
from gigatron.models.transformer import Norm, rotate_query_key
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import vocab_parallel_cross_entropy
from gigatron.training.pretrain import main as pretrain_main

DEVICE = os.environ.get("GIGATRON_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE == "cuda"
LLAMA = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
    "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip
TRAIN = [
    "--mock-data", "--vocab-size", "128", "--padded-vocab-size", "128", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
    "--lr", "1e-3", "--train-iters", "4", "--log-interval", "1", "--eval-iters", "0",
    "--num-workers", "0", "--no-create-attention-mask-in-dataloader", "--device", DEVICE,
]  # fmt: skip
UNFUSED = ["--no-rope-fusion", "--no-bias-swiglu-fusion", "--transformer-impl", "local"]


def needs_cuda() -> None:
    if not CUDA:
        pytest.skip(f"needs CUDA (this run is on {DEVICE})")


def needs_liger() -> None:
    needs_cuda()
    try:
        # why: the optional Triton kernels; only probing whether they are installed
        import liger_kernel  # noqa: F401
    except ImportError as error:
        pytest.skip(f"liger-kernel is not installed ({error})")


def needs_compile() -> None:
    if os.environ.get("GIGATRON_CHECK_NO_COMPILE"):
        pytest.skip("torch.compile left out ($GIGATRON_CHECK_NO_COMPILE)")
    try:
        parse_config(["--torch-compile"])
    except (GigatronError, SystemExit):
        pytest.skip("this gigatron has no --torch-compile")


def train(*flags: str, save: Path | None = None) -> dict[int, dict]:
    """`gigatron pretrain gpt` in this process; the train records by iteration."""
    directory = save or Path(tempfile.mkdtemp())
    metrics = directory / "metrics.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = pretrain_main(["gpt", *TRAIN, *flags, "--metrics-file", str(metrics)])
    assert code == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["iteration"]: r for r in records if r.get("type") == "train"}


def losses(records: dict[int, dict]) -> list[float]:
    return [records[i]["lm_loss"] for i in sorted(records)]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


# ---- precisions ---------------------------------------------------------------------------------
def test_bf16_trains_like_fp32():
    fp32, bf16 = losses(train(*LLAMA)), losses(train(*LLAMA, "--bf16"))
    assert all(torch.isfinite(torch.tensor(bf16)))
    assert abs(bf16[0] - fp32[0]) / fp32[0] < 0.02
    assert bf16[-1] < bf16[0]


def test_fp16_with_dynamic_loss_scaling():
    fp16 = ["--fp16", "--loss-scale-window", "2"]
    records = train(*LLAMA, *fp16, "--initial-loss-scale", "65536")
    fp32, got = losses(train(*LLAMA)), losses(records)
    assert abs(got[0] - fp32[0]) / fp32[0] < 0.02 and got[-1] < got[0]
    # Doubled after every 2 clean steps; an overflowing scale skips the step and halves.
    assert [records[i]["loss_scale"] for i in (1, 2, 3, 4)] == [2.0**16, 2.0**17, 2.0**17, 2.0**18]
    overflow = train(*LLAMA, *fp16, "--initial-loss-scale", str(2.0**40))
    assert [overflow[i]["loss_scale"] for i in (1, 2, 3, 4)] == [2.0**k for k in (40, 39, 38, 37)]
    assert [overflow[i]["skipped_iterations"] for i in (1, 2, 3, 4)] == [1, 2, 3, 4]


# ---- fused kernels --------------------------------------------------------------------------------
def _pytorch_config(dtype: torch.dtype) -> TransformerConfig:
    """The Llama-style layers' config with no fused kernel (the reference side)."""
    flags = [*LLAMA, "--seq-length", "32", "--device", DEVICE]
    flags += ["--bf16"] if dtype == torch.bfloat16 else []
    return TransformerConfig.from_config(parse_config(flags), kernels=PYTORCH)


def _pair(part: str, dtype: torch.dtype):
    """(Liger's kernel, the PyTorch path, input shapes) of one part; every input is a float
    tensor whose gradient is compared."""
    kernels, pctx = liger_kernels(), ParallelContext.single(DEVICE)
    if part == "rms_norm":
        norm = Norm(_pytorch_config(dtype), pctx)
        return (
            lambda x, w: kernels.rms_norm(x, w, norm.eps),
            lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
            [(32, 2, 64), (64,)],
        )
    if part == "rope":  # partial rotary: 8 of 16 channels (tables duplicated, rotate-half)
        angles = torch.rand(32, 2, 1, 4, device=DEVICE).repeat(1, 1, 1, 2) * 6.28
        cos, sin = angles.cos(), angles.sin()
        return (
            lambda q, k: kernels.rope(q, k, cos, sin),
            lambda q, k: rotate_query_key(q, k, cos, sin),
            [(32, 2, 4, 16), (32, 2, 2, 16)],
        )
    if part == "swiglu":
        reference = mlp_activation(SimpleNamespace(swiglu=True, openai_gelu=False))
        return kernels.swiglu, reference, [(64, 2 * 96)]
    labels = torch.randint(0, 128, (64,), device=DEVICE)
    return (
        lambda hidden, w: kernels.linear_cross_entropy(hidden, w, labels),
        lambda hidden, w: vocab_parallel_cross_entropy(F.linear(hidden, w), labels, pctx),
        [(64, 64), (128, 64)],
    )


def _forward_backward(function, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs and input gradients of `function` for a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = function(*leaves)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    grads = [torch.randn(o.shape, generator=g, device=DEVICE, dtype=o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("part", ["rms_norm", "rope", "swiglu", "linear_cross_entropy"])
def test_fused_kernel_matches_pytorch(part, dtype):
    needs_liger()
    fused, reference, shapes = _pair(part, dtype)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    inputs = [torch.randn(*shape, generator=g, device=DEVICE, dtype=dtype) for shape in shapes]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    got, expected = _forward_backward(fused, inputs), _forward_backward(reference, inputs)
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected)):
        assert torch.isfinite(a).all() and relative_error(a, b) < tolerance, (part, index)


def test_fused_model_trains_like_the_unfused_one():
    needs_liger()
    fused = train(*LLAMA, "--cross-entropy-loss-fusion")
    reference = losses(train(*LLAMA, *UNFUSED))
    assert losses(fused) == pytest.approx(reference, rel=1e-4)


# ---- torch.compile --------------------------------------------------------------------------------
def test_compiled_trains_like_eager():
    needs_compile()
    eager = losses(train(*LLAMA))
    assert losses(train(*LLAMA, "--torch-compile")) == pytest.approx(eager, rel=1e-4)


# ---- fp8 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_products_match_torchao_emulation(recipe):
    """torch's scaled matrix product on the GPU against the emulation the CPU tests check."""
    needs_cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    real = Float8Matmul(float8_config("hybrid", recipe, emulate=False))(x, w, None)
    emulated = Float8Matmul(float8_config("hybrid", recipe, emulate=True))(x, w, None)
    assert relative_error(real, emulated) < 1e-2
    assert 1e-3 < relative_error(real, x.float() @ w.float().t()) < 0.1


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_like_bf16(recipe):
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    bf16 = losses(train(*LLAMA, "--bf16"))
    got = losses(train(*LLAMA, "--bf16", *fp8))
    assert got[-1] < got[0] and abs(got[0] - bf16[0]) / bf16[0] < 0.05


# ---- checkpoints and inference ----------------------------------------------------------------------
def test_checkpoint_save_and_resume():
    """Resumed iterations 3 and 4 match the uninterrupted run (to the rounding of GPU kernels
    that sum with atomics; on a CPU exactly)."""
    full, part = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    reference = losses(train(*LLAMA, "--bf16", "--save", str(full), "--save-interval", "2"))
    train(*LLAMA, "--bf16", "--save", str(part), "--save-interval", "2", "--exit-interval", "2")
    resumed = train(*LLAMA, "--bf16", "--save", str(part), "--load", str(part), save=part)
    assert sorted(resumed) == [3, 4]  # the second run went on from iteration 2
    assert [resumed[i]["lm_loss"] for i in (3, 4)] == pytest.approx(reference[2:], rel=1e-3)


def test_inference_engine_greedy_matches_full_forward():
    from gigatron.inference.engine import SamplingParams
    from gigatron.inference.load import build_engine

    cfg = parse_config([*LLAMA, "--seq-length", "32", "--max-position-embeddings", "32",
                        "--padded-vocab-size", "128", "--device", DEVICE])  # fmt: skip
    pctx = ParallelContext.single(DEVICE)
    chunks = build_model(cfg, pctx, vocab_size=128)
    chunks[0].eval()
    engine = build_engine(chunks, pctx, None, max_batch_size=2, max_sequence_length=32)
    prompts = [[5, 17, 42, 9], [88, 3]]
    completions = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, completion in zip(prompts, completions):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(8):
                ids = torch.tensor([tokens], device=DEVICE)
                positions = torch.arange(len(tokens), device=DEVICE).unsqueeze(0)
                tokens.append(int(chunks[0](ids, positions)[0, -1].argmax()))
        assert completion.output_ids == tokens[len(prompt) :]
