"""Megatron-LM's legacy model-class checkpoints (the layout of the NGC GPT-345M and BERT-345M
downloads; tests/data/megatron-fixtures/legacy-*, made by tests/tools/make_legacy_fixtures.py)
load as the same weights in Megatron-Core's layout: converted, the tensors are equal; started
from with --finetune, the first loss is the one Megatron-LM recorded for those weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gigatron.checkpoint.convert import main as convert_checkpoint
from gigatron.checkpoint.megatron_legacy import core_state, legacy_to_core, reorder_qkv
from gigatron.checkpoint.torch_format import safe_load
from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext
from megatron_fixtures import FIXTURES, record, resume


def _converted(tmp: Path, name: str, model_type: str) -> dict[str, torch.Tensor]:
    out = tmp / name
    convert_checkpoint(["--model-type", model_type, "--loader", "legacy",
                        "--load", str(FIXTURES / name), "--save", str(out)])  # fmt: skip
    (path,) = out.glob("*/mp_rank_00/model_optim_rng.pt")
    return safe_load(path)["model"]


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_qkv_rows_of_each_checkpoint_version_come_in_core_order():
    rows = torch.arange(6.0)  # 2 heads of head dim 1, version 0: [q0 q1 k0 k1 v0 v1]
    assert reorder_qkv(rows, 0, head_dim=1).tolist() == [0, 2, 4, 1, 3, 5]
    # 1 head of head dim 2, version 1: [q_d0 k_d0 v_d0 q_d1 k_d1 v_d1] -> [q_d0 q_d1 k_d0 ...]
    assert reorder_qkv(rows, 1, head_dim=2).tolist() == [0, 3, 1, 4, 2, 5]
    weight = torch.randn(12, 3)
    assert torch.equal(reorder_qkv(weight, 2, head_dim=2), weight)  # from version 2: core's order


def test_legacy_gpt_converts_to_megatrons_own_core_layout_weights(tmp_path):
    legacy = _converted(tmp_path, "legacy-gpt", "GPT")  # version 0, transformer/attention names
    _assert_same(legacy, _converted(tmp_path, "gpt2_tp1_torch", "GPT"))


def test_legacy_gpt_finetune_gives_megatrons_loss_of_those_weights(tmp_path):
    losses = resume("legacy-gpt", tmp_path, "--finetune", "--exit-interval", "1")
    assert losses[1] == pytest.approx(record("gpt2_tp1_torch")["next_loss"], abs=1e-5)


def test_legacy_bert_and_core_pooler_names_load_into_gigatrons_bert(tmp_path):
    legacy = _converted(tmp_path, "legacy-bert", "BERT")  # version 1, encoder/self_attention
    core = _converted(tmp_path, "legacy-bert-core", "BERT")  # pooler.dense.* of the core layout
    _assert_same(legacy, core)
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "64",
            "--make-vocab-size-divisible-by", "32"]  # fmt: skip
    (model,) = build_bert_model(parse_config(argv), ParallelContext.single(), vocab_size=64)
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    assert {k for k in legacy if not k.endswith("_extra_state")} == expected
    assert torch.equal(legacy["pooler.weight"], core["pooler.weight"])


def test_a_legacy_tensor_gigatron_does_not_know_is_named():
    model = {
        "language_model": {"encoder": {"layers.0.self_attention.rotary.weight": torch.ones(1)}}
    }
    with pytest.raises(GigatronError, match="layers.0.self_attention.rotary.weight"):
        legacy_to_core(model, 3.0, head_dim=16)


def _generated(tmp: Path, name: str) -> dict:
    from gigatron.inference.generate import main as generate

    out = tmp / f"{name}.jsonl"
    generate(["--load", str(FIXTURES / name), "--prompt", "5 9 12 40", "--greedy",
              "--max-tokens", "6", "--prompt-logprobs", "--output", str(out)])  # fmt: skip
    return json.loads(out.read_text())


def test_generate_reads_megatrons_legacy_and_core_files_alike(tmp_path):
    legacy, core = _generated(tmp_path, "legacy-gpt"), _generated(tmp_path, "gpt2_tp1_torch")
    assert legacy["tokens"] == core["tokens"] and len(core["tokens"]) == 6
    assert len(core["prompt_logprobs"]) == 3  # the tokens after the first
    assert legacy["prompt_logprobs"] == pytest.approx(core["prompt_logprobs"], abs=1e-6)


def test_a_legacy_file_without_args_takes_the_head_size_of_the_model():
    path = FIXTURES / "legacy-gpt" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(path)
    with_args = core_state(state)["model"]
    without = core_state({"model": state["model"]}, head_dim=8)["model"]  # hidden 32 / 4 heads
    _assert_same(without, with_args)
    with pytest.raises(GigatronError, match="attention head size"):
        core_state({"model": state["model"]})


def test_gigatrons_saved_args_read_as_megatrons_namespace_too(tmp_path):
    """Megatron-LM's load_checkpoint reads `args.num_layers`, ... of a file without --finetune;
    gigatron reads the same value as its nested configuration."""
    save = tmp_path / "save"
    resume("gpt2_tp1_torch", tmp_path, "--save", str(save), "--exit-interval", "4")
    trained = torch.load(save / "iter_0000004/mp_rank_00/model_optim_rng.pt", weights_only=True)
    converted = tmp_path / "converted"
    convert_checkpoint(["--loader", "core", "--load", str(FIXTURES / "gpt2_tp1_torch"),
                        "--save", str(converted)])  # fmt: skip
    copy = torch.load(converted / "iter_0000003/mp_rank_00/model_optim_rng.pt", weights_only=True)
    for args, iteration in ((trained["args"], 4), (copy["args"], 3)):
        assert args["model"]["num_layers"] == 2 and args["model"]["hidden_size"] == 32
        assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 32, 4)
        assert args.add_position_embedding and args.padded_vocab_size == 64
        assert args.iteration == iteration and args.params_dtype == torch.float32
    assert trained["args"].consumed_train_samples == 4 * 2  # global batch 2


def test_megatron_core_second_names_map_to_gigatrons_parameters():
    from gigatron.checkpoint.megatron_format import gigatron_name, model_to_gigatron

    bias = torch.arange(3.0)
    t5 = model_to_gigatron({"output_layer.bias": bias, "lm_head.output_layer.bias": bias})
    assert list(t5) == ["output_layer.bias"]  # T5's alias of the same tensor: one parameter
    assert gigatron_name("pooler.dense.weight") == "pooler.weight"  # BERT's Pooler module
    assert gigatron_name("encoder.layers.0.mlp.linear_fc1.weight").endswith("linear_fc1.weight")


def test_convert_of_a_file_without_args_takes_the_model_flags(tmp_path):
    """An older NGC-style file (legacy names, no args): `convert --from megatron` names the
    shape flags it needs, then builds the configuration from the flags given; the weights are
    those of the same file with its args."""
    from gigatron.checkpoint.hf_convert import main

    bare = tmp_path / "bare"
    (bare / "release" / "mp_rank_00").mkdir(parents=True)
    (bare / "latest_checkpointed_iteration.txt").write_text("release\n")
    state = safe_load(FIXTURES / "legacy-gpt" / "release" / "mp_rank_00" / "model_optim_rng.pt")
    saved = state.pop("args")
    torch.save(state, bare / "release" / "mp_rank_00" / "model_optim_rng.pt")
    command = ["--from", "megatron", "--to", "gigatron", "--load", str(bare)]
    with pytest.raises(GigatronError, match="pass --hidden-size, --num-attention-heads"):
        main([*command, "--save", str(tmp_path / "x"), "--num-layers", "2"])
    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--ffn-hidden-size", "64", "--max-position-embeddings", "32",
             "--seq-length", "32"]  # fmt: skip
    main([*command, "--save", str(tmp_path / "out"), *shape])
    main([*command[:-1], str(FIXTURES / "legacy-gpt"), "--save", str(tmp_path / "ref")])
    part = Path("release") / "mp_rank_00" / "model_optim_rng.pt"
    out, ref = safe_load(tmp_path / "out" / part), safe_load(tmp_path / "ref" / part)
    _assert_same(out["model"], ref["model"])
    assert out["args"]["model"]["padded_vocab_size"] == saved.padded_vocab_size == 64
    assert out["args"]["model"]["ffn_hidden_size"] == ref["args"]["model"]["ffn_hidden_size"]
    with pytest.raises(GigatronError, match="saved its args; drop the model flags"):
        main([*command[:-1], str(FIXTURES / "legacy-gpt"), "--save", str(tmp_path / "y"), *shape])
