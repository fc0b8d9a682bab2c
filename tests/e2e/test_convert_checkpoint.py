"""`gigatron convert-checkpoint`: a tp = 2 checkpoint re-split to tp = 1 and to pp = 2 with virtual
stages keeps its weights exactly and evaluates to the same test loss."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.convert import convert_checkpoint
from gigatron.errors import GigatronError
from helpers import WEIGHTS_ONLY, gigatron, pretrain, tiny_gpt_flags
from helpers import loss_on_test_split as _test_loss

# 64 tokens padded to a multiple of 32 x tp gives 64 rows at tp 1 and 2, so the layouts compute
# the same logits (padding rows would change the softmax denominator).
TINY = [
    *tiny_gpt_flags(vocab_size=64, num_layers=4, hidden_size=32), "--make-vocab-size-divisible-by",
    "32", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1",
    "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0", "--deterministic-mode",
    "--hidden-dropout", "0", "--attention-dropout", "0",
]  # fmt: skip


def _pretrain(*flags: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    return pretrain("gpt", *TINY, *flags, nproc=nproc, check=check)


def _model(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v for k, v in state.items() if k.startswith("model")}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """2 iterations at tensor-parallel 2 (2 processes), saved at iteration 2."""
    directory = tmp_path_factory.mktemp("convert") / "src"
    _pretrain("--tensor-model-parallel-size", "2", "--save", str(directory), nproc=2)
    return directory


@pytest.fixture(scope="module")
def tp1(source) -> Path:
    """Converted with the command the loader's layout error prints."""
    refused = _pretrain("--load", str(source), *WEIGHTS_ONLY, check=False)
    assert refused.returncode != 0
    hint = refused.stderr[refused.stderr.index("gigatron convert-checkpoint") :].split("\n")[0]
    assert hint == (
        f"gigatron convert-checkpoint --load {source} --save <new dir> "
        "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1"
    )
    target = source.parent / "tp1"
    argv = hint.replace("<new dir>", str(target)).split()[1:]
    result = gigatron(*argv)
    assert "model weights only" in result.stdout and "optimizer" in result.stdout
    return target


def test_tp1_weights_are_the_merged_shards(source, tp1):
    shards = [_model(source / f"iter_0000002/mp_rank_0{r}/model_optim_rng.pt") for r in (0, 1)]
    (merged,) = _model(tp1 / "iter_0000002/mp_rank_00/model_optim_rng.pt").values()
    parts = [s["model"] for s in shards]
    assert sorted(merged) == sorted(parts[0])
    assert "output_layer.weight" not in merged  # tied embedding, pp = 1
    column = ("word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.")
    row = ("linear_proj.weight", "linear_fc2.weight")
    split_names = 0
    for name, full in merged.items():
        if any(name.endswith(c) or c in name for c in column):
            expected = torch.cat([p[name] for p in parts], 0)
            split_names += 1
        elif name.endswith(row):
            expected = torch.cat([p[name] for p in parts], 1)
            split_names += 1
        else:
            assert torch.equal(parts[0][name], parts[1][name]), name  # replicated over tp
            expected = parts[0][name]
        assert torch.equal(full, expected), name
    assert split_names == 1 + 4 * 6  # the embedding, 6 split tensors per layer
    assert (tp1 / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    state = torch.load(tp1 / "iter_0000002/mp_rank_00/model_optim_rng.pt", weights_only=True)
    assert "optimizer" not in state and "rng_state" not in state
    assert state["iteration"] == 2 and state["consumed_train_samples"] == 8
    assert state["args"]["parallel"]["tensor_model_parallel_size"] == 1


def test_tp1_evaluates_like_the_source(source, tp1):
    metrics = tp1.parent / "tp1_metrics.jsonl"
    result = _pretrain("--load", str(tp1), *WEIGHTS_ONLY, "--metrics-file", str(metrics))
    assert f"loaded checkpoint {tp1} at iteration 2 (consumed samples 8)\n" in result.stdout
    # Same weights, same test batch: only the tp reduction order could differ, and it does not.
    assert _test_loss(metrics) == pytest.approx(_test_loss(source / "metrics.jsonl"), abs=1e-6)


def test_loading_a_converted_checkpoint_names_the_conversion(source, tp1):
    refused = _pretrain("--load", str(tp1), "--skip-train", check=False)
    assert refused.returncode == 2
    assert (
        "was written by `gigatron convert-checkpoint` (from "
        f"{source / 'iter_0000002'}): it has no optimizer, learning-rate schedule or random "
        "states; pass --no-load-optim --no-load-rng"
    ) in refused.stderr
    assert "--no-save-optim" not in refused.stderr


def test_pipeline_with_virtual_stages(source):
    target = source.parent / "pp2"
    convert_checkpoint(source, target, target_tp=1, target_pp=2, target_vp=2)
    first = _model(target / "iter_0000002/mp_rank_00_000/model_optim_rng.pt")
    last = _model(target / "iter_0000002/mp_rank_00_001/model_optim_rng.pt")
    layers = {
        key: sorted({int(n.split(".")[2]) for n in chunk if n.startswith("decoder.layers.")})
        for key, chunk in {**{f"first{k}": v for k, v in first.items()}, **last}.items()
    }
    # Round-robin chunks: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3.
    assert layers == {
        "first" + "model0": [0],
        "first" + "model1": [2],
        "model0": [1],
        "model1": [3],
    }
    embedding = first["model0"]["embedding.word_embeddings.weight"]
    assert torch.equal(last["model1"]["output_layer.weight"], embedding)  # the tied copy
    metrics = target.parent / "pp2_metrics.jsonl"
    _pretrain(
        "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
        "--load", str(target), *WEIGHTS_ONLY, "--metrics-file", str(metrics), nproc=2,
    )  # fmt: skip
    assert _test_loss(metrics) == pytest.approx(_test_loss(source / "metrics.jsonl"), abs=1e-6)


def test_bad_input(source, tmp_path):
    with pytest.raises(GigatronError, match="does not divide the 4 attention heads"):
        convert_checkpoint(source, tmp_path / "a", target_tp=3, target_pp=1)
    with pytest.raises(GigatronError, match="do not split evenly over pipeline size 3"):
        convert_checkpoint(source, tmp_path / "b", target_tp=1, target_pp=3)
    with pytest.raises(GigatronError, match="no such directory"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "c", target_tp=1, target_pp=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(GigatronError, match="no latest_checkpointed_iteration.txt"):
        convert_checkpoint(tmp_path / "empty", tmp_path / "d", target_tp=1, target_pp=1)
    with pytest.raises(GigatronError, match="iter_0000007 is missing"):
        convert_checkpoint(source, tmp_path / "e", target_tp=1, target_pp=1, iteration=7)
    with pytest.raises(GigatronError, match="is the --load directory"):
        convert_checkpoint(source, source, target_tp=1, target_pp=1)
    assert not any(p.name.startswith(("a", "b")) for p in tmp_path.iterdir())
