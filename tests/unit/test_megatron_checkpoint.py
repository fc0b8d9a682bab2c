"""Checkpoints as Megatron-LM writes them (`--ckpt-format torch`) load with `--load`.

The files are written here the way Megatron-LM writes them, without Megatron: `args` is an
`argparse.Namespace` holding a Megatron enum value (from a stub `megatron.core.enums` module this
test creates and removes from sys.modules before loading), `signal.Signals` and a dtype; the
random states hold numpy's get_state tuple; model entries are in Megatron's registration order,
with the local or the Transformer Engine names (norms fused into the next linear, `_extra_state`
entries); the optimizer state is torch's, indexed by position in Megatron's parameter groups
(weights with weight decay, then biases and norms)."""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import signal
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gigatron.checkpoint.torch_format import safe_load
from gigatron.errors import GigatronError
from gigatron.optim.optimizer import get_param_groups
from gigatron.torch_files import load_megatron_file
from gigatron.training.pretrain import parse_pretrain_config, pretrain
from helpers import EnumsByGetattr, GetattrOf

FLAGS = [
    "--mock-data", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "0.01", "--min-lr", "0.001",
    "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--log-interval", "1",
    "--weight-decay", "0.1", "--seed", "5", "--make-vocab-size-divisible-by", "32",
    "--eval-iters", "0",
]  # fmt: skip
MEGATRON_LAYER_ORDER = (  # a TransformerLayer's parameters as Megatron registers them
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
)  # fmt: skip
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
TE_LAYER_ORDER = (  # TE's LayerNormLinear registers its norm before its weight
    "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
    "self_attention.linear_qkv._extra_state",
    "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2.weight", "mlp.linear_fc2.bias", "mlp.linear_fc2._extra_state",
)  # fmt: skip


def _stub_megatron_enums() -> type:
    """A `megatron.core.enums.ModelType` importable while the file is written."""
    modules = {name: types.ModuleType(name) for name in ("megatron", "megatron.core")}
    enums = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1
        encoder_and_decoder = 2

    ModelType.__module__ = "megatron.core.enums"
    ModelType.__qualname__ = "ModelType"
    enums.ModelType = ModelType
    modules["megatron.core.enums"] = enums
    sys.modules.update(modules)
    return ModelType


def _forget_megatron() -> None:
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


def _megatron_order(model: dict, te: bool, layers: int) -> list[str]:
    names = ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    for i in range(layers):
        order = TE_LAYER_ORDER if te else MEGATRON_LAYER_ORDER
        names += [f"decoder.layers.{i}.{name}" for name in order]
    names += ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias"]
    return names + (["output_layer.weight"] if "output_layer.weight" in model else [])


def write_megatron_checkpoint(gigatron_dir: Path, out: Path, te: bool, iteration: int) -> None:
    """Re-write gigatron's tp = pp = 1 checkpoint of `iteration` as Megatron-LM writes it."""
    state = safe_load(gigatron_dir / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    cfg_values = state["args"]
    model_type = _stub_megatron_enums()
    args = argparse.Namespace(
        **{k: v for section in cfg_values.values() for k, v in section.items()}
    )
    args.norm_epsilon = args.layernorm_epsilon  # Megatron's dest for --norm-epsilon
    args.model_type = model_type.encoder_or_decoder
    args.exit_signal = signal.SIGTERM
    args.params_dtype = torch.float32
    args.consumed_train_samples = state["consumed_train_samples"]
    args.consumed_valid_samples = state["consumed_valid_samples"]
    args.padded_vocab_size = state["model"]["embedding.word_embeddings.weight"].shape[0]

    layers = cfg_values["model"]["num_layers"]
    gigatron_model = state["model"]
    model = {}
    for name in _megatron_order(gigatron_model, te, layers):
        if name.endswith("_extra_state"):
            model[name] = io.BytesIO() if "fc2" in name else torch.tensor([], dtype=torch.uint8)
            continue
        local = name
        for ours, theirs in TE_NAMES.items():
            local = local.replace(theirs, ours)
        model[name] = gigatron_model[local]
    assert {n for n in model if not n.endswith("_extra_state")} != set(), "empty"

    # gigatron's optimizer positions -> Megatron's (groups: with weight decay, then without).
    from gigatron.config import config_from_dict
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext

    cfg = config_from_dict(cfg_values)
    (chunk,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=96)
    ids = {id(p): n for n, p in chunk.named_parameters()}
    gigatron_names = [ids[id(p)] for group in get_param_groups([chunk]) for p in group["params"]]
    megatron_params = []
    for name in model:
        if name.endswith("_extra_state"):
            continue
        local = name
        for ours, theirs in TE_NAMES.items():
            local = local.replace(theirs, ours)
        megatron_params.append((local, model[name]))
    decay = [n for n, t in megatron_params if not (n.endswith(".bias") or t.dim() == 1)]
    no_decay = [n for n, t in megatron_params if n.endswith(".bias") or t.dim() == 1]
    saved_inner = state["optimizer"]["optimizer"]
    old_state = saved_inner["state"]
    torch_state, position = {}, 0
    groups = []
    for members, wd_mult in ((decay, 1.0), (no_decay, 0.0)):
        ids_in_group = []
        for name in members:
            entry = dict(old_state[gigatron_names.index(name)])
            torch_state[position] = entry
            ids_in_group.append(position)
            position += 1
        template = dict(saved_inner["param_groups"][0 if wd_mult else 1])
        template.update(params=ids_in_group, wd_mult=wd_mult, lr_mult=1.0, max_lr=0.01)
        groups.append(template)
    optimizer = {"state": torch_state, "param_groups": groups}  # FP32Optimizer: torch's own
    mains = state["optimizer"].get("fp32_from_fp16_params")
    if mains is not None:  # Float16OptimizerWithFloat16Params: fp32 main copies per group
        by_name = dict(zip(gigatron_names, mains))
        optimizer = {
            "optimizer": optimizer,
            "fp32_from_fp16_params": [
                [by_name[n] for n in members] for members in (decay, no_decay)
            ],
        }

    rng = dict(state["rng_state"])
    np_state = rng["np_rng_state"]
    rng["np_rng_state"] = (
        np_state["algorithm"],
        np_state["keys"].numpy().astype(np.uint32),
        np_state["pos"],
        np_state["has_gauss"],
        np_state["cached_gaussian"],
    )
    version, internal, gauss = rng["random_rng_state"]
    rng["random_rng_state"] = (version, tuple(internal), gauss)  # random.getstate()
    megatron_state = {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "model": model,
        "optimizer": optimizer,
        "opt_param_scheduler": state["opt_param_scheduler"],
        "rng_state": [rng],
        "rerun_state_machine": {"mode": model_type.encoder_or_decoder},
        "num_floating_point_operations_so_far": state["num_floating_point_operations_so_far"],
    }
    path = out / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    torch.save(megatron_state, path)
    (out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    _forget_megatron()


SHAPE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads")
SHAPE_FLAGS += ("--max-position-embeddings", "--make-vocab-size-divisible-by")


def _without_shape(flags: list[str]) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in SHAPE_FLAGS:
            skip = True
        else:
            out.append(flag)
    return out


def _run(tmp: Path, *flags: str, shape: bool = True):
    base = FLAGS if shape else _without_shape(FLAGS)
    metrics = ["--metrics-file", str(tmp / "metrics.jsonl")]
    cfg = parse_pretrain_config([*base, *flags, *metrics], world_size=1)
    result, _ = pretrain(cfg, stream=io.StringIO())
    return result


def _reference(directory: Path, *flags: str):
    """A run of 6 iterations that saves at iteration 3."""
    result = _run(
        directory, "--train-iters", "6", "--save", str(directory / "ckpt"), "--save-interval", "3",
        *flags,
    )  # fmt: skip
    return directory, result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("reference"))


def test_bf16_resume_maps_the_fp32_main_parameters(tmp_path):
    directory, full = _reference(tmp_path / "reference", "--bf16")
    write_megatron_checkpoint(directory / "ckpt", tmp_path / "megatron", False, 3)
    written = torch.load(
        tmp_path / "megatron" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt",
        weights_only=False,
        pickle_module=_lenient(),
    )
    _forget_megatron()
    assert len(written["optimizer"]["fp32_from_fp16_params"]) == 2
    resumed = _run(tmp_path, "--train-iters", "6", "--load", str(tmp_path / "megatron"), "--bf16")
    for iteration in (4, 5, 6):
        assert resumed.train_losses[iteration] == pytest.approx(
            full.train_losses[iteration], rel=1e-6
        )


@pytest.mark.parametrize("te", [False, True], ids=["local-names", "te-names"])
def test_full_resume_from_megatron_continues_the_same_run(tmp_path, reference, te):
    directory, full = reference
    write_megatron_checkpoint(directory / "ckpt", tmp_path / "megatron", te, 3)
    assert "megatron" not in sys.modules
    # with Transformer Engine names, the model flags are left out: the saved args give the shape
    resumed = _run(
        tmp_path, "--train-iters", "6", "--load", str(tmp_path / "megatron"), shape=not te
    )
    assert "megatron" not in sys.modules and "megatron.core.enums" not in sys.modules
    assert sorted(resumed.train_losses) == [4, 5, 6]
    for iteration in (4, 5, 6):
        assert resumed.train_losses[iteration] == pytest.approx(
            full.train_losses[iteration], rel=1e-6
        )


def test_finetune_loads_weights_only(tmp_path, reference):
    directory, full = reference
    write_megatron_checkpoint(directory / "ckpt", tmp_path / "megatron", True, 3)
    result = _run(
        tmp_path, "--train-iters", "3", "--load", str(tmp_path / "megatron"), "--finetune"
    )
    assert sorted(result.train_losses) == [1, 2, 3]
    # the weights of iteration 3, a fresh optimizer at iteration 1: the loss of a trained model
    assert result.train_losses[1] < full.train_losses[1]


def test_other_pickled_objects_are_still_refused(tmp_path, reference):
    directory, _ = reference
    write_megatron_checkpoint(directory / "ckpt", tmp_path / "megatron", False, 3)
    path = tmp_path / "megatron" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False, pickle_module=_lenient())
    state["hook"] = print  # a callable: never allowed
    torch.save(state, path)
    _forget_megatron()
    with pytest.raises(GigatronError, match="refused to load"):
        safe_load(path)


def test_enum_members_pickled_by_getattr_load(tmp_path):
    """Python 3.11.0-3.11.4 pickle enum members as getattr(class, name): a Megatron enum (its
    inert stand-in keeps the name) and a signal load; getattr of anything else is refused."""
    model_type = _stub_megatron_enums()
    args = argparse.Namespace(model_type=model_type.encoder_and_decoder, signal=signal.SIGTERM)
    module = types.SimpleNamespace(**vars(pickle))
    module.Pickler = EnumsByGetattr
    for name, extra in (("ok", {}), ("reach", {"hook": GetattrOf(argparse.Namespace, "__init__")})):
        torch.save({"args": args, "w": torch.ones(2), **extra}, tmp_path / name,
                   pickle_module=module)  # fmt: skip
    _forget_megatron()
    assert b"getattr" in (tmp_path / "ok").read_bytes()
    state = load_megatron_file(tmp_path / "ok")
    assert state["args"].signal == signal.SIGTERM and torch.equal(state["w"], torch.ones(2))
    stored = state["args"].model_type
    assert (stored.qualified_name, stored.args) == (
        "megatron.core.enums.ModelType",
        ("encoder_and_decoder",),
    )
    with pytest.raises(pickle.UnpicklingError, match="getattr of '__init__' on"):
        load_megatron_file(tmp_path / "reach")


def _lenient():
    """Unpickling with Megatron's classes faked (only to rewrite the test file)."""
    _stub_megatron_enums()
    return pickle


def test_model_shape_from_saved_args_and_conflicts_flag_by_flag(tmp_path, reference):
    directory, _ = reference
    write_megatron_checkpoint(directory / "ckpt", tmp_path / "megatron", False, 3)
    flags = [*_without_shape(FLAGS), "--train-iters", "6", "--load", str(tmp_path / "megatron")]
    cfg = parse_pretrain_config(flags, world_size=1)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (2, 32, 4)
    assert (m.max_position_embeddings, m.padded_vocab_size) == (16, 96)
    given = [*flags, "--hidden-size", "64", "--num-layers", "3", "--num-attention-heads", "4"]
    with pytest.raises(GigatronError) as error:
        parse_pretrain_config(given, world_size=1)
    message = str(error.value)
    assert "--hidden-size 64 (checkpoint: 32)" in message
    assert "--num-layers 3 (checkpoint: 2)" in message
    assert "--num-attention-heads" not in message  # it agrees


def test_export_to_megatron_and_import_again(tmp_path, reference):
    from gigatron.checkpoint.convert import convert_checkpoint
    from gigatron.checkpoint.hf_convert import main

    directory, _ = reference
    ckpt, megatron = directory / "ckpt", tmp_path / "megatron"
    main(["--from", "gigatron", "--to", "megatron", "--load", str(ckpt), "--save",
          str(megatron), "--ckpt-step", "3", "--megatron-te-names"])  # fmt: skip
    path = megatron / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    written = torch.load(path, weights_only=False)
    args = written["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.num_layers, args.hidden_size, args.padded_vocab_size) == (2, 32, 96)
    assert args.consumed_train_samples == 12 and written["iteration"] == 3
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in written["model"]
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in written["model"]
    assert written["model"]["decoder.layers.1.mlp.linear_fc2._extra_state"] is None

    back = tmp_path / "back"
    main(["--from", "megatron", "--to", "gigatron", "--load", str(megatron), "--save",
          str(back), "--target-tensor-parallel-size", "2"])  # fmt: skip
    assert sorted(p.name for p in (back / "iter_0000003").iterdir()) == [
        "mp_rank_00",
        "mp_rank_01",
    ]
    convert_checkpoint(back, tmp_path / "tp1", 1, 1)
    original = safe_load(ckpt / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")["model"]
    again = safe_load(tmp_path / "tp1" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    assert again["model"].keys() == original.keys()
    assert all(torch.equal(again["model"][k], original[k]) for k in original)


@pytest.mark.parametrize("style", ["sequential", "te-grouped"])
def test_moe_expert_weights_of_both_styles_load(tmp_path, style):
    from gigatron.checkpoint.torch_format import load_checkpoint
    from gigatron.config import parse_config
    from gigatron.families import get_family
    from gigatron.parallel.context import ParallelContext

    flags = [*FLAGS[1:], "--num-experts", "4", "--moe-router-topk", "2", "--train-iters", "1"]
    flags += ["--disable-bias-linear"]
    source_cfg = parse_config([*flags, "--seed", "1"])
    (source,) = get_family("gpt").build_model(source_cfg, ParallelContext.single(), vocab_size=96)
    model = {}
    for name, tensor in source.state_dict().items():
        if ".mlp.experts.linear_fc" in name:
            prefix, fc = name.rsplit(".", 2)[0], name.split(".")[-2]
            for e, weight in enumerate(tensor):
                key = (
                    f"{prefix}.local_experts.{e}.{fc}.weight"
                    if style == "sequential"
                    else f"{prefix}.{fc}.weight{e}"
                )
                model[key] = weight.clone()
        else:
            model[name] = tensor
    _stub_megatron_enums()
    path = tmp_path / "megatron" / "release" / "mp_rank_00" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True)
    args = argparse.Namespace(num_layers=2, num_experts=4, model_type=sys.modules[
        "megatron.core.enums"].ModelType.encoder_or_decoder)  # fmt: skip
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": model}, path)
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("release")
    _forget_megatron()

    cfg = parse_config([*flags, "--finetune"])
    (target,) = get_family("gpt").build_model(cfg, ParallelContext.single(), vocab_size=96)
    assert not torch.equal(
        target.state_dict()["decoder.layers.0.mlp.experts.linear_fc1.weight"],
        source.state_dict()["decoder.layers.0.mlp.experts.linear_fc1.weight"],
    )
    load_checkpoint(tmp_path / "megatron", [target], None, None, ParallelContext.single(), cfg)
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
