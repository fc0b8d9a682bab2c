"""`gigatron pretrain t5` end to end on a real corpus preprocessed with --split-sentences:
training and validation losses fall, and tensor (+ sequence) parallelism, pipeline parallelism
(encoder and decoder on different stages) and data parallelism with the distributed optimizer
give the one-process losses, for Megatron's T5 and for the Hugging Face layout (relative
positions, RMSNorm, gated GeLU, no biases)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import BERT_VOCAB as VOCAB
from helpers import gigatron, pretrain, records

HF_LAYOUT = [
    "--position-embedding-type", "relative", "--relative-attention-num-buckets", "8",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--geglu", "--openai-gelu",
    "--kv-channels", "4", "--ffn-hidden-size", "48",
]  # fmt: skip


def _flags(data: str, save: Path, *extra: str) -> list[str]:
    return [
        "--data-path", data, "--split", "90,8,2", "--tokenizer-type", "BertWordPieceLowerCase",
        "--vocab-file", str(VOCAB), "--vocab-extra-ids", "100",
        "--padded-vocab-size", "30720",  # the same at every tp
        "--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--encoder-seq-length", "64", "--decoder-seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2",
        "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
        "--train-iters", "10", "--save", str(save), *extra,
    ]  # fmt: skip


def _train(flags: list[str], nproc: int = 1) -> None:
    pretrain("t5", *flags, nproc=nproc)


@pytest.fixture(scope="module")
def references(wordpiece_corpus, tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for name, extra in (("megatron", []), ("hf", HF_LAYOUT)):
        runs[name] = tmp_path_factory.mktemp(f"t5-{name}")
        _train(_flags(wordpiece_corpus, runs[name], *extra))
    return runs


@pytest.mark.parametrize("variant", ["megatron", "hf"])
def test_training_and_validation_losses_fall(references, variant):
    train = records(references[variant], "train")
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 1.0  # ln(30720) ~ 10.3 at the start
    valid = [r for r in records(references[variant], "eval") if r["split"] == "valid"]
    assert [r["iteration"] for r in valid] == [5, 10]
    assert valid[1]["lm_loss"] < valid[0]["lm_loss"]


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize(
    "variant, nproc, layout",
    [
        ("megatron", 2, TP2_SP),
        # The layout: tp 2 + sp, encoder | decoder (the split rank's default), dp 2 with
        # the distributed optimizer; eight processes, as the three sizes multiply.
        ("megatron", 8, [*TP2_SP, *PP2, "--use-distributed-optimizer"]),
        # two encoder and two decoder stages: the embedding on stages 0, 2 and 3
        (
            "megatron",
            4,
            ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-split-rank", "2"],
        ),  # fmt: skip
        ("hf", 4, [*TP2_SP, *PP2, "--pipeline-model-parallel-split-rank", "1"]),
    ],
    ids=["tp2-sp", "tp2-sp-pp2-dp2-distopt", "pp4-split2", "hf-tp2-sp-pp2"],
)
def test_parallel_layouts_match_one_process(
    wordpiece_corpus, references, tmp_path, variant, nproc, layout
):
    extra = HF_LAYOUT if variant == "hf" else []
    _train(_flags(wordpiece_corpus, tmp_path, *extra, *layout), nproc=nproc)
    one = [r["lm_loss"] for r in records(references[variant], "train")]
    two = [r["lm_loss"] for r in records(tmp_path, "train")]
    assert two == pytest.approx(one, rel=2e-5)


def test_convert_checkpoint_round_trips_through_a_t5_pipeline_layout(references, tmp_path):
    """tp 1 pp 1 -> tp 2 pp 4 (two encoder, two decoder stages: the embedding on three of them)
    -> tp 1 pp 1 gives back the same weights."""
    import torch

    source = references["megatron"]
    split, back = tmp_path / "split", tmp_path / "back"
    for load, save, tp, pp in ((source, split, "2", "4"), (split, back, "1", "1")):
        gigatron("convert-checkpoint", "--load", load, "--save", save,
                 "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp)  # fmt: skip
    stage_dirs = sorted(p.name for p in (split / "iter_0000010").iterdir())
    assert stage_dirs == [f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(4)]
    decoder_first = torch.load(
        split / "iter_0000010" / "mp_rank_00_002" / "model_optim_rng.pt", weights_only=True
    )["model"]
    assert "embedding.word_embeddings.weight" in decoder_first
    assert "decoder.layers.0.cross_attention.linear_kv.weight" in decoder_first

    def model(directory):
        path = directory / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
        return torch.load(path, weights_only=True)["model"]

    original, restored = model(source), model(back)
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name


def test_torch_dist_checkpoint_resumes_in_another_layout(wordpiece_corpus, references, tmp_path):
    """Saved by encoder | decoder pipeline stages in the torch_dist format, resumed at tp 2
    without a pipeline: iterations 6-10 give the one-process losses."""
    first, second = tmp_path / "pp2", tmp_path / "tp2"
    _train(_flags(wordpiece_corpus, first, *PP2, "--ckpt-format", "torch_dist",
                  "--save-interval", "5", "--exit-interval", "5"), nproc=2)  # fmt: skip
    _train(_flags(wordpiece_corpus, second, "--tensor-model-parallel-size", "2",
                  "--ckpt-format", "torch_dist", "--load", str(first)), nproc=2)  # fmt: skip
    one = {r["iteration"]: r["lm_loss"] for r in records(references["megatron"], "train")}
    resumed = {r["iteration"]: r["lm_loss"] for r in records(second, "train")}
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert [resumed[i] for i in range(6, 11)] == pytest.approx(
        [one[i] for i in range(6, 11)], rel=2e-5
    )
