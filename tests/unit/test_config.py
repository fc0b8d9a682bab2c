import pytest
import yaml

from gigatron.config import config_from_dict, parse_config
from gigatron.errors import GigatronError

BASE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
]


def test_megatron_flag_names_and_derived_values():
    cfg = parse_config([*BASE, "--swiglu", "--disable-bias-linear", "--norm-epsilon", "1e-6"])
    assert cfg.model.add_bias_linear is False
    assert cfg.model.layernorm_epsilon == 1e-6
    assert cfg.model.ffn_hidden_size == 128  # int(4*64*2/3 / 64) * 64
    assert cfg.model.kv_channels == 16
    assert cfg.model.num_query_groups == 4  # no GQA: one group per head
    assert cfg.model.max_position_embeddings == 32


def test_yaml_then_flags_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"num_layers": 6, "hidden_size": 64}, "lr": 3e-4}))
    cfg = parse_config(["--config", str(path), "--num-layers", "3", "--num-attention-heads", "4"])
    assert cfg.model.num_layers == 3
    assert cfg.model.hidden_size == 64
    assert cfg.optimizer.lr == 3e-4


def test_unknown_yaml_key_is_named(tmp_path):
    with pytest.raises(GigatronError, match="hiden_size"):
        config_from_dict({"hiden_size": 3})


def test_all_problems_reported_together():
    with pytest.raises(GigatronError) as info:
        parse_config(
            [
                "--num-layers",
                "2",
                "--hidden-size",
                "65",
                "--num-attention-heads",
                "4",
                "--fp16",
                "--bf16",
                "--split",
                "90,x,10",
            ]
        )
    message = str(info.value)
    assert "--fp16 and --bf16" in message
    assert "--hidden-size 65 is not divisible by --num-attention-heads 4" in message
    assert "--split '90,x,10': 'x' is not a non-negative number" in message


def test_sequence_parallel_without_tensor_parallel_is_turned_off_with_a_warning():
    """Megatron's rule, so that one script runs at any tensor-parallel size."""
    with pytest.warns(UserWarning, match="--sequence-parallel needs --tensor-model-parallel"):
        cfg = parse_config([*BASE, "--sequence-parallel"], world_size=2)
    assert cfg.parallel.sequence_parallel is False
    cfg = parse_config(
        [*BASE, "--sequence-parallel", "--tensor-model-parallel-size", "2"], world_size=2
    )
    assert cfg.parallel.sequence_parallel is True


def test_world_size_arithmetic_is_shown():
    with pytest.raises(
        GigatronError, match=r"world size 6 is not divisible by tp 4 x pp 1 x cp 1 = 4"
    ):
        parse_config([*BASE, "--tensor-model-parallel-size", "4"], world_size=6)


def test_global_batch_default_and_divisibility():
    cfg = parse_config(
        [*BASE, "--micro-batch-size", "2", "--tensor-model-parallel-size", "2"], world_size=8
    )
    assert cfg.training.global_batch_size == 8
    with pytest.raises(GigatronError, match="--global-batch-size 6 is not divisible"):
        parse_config([*BASE, "--micro-batch-size", "2", "--global-batch-size", "6"], world_size=4)


def test_interleaved_schedule_rules_checked_with_the_config():
    args = [*BASE, "--num-layers", "8", "--pipeline-model-parallel-size", "2",
            "--num-virtual-stages-per-pipeline-rank", "2", "--micro-batch-size", "1"]  # fmt: skip
    parse_config([*args, "--global-batch-size", "4"], world_size=2)
    with pytest.raises(GigatronError, match="leaves a last group of 1"):
        parse_config([*args, "--global-batch-size", "5"], world_size=2)


def test_the_yaml_example_is_a_complete_run_and_is_documented(tmp_path):
    """examples/pretrain_gpt_tiny.yaml (per-section keys) validates for training, its flat form
    gives the same configuration, and command-line flags override the file."""
    from pathlib import Path

    from gigatron.config import config_to_dict
    from gigatron.training.pretrain import parse_pretrain_config

    root = Path(__file__).resolve().parents[2]
    example = root / "examples" / "pretrain_gpt_tiny.yaml"
    cfg = parse_pretrain_config(["--config", str(example), "--train-iters", "20"], world_size=1)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.optimizer.lr) == (2, 64, 1e-3)
    assert cfg.training.exit_signal_handler is True and cfg.data.mock_data is True
    assert cfg.training.train_iters == 20  # the flag wins over the file's 50
    sections = yaml.safe_load(example.read_text())
    flat = {key: value for section in sections.values() for key, value in section.items()}
    (tmp_path / "flat.yaml").write_text(yaml.safe_dump(flat))
    flat_cfg = parse_pretrain_config(
        ["--config", str(tmp_path / "flat.yaml"), "--train-iters", "20"], world_size=1
    )
    assert config_to_dict(flat_cfg) == config_to_dict(cfg)
    docs = (root / "docs" / "training.md").read_text()
    assert "## Configuration files (YAML)" in docs and "pretrain_gpt_tiny.yaml" in docs
