"""Pipeline parallelism on Gloo: 1F1B and interleaved 1F1B train the GPT exactly like one
process (same losses for 10 iterations, same final weights), alone and with tensor parallelism.

The single-process reference runs in the test process; the spawned ranks compare against it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from gigatron.config import parse_config
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.pipeline_stage import ChunkWrapper
from gigatron.parallel.schedules import (
    ScheduleConfig,
    ScheduleObserver,
    forward_backward,
    pipeline_schedule_order,
)

pytestmark = pytest.mark.distributed

VOCAB, SEQ, MICRO_BATCH, MICROBATCHES, ITERATIONS, LR = 64, 16, 2, 4, 10, 1e-2
# Adam divides by the gradient's running RMS: with the default eps (1e-8) a gradient that is
# zero in exact arithmetic (e.g. the key bias) but 1e-10 in float32 would take full-size steps
# in a direction set by rounding noise. A larger eps keeps the comparison about real gradients.
ADAM_EPS = 1e-4
BASE_FLAGS = (
    f"--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
    f"--max-position-embeddings {SEQ} --micro-batch-size {MICRO_BATCH} "
    f"--global-batch-size {MICRO_BATCH * MICROBATCHES} --attention-dropout 0 --hidden-dropout 0 "
    f"--make-vocab-size-divisible-by 1 --vocab-size {VOCAB}"
).split()

# Hand-written orders for pp = 2, m = 4 (see tests/unit/test_schedule_order.py).
EXPECTED_PP2_ORDER = {
    (1, 0): "F00 F01 B00 F02 B01 F03 B02 B03",
    (1, 1): "F00 B00 F01 B01 F02 B02 F03 B03",
    (2, 0): "F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 B01 B12 B13 B02 B03",
    (2, 1): "F00 F01 F10 B10 F11 B11 F02 B00 F03 B01 F12 B12 F13 B13 B02 B03",
}


def microbatches(iteration: int) -> list[dict[str, torch.Tensor]]:
    """The iteration's micro-batches, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + iteration)
    # Learnable sequences: each token determines the next (a fixed bigram rule).
    start = torch.randint(0, VOCAB, (MICROBATCHES, MICRO_BATCH, 1), generator=generator)
    steps = torch.arange(SEQ + 1)
    data = (start * 5**steps + 3 * (5**steps - 1) // 4) % VOCAB
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return [{"tokens": d[:, :-1], "labels": d[:, 1:], "position_ids": positions} for d in data]


def forward_step(data_iterator, chunk):
    batch = next(data_iterator)
    output = chunk(batch["tokens"], batch["position_ids"])

    def loss_fn(logits):
        per_token_loss = token_losses(logits, batch["labels"], getattr(chunk, "module", chunk).pctx)
        loss_sum = per_token_loss.float().sum()
        num_tokens = torch.tensor(float(per_token_loss.numel()))
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach(), "tokens": num_tokens}

    return output, loss_fn


def iteration_loss(reports) -> float:
    return (sum(r["loss_sum"] for r in reports) / sum(r["tokens"] for r in reports)).item()


def schedule_config(cfg) -> ScheduleConfig:
    return ScheduleConfig(
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.training.micro_batch_size,
        hidden_size=cfg.model.hidden_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )


class Trace(ScheduleObserver):
    """The steps ("F" | "B", chunk, micro-batch) of a pass, in execution order, and its timings."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int]] = []
        self.timings: list[tuple[float, float]] = []

    def on_step(self, kind: str, chunk: int, microbatch: int) -> None:
        self.steps.append((kind, chunk, microbatch))

    def on_pass_end(self, compute_s: float, recv_wait_s: float) -> None:
        self.timings.append((compute_s, recv_wait_s))


def reference_run(
    flags=BASE_FLAGS, batches=None, iterations=ITERATIONS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final weights of the same training in one process without pipelining
    (`batches(iteration)`: the micro-batches of an iteration; default `microbatches`)."""
    batches = batches or microbatches
    cfg = parse_config(flags, world_size=1)
    pctx = ParallelContext.single()
    torch.manual_seed(0)
    (model,) = build_model(cfg, pctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for iteration in range(iterations):
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step, iter(batches(iteration)), [model], len(batches(iteration)), pctx,
            schedule_config(cfg),
        )  # fmt: skip
        losses.append(iteration_loss(reports))
        optimizer.step()
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


class SyncRecorder(ChunkWrapper):
    """A DDP stand-in: records, for every backward through the chunk, whether it ran outside
    no_sync() (gradient reduction enabled); the schedule reaches the stage through `.module`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.syncing = True
        self.sync_events: list[bool] = []
        first_param = next(module.parameters())
        first_param.register_hook(lambda grad: self.sync_events.append(self.syncing) or grad)

    @contextlib.contextmanager
    def no_sync(self):
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def expected_shard(full: torch.Tensor, param: torch.nn.Parameter, pctx: ParallelContext):
    """This rank's slice of a full reference weight (tensor-parallel partitioning)."""
    if not getattr(param, "tensor_model_parallel", False) or pctx.tp_size == 1:
        return full
    stride = getattr(param, "partition_stride", 1)
    pieces = full.chunk(stride * pctx.tp_size, dim=param.partition_dim)
    return torch.cat(
        [pieces[s * pctx.tp_size + pctx.tp_rank] for s in range(stride)], dim=param.partition_dim
    )


def run_layout(tp: int, pp: int, vp: int, reference, sequence_parallel: bool = False) -> None:
    ref_losses, ref_weights = reference
    flags = [*BASE_FLAGS, "--tensor-model-parallel-size", str(tp)]
    flags += ["--pipeline-model-parallel-size", str(pp)]
    if vp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(vp)]
    if sequence_parallel:
        flags += ["--sequence-parallel"]
    cfg = parse_config(flags, world_size=tp * pp)
    pctx = ParallelContext.from_sizes(tp=tp, pp=pp)
    chunks = [SyncRecorder(chunk) for chunk in build_model(cfg, pctx)]
    assert len(chunks) == vp
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.Adam(params, lr=LR, eps=ADAM_EPS)
    where = f"tp={tp} pp={pp} vp={vp} sp={sequence_parallel} rank {pctx.rank}"

    # Outputs sent to the next stage are freed as soon as they are sent.
    sent_outputs = []

    def recording_forward_step(data_iterator, chunk):
        output, loss_fn = forward_step(data_iterator, chunk)
        if not chunk.module.post_process:
            sent_outputs.append(output)
        return output, loss_fn

    # Forward only first: the reference's first loss, no gradients, no backward steps.
    trace = Trace()
    with torch.no_grad():
        reports = forward_backward(
            recording_forward_step, iter(microbatches(0)), chunks, MICROBATCHES, pctx,
            schedule_config(cfg), forward_only=True, observer=trace,
        )  # fmt: skip
    forward_order = pipeline_schedule_order(pp, pctx.pp_rank, MICROBATCHES, vp, forward_only=True)
    assert trace.steps == forward_order, where
    assert len(trace.timings) == 1 and min(trace.timings[0]) >= 0, where
    assert all(p.grad is None for p in params), where
    if pctx.is_pipeline_last_stage():
        assert iteration_loss(reports) == pytest.approx(ref_losses[0], rel=1e-5), where
    else:
        assert reports == [], where

    losses = []
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        trace = Trace()
        sent_outputs.clear()
        reports = forward_backward(
            recording_forward_step, iter(microbatches(iteration)), chunks, MICROBATCHES, pctx,
            schedule_config(cfg), observer=trace,
        )  # fmt: skip
        assert trace.steps == pipeline_schedule_order(pp, pctx.pp_rank, MICROBATCHES, vp), where
        if pp == 2 and iteration == 0:
            expected = [
                (t[0], int(t[1]), int(t[2])) for t in EXPECTED_PP2_ORDER[(vp, pctx.pp_rank)].split()
            ]
            assert trace.steps == expected, where
        if not all(chunk.module.post_process for chunk in chunks):
            assert len(sent_outputs) == MICROBATCHES * (vp - chunks[-1].module.post_process)
            assert all(out.numel() == 1 for out in sent_outputs), where
        finalize_model_grads(chunks, pctx)
        optimizer.step()
        if pctx.is_pipeline_last_stage():
            assert len(reports) == MICROBATCHES
            losses.append(iteration_loss(reports))

    # Gradient reduction ran exactly once per chunk and iteration: on its last micro-batch.
    for chunk in chunks:
        assert chunk.sync_events == ([False] * (MICROBATCHES - 1) + [True]) * ITERATIONS, where

    if pctx.is_pipeline_last_stage():
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
        assert losses[-1] < losses[0] - 0.3, "the model learns"
    checked = 0
    for chunk in chunks:
        for name, param in chunk.module.named_parameters():
            if getattr(param, "shared_embedding", False):
                # The tied output weight on the last stage is the word embedding of stage 0;
                # equal to the reference only if finalize_model_grads summed both gradients.
                name = "embedding.word_embeddings.weight"
            expected = expected_shard(ref_weights[name], param, pctx)
            torch.testing.assert_close(
                param.detach(),
                expected,
                rtol=1e-4,
                atol=1e-5,
                msg=lambda text, where=where, name=name: f"{where} {name}: {text}",
            )
            checked += 1
    assert checked > 0
    if pctx.is_pipeline_last_stage() and pp > 1:
        assert any(getattr(p, "shared_embedding", False) for p in params), "tied output weight"


def _run_layouts(rank: int, world_size: int, layouts, reference) -> None:
    for layout in layouts:
        run_layout(*layout[:3], reference, *layout[3:])


@pytest.fixture(scope="module")
def reference():
    return reference_run()


def test_pipeline_two_stages_1f1b_and_interleaved(reference):
    run_distributed(_run_layouts, 2, [(1, 2, 1), (1, 2, 2)], reference)


def test_pipeline_four_stages_and_with_tensor_and_sequence_parallel(reference):
    # The last layout also shards the sequence over tp: stages exchange [seq / tp, b, h].
    layouts = [(1, 4, 1), (1, 4, 2), (2, 2, 1), (2, 2, 2, True)]
    run_distributed(_run_layouts, 4, layouts, reference)
