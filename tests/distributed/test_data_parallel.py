"""Data parallelism (DistributedDataParallel + the plain optimizer) against one process.

Every case trains the tiny GPT (2 layers, hidden 64, seq 16, vocab 64) for 10 iterations on a
deterministic synthetic global batch, each data-parallel rank taking its slice, through the real
schedule (`forward_backward`), `finalize_model_grads` and `build_optimizer`; the loss and grad-norm
trajectory must equal the single-process run on the whole batch.

The harness here is shared with test_distributed_optimizer.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import pytest
import torch

from gigatron.config.root import GigatronConfig
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import ScheduleConfig, forward_backward

VOCAB, SEQ, HIDDEN = 64, 16, 64
GLOBAL_BATCH, MICRO_BATCH = 8, 2
ITERATIONS = 10
BUCKET = 20_000  # elements: the 109k-parameter model splits into several buckets
# fp16 runs: on these iterations the loss of the last global sample is multiplied by 1e30 (its
# fp16 gradients overflow) -- on the last data-parallel rank only, so the found-inf flag must
# travel to every rank for all of them to skip the step.
POISONED = (2, 6)
POISONED_SAMPLE = GLOBAL_BATCH - 1

pytestmark = pytest.mark.distributed


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tp: int = 1
    precision: str = "fp32"  # fp32 | bf16 | fp16
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None


def make_config(case: Case, seed: int = 1234) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, HIDDEN, 4
    m.seq_length = m.max_position_embeddings = SEQ
    m.hidden_dropout = m.attention_dropout = 0.0
    m.padded_vocab_size = VOCAB  # the same vocabulary whatever tp (no tp-dependent padding)
    p = cfg.parallel
    p.tensor_model_parallel_size = case.tp
    p.use_distributed_optimizer = case.distributed_optimizer
    p.overlap_grad_reduce = case.overlap_grad_reduce
    p.overlap_param_gather = case.overlap_param_gather
    p.ddp_bucket_size = case.bucket_size
    t = cfg.training
    t.seed = seed
    t.micro_batch_size, t.global_batch_size = MICRO_BATCH, GLOBAL_BATCH
    t.bf16 = case.precision == "bf16"
    t.fp16 = case.precision == "fp16"
    # fp16: a dynamic scale that backs off at the first overflow; overflows are injected on the
    # POISONED iterations (see train_steps), so both runs must skip exactly those.
    t.initial_loss_scale = 2.0**12
    t.hysteresis = 1
    cfg.optimizer.lr = 3e-3
    cfg.optimizer.clip_grad = 0.5  # small enough to clip: exercises the global norm
    return cfg


def global_batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + iteration)
    # A learnable pattern (each token predicts the next of a shifted ramp) plus noise tokens.
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    text = (start + torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(text.shape, generator=g) < 0.2
    text = torch.where(noise, torch.randint(0, VOCAB, text.shape, generator=g), text)
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


def grad_dtype_for(case: Case) -> torch.dtype:
    # fp16/bf16 parameters accumulate and reduce their gradients in fp32 here.
    return torch.float32


def build(case: Case, pctx: ParallelContext, use_ddp: bool, seed: int = 1234):
    cfg = make_config(case, seed)
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = (
        DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=grad_dtype_for(case))
        if use_ddp
        else model
    )
    optimizer = build_optimizer(cfg, [chunk], pctx)
    return cfg, chunk, optimizer


def train_steps(
    chunk, optimizer, pctx: ParallelContext, iterations: range, use_ddp: bool
) -> list[list[float]]:
    """[loss, grad_norm, success, loss_scale] per iteration (global loss over all ranks)."""
    dp = pctx.size("dp_cp")
    rank = pctx.rank_in("dp_cp")
    local = GLOBAL_BATCH // dp
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    schedule_cfg = ScheduleConfig(
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        hidden_size=HIDDEN,
        grad_scale_func=optimizer.scale_loss,
    )

    def forward_step(data_iterator, model):
        tokens, labels, poisoned = next(data_iterator)
        output = token_losses(model(tokens, positions, None), labels, pctx)

        def loss_fn(per_token_loss):
            loss_sum = per_token_loss.float().sum()
            report = {"loss_sum": loss_sum.detach()}
            if poisoned:
                loss_sum = loss_sum * 1e30
            return loss_sum, torch.tensor(float(labels.numel())), report

        return output, loss_fn

    fp16 = optimizer.cfg.training.fp16
    records = []
    for iteration in iterations:
        tokens, labels = global_batch(iteration)
        tokens, labels = (
            tokens[rank * local : (rank + 1) * local],
            labels[rank * local : (rank + 1) * local],
        )
        poison = fp16 and iteration in POISONED
        micro = [
            (
                tokens[i : i + MICRO_BATCH],
                labels[i : i + MICRO_BATCH],
                poison and rank * local + i <= POISONED_SAMPLE < rank * local + i + MICRO_BATCH,
            )
            for i in range(0, local, MICRO_BATCH)
        ]
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step, iter(micro), [chunk], len(micro), pctx, schedule_cfg
        )
        if use_ddp:
            finalize_model_grads([chunk], pctx)
        success, grad_norm, _ = optimizer.step()
        loss = torch.stack([r["loss_sum"] for r in reports]).sum().reshape(1)
        pctx.all_reduce(loss, "dp_cp")
        records.append(
            [
                float(loss) / (GLOBAL_BATCH * SEQ),
                math.nan if grad_norm is None else grad_norm,
                float(success),
                float(optimizer.get_loss_scale()),
            ]
        )
    return records


def reference(case: Case) -> torch.Tensor:
    """The single-process run: tp = 1, no DDP wrapper, the whole batch."""
    return _reference(case.precision).clone()


@functools.cache
def _reference(precision: str) -> torch.Tensor:
    single = Case("reference", precision=precision)
    pctx = ParallelContext.single()
    _, chunk, optimizer = build(single, pctx, use_ddp=False)
    return torch.tensor(train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=False))


def run_cases(rank: int, world_size: int, cases: list[Case], out_dir: str) -> None:
    """Spawned entry: run every case on this world, rank 0 saves the trajectories."""
    results = {}
    for case in cases:
        pctx = ParallelContext.from_sizes(tp=case.tp)
        _, chunk, optimizer = build(case, pctx, use_ddp=True)
        records = train_steps(chunk, optimizer, pctx, range(ITERATIONS), use_ddp=True)
        check_buckets(case, chunk)
        results[case.name] = torch.tensor(records)
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def check_buckets(case: Case, chunk: DistributedDataParallel) -> None:
    """Each bucket was reduced once per iteration, never before all its gradients were ready;
    with --overlap-param-gather the last step's all-gathers are still in flight."""
    for bucket in chunk.buckets:
        assert bucket.num_reductions == ITERATIONS, (case.name, bucket.index)
        assert bucket.ready_counts_at_launch == [len(bucket.params)] * ITERATIONS, case.name
    if case.overlap_grad_reduce:
        assert len(chunk.buckets) > 1, case.name
    if case.overlap_param_gather and chunk.pctx.size("dp_cp") > 1:
        assert any(b.gather_handle is not None for b in chunk.buckets), case.name
        chunk.finish_param_sync()


def check_trajectory(name: str, got: torch.Tensor, want: torch.Tensor, precision: str) -> None:
    """Same skipped steps and loss scales exactly; losses and norms within the precision's
    tolerance (fp32: summation-order differences only)."""
    assert torch.equal(got[:, 2], want[:, 2]), f"{name}: skipped steps differ"
    assert torch.equal(got[:, 3], want[:, 3]), f"{name}: loss scales differ"
    tol = {"fp32": 2e-5, "bf16": 2e-2, "fp16": 5e-3}[precision]
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=tol, atol=tol, msg=f"{name}: loss")
    torch.testing.assert_close(
        got[:, 1], want[:, 1], rtol=tol * 10, atol=tol, equal_nan=True, msg=f"{name}: grad norm"
    )


def run_and_compare(world_size: int, cases: list[Case], tmp_path: Path) -> None:
    run_distributed(run_cases, world_size, cases, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=True)
    references: dict[tuple, torch.Tensor] = {}
    for case in cases:
        want = references.setdefault(case.precision, reference(case))
        check_trajectory(case.name, results[case.name], want, case.precision)


def _learned(trajectory: torch.Tensor) -> bool:
    return float(trajectory[-1, 0]) < float(trajectory[0, 0]) - 0.05


# ---- tests --------------------------------------------------------------------------------
def test_reference_learns_and_fp16_skips_some_steps():
    """The references are meaningful: the loss falls, the norm clips, fp16 skips a few steps."""
    fp32 = reference(Case("fp32"))
    assert _learned(fp32)
    assert (fp32[:, 1] > 0.5).any(), "clipping never active"
    fp16 = reference(Case("fp16", precision="fp16"))
    skipped = [i for i in range(ITERATIONS) if fp16[i, 2] == 0]
    assert skipped == list(POISONED), fp16
    assert float(fp16[-1, 3]) == 2.0**12 / 4  # halved at each overflow


def test_dp2_plain_optimizer_with_and_without_overlap(tmp_path):
    cases = [
        Case("dp2"),
        Case("dp2_overlap", overlap_grad_reduce=True, bucket_size=BUCKET),
        Case("dp2_fp16_overlap", precision="fp16", overlap_grad_reduce=True, bucket_size=BUCKET),
    ]
    run_and_compare(2, cases, tmp_path)


def test_world4_dp4_and_tp2_dp2_plain_and_distributed_optimizer(tmp_path):
    """One spawn of 4 processes for every world-4 case (process start-up dominates on CPU)."""
    distributed = {"distributed_optimizer": True}
    overlap_all = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_size": BUCKET}
    cases = [
        Case("dp4_overlap", overlap_grad_reduce=True, bucket_size=BUCKET),
        Case("dp4_distopt", **distributed),
        Case("dp4_distopt_overlap", **distributed, **overlap_all),
        Case("tp2_dp2", tp=2),
        Case("tp2_dp2_overlap", tp=2, overlap_grad_reduce=True, bucket_size=BUCKET),
        Case("tp2_dp2_distopt_overlap", tp=2, **distributed, **overlap_all),
    ]
    run_and_compare(4, cases, tmp_path)
