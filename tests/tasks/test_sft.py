"""Supervised fine-tuning (`gigatron pretrain gpt --sft`): JSON-lines conversations become samples
whose loss mask covers the response tokens only, and the loss the run logs is the
response-only loss computed by hand from the same model."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import helpers
from gigatron.data.sft_dataset import conversation_from_json, sft_sample
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config, pretrain
from helpers import write_jsonl

DATA = Path(__file__).resolve().parents[1] / "data"
SEQ = 40
PAIRS = [
    ("Question: what colour is the sky?\nAnswer:", " The sky is blue."),
    ("Translate to French: cat\n", " chat"),
    ("Name a prime number.", " Seven is a prime number, and so is eleven."),
    ("Say hello.", " Hello!"),
]


def _flags(data: Path, tmp_path: Path) -> list[str]:
    return [
        "--sft", "--data-path", str(data), "--split", "100,0,0",
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2-vocab.json"),
        "--merge-file", str(DATA / "gpt2-merges.txt"), "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", str(SEQ), "--max-position-embeddings",
        str(SEQ), "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "1",
        "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0",
        "--init-method-std", "0.2", "--seed", "5", "--padded-vocab-size", "50304",
        "--metrics-file", str(tmp_path / "metrics.jsonl"), "--no-progress-bar",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    cfg = parse_pretrain_config(_flags(Path("x.jsonl"), Path(".")), world_size=1)
    return build_tokenizer(cfg.tokenizer)


def test_prompt_response_and_messages_records(tokenizer):
    prompt, response = PAIRS[0]
    conversation = conversation_from_json({"prompt": prompt, "response": response}, tokenizer, "x")
    p, r = tokenizer.tokenize(prompt), tokenizer.tokenize(response)
    assert conversation.tokens.tolist() == [*p, *r, tokenizer.eod]
    assert conversation.targets.tolist() == [False] * len(p) + [True] * (len(r) + 1)
    messages = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": response},
        ]
    }
    same = conversation_from_json(messages, tokenizer, "x")
    s = tokenizer.tokenize("Be brief.")
    assert same.tokens.tolist() == [*s, *p, *r, tokenizer.eod]
    assert same.targets.tolist() == [False] * (len(s) + len(p)) + [True] * (len(r) + 1)
    with pytest.raises(GigatronError, match="not an SFT record"):
        conversation_from_json({"text": "plain"}, tokenizer, "line 3")


def test_sample_masks_the_prompt_and_the_padding():
    from gigatron.data.sft_dataset import Conversation

    conversation = Conversation(np.array([10, 11, 12, 13, 99]), np.array([0, 0, 1, 1, 1], bool))
    sample = sft_sample(conversation, 6, pad=0)
    assert sample["tokens"].tolist() == [10, 11, 12, 13, 99, 0]
    assert sample["labels"].tolist() == [11, 12, 13, 99, 0, 0]
    # Label 12 is the first response token: predicted at position 1.
    assert sample["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0]
    cut = sft_sample(conversation, 3, pad=0)
    assert cut["labels"].tolist() == [11, 12, 13] and cut["loss_mask"].tolist() == [0, 1, 1]


def test_logged_loss_is_the_response_only_loss(tokenizer, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in PAIRS))
    cfg = parse_pretrain_config(_flags(data, tmp_path), world_size=1)
    result, _ = pretrain(cfg, stream=io.StringIO())
    logged = result.train_losses[1]

    # By hand: the same model (initialised from the seed), the loss over response tokens only.
    cfg = parse_pretrain_config(_flags(data, tmp_path), world_size=1)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=tokenizer.vocab_size)
    response_sum = response_count = all_sum = all_count = 0.0
    for prompt, response in PAIRS:
        p, r = tokenizer.tokenize(prompt), tokenizer.tokenize(response)
        tokens = torch.tensor([[*p, *r, tokenizer.eod]])
        with torch.no_grad():
            logits = model(tokens[:, :-1], torch.arange(tokens.shape[1] - 1)[None])
        losses = token_losses(logits, tokens[:, 1:], ParallelContext.single())[0]
        response_sum += float(losses[len(p) - 1 :].sum())
        response_count += len(r) + 1
        all_sum += float(losses.sum())
        all_count += losses.numel()
    assert logged == pytest.approx(response_sum / response_count, rel=1e-5)
    assert abs(logged - all_sum / all_count) > 1e-3  # prompt tokens would change it


def test_sft_is_refused_where_it_does_not_apply(tmp_path):
    from gigatron.data.sft_dataset import SFTDataset

    flags = _flags(tmp_path / "x.jsonl", tmp_path)
    with pytest.raises(GigatronError, match="--eod-mask-loss: not used with --sft"):
        SFTDataset.options_from_config(
            parse_pretrain_config([*flags, "--eod-mask-loss"], world_size=1), build_tokenizer(
                parse_pretrain_config(flags, world_size=1).tokenizer
            )
        )  # fmt: skip
    bert = [f for f in flags if f != "--sft"]
    with pytest.raises(GigatronError, match=r"--sft: the bert family does not use it \(only gpt"):
        parse_pretrain_config(["--sft", *bert], world_size=1, family="bert")


def test_data_parallel_sft_matches_one_process(tmp_path):
    """Two data-parallel ranks, each with half of every global batch, log the one-process loss."""
    data = write_jsonl(tmp_path / "sft.jsonl", ({"prompt": p, "response": r} for p, r in PAIRS * 2))
    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        flags = _flags(data, out) + [
            "--train-iters",
            "2",
            "--micro-batch-size",
            "2",
            "--log-interval",
            "1",
        ]
        helpers.pretrain("gpt", *flags, nproc=nproc, timeout=600)
        losses[nproc] = [r["lm_loss"] for r in helpers.records(out, "train")]
    assert len(losses[1]) == 2
    assert losses[2] == pytest.approx(losses[1], rel=1e-5)
