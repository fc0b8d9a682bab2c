"""InstructRetro's instruction tuning (`gigatron pretrain retro --sft`, families/retro/sft.py):
JSON-lines conversations with their neighbour passages; the loss counts response tokens only,
training lowers it, the neighbours reach the model, and bad input is one line."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from gigatron.checkpoint.formats import load_checkpoint
from gigatron.checkpoint.torch_format import save_checkpoint
from gigatron.cli import main as cli
from gigatron.data.sft_dataset import SFTConversations
from gigatron.data.tokenizers import NullTokenizer
from gigatron.errors import GigatronError
from gigatron.families.gpt import token_losses
from gigatron.families.retro.sft import RetroSFTConversations, build_retro_sft_datasets
from gigatron.models.retro import build_retro_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config, pretrain
from helpers import write_jsonl

PCTX = ParallelContext.single()
SEQ, CHUNK = 8, 4  # two chunks per sample, as Megatron's SFT cuts them
LINES = [
    {"prompt": "5 6 7", "response": "8 9", "neighbours": ["10 11 12", "13", "14"]},
    {"prompt": "1 2", "response": "3 4 5 6", "neighbours": ["20 21", "22 23 24 25 26 27 28 29 30"]},
    {"prompt": "30 31 32", "response": "33", "neighbours": ["40", "41 42"]},
    {"prompt": "50", "response": "51 52 53", "neighbours": ["60 61 62", "63"]},
]


def flags(root: Path, *extra: str) -> list[str]:
    return [
        "--num-layers", "6", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--retro-gpt-chunk-length", str(CHUNK), "--retro-encoder-hidden-dropout", "0",
        "--retro-encoder-attention-dropout", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "3e-3",
        "--train-iters", "1", "--eval-iters", "0", "--split", "100,0,0", "--seed", "3",
        "--init-method-std", "0.2", "--no-progress-bar", "--metrics-file",
        str(root / "metrics.jsonl"), "--data-cache-path", str(root / "cache"), *extra,
    ]  # fmt: skip


def sft_flags(data: Path, *extra: str) -> list[str]:
    return flags(data.parent, "--sft", "--data-path", str(data), *extra)


def test_samples_learn_the_response_and_carry_the_lines_neighbours(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", LINES[:1])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "1", "response": "2"}])  # no neighbours
    blend = flags(tmp_path, "--sft", "--data-path", "0.5", str(a), "0.5", str(b))
    cfg = parse_pretrain_config(blend, world_size=1, family="retro")
    tokenizer = NullTokenizer(100)
    train, _, _ = build_retro_sft_datasets(cfg, tokenizer, (4, None, None))
    samples = {int(s["dataset_id"]): s for s in (train[i] for i in range(4))}
    first, fallback = samples[0], samples[1]
    eod = tokenizer.eod
    assert first["tokens"].tolist() == [5, 6, 7, 8, 9, eod, eod, eod]  # padded with eod
    assert first["labels"].tolist() == [6, 7, 8, 9, eod, eod, eod, eod]
    # Learned: the labels 8, 9 and the eod closing the response; not the prompt or padding.
    assert first["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    # [l=2 chunks, k=2 neighbours, r=8]: the first two passages, cut or eod-padded, every chunk.
    one = [[10, 11, 12, *[eod] * 5], [13, *[eod] * 7]]
    assert first["neighbour_tokens"].tolist() == [one, one]
    assert fallback["neighbour_tokens"].shape == (2, 2, 8)
    assert not fallback["neighbour_tokens"].any()  # Megatron's fallback: token id 0


def test_bad_neighbours_are_named(tmp_path):
    tokenizer = NullTokenizer(100)
    cases = {
        "too_few": ({**LINES[0], "neighbours": ["1"]}, 'line 1: 1 "neighbours" for'),
        "not_texts": ({**LINES[0], "neighbours": "1 2"}, '"neighbours" must be a list'),
    }
    for name, (line, message) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", [line])
        with pytest.raises(GigatronError, match=message):
            RetroSFTConversations(SFTConversations(str(path), tokenizer), tokenizer, (2, 2, 8))


def hand_loss(cfg, load: Path, lines) -> float:
    """The response-only loss of `lines` under the checkpoint in `load`, by hand."""
    (model,) = build_retro_model(cfg, PCTX, vocab_size=100)
    load_checkpoint(str(load), [model], None, None, PCTX, cfg)
    total = count = 0.0
    for line in lines:
        prompt, response = line["prompt"].split(), line["response"].split()
        ids = [int(t) for t in prompt + response] + [99] * (SEQ + 1 - len(prompt + response))
        tokens = torch.tensor([ids])
        passages = [[int(t) for t in p.split()][:8] for p in line["neighbours"][:2]]
        rows = [p + [99] * (8 - len(p)) for p in passages]
        neighbours = torch.tensor([[rows, rows]])
        with torch.no_grad():
            logits = model(tokens[:, :-1], torch.arange(SEQ)[None], neighbour_tokens=neighbours)
        losses = token_losses(logits, tokens[:, 1:], PCTX)[0]
        learned = slice(len(prompt) - 1, len(prompt) + len(response))  # response + eod labels
        total += float(losses[learned].sum())
        count += len(response) + 1
    return total / count


def test_instruction_tuning_a_retro_checkpoint(tmp_path):
    saved = tmp_path / "retro"  # a random Retro model, saved as `pretrain retro` saves it
    base = parse_pretrain_config(flags(tmp_path, "--mock-data"), world_size=1, family="retro")
    (model,) = build_retro_model(base, PCTX, vocab_size=100)
    save_checkpoint(saved, 1, [model], None, None, PCTX, base, {"gigatron_family": "retro"})
    data = write_jsonl(tmp_path / "inst.jsonl", LINES)
    tune = sft_flags(data, "--load", str(saved), "--finetune", "--train-iters", "3")
    cfg = parse_pretrain_config(tune, world_size=1, family="retro")
    losses = pretrain(cfg, io.StringIO(), "retro")[0].train_losses
    assert losses[3] < losses[2] < losses[1] - 0.5
    assert losses[1] == pytest.approx(hand_loss(cfg, saved, LINES), rel=1e-5)
    # Other neighbours, same conversations: another loss (the neighbours reach the model).
    other = [{**line, "neighbours": ["70 71 72 73", "74 75"]} for line in LINES]
    moved = write_jsonl(tmp_path / "other.jsonl", other)
    cfg = parse_pretrain_config(sft_flags(moved, "--load", str(saved), "--finetune"),
                                world_size=1, family="retro")  # fmt: skip
    first = pretrain(cfg, io.StringIO(), "retro")[0].train_losses[1]
    assert first == pytest.approx(hand_loss(cfg, saved, other), rel=1e-5)
    assert abs(first - losses[1]) > 1e-3


def test_refusals_are_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "inst.jsonl", LINES)
    gpt = tmp_path / "gpt"
    cfg = parse_pretrain_config(sft_flags(data), world_size=1, family="retro")
    save_checkpoint(gpt, 1, [nn.Linear(2, 2)], None, None, PCTX, cfg, {"gigatron_family": "gpt"})
    cases = {
        ("--load", str(gpt)): "a gpt checkpoint; instruction tuning (--sft) starts from a retro",
        ("--retro-project-dir", str(tmp_path)): "with --sft: instruction data are not queried",
        ("--sft-pack-sequences",): "--sft-pack-sequences",
    }
    for extra, message in cases.items():
        assert cli(["pretrain", "retro", *sft_flags(data, *extra)]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
