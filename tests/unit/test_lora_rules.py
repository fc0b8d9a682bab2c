"""LoRA's rules in one process: the flags that cannot go with it are refused with one line each,
an adapted chunk loads a state of its adapters alone or of its base alone but not one lacking
some of both, and `convert` refuses LoRA flags where they mean nothing."""

from __future__ import annotations

import re

import pytest
import torch

from gigatron.checkpoint.hf_convert import main as convert_main
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.models import build_model
from gigatron.models.lora import LoRASpec, add_lora_adapters, is_adapter_name
from gigatron.parallel.context import ParallelContext
from gigatron.training.pretrain import parse_pretrain_config
from helpers import tiny_gpt_flags
from parallel_helpers import tiny_tp_config

FLAGS = [*tiny_gpt_flags(), "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
         "--lora-target-modules", "linear_qkv"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--lora-rank", "0"], "--lora-rank is 0; it must be positive"),
        (["--lora-dropout", "1"], "--lora-dropout 1.0 must lie in [0, 1)"),
        (["--lora-dora", "--lora-dropout", "0.1"], "--lora-dora with --lora-dropout 0.1"),
        (["--lora-dora", "--use-torch-fsdp2"], "with --lora-dora is not available yet"),
    ],
)
def test_lora_flags_that_cannot_work_are_refused(extra, expected):
    with pytest.raises(GigatronError, match=re.escape(expected)):
        parse_pretrain_config([*FLAGS, *extra], world_size=2)
    plain = [f for f in FLAGS if f not in ("--lora-target-modules", "linear_qkv")]
    with pytest.raises(GigatronError, match="--lora-dora: adapts the --lora-target-modules"):
        parse_pretrain_config([*plain, "--lora-dora"], world_size=1)


def test_an_unknown_target_module_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_pretrain_config([*FLAGS, "linear_fc3"], world_size=1)
    assert "linear_fc3" in capsys.readouterr().err


def test_adapted_chunk_loads_adapters_alone_or_base_alone_only():
    cfg = tiny_tp_config(8, 1, False)
    cfg.model.num_attention_heads = 4
    (model,) = build_model(cfg, ParallelContext.single())
    full = {k: v.clone() for k, v in model.state_dict().items()}
    spec = LoRASpec(("linear_qkv", "linear_fc2"), rank=2, alpha=4.0)
    add_lora_adapters([model], spec, ParallelContext.single(), seed=3)
    adapters = model.state_dict()
    assert sorted(adapters) == sorted(
        f"decoder.layers.{i}.{m}.adapter.linear_{x}.weight"
        for i in (0, 1) for m in ("self_attention.linear_qkv", "mlp.linear_fc2") for x in ("in", "out")
    )  # fmt: skip
    assert all(torch.equal(t, torch.zeros_like(t)) for k, t in adapters.items() if "_out" in k)
    model.load_state_dict(full)  # the base alone (a pretrained checkpoint)
    model.load_state_dict(adapters)  # the adapters alone (a LoRA run's checkpoint)
    partial = {k: v for k, v in full.items() if "layers.0" not in k}
    partial.update({k: v for k, v in adapters.items() if "layers.1" in k})
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict(partial)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--from", "hf", "--to", "gigatron", "--merge-lora"], "--merge-lora"),
        (["--from", "gigatron", "--to", "hf", "--pretrained-checkpoint", "x"],
         "--pretrained-checkpoint"),
    ],
)  # fmt: skip
def test_convert_refuses_lora_flags_where_they_mean_nothing(tmp_path, argv, flag):
    with pytest.raises(GigatronError, match=f"{flag}: no meaning"):
        convert_main([*argv, "--load", str(tmp_path), "--save", str(tmp_path / "out")])


def test_dora_on_moe_experts_is_refused():
    cfg = tiny_tp_config(8, 1, False)
    cfg.model.num_attention_heads = 4
    cfg.moe.num_experts, cfg.moe.moe_router_topk = 2, 1
    (model,) = build_model(finalize_config(cfg), ParallelContext.single())
    spec = LoRASpec(("linear_fc1",), rank=2, alpha=4.0, dora=True)
    with pytest.raises(GigatronError, match="--lora-dora on MoE experts"):
        add_lora_adapters([model], spec, ParallelContext.single(), seed=3)
