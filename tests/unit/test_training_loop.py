"""The training loop on a toy language model: losses against a hand-written reference loop,
evaluation, the stop on a non-finite loss, and the exit conditions."""

from __future__ import annotations

import copy
import io
import json
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.families.gpt import make_forward_step
from gigatron.families.gpt.flops import model_flops_per_iteration
from gigatron.optim import build_lr_scheduler, build_num_microbatches_calculator, build_optimizer
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.schedules import ScheduleConfig
from gigatron.training.loop import Run, evaluate, train
from gigatron.training.metrics import MetricsLogger

VOCAB, HIDDEN, SEQ, MICRO, GLOBAL = 16, 8, 6, 2, 4


class ToyLM(PipelineStage):
    """Embedding -> dropout -> output layer; per-token loss when labels are given."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.output_layer = nn.Linear(HIDDEN, VOCAB)
        self.dropout = dropout
        self.calls = 0
        self.poison_at_call: int | None = None
        self.on_call = None

    def forward(self, tokens, position_ids, attention_mask=None, labels=None):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        hidden = F.dropout(self.embedding(tokens), self.dropout, self.training)
        logits = self.output_layer(hidden)
        if self.poison_at_call is not None and self.calls >= self.poison_at_call:
            logits = logits * float("inf")
        if labels is None:
            return logits
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


def batches(seed: int):
    """Endless micro-batches of random tokens (numpy, as the data loader yields them)."""
    rng = np.random.default_rng(seed)
    while True:
        text = rng.integers(0, VOCAB, size=(MICRO, SEQ + 1))
        yield {
            "tokens": text[:, :-1].astype(np.int64),
            "labels": text[:, 1:].astype(np.int64),
            "loss_mask": np.ones((MICRO, SEQ), dtype=np.float32),
            "position_ids": np.tile(np.arange(SEQ, dtype=np.int64), (MICRO, 1)),
        }


def make_run(tmp_path, *flags: str, toy: ToyLM | None = None, saved: list | None = None) -> Run:
    cfg = parse_config(
        ["--num-layers", "1", "--hidden-size", str(HIDDEN), "--num-attention-heads", "1",
         "--seq-length", str(SEQ), "--micro-batch-size", str(MICRO),
         "--global-batch-size", str(GLOBAL), "--lr", "0.05", "--lr-decay-style", "constant",
         "--clip-grad", "0", "--weight-decay", "0", "--train-iters", "4", "--log-interval", "1",
         "--eval-iters", "2", *flags],
        world_size=1,
    )  # fmt: skip
    pctx = ParallelContext.single()
    torch.manual_seed(0)
    toy = toy or ToyLM()
    model = [DistributedDataParallel(toy, pctx, cfg.parallel)]
    optimizer = build_optimizer(cfg, model, pctx)
    metrics = MetricsLogger(str(tmp_path / "metrics.jsonl"), pctx, stream=io.StringIO())
    return Run(
        cfg=cfg,
        pctx=pctx,
        model=model,
        optimizer=optimizer,
        scheduler=build_lr_scheduler(cfg, optimizer),
        batch_calculator=build_num_microbatches_calculator(cfg, 1),
        forward_step=make_forward_step(cfg, pctx),
        schedule_config=ScheduleConfig(SEQ, MICRO, HIDDEN, grad_scale_func=optimizer.scale_loss),
        metrics=metrics,
        train_iters=cfg.training.train_iters,
        vocab_size=VOCAB,
        flops_per_iteration=lambda batch: model_flops_per_iteration(cfg.model, batch, VOCAB),
        train_iterator=batches(1),
        valid_iterator=batches(2),
        save_checkpoint=(lambda state: saved.append(state.iteration))
        if saved is not None
        else None,
        startup_record=lambda: {"parameters": sum(p.numel() for p in toy.parameters())},
    )


def reference_losses(iterations: int) -> list[float]:
    """The same training written out by hand: whole global batch, plain AdamW."""
    torch.manual_seed(0)
    model = ToyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    data = batches(1)
    losses = []
    for _ in range(iterations):
        micro = [next(data) for _ in range(GLOBAL // MICRO)]
        tokens = torch.from_numpy(np.concatenate([m["tokens"] for m in micro]))
        labels = torch.from_numpy(np.concatenate([m["labels"] for m in micro]))
        loss = model(tokens, None, labels=labels).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_losses_and_records_match_a_reference_loop(tmp_path):
    run = make_run(tmp_path)
    result = train(run)
    run.metrics.close()
    assert result.exit_reason == "finished" and result.iteration == 4
    expected = reference_losses(4)
    got = [result.train_losses[i] for i in range(1, 5)]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert got[-1] < got[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    startup = [r for r in records if r["type"] == "startup"]
    train_records = [r for r in records if r["type"] == "train"]
    assert startup[0]["parameters"] == VOCAB * HIDDEN + HIDDEN * VOCAB + VOCAB
    assert [r["iteration"] for r in train_records] == [1, 2, 3, 4]
    assert [r["consumed_samples"] for r in train_records] == [4, 8, 12, 16]
    first = train_records[0]
    assert first["lm_loss"] == pytest.approx(expected[0], rel=1e-5)
    assert first["lr"] == 0.05 and first["loss_scale"] == 1.0 and first["mfu"] is None
    assert first["grad_norm"] > 0 and first["tokens_per_s"] > 0
    assert first["skipped_iterations"] == 0 and first["iteration_time_s"] > 0
    # The final validation pass ran (no --eval-interval: only at the end).
    evals = [r for r in records if r["type"] == "eval"]
    assert [(r["split"], r["iteration"]) for r in evals] == [("valid", 4)]


def test_evaluate_is_the_token_mean_without_dropout(tmp_path):
    toy = ToyLM(dropout=0.5)
    run = make_run(tmp_path, toy=toy)
    reference = copy.deepcopy(toy).eval()
    data = batches(7)
    micro = [next(data) for _ in range(4)]  # 2 eval iterations x 2 micro-batches
    with torch.no_grad():
        expected = torch.cat(
            [
                reference(
                    torch.from_numpy(m["tokens"]), None, labels=torch.from_numpy(m["labels"])
                ).reshape(-1)
                for m in micro
            ]
        ).mean()
    losses = evaluate(run, batches(7), eval_iters=2, num_microbatches=2)
    assert losses == {"lm_loss": pytest.approx(expected.item(), rel=1e-6)}
    assert toy.training  # back in training mode


def test_non_finite_loss_stops_without_saving(tmp_path):
    toy = ToyLM()
    toy.poison_at_call = 5  # 2 micro-batches per iteration: the 3rd iteration's forward
    saved: list[int] = []
    run = make_run(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "1", toy=toy,
                   saved=saved)  # fmt: skip
    with pytest.raises(GigatronError, match=r"iteration 3: the lm loss is (nan|inf)") as error:
        train(run)
    assert "last good checkpoint" in str(error.value)
    assert saved == [1, 2]


def test_exit_interval_saves_and_stops(tmp_path):
    saved: list[int] = []
    run = make_run(tmp_path, "--save", str(tmp_path), "--exit-interval", "2", saved=saved)
    result = train(run)
    assert (result.exit_reason, result.iteration, saved) == ("exit-interval", 2, [2])
    assert result.valid_losses == {}  # Megatron's default: exit without validating


def test_eval_at_start_and_on_early_exit(tmp_path):
    run = make_run(tmp_path, "--exit-interval", "3", "--eval-at-start")
    run.evaluate_on_early_exit = True
    result = train(run)
    assert sorted(result.valid_losses) == [0, 3]
    # The first validation sees the untrained model: near uniform, ln(16) = 2.77.
    assert abs(result.valid_losses[0] - np.log(VOCAB)) < 0.3


def test_sigterm_saves_and_stops(tmp_path):
    toy = ToyLM()
    # SIGTERM arrives in the middle of the 2nd iteration's first forward pass.
    toy.on_call = lambda call: os.kill(os.getpid(), signal.SIGTERM) if call == 3 else None
    saved: list[int] = []
    run = make_run(tmp_path, "--save", str(tmp_path), "--exit-signal-handler", toy=toy,
                   saved=saved)  # fmt: skip
    previous = signal.getsignal(signal.SIGTERM)
    result = train(run)
    assert (result.exit_reason, result.iteration, saved) == ("signal", 2, [2])
    assert signal.getsignal(signal.SIGTERM) == previous  # handler restored


def test_mfu_is_model_flops_over_the_peak(tmp_path):
    run = make_run(tmp_path)
    run.peak_flops = 1e9
    train(run)
    run.metrics.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if r["type"] == "train")
    flops = model_flops_per_iteration(run.cfg.model, GLOBAL, VOCAB)
    assert first["tflops_per_s"] == pytest.approx(flops / first["iteration_time_s"] / 1e12)
    assert first["mfu"] == pytest.approx(flops / first["iteration_time_s"] / 1e9)


def test_a_slow_first_iteration_is_announced(tmp_path, monkeypatch):
    """Until the first log line, a notice says which iteration runs and for how long."""
    from gigatron.training import notice

    monkeypatch.setattr(notice, "FIRST_NOTICE_S", 0.05)
    monkeypatch.setattr(notice, "NOTICE_EVERY_S", 0.05)
    run = make_run(tmp_path, "--log-interval", "4")
    step = run.forward_step

    def slow_step(data_iterator, chunk):
        time.sleep(0.1 if run.state.iteration == 0 else 0.0)  # only the first iteration is slow
        return step(data_iterator, chunk)

    run.forward_step = slow_step
    out = run.metrics.stream = io.StringIO()
    train(run)
    run.metrics.close()
    lines = out.getvalue().splitlines()
    first_log = next(i for i, line in enumerate(lines) if line.startswith(" iteration        4"))
    notices = [line for line in lines if "running..." in line]
    assert notices and notices[0].startswith(" iteration 1 running... (0 s since training")
    assert all(lines.index(n) < first_log for n in notices)  # none after the first log line


def test_no_check_for_nan_keeps_training(tmp_path):
    toy = ToyLM()
    toy.poison_at_call = 5  # from the 3rd iteration on, the loss is not finite
    run = make_run(tmp_path, "--no-check-for-nan-in-loss-and-grad", toy=toy)
    result = train(run)
    assert result.iteration == 4
    assert np.isfinite(result.train_losses[2]) and not np.isfinite(result.train_losses[3])


def test_manual_gc_turns_the_collector_off_and_collects_on_schedule(tmp_path):
    import gc

    seen: list[tuple[bool, int]] = []
    collections: list[int] = []
    toy = ToyLM()
    toy.on_call = lambda call: seen.append((gc.isenabled(), call))

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    run = make_run(tmp_path, "--manual-gc", "--manual-gc-interval", "2", "--eval-iters", "0",
                   toy=toy)  # fmt: skip
    gc.callbacks.append(count)
    try:
        train(run)
    finally:
        gc.callbacks.remove(count)
    assert gc.isenabled()  # restored
    assert all(not enabled for enabled, _ in seen)
    # One full collection at the start, then after iterations 2 and 4 (automatic ones are off).
    assert collections == [2, 2, 2]


def test_params_norm_is_logged(tmp_path):
    run = make_run(tmp_path, "--log-params-norm")
    train(run)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if r["type"] == "train"][-1]
    expected = torch.sqrt(sum((p.detach() ** 2).sum() for p in run.model[0].parameters()))
    assert last["params_norm"] == pytest.approx(expected.item(), rel=1e-6)
    assert "params norm:" in run.metrics.stream.getvalue()


def test_profile_writes_a_trace_of_the_window(tmp_path):
    run = make_run(
        tmp_path, "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
        "--tensorboard-dir", str(tmp_path / "tb"), "--eval-iters", "0",
    )  # fmt: skip
    train(run)
    (trace,) = (tmp_path / "tb").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    # Two iterations (2 and 3) of 2 micro-batches: four forward passes of the toy model.
    embeddings = [e for e in events if e.get("name") == "aten::embedding"]
    assert len(embeddings) == 4


def test_profile_on_a_rank_not_listed_writes_nothing(tmp_path, monkeypatch):
    run = make_run(tmp_path, "--profile", "--profile-step-start", "1", "--profile-step-end", "2",
                   "--profile-ranks", "1", "--eval-iters", "0")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    train(run)
    assert not (tmp_path / "profile").exists()


def test_record_memory_history_needs_cuda(tmp_path):
    run = make_run(tmp_path, "--record-memory-history")
    with pytest.raises(GigatronError, match="--record-memory-history: records CUDA"):
        train(run)
