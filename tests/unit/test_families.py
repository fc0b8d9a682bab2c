"""The model-family registry: a family registered from a test file trains through `pretrain`
with no change to the loop; named losses reach metrics.jsonl."""

from __future__ import annotations

import io
import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.families import ModelFamily, family_names, get_family, register_family
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.training.pretrain import parse_pretrain_config, pretrain

VOCAB, SEQ = 32, 8


class Bigram(PipelineStage):
    """A one-matrix language model: logits of the next token from the current one."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, VOCAB)
        self.pre_process = self.post_process = True

    def set_input_tensor(self, tensor) -> None:
        raise AssertionError("a one-stage model gets no pipeline input")

    def forward(self, tokens):
        return self.table(tokens)


class ShiftDataset:
    """Samples whose next token is always token + 1: learnable by a bigram."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, VOCAB, size)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        text = (self.starts[index] + np.arange(SEQ + 1)) % VOCAB
        return {"tokens": text[:-1].astype(np.int64), "labels": text[1:].astype(np.int64)}


def _loss(labels, logits):
    losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    first = losses[:, 0]
    report = {
        "toy_loss": torch.stack([losses.sum().detach(), torch.tensor(float(losses.numel()))]),
        "first_token_loss": torch.stack([first.sum().detach(), torch.tensor(float(first.numel()))]),
    }
    return losses.sum(), torch.tensor(float(losses.numel())), report


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["tokens"]), partial(_loss, batch["labels"])


TOY = ModelFamily(
    name="toy-bigram",
    description="a bigram table (test family)",
    build_model=lambda cfg, pctx, vocab_size=None: [Bigram()],
    make_forward_step=lambda cfg, pctx: _forward_step,
    loss_names=lambda cfg: ("toy_loss", "first_token_loss"),
    build_datasets=lambda cfg, tok, counts, pctx=None: tuple(
        ShiftDataset(n, seed) if n else None for n, seed in zip(counts, (1, 2, 3))
    ),
    flops_per_iteration=lambda cfg, batch, vocab: 2.0 * 3 * batch * SEQ * VOCAB * VOCAB,
)


def test_a_registered_toy_family_trains_through_pretrain(tmp_path):
    register_family(TOY)
    assert "toy-bigram" in family_names() and get_family("toy-bigram") is TOY
    cfg = parse_pretrain_config(
        ["--mock-data", "--vocab-size", str(VOCAB), "--num-layers", "1", "--hidden-size", "8",
         "--num-attention-heads", "1", "--seq-length", str(SEQ), "--micro-batch-size", "4",
         "--global-batch-size", "8", "--lr", "0.5", "--train-iters", "30", "--log-interval", "5",
         "--eval-interval", "15", "--eval-iters", "2", "--save", str(tmp_path)],
        world_size=1, family="toy-bigram",
    )  # fmt: skip
    result, _ = pretrain(cfg, stream=io.StringIO(), family="toy-bigram")
    losses = result.train_losses
    assert losses[30] < 0.5 * losses[1]  # the bigram is learnt
    assert set(result.train_reports[1]) == {"toy_loss", "first_token_loss"}
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert all("toy_loss" in r and "first_token_loss" in r for r in train)
    assert all("toy_loss_ppl" in r and "first_token_loss_ppl" in r for r in evals)
    saved = torch.load(
        tmp_path / "iter_0000030" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True
    )
    assert saved["gigatron_family"] == "toy-bigram"


def test_registering_another_family_under_a_taken_name_is_refused():
    register_family(TOY)
    other = ModelFamily(**{**TOY.__dict__, "description": "another"})
    with pytest.raises(GigatronError, match="already registered"):
        register_family(other)
