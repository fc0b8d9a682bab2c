"""The model shape of a Megatron-LM checkpoint taken from the arguments it saved.

`gigatron pretrain ... --load DIR` on a checkpoint Megatron-LM wrote needs no model flags: the
shape (layers, sizes, heads, norms, positions, vocabulary padding, experts) comes from the
`args` Namespace in its files when the flags (or `--config`) do not give it. A flag that gives a
different value than the saved arguments is an error naming each such flag.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gigatron.checkpoint.megatron_dist import stored_args
from gigatron.checkpoint.megatron_format import is_megatron_state
from gigatron.checkpoint.torch_format import CHECKPOINT_FILENAME, locate_iteration, safe_load
from gigatron.config import GigatronConfig
from gigatron.config.fields import flag_name
from gigatron.config.parser import FlagParser
from gigatron.config.root import (
    SECTIONS,
    add_config_arguments,
    config_from_dict,
    config_from_namespace,
    load_yaml,
)
from gigatron.config.validate import finalize_config, validate_config
from gigatron.errors import GigatronError

# gigatron field -> Megatron's `args` attribute (the same name unless listed)
SHAPE_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "group_query_attention": "group_query_attention",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "max_position_embeddings": "max_position_embeddings",
    "position_embedding_type": "position_embedding_type",
    "rotary_percent": "rotary_percent",
    "rotary_base": "rotary_base",
    "rotary_seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
    "use_rope_scaling": "use_rope_scaling",
    "rope_scaling_factor": "rope_scaling_factor",
    "normalization": "normalization",
    "layernorm_epsilon": "norm_epsilon",
    "swiglu": "swiglu",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "openai_gelu": "openai_gelu",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
    "apply_residual_connection_post_layernorm": "apply_residual_connection_post_layernorm",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_topk": "moe_router_topk",
}
_FLAGS = {
    f.name: flag_name(f)
    for section in SECTIONS.values()
    for f in section.__dataclass_fields__.values()
}


def stored_megatron_args(load_dir: str | Path, iteration: int | None) -> dict[str, Any] | None:
    """The saved `args` of the Megatron-LM checkpoint in `load_dir` (None when there is none or
    it is not Megatron's)."""

    load_dir = Path(load_dir)
    if not load_dir.is_dir():
        return None
    located = locate_iteration(load_dir, iteration)
    if located is None:
        return None
    files = sorted(located[0].glob(f"mp_rank_*/{CHECKPOINT_FILENAME}"))
    if not files:
        return stored_args(located[0])  # Megatron's torch_dist: common.pt
    state = safe_load(files[0], mmap=True)
    args = state.get("args") if is_megatron_state(state) else None
    return vars(args) if args is not None else None  # a legacy file may hold no args


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return a == b


def shape_from_args(stored: dict[str, Any], given: dict[str, Any], load_dir: str) -> dict[str, Any]:
    """The stored shape values the flags do not give; raises on flags that contradict them."""
    values, conflicts = {}, []
    for field, attribute in SHAPE_FIELDS.items():
        if attribute not in stored or stored[attribute] is None:
            continue
        saved = stored[attribute]
        if field in given:
            if given[field] is not None and not _same(given[field], saved):
                conflicts.append(f"{_FLAGS[field]} {given[field]} (checkpoint: {saved})")
        else:
            values[field] = saved
    if "padded_vocab_size" in stored and "padded_vocab_size" not in given:
        values["padded_vocab_size"] = stored["padded_vocab_size"]
    if conflicts:
        raise GigatronError(
            f"--load {load_dir}: the flags disagree with the arguments Megatron-LM saved in the "
            f"checkpoint: {'; '.join(conflicts)}. Drop these flags to use the checkpoint's "
            "values, or load another checkpoint"
        )
    return values


def parse_config_with_checkpoint_args(
    argv: Sequence[str], prog: str, world_size: int | None
) -> GigatronConfig:
    """`parse_config`, with the model shape of a Megatron-LM checkpoint under `--load` filling
    what the flags leave out."""

    parser = FlagParser(prog=prog, allow_abbrev=False)
    add_config_arguments(parser)
    namespace = parser.parse_args(list(argv))
    given = {k: v for k, v in vars(namespace).items() if k != "config"}
    if namespace.config:
        yaml_values = config_from_dict(load_yaml(namespace.config), source=namespace.config)
        defaults = GigatronConfig()
        for name in SECTIONS:
            section, default = getattr(yaml_values, name), getattr(defaults, name)
            for field in section.__dataclass_fields__:
                if getattr(section, field) != getattr(default, field):
                    given.setdefault(field, getattr(section, field))
    base = GigatronConfig()
    load = given.get("load")
    stored = stored_megatron_args(load, given.get("ckpt_step")) if load else None
    if stored is not None:
        base = config_from_dict(shape_from_args(stored, given, load), base=base)
    cfg = config_from_namespace(namespace, base=base)
    finalize_config(cfg, world_size=world_size)
    validate_config(cfg, world_size=world_size)
    return cfg
