"""A hybrid Mamba-Transformer stack with all three layer kinds (`M*-M-M*-`) trains like one
process under tensor + sequence parallelism with data parallelism, pipeline with data
parallelism, and tensor + sequence + pipeline parallelism, every layout with the distributed
optimizer: the same loss and grad-norm trajectories for several iterations.

Every layout runs in one spawn of 4 processes; the single-process reference runs here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gigatron.config import parse_config
from gigatron.families.gpt import token_losses
from gigatron.models.hybrid import build_model
from gigatron.optim import build_optimizer
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.schedules import ScheduleConfig, forward_backward

pytestmark = pytest.mark.distributed

PATTERN = "M*-M-M*-"  # 8 layers: a pipeline split gives each stage every kind but one or two
VOCAB, SEQ, HIDDEN, MICRO_BATCH, GLOBAL_BATCH, ITERATIONS = 64, 16, 32, 2, 8, 6
# (name, tp, pp, sequence parallel, distributed optimizer); dp = 4 / (tp * pp)
LAYOUTS = [
    ("tp2_sp_dp2_distopt", 2, 1, True, True),
    ("pp2_dp2_distopt", 1, 2, False, True),
    ("tp2_sp_pp2_distopt", 2, 2, True, True),
]


def make_config(tp: int, pp: int, sequence_parallel: bool, distributed_optimizer: bool):
    flags = (
        f"--hybrid-layer-pattern {PATTERN} --hidden-size {HIDDEN} --num-attention-heads 4 "
        "--mamba-state-dim 8 --mamba-head-dim 8 --mamba-num-groups 2 "
        f"--seq-length {SEQ} --micro-batch-size {MICRO_BATCH} --global-batch-size {GLOBAL_BATCH} "
        f"--padded-vocab-size {VOCAB} --normalization RMSNorm --position-embedding-type rope "
        "--swiglu --disable-bias-linear --untie-embeddings-and-output-weights "
        "--hidden-dropout 0 --attention-dropout 0 --lr 3e-3 --clip-grad 0.5 "
        f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}"
    ).split()
    if sequence_parallel:
        flags.append("--sequence-parallel")
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    return parse_config(flags)


def global_batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + iteration)
    # Learnable (each token is the previous plus 3) with some noise tokens.
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    text = (start + 3 * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(text.shape, generator=g) < 0.2
    text = torch.where(noise, torch.randint(0, VOCAB, text.shape, generator=g), text)
    return text[:, :-1], text[:, 1:]


def train(pctx: ParallelContext, layout=(1, 1, False, False)) -> torch.Tensor:
    """[loss, grad_norm] per iteration (global, on every rank)."""
    cfg = make_config(*layout)
    (model,) = build_model(cfg, pctx, vocab_size=VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel, grad_dtype=torch.float32)
    optimizer = build_optimizer(cfg, [chunk], pctx)
    schedule = ScheduleConfig(
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        hidden_size=HIDDEN,
        sequence_parallel=cfg.parallel.sequence_parallel,
        grad_scale_func=optimizer.scale_loss,
    )
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    dp, dp_rank = pctx.size("dp"), pctx.rank_in("dp")
    local = GLOBAL_BATCH // dp

    def forward_step(data_iterator, module):
        tokens, labels = next(data_iterator)

        def loss_fn(logits):
            loss_sum = token_losses(logits, labels, pctx).sum()
            return loss_sum, torch.tensor(float(labels.numel())), {"loss": loss_sum.detach()}

        return module(tokens, positions, None), loss_fn

    records = []
    for iteration in range(ITERATIONS):
        tokens, labels = (
            t[dp_rank * local : (dp_rank + 1) * local] for t in global_batch(iteration)
        )
        micro = [
            (tokens[i : i + MICRO_BATCH], labels[i : i + MICRO_BATCH])
            for i in range(0, local, MICRO_BATCH)
        ]
        optimizer.zero_grad()
        reports = forward_backward(forward_step, iter(micro), [chunk], len(micro), pctx, schedule)
        finalize_model_grads([chunk], pctx)
        _, grad_norm, _ = optimizer.step()
        loss = torch.stack([r["loss"] for r in reports]).sum() if reports else torch.zeros(())
        loss = loss.reshape(1).clone()
        for group in ("dp", "pp"):  # only the last stage holds losses
            if pctx.size(group) > 1:
                dist.all_reduce(loss, group=pctx.group(group))
        records.append([float(loss) / (GLOBAL_BATCH * SEQ), grad_norm or math.nan])
    return torch.tensor(records)


def run_layouts(rank: int, world_size: int, out_dir: str) -> None:
    for name, tp, pp, sp, distopt in LAYOUTS:
        pctx = ParallelContext.from_sizes(tp=tp, pp=pp)
        trajectory = train(pctx, (tp, pp, sp, distopt))
        if pctx.rank == 0:  # every rank holds the global losses and norms
            torch.save(trajectory, Path(out_dir) / f"{name}.pt")


def test_hybrid_stack_trains_like_one_process_under_tp_sp_pp_dp(tmp_path):
    reference = train(ParallelContext.single())
    assert reference[-1, 0] < reference[0, 0] - 0.1  # it learns: the comparison means something
    run_distributed(run_layouts, 4, str(tmp_path))
    for name, *_ in LAYOUTS:
        got = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        torch.testing.assert_close(got[:, 0], reference[:, 0], rtol=2e-5, atol=2e-5, msg=name)
        torch.testing.assert_close(got[:, 1], reference[:, 1], rtol=2e-4, atol=1e-5, msg=name)
