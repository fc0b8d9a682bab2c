"""Shared by the fine-tuning tests: a tiny BERT checkpoint with the real uncased WordPiece
vocabulary, and the flags of a tiny `gigatron finetune` run."""

from __future__ import annotations

from pathlib import Path

from gigatron.checkpoint.torch_format import save_checkpoint
from gigatron.data.tokenizers import build_tokenizer
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config

DATA = Path(__file__).resolve().parents[1] / "data"
VOCAB = DATA / "bert-base-uncased-vocab.txt"
MNLI = DATA / "glue-mnli-sample"
RACE = DATA / "race-sample" / "RACE"
QQP = DATA / "qqp-sample" / "dev.tsv"


def model_flags(seq_length: int = 64, *extra: str) -> list[str]:
    return [
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(VOCAB),
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", "128",
        "--padded-vocab-size", "30592", "--init-method-std", "0.05", "--seed", "3", *extra,
    ]  # fmt: skip


def save_pretrained(directory: Path, *extra: str) -> None:
    """An untrained tiny BERT (with pooler and sentence-order head), saved like `pretrain bert`."""
    flags = model_flags(64, *extra) + [
        "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
    ]  # fmt: skip
    cfg = parse_pretrain_config(flags, world_size=1, family="bert")
    pctx = ParallelContext.single()
    tokenizer = build_tokenizer(cfg.tokenizer)
    chunks = build_bert_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    save_checkpoint(directory, 1, chunks, None, None, pctx, cfg, extra={"gigatron_family": "bert"})


def finetune_flags(
    task: str, pretrained: Path | None, save: Path, seq_length: int = 64, **options: str
) -> list[str]:
    flags = model_flags(seq_length) + [
        "--task", task, "--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--save", str(save),
        "--no-progress-bar",
    ]  # fmt: skip
    if pretrained is not None:
        flags += ["--pretrained-checkpoint", str(pretrained)]
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", *str(value).split()]
    return flags
