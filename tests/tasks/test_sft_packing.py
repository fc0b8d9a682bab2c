"""Sequence packing for --sft (data/packing.py): first-fit-decreasing bins, packed samples with
restarting positions and a per-document attention mask, and packed training equal to the unpacked
one-conversation-per-sample run: gradients in one process, and losses and gradient norms at
tp 2 (with sequence parallelism), pp 2, cp 2 and dp 2 in one two-process launch."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch

import helpers
from gigatron.data.gpt_dataset import GPTDatasetOptions, make_sample
from gigatron.data.packing import (
    first_fit_decreasing,
    packed_sample,
    packing_stats,
    padded_length,
)
from gigatron.data.sft_dataset import Conversation, sft_sample
from gigatron.errors import GigatronError
from gigatron.families.gpt import forward_step
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config, pretrain

SEQ = 32
VOCAB = 128
# Conversation lengths (tokens with the closing eod): first-fit-decreasing puts them into 4 bins
# of 32: [25, 5], [20, 12], [18, 14], [16, 15].
LENGTHS = (12, 25, 16, 5, 18, 14, 20, 15)


def conversations() -> list[dict]:
    rng = np.random.default_rng(3)
    rows = []
    for n in LENGTHS:
        ids = rng.integers(0, VOCAB - 1, size=n - 1).tolist()
        cut = max(1, (n - 1) // 2)
        rows.append(
            {"prompt": " ".join(map(str, ids[:cut])), "response": " ".join(map(str, ids[cut:]))}
        )
    return rows


def flags(data: Path, out: Path, packed: bool, *extra: str) -> list[str]:
    batch = "4" if packed else str(len(LENGTHS))
    return [
        "--sft", *(["--sft-pack-sequences"] if packed else []), "--data-path", str(data),
        "--split", "100,0,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "64", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ + 8),
        "--micro-batch-size", "2", "--global-batch-size", batch, "--train-iters", "2",
        "--lr", "1e-2", *helpers.NO_DROPOUT, "--eval-iters", "0", "--seed", "5",
        "--calculate-per-token-loss", "--log-interval", "1", "--num-workers", "0",
        "--metrics-file", str(out / "metrics.jsonl"), "--no-progress-bar", *extra,
    ]  # fmt: skip


def test_first_fit_decreasing_and_fill_ratio():
    bins = first_fit_decreasing(LENGTHS, SEQ)
    assert bins == [[1, 3], [6, 0], [4, 5], [2, 7]]
    # Longer than a sequence: cut to it, alone in its bin.
    assert first_fit_decreasing([40, 3, 30], SEQ) == [[0], [2], [1]]
    stats = packing_stats(LENGTHS, bins, SEQ)
    assert (stats.documents, stats.sequences, stats.tokens) == (8, 4, 125)
    assert stats.fill_ratio == pytest.approx(125 / 128)
    assert "fill ratio 97.7%" in stats.line("train") and "(one per sequence: 48.8%)" in stats.line(
        "x"
    )


def test_packed_sample_keeps_each_document_to_itself():
    a = (np.array([10, 11, 12]), np.array([0, 1, 1], bool))
    b = (np.array([20, 21]), np.array([0, 1], bool))
    sample = packed_sample([a, b], 7, pad=0)
    assert sample["tokens"].tolist() == [10, 11, 12, 20, 21, 0, 0]
    # No label crosses from a document into the next; the last position of each is no target.
    assert sample["labels"].tolist() == [11, 12, 0, 21, 0, 0, 0]
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 0, 0, 0]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1]
    visible = ~sample["attention_mask"][0]
    expected = np.zeros((7, 7), bool)
    for start, end in ((0, 3), (3, 5), (5, 7)):
        expected[start:end, start:end] = np.tri(end - start, dtype=bool)
    assert (visible == expected).all()
    # Alone, a document's labels and loss mask are those of its unpacked sample.
    alone = sft_sample(Conversation(*a), 7, pad=0)
    assert alone["labels"][:3].tolist() == [11, 12, 0] and alone["loss_mask"][:3].tolist() == [
        1,
        1,
        0,
    ]
    with pytest.raises(ValueError, match="do not fit"):
        packed_sample([a, b, a], 7, pad=0)
    # For the context-parallel split (cp 2): each document padded to 4 positions, the padding
    # in its document's segment (after it, so never seen by it) and never a target.
    padded = packed_sample([a, b], 12, pad=0, multiple=4)
    assert padded["tokens"].tolist() == [10, 11, 12, 0, 20, 21, 0, 0, 0, 0, 0, 0]
    assert padded["loss_mask"].tolist() == [1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert padded["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert padded["document_start"].tolist() == [0] * 4 + [4] * 4 + [8] * 4
    assert padded_length(3, 12, 4) == 4 and padded_length(13, 12, 4) == 12


def _loss_and_grads(model, batch: dict) -> tuple[float, float, list[torch.Tensor]]:
    model.zero_grad()
    pctx = ParallelContext.single()
    output, loss_fn = forward_step(pctx, iter([batch]), model)
    loss_sum, tokens, _ = loss_fn(output)
    loss_sum.backward()
    return float(loss_sum.detach()), float(tokens), [p.grad.clone() for p in model.parameters()]


def test_packed_gradients_equal_the_unpacked_ones(tmp_path):
    cfg = parse_pretrain_config(flags(tmp_path / "x.jsonl", tmp_path, True), world_size=1)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, VOCAB, n), rng.random(n) < 0.6) for n in LENGTHS]

    def stack(samples):
        return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}

    bins = first_fit_decreasing(LENGTHS, SEQ)
    packed = stack([packed_sample([docs[i] for i in b], SEQ, 0) for b in bins])
    unpacked = stack([sft_sample(Conversation(t, m), SEQ, 0) for t, m in docs])
    loss_p, tokens_p, grads_p = _loss_and_grads(model, packed)
    loss_u, tokens_u, grads_u = _loss_and_grads(model, unpacked)
    assert tokens_p == tokens_u > 0
    assert loss_p == pytest.approx(loss_u, rel=1e-6)
    for gp, gu in zip(grads_p, grads_u):
        assert torch.allclose(gp, gu, rtol=0, atol=1e-6 * float(gu.abs().max()) + 1e-9)
    assert sum(float(g.abs().sum()) for g in grads_u) > 0


def test_pretraining_documents_with_reset_flags_equal_one_per_sample(tmp_path):
    """GPTDataset's packing (--reset-attention-mask --reset-position-ids --eod-mask-loss):
    documents joined by eod train as each alone would (the eod's label, the next document's
    first token, is masked)."""
    cfg = parse_pretrain_config(flags(tmp_path / "x.jsonl", tmp_path, True), world_size=1)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    eod, rng = VOCAB - 1, np.random.default_rng(1)
    docs = [np.append(rng.integers(0, eod, n - 1), eod) for n in (9, 13, 10)]
    options = GPTDatasetOptions(
        seq_length=SEQ, eod=eod, eod_mask_loss=True, reset_position_ids=True,
        reset_attention_mask=True,
    )  # fmt: skip
    text = np.concatenate([*docs, [3]])  # seq + 1 tokens: the last is only a label
    packed = {k: torch.from_numpy(v)[None] for k, v in make_sample(text, SEQ + 1, options).items()}
    one = GPTDatasetOptions(seq_length=SEQ, eod=eod, eod_mask_loss=True)
    padded = [np.append(d, np.zeros(SEQ + 1 - len(d), np.int64)) for d in docs]
    alone = [make_sample(p, len(d), one) for p, d in zip(padded, docs)]
    unpacked = {k: torch.from_numpy(np.stack([a[k] for a in alone])) for k in alone[0]}
    loss_p, tokens_p, grads_p = _loss_and_grads(model, packed)
    loss_u, tokens_u, grads_u = _loss_and_grads(model, unpacked)
    assert tokens_p == tokens_u == sum(len(d) - 1 for d in docs)
    assert loss_p == pytest.approx(loss_u, rel=1e-6)
    for gp, gu in zip(grads_p, grads_u):
        assert torch.allclose(gp, gu, rtol=0, atol=1e-6 * float(gu.abs().max()) + 1e-9)


def test_packing_flags_are_checked(tmp_path):
    base = flags(tmp_path / "x.jsonl", tmp_path, True)
    no_sft = [f for f in base if f != "--sft"]
    with pytest.raises(GigatronError, match="--sft-pack-sequences: packs --sft conversations"):
        parse_pretrain_config(no_sft, world_size=1)
    with pytest.raises(GigatronError, match="drop --no-create-attention-mask-in-dataloader"):
        parse_pretrain_config([*base, "--no-create-attention-mask-in-dataloader"], world_size=1)


LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"],
    # Split per document: each padded to a multiple of 4, so the 8 fit 4 sequences of 40.
    "cp2": ["--context-parallel-size", "2", "--seq-length", str(SEQ + 8)],
    "dp2": [],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_packing")
    data = helpers.write_jsonl(root / "sft.jsonl", conversations())
    plan = {name: (2, flags(data, root / name, True, *extra)) for name, extra in LAYOUTS.items()}
    outputs = helpers.gigatron_runs(
        root, {n: (p, ["pretrain", "gpt", *a]) for n, (p, a) in plan.items()}
    )
    # The references, in this process: one conversation per sample, and packed.
    values = {}
    for name, packed in (("unpacked", False), ("packed", True)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cfg = parse_pretrain_config(flags(data, root / name, packed), world_size=1)
            pretrain(cfg, stream=out)
        outputs[name] = out.getvalue()
    for name in (*LAYOUTS, "unpacked", "packed"):
        train = helpers.records(root / name, "train")
        values[name] = [(r["lm_loss"], r["grad_norm"]) for r in train]
    return values, outputs


@pytest.mark.parametrize("name", ["packed", *LAYOUTS])
def test_packed_training_equals_unpacked(runs, name):
    values, outputs = runs
    reference = values["unpacked"]
    assert len(reference) == 2 and reference[0][0] != reference[1][0]
    for (loss, norm), (ref_loss, ref_norm) in zip(values[name], reference, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert norm == pytest.approx(ref_norm, rel=1e-6)
    if name == "cp2":
        assert "8 documents in 4 sequences of 40 tokens, fill ratio 78.1%" in outputs[name]
    elif name != "unpacked":
        assert "8 documents in 4 sequences of 32 tokens, fill ratio 97.7%" in outputs[name]


def test_fill_ratio_of_each_blended_file(tmp_path, capsys):
    from gigatron.data.sft_dataset import build_sft_datasets
    from gigatron.data.tokenizers import build_tokenizer

    rows = conversations()
    first = helpers.write_jsonl(tmp_path / "a.jsonl", rows[:4])
    second = helpers.write_jsonl(tmp_path / "b.jsonl", rows[4:])
    base = flags(first, tmp_path, True)
    at = base.index("--data-path")
    argv = [*base[:at], "--data-path", "1", str(first), "1", str(second), *base[at + 2 :]]
    cfg = parse_pretrain_config(argv, world_size=1)
    train, _, _ = build_sft_datasets(cfg, build_tokenizer(cfg.tokenizer), (6, None, None))
    assert len(train) == 6
    lines = capsys.readouterr().out.splitlines()
    # a: 12, 25, 16, 5 -> [25, 5], [16, 12]; b: 18, 14, 20, 15 -> [20], [18, 14], [15].
    assert f"sequence packing (train, {first}): 4 documents in 2 sequences" in lines[0]
    assert f"sequence packing (train, {second}): 4 documents in 3 sequences" in lines[1]
