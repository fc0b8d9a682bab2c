"""Writes tests/data/megatron-fixtures: tiny checkpoints saved by Megatron-LM's own code.

Needs megatron-core 0.16.1 and Megatron-LM's training package (not a test dependency; run by
hand when the fixtures are regenerated):

    PYTHONPATH=<Megatron-LM checkout at core_v0.16.1> python tests/tools/make_megatron_fixtures.py [OUT] [NAME...]

Each fixture is one run of Megatron's own model, optimizer and scheduler builders
(megatron.training.training.setup_model_and_optimizer), three real Adam steps through its
forward-backward schedule and optimizer, then megatron.training.checkpointing.save_checkpoint.
Beside the checkpoint, fixture.json records the batches of the next two steps and Megatron's
losses on them: the loss of step 4 (the saved weights) and of step 5 (after one more Adam step,
which reads the saved moments). Runs of two processes are launched with torchrun (Gloo, CPU).

Megatron's training code assumes CUDA in a few places; `cpu_shims` stands in for them (a triton
stub for an import, CUDA RNG calls on the CPU generator, module.cuda() as a no-op). None of
them changes the arithmetic of the model or the optimizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

VOCAB, SEQ, MICRO = 63, 32, 2  # NullTokenizer adds one token: 64, no padding
COMMON = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--ffn-hidden-size", "64",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
    "--micro-batch-size", str(MICRO), "--vocab-size", str(VOCAB),
    "--make-vocab-size-divisible-by", "32", "--tokenizer-type", "NullTokenizer",
    "--train-iters", "10", "--lr", "0.01", "--min-lr", "0.001", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta2", "0.95",
    "--clip-grad", "0.0", "--seed", "1234", "--init-method-std", "0.05",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-rope-fusion", "--no-persist-layer-norm", "--use-cpu-initialization",
    "--distributed-backend", "gloo", "--no-check-for-nan-in-loss-and-grad", "--save-interval", "3", "--eval-iters", "0",
]  # fmt: skip
LLAMA = [
    "--normalization", "RMSNorm", "--swiglu", "--no-bias-swiglu-fusion", "--ffn-hidden-size", "32",
    "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
]  # fmt: skip
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.0",
       "--moe-router-load-balancing-type", "none"]  # fmt: skip
MTP = ["--mtp-num-layers", "1"]
DISTOPT = ["--use-distributed-optimizer"]
TP2 = ["--tensor-model-parallel-size", "2"]
# name -> (processes, extra flags)
FIXTURES = {
    "gpt2_tp1_torch": (1, ["--ckpt-format", "torch"]),
    "gpt2_tp1_torch_dist": (1, ["--ckpt-format", "torch_dist"]),
    "gpt2_dp2_distopt_torch": (2, ["--ckpt-format", "torch", *DISTOPT]),
    "gpt2_dp2_distopt_torch_dist": (2, ["--ckpt-format", "torch_dist", *DISTOPT]),
    "llama_tp2_torch": (2, [*LLAMA, "--ckpt-format", "torch", *TP2]),
    "llama_tp2_torch_dist": (2, [*LLAMA, "--ckpt-format", "torch_dist", *TP2]),
    "llama_tp2_distopt_torch": (2, [*LLAMA, "--ckpt-format", "torch", *TP2, *DISTOPT]),
    "llama_tp2_distopt_torch_dist": (2, [*LLAMA, "--ckpt-format", "torch_dist", *TP2, *DISTOPT]),
    "mtp_tp1_torch_dist": (1, [*LLAMA, *MTP, "--ckpt-format", "torch_dist"]),
    "moe_tp1_torch": (1, [*LLAMA, *MOE, "--ckpt-format", "torch"]),
    "moe_tp1_torch_dist": (1, [*LLAMA, *MOE, "--ckpt-format", "torch_dist"]),
}  # fmt: skip


# ---- CPU stand-ins ------------------------------------------------------------------------------
class _Stream:
    def wait_stream(self, other):
        return None

    def synchronize(self):
        return None

    def record_event(self):
        return self  # an event: synchronize() only


_STREAM = _Stream()  # one stream, as on a CPU: "another stream" checks see the same one


def _on_cpu(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaToCpu(TorchFunctionMode):
    """Tensors Megatron creates or moves with device="cuda" stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _on_cpu(v) if k == "device" else v for k, v in (kwargs or {}).items()}
        args = tuple(_on_cpu(a) for a in args)
        return func(*args, **kwargs)


def _refuse(*args, **kwargs):
    raise RuntimeError("batch-invariant mode needs triton")


def cpu_shims() -> None:
    """Stand-ins for the CUDA calls Megatron's training code makes on the way (see the doc)."""
    # batch-invariant kernels are triton-only (import-time); this run never enables them
    kernels = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    kernels.enable_batch_invariant_mode = _refuse
    sys.modules.setdefault(kernels.__name__, kernels)
    cuda = torch.cuda
    cuda.is_available = lambda: True  # initialize_megatron asserts it
    cuda.device_count = lambda: 1
    cuda.set_device = lambda device: None
    cuda.current_device = lambda: "cpu"
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": None
    cuda.manual_seed = lambda seed: None
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.Stream = lambda *a, **k: _STREAM
    cuda.current_stream = lambda device=None: _STREAM
    cuda.stream = lambda s: contextlib.nullcontext()
    torch.nn.Module.cuda = lambda self, device=None: self
    tensor_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):  # the distributed optimizer checks the type name
        if args or kwargs:
            return tensor_type(self, *args, **kwargs)
        name = tensor_type(self)  # (through _CudaToCpu this runs twice)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name
    import megatron.core.tensor_parallel.random as tp_random  # (after the stubs above)

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    _CudaToCpu().__enter__()  # for the whole run
    torch.Tensor.cuda = lambda self, *a, **k: self


# ---- one run ------------------------------------------------------------------------------------
def _batch(step: int, rows: int) -> torch.Tensor:
    """The tokens of a step's global batch: [rows, SEQ + 1], the same for every run."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    output = model(inputs, position_ids, mask, labels=labels)
    loss_mask = torch.ones_like(labels, dtype=torch.float)

    def loss_func(per_token):
        loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def _train_step(model, optimizer, scheduler, step: int, args) -> float:
    """One Megatron training step on this dp rank's part of the step's batch; the global loss."""
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows = args.global_batch_size
    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = _batch(step, rows).chunk(dp)[rank].split(MICRO)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iter(mine), model=model,
        num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MICRO,
        forward_only=False,
    )  # fmt: skip
    ok, _, _ = optimizer.step()
    assert ok, "Megatron's optimizer step failed"
    scheduler.step(increment=rows)
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(loss, group=mpu.get_data_parallel_group())
    return float(loss) / dp


def _eval_loss(model, step: int, args) -> float:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine = _batch(step, args.global_batch_size).chunk(dp)[rank].split(MICRO)
    with torch.no_grad():
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(mine), model=model,
            num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MICRO,
            forward_only=True,
        )  # fmt: skip
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    torch.distributed.all_reduce(loss, group=mpu.get_data_parallel_group())
    return float(loss) / dp


def _setup(argv: list[str]):
    """Megatron's args, process groups, model, optimizer and scheduler for `argv`."""
    cpu_shims()
    sys.argv = ["make_megatron_fixtures", *argv]
    import megatron.training.initialize as init
    from gpt_builders import gpt_builder
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.training import setup_model_and_optimizer
    from model_provider import model_provider

    init._compile_dependencies = lambda: None  # C++ dataset helpers and CUDA kernels: unused here
    import megatron.training.arguments as arguments

    arguments.get_device_arch_version = lambda: 10  # no GPU to ask; 10: no CUDA connection rule
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None  # unset without Transformer Engine (the router's torch path)
    init.initialize_megatron()
    args = get_args()
    model, optimizer, scheduler = setup_model_and_optimizer(
        partial(model_provider, gpt_builder), ModelType.encoder_or_decoder
    )
    return args, model, optimizer, scheduler


def run_fixture(out: Path, argv: list[str]) -> None:
    """Three Adam steps, save, then the next two steps' losses into fixture.json."""
    args, model, optimizer, scheduler = _setup([*argv, "--save", str(out)])
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import save_checkpoint

    config = get_model_config(model[0])  # as megatron.training.training.train sets it
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads

    train_losses = [_train_step(model, optimizer, scheduler, step, args) for step in (1, 2, 3)]
    args.consumed_train_samples = 3 * args.global_batch_size
    save_checkpoint(3, model, optimizer, scheduler, 0)
    loss4 = _eval_loss(model, 4, args)
    step4 = _train_step(model, optimizer, scheduler, 4, args)
    loss5 = _eval_loss(model, 5, args)
    if torch.distributed.get_rank() == 0:
        record = {
            "megatron_flags": argv,
            "iteration": 3,
            "train_losses": train_losses,
            "next_loss": loss4,
            "next_train_loss": step4,
            "loss_after_next_step": loss5,
            "batch_step4": _batch(4, args.global_batch_size).tolist(),
            "batch_step5": _batch(5, args.global_batch_size).tolist(),
            "padded_vocab_size": args.padded_vocab_size,
        }
        (out / "fixture.json").write_text(json.dumps(record, indent=1) + "\n")
    torch.distributed.barrier()


def _logits(model, step: int, args) -> torch.Tensor:
    """Megatron's logits on this dp rank's rows of the step's batch (its tp shard of the
    vocabulary): every output-layer call of the forward, so an MTP block's heads too."""
    from megatron.core import parallel_state as mpu

    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    rows = _batch(step, args.global_batch_size).chunk(dp)[rank]
    mine, labels = rows[:, :-1], rows[:, 1:]
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(mine)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    head = next(m for n, m in model[0].named_modules() if n.endswith("output_layer"))
    seen: list[torch.Tensor] = []
    hook = head.register_forward_hook(lambda module, inputs, out: seen.append(out[0].float()))
    with torch.no_grad():  # labels: Megatron's MTP block needs them (the loss is not kept)
        model[0](mine, position_ids, mask, labels=labels)
    hook.remove()
    return torch.cat([x.flatten() for x in seen])


def _reference_logits(model, optimizer, scheduler, args, reference: Path) -> torch.Tensor:
    """The logits of the fixture's own checkpoint (weights only, in its own format)."""
    from megatron.training.checkpointing import load_checkpoint

    args.fixture_reference = str(reference)
    kept = args.finetune, args.ckpt_format
    dist = (next(reference.glob("iter_*")) / "metadata.json").is_file()
    args.finetune, args.ckpt_format = True, "torch_dist" if dist else "torch"
    load_checkpoint(model, optimizer, scheduler, load_arg="fixture_reference", strict=True)
    args.finetune, args.ckpt_format = kept
    return _logits(model, 4, args)


def _refuse_lenient_loads() -> None:
    """Megatron's load_checkpoint retries a failed strict load with strict=False and only prints
    (load_model_state_dict): here that retry fails the check instead."""
    load = torch.nn.Module.load_state_dict

    def strict_only(self, state_dict, strict=True, assign=False):
        assert strict, "Megatron's strict load failed; it retried with strict=False"
        return load(self, state_dict, strict=strict, assign=assign)

    torch.nn.Module.load_state_dict = strict_only


def verify_load(directory: Path, argv: list[str], expected: float, reference: Path) -> None:
    """Megatron's own load_checkpoint (strict; weights only) of `directory` (e.g. written by
    `gigatron convert --to megatron`): its loss on batch 4 must be `expected` and its logits
    those of the fixture's own checkpoint `reference`, both within 1e-5."""
    resume = os.environ.get("FIXTURE_RESUME") == "1"  # a gigatron save: its args read too
    weights = [] if resume else ["--finetune"]
    flags = [*argv, "--load", str(directory), *weights, "--no-load-optim", "--no-load-rng"]
    args, model, optimizer, scheduler = _setup(flags)
    from megatron.training.checkpointing import load_checkpoint

    _refuse_lenient_loads()
    iteration, _ = load_checkpoint(model, optimizer, scheduler, strict=True)
    if resume:  # Megatron checked gigatron's saved args (check_checkpoint_args) and resumes
        assert iteration == 3, f"iteration {iteration}"
        print(f"resumed at iteration {iteration}, consumed samples {args.consumed_train_samples}")
    loss, logits = _eval_loss(model, 4, args), _logits(model, 4, args)
    # loaded second: a tensor `directory` lacked would keep its random start above, not this
    wanted = _reference_logits(model, optimizer, scheduler, args, reference)
    gap = (logits - wanted).abs().max()
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    assert abs(loss - expected) < 1e-5, f"Megatron's loss {loss}, expected {expected}"
    assert float(gap) < 1e-5, f"logits differ from the fixture's by up to {float(gap)}"
    if torch.distributed.get_rank() == 0:
        print(f"verified: Megatron loaded {directory} strictly; loss {loss} (expected "
              f"{expected}); {logits.numel()} logits per rank, largest gap {float(gap)}")  # fmt: skip


def _launch(procs: int, env: dict[str, str], port: int) -> None:
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}",
           "--master-port", str(port), __file__]  # fmt: skip
    subprocess.run(cmd, env=env, check=True)


def verify(fixtures: Path, name: str, directory: Path, resume: bool = False) -> None:
    """`--verify NAME DIR [--resume]`: DIR (a conversion of fixture NAME) loads in Megatron with
    its loss; `--resume`: without --finetune (Megatron reads the saved args and iteration)."""
    record = json.loads((fixtures / name / "fixture.json").read_text())
    fmt = "torch_dist" if (next(directory.glob("iter_*")) / "metadata.json").is_file() else "torch"
    env = dict(os.environ, FIXTURE_VERIFY=str(directory), FIXTURE_EXPECTED=str(record["next_loss"]))
    env["FIXTURE_ARGV"] = json.dumps([*record["megatron_flags"], "--ckpt-format", fmt])
    env["FIXTURE_RESUME"] = "1" if resume else "0"
    env["FIXTURE_REFERENCE"] = str((fixtures / name).resolve())
    _launch(FIXTURES[name][0], env, 29700)


def main() -> None:
    if os.environ.get("FIXTURE_VERIFY"):
        argv = json.loads(os.environ["FIXTURE_ARGV"])
        expected, reference = float(os.environ["FIXTURE_EXPECTED"]), os.environ["FIXTURE_REFERENCE"]
        verify_load(Path(os.environ["FIXTURE_VERIFY"]), argv, expected, Path(reference))
        return
    if os.environ.get("FIXTURE_ARGV"):
        run_fixture(Path(os.environ["FIXTURE_OUT"]), json.loads(os.environ["FIXTURE_ARGV"]))
        return
    if sys.argv[1:2] == ["--verify"]:
        resume = sys.argv[4:5] == ["--resume"]
        verify(Path("tests/data/megatron-fixtures"), sys.argv[2], Path(sys.argv[3]), resume)
        return
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/data/megatron-fixtures")
    names = sys.argv[2:] or list(FIXTURES)
    for name in names:
        procs, flags = FIXTURES[name]
        argv = [
            *COMMON,
            *flags,
            "--global-batch-size",
            str(MICRO * (procs if "dp2" in name else 1)),
        ]
        env = dict(os.environ, FIXTURE_ARGV=json.dumps(argv), FIXTURE_OUT=str(root / name))
        print("==", name, flush=True)
        _launch(procs, env, 29600 + len(name))


if __name__ == "__main__":
    main()
