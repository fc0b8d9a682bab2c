"""gigatron resumes from checkpoints written by Megatron-LM's own save_checkpoint
(tests/data/megatron-fixtures): the losses of the next two steps equal the ones Megatron
recorded, so weights, Adam moments, step count and learning-rate schedule all carried over
(the step-5 loss needs the saved moments: with --no-load-optim it differs)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gigatron.checkpoint.dcp_io import read_tensors
from gigatron.errors import GigatronError
from helpers import TIMEOUT_S, env, launcher
from megatron_fixtures import FIXTURES, record, resume

TOLERANCE = 1e-5


def assert_megatron_losses(name: str, losses: dict[int, float]) -> None:
    fixture = record(name)
    assert sorted(losses) == [4, 5]
    assert losses[4] == pytest.approx(fixture["next_loss"], abs=TOLERANCE)
    assert losses[5] == pytest.approx(fixture["loss_after_next_step"], abs=TOLERANCE)


@pytest.mark.parametrize(
    "name",
    [
        "gpt2_tp1_torch",
        "gpt2_tp1_torch_dist",
        "gpt2_dp2_distopt_torch",  # distrib_optim.pt, saved at dp 2
        "gpt2_dp2_distopt_torch_dist",  # dp_reshardable flat buffers, saved at dp 2
        "llama_tp2_torch_dist",  # saved at tp 2, loaded at tp 1
        "llama_tp2_distopt_torch_dist",  # flat buffers of each tp rank, merged at tp 1
        "moe_tp1_torch",  # experts' moments stacked per layer
        "moe_tp1_torch_dist",  # decoder.layers.mlp.experts.experts.* [layers, experts, ...]
    ],
)
def test_resume_at_tp1_gives_megatrons_next_losses(tmp_path, name):
    flags = ["--ckpt-format", "torch_dist"] if name.endswith("torch_dist") else []
    assert_megatron_losses(name, resume(name, tmp_path, *flags))


def test_mtp_layers_of_megatron_core_resume(tmp_path):
    """megatron-core 0.16.1's MTP block (`mtp.layers.0.transformer_layer.*`, TE norm names, not
    stacked) loads into gigatron's `mtp_model_layer`: Megatron's next two losses."""
    flags = ["--ckpt-format", "torch_dist", "--mtp-num-layers", "1"]
    assert_megatron_losses("mtp_tp1_torch_dist", resume("mtp_tp1_torch_dist", tmp_path, *flags))


def test_torch_dist_resumes_into_the_distributed_optimizer(tmp_path):
    name = "gpt2_dp2_distopt_torch_dist"
    flags = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
    assert_megatron_losses(name, resume(name, tmp_path, *flags))
    with pytest.raises(GigatronError, match="non-distributed optimizer only"):
        resume("gpt2_dp2_distopt_torch", tmp_path, "--use-distributed-optimizer")


def test_finetune_starts_from_the_weights(tmp_path):
    losses = resume("llama_tp2_torch_dist", tmp_path, "--ckpt-format", "torch_dist", "--finetune")
    assert sorted(losses) == [1, 2, 3, 4, 5]  # a new run: iteration 1 on Megatron's next batch
    assert losses[1] == pytest.approx(record("llama_tp2_torch_dist")["next_loss"], abs=TOLERANCE)


def test_moments_matter(tmp_path):
    """Without the saved moments the step after the next one differs: the check above reads them."""
    losses = resume(
        "gpt2_tp1_torch_dist", tmp_path, "--ckpt-format", "torch_dist", "--no-load-optim"
    )
    fixture = record("gpt2_tp1_torch_dist")
    assert losses[4] == pytest.approx(fixture["next_loss"], abs=TOLERANCE)
    assert abs(losses[5] - fixture["loss_after_next_step"]) > 1e-3


@pytest.mark.parametrize(
    "spec",
    [
        "llama_tp2_torch:--tensor-model-parallel-size,2",  # the saved layout
        "llama_tp2_distopt_torch:--tensor-model-parallel-size,2",  # each rank's distrib_optim.pt
        "gpt2_tp1_torch_dist:--tensor-model-parallel-size,2,--ckpt-format,torch_dist",  # saved at tp 1
    ],
    ids=["llama_tp2_torch", "llama_tp2_distopt_torch", "gpt2_tp1_torch_dist"],
)
def test_resume_at_tp2_gives_megatrons_next_losses(tmp_path, spec):
    """Two processes under torchrun (one resume per launch: a run ends its process group)."""
    out = tmp_path / "losses.json"
    script = Path(__file__).resolve().parents[1] / "megatron_fixtures.py"
    subprocess.run([*launcher(2), str(script), str(out), spec], env=env(), check=True,
                   timeout=TIMEOUT_S, capture_output=True)  # fmt: skip
    ((name, losses),) = json.loads(out.read_text()).items()
    assert name == spec.partition(":")[0]
    assert_megatron_losses(name, {int(k): v for k, v in losses.items()})


def _llama_model(*flags: str):
    """gigatron's model of the Llama-style fixtures' shape (flags may change it)."""
    from gigatron.config import parse_config
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext

    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--normalization",
             "RMSNorm", "--swiglu", "--ffn-hidden-size", "32", "--position-embedding-type",
             "rope", "--group-query-attention", "--num-query-groups", "2",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--micro-batch-size", "2", "--train-iters", "1", "--padded-vocab-size", "64"]  # fmt: skip
    cfg = parse_config([*shape, *flags])
    (chunk,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=64)
    return cfg, chunk


def _load(directory: Path, chunk, cfg) -> None:
    from gigatron.checkpoint.megatron_dist import load_located
    from gigatron.checkpoint.state import Located, TrainingState
    from gigatron.parallel.context import ParallelContext

    located = Located(directory, directory / "iter_0000003", 3, False)
    load_located(located, TrainingState([chunk]), ParallelContext.single(), cfg)


def test_tensors_of_an_architecture_the_model_lacks_are_named():
    cfg, dense = _llama_model()
    with pytest.raises(GigatronError) as error:
        _load(FIXTURES / "moe_tp1_torch_dist", dense, cfg)
    message = str(error.value)
    assert "tensors this model does not have" in message
    assert "decoder.layers.mlp.router.weight" in message
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in message


def test_a_missing_shard_file_is_named(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_tp2_torch_dist", copy)
    (copy / "iter_0000003" / "__1_0.distcp").unlink()
    cfg, model = _llama_model()
    with pytest.raises(GigatronError, match=r"shard file\(s\) __1_0\.distcp are missing"):
        _load(copy, model, cfg)
    (copy / "iter_0000003" / "__1_0.distcp").write_bytes(b"")
    shutil.copy(FIXTURES / "llama_tp2_torch_dist" / "iter_0000003" / "__1_0.distcp",
                copy / "iter_0000003" / "__1_0.distcp")  # fmt: skip
    _load(copy, model, cfg)  # whole again: loads
    saved = read_tensors(copy / "iter_0000003", ["decoder.layers.mlp.linear_fc2.weight"])
    stacked = saved["decoder.layers.mlp.linear_fc2.weight"]
    assert torch.equal(model.state_dict()["decoder.layers.1.mlp.linear_fc2.weight"], stacked[1])


def test_convert_from_megatron_torch_dist_gives_the_loaded_weights(tmp_path):
    from gigatron.checkpoint.hf_convert import main
    from gigatron.checkpoint.torch_format import safe_load

    main(["--from", "megatron", "--to", "gigatron", "--load",
          str(FIXTURES / "llama_tp2_torch_dist"), "--save", str(tmp_path / "out")])  # fmt: skip
    converted = safe_load(tmp_path / "out" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    cfg, model = _llama_model()
    _load(FIXTURES / "llama_tp2_torch_dist", model, cfg)
    loaded = model.state_dict()
    assert converted["model"].keys() == loaded.keys()
    assert all(torch.equal(converted["model"][k], loaded[k]) for k in loaded)
    assert converted["args"]["model"]["num_query_groups"] == 2


def test_random_states_are_restored_at_the_saved_layout():
    from gigatron.checkpoint.megatron_dist import read_bytes
    from gigatron.config import parse_config
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext
    from gigatron.torch_files import load_megatron_object

    gpt2 = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--ffn-hidden-size", "64",
            "--micro-batch-size", "2", "--train-iters", "1", "--padded-vocab-size", "64"]  # fmt: skip
    cfg = parse_config(gpt2)
    (model,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=64)
    directory = FIXTURES / "gpt2_tp1_torch_dist"
    torch.manual_seed(0)
    _load(directory, model, cfg)
    ((saved,),) = load_megatron_object(
        read_bytes(directory / "iter_0000003", "rng_state/shard_0.0_1.1")
    )  # [[the states of dp rank 0]]
    assert torch.equal(torch.get_rng_state(), saved["torch_rng_state"])
    assert np.random.get_state()[2] == saved["np_rng_state"][2]
    assert random.getstate() == saved["random_rng_state"]
    cfg, llama = _llama_model()  # saved at tp 2, loaded at tp 1: other random streams
    with pytest.warns(UserWarning, match="random states are not restored"):
        _load(FIXTURES / "llama_tp2_torch_dist", llama, cfg)


@pytest.mark.parametrize(
    "name", ["llama_tp2_torch_dist", "moe_tp1_torch_dist", "mtp_tp1_torch_dist"]
)
def test_convert_to_megatron_torch_dist_writes_megatrons_own_files(tmp_path, name):
    """Megatron's files -> gigatron at tp 2 -> `--to megatron --ckpt-format torch_dist`: the
    model entries Megatron's save_checkpoint wrote, the same keys, shapes and values."""
    from gigatron.checkpoint.dcp_io import read_metadata
    from gigatron.checkpoint.hf_convert import main
    from gigatron.checkpoint.megatron_dist import read_common
    from gigatron.checkpoint.torch_format import safe_load

    main(["--from", "megatron", "--to", "gigatron", "--load", str(FIXTURES / name),
          "--save", str(tmp_path / "g"), "--target-tensor-parallel-size", "2"])  # fmt: skip
    main(["--from", "gigatron", "--to", "megatron", "--ckpt-format", "torch_dist",
          "--load", str(tmp_path / "g"), "--save", str(tmp_path / "m")])  # fmt: skip
    original = read_metadata(FIXTURES / name / "iter_0000003").state_dict_metadata
    written = read_metadata(tmp_path / "m" / "iter_0000003").state_dict_metadata
    model_keys = {k for k in original if not k.startswith(("optimizer.", "rng_state"))}
    assert set(written) == model_keys
    tensors = [k for k in model_keys if hasattr(original[k], "size")]
    assert all(written[k].size == original[k].size for k in tensors)
    saved = read_tensors(FIXTURES / name / "iter_0000003", tensors)
    again = read_tensors(tmp_path / "m" / "iter_0000003", tensors)
    assert all(torch.equal(saved[k], again[k]) for k in tensors)
    common = safe_load(tmp_path / "m" / "iter_0000003" / "common.pt")
    assert (common["args"].num_layers, common["iteration"]) == (2, 3)
    # what Megatron's check_checkpoint_args compares and its resume reads: Megatron's own values
    theirs = read_common(FIXTURES / name / "iter_0000003")["args"]
    checked = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
               "max_position_embeddings", "padded_vocab_size", "consumed_train_samples")  # fmt: skip
    assert {k: getattr(common["args"], k) for k in checked} == {
        k: getattr(theirs, k) for k in checked
    }
    assert (
        json.loads((tmp_path / "m" / "iter_0000003" / "metadata.json").read_text())[
            "sharded_backend"
        ]
        == "torch_dist"
    )


@pytest.mark.parametrize("name", ["gpt2_tp1_torch", "moe_tp1_torch"])
def test_convert_to_megatron_torch_writes_megatrons_own_entries(tmp_path, name):
    """Megatron's file -> gigatron -> `--to megatron` (torch format): the entries Megatron's
    save_checkpoint wrote (SequentialMLP's `local_experts.{e}`, each linear's `_extra_state`),
    the same values: Megatron's strict load reads it (make_megatron_fixtures.py --verify)."""
    from gigatron.checkpoint.hf_convert import main
    from gigatron.checkpoint.torch_format import safe_load

    main(["--from", "megatron", "--to", "gigatron", "--load", str(FIXTURES / name),
          "--save", str(tmp_path / "g")])  # fmt: skip
    main(["--from", "gigatron", "--to", "megatron", "--load", str(tmp_path / "g"),
          "--save", str(tmp_path / "m")])  # fmt: skip
    part = Path("iter_0000003") / "mp_rank_00" / "model_optim_rng.pt"
    original = safe_load(FIXTURES / name / part)["model"]
    written = safe_load(tmp_path / "m" / part)["model"]
    assert written.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(written[key], value) if value is not None else written[key] is None
