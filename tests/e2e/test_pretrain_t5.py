"""`gigatron pretrain t5` end to end on a real corpus preprocessed with --split-sentences:
training and validation losses fall, and tensor (+ sequence) parallelism, pipeline parallelism
(encoder and decoder on different stages) and data parallelism with the distributed optimizer
give the one-process losses, for Megatron's T5 and for the Hugging Face layout (relative
positions, RMSNorm, gated GeLU, no biases). The trainings go in a few launches (`runs`,
helpers.gigatron_runs); each test checks its runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import BERT_VOCAB as VOCAB
from helpers import gigatron, gigatron_runs, records

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


TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PP2 = ["--pipeline-model-parallel-size", "2"]
# name -> (variant, processes, layout flags)
LAYOUTS = {
    "tp2-sp": ("megatron", 2, TP2_SP),
    # The layout: tp 2 + sp, encoder | decoder (the split rank's default), dp 2 with
    # the distributed optimizer; eight processes, as the three sizes multiply.
    "tp2-sp-pp2-dp2-distopt": ("megatron", 8, [*TP2_SP, *PP2, "--use-distributed-optimizer"]),
    # two encoder and two decoder stages: the embedding on stages 0, 2 and 3
    "pp4-split2": ("megatron", 4, ["--pipeline-model-parallel-size", "4",
                                   "--pipeline-model-parallel-split-rank", "2"]),
    "hf-tp2-sp-pp2": ("hf", 4, [*TP2_SP, *PP2, "--pipeline-model-parallel-split-rank", "1"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(wordpiece_corpus, tmp_path_factory) -> Path:
    """Every training of this file, in one launch per process count (process start-up dominates
    on CPU), then the torch_dist resume; each run's folder is named after it."""
    root = tmp_path_factory.mktemp("t5")

    def command(save: str, *extra: str) -> list[str]:
        return ["pretrain", "t5", *_flags(wordpiece_corpus, root / save, *extra)]

    first = {"megatron": (1, command("megatron")), "hf": (1, command("hf", *HF_LAYOUT))}
    for name, (variant, nproc, layout) in LAYOUTS.items():
        first[name] = (nproc, command(name, *(HF_LAYOUT if variant == "hf" else []), *layout))
    first["dist-pp2"] = (2, command("dist-pp2", *PP2, "--ckpt-format", "torch_dist",
                                    "--save-interval", "5", "--exit-interval", "5"))  # fmt: skip
    gigatron_runs(root, first)
    resumed = command("dist-tp2", "--tensor-model-parallel-size", "2", "--ckpt-format",
                      "torch_dist", "--load", str(root / "dist-pp2"))  # fmt: skip
    gigatron_runs(root, {"dist-tp2": (2, resumed)})
    return root


@pytest.fixture(scope="module")
def references(runs) -> dict[str, Path]:
    return {name: runs / name for name in ("megatron", "hf")}


@pytest.mark.parametrize("variant", ["megatron", "hf"])
def test_training_and_validation_losses_fall(references, variant):
    train = records(references[variant], "train")
    assert [r["iteration"] for r in train] == list(range(1, 11))
    assert train[-1]["lm_loss"] < train[0]["lm_loss"] - 1.0  # ln(30720) ~ 10.3 at the start
    valid = [r for r in records(references[variant], "eval") if r["split"] == "valid"]
    assert [r["iteration"] for r in valid] == [5, 10]
    assert valid[1]["lm_loss"] < valid[0]["lm_loss"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_process(runs, references, layout):
    variant = LAYOUTS[layout][0]
    one = [r["lm_loss"] for r in records(references[variant], "train")]
    two = [r["lm_loss"] for r in records(runs / layout, "train")]
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


def test_torch_dist_checkpoint_resumes_in_another_layout(runs, references):
    """Saved by encoder | decoder pipeline stages in the torch_dist format, resumed at tp 2
    without a pipeline: iterations 6-10 give the one-process losses."""
    one = {r["iteration"]: r["lm_loss"] for r in records(references["megatron"], "train")}
    resumed = {r["iteration"]: r["lm_loss"] for r in records(runs / "dist-tp2", "train")}
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    assert [resumed[i] for i in range(6, 11)] == pytest.approx(
        [one[i] for i in range(6, 11)], rel=2e-5
    )
