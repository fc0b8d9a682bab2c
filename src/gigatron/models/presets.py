"""The `gigatron presets` command: the named model shapes (config/presets.py) with their
parameter counts."""

from __future__ import annotations

from collections.abc import Sequence

from gigatron.config.parser import command_parser
from gigatron.config.presets import PRESET_VOCAB_SIZE, PRESETS
from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.models.params import count_parameters


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def preset_table() -> str:
    """A markdown table of every preset with its parameter count."""

    header = (
        "| preset | layers | hidden | heads | kv groups | ffn | seq | position | norm | mlp | "
        "vocab | parameters |"
    )
    lines = [header, "|" + "---|" * 12]
    for name in PRESETS:
        cfg = GigatronConfig()
        cfg.model.model_preset = name
        finalize_config(cfg)
        m = cfg.model
        counts = count_parameters(cfg, PRESET_VOCAB_SIZE[name])
        lines.append(
            f"| {name} | {m.num_layers} | {m.hidden_size} | {m.num_attention_heads} | "
            f"{m.num_query_groups} | {m.ffn_hidden_size} | {m.seq_length} | "
            f"{m.position_embedding_type} | {m.normalization} | "
            f"{'SwiGLU' if m.swiglu else 'GeLU'} | {PRESET_VOCAB_SIZE[name]} | "
            f"{_human(counts.total)} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`gigatron presets`: print the named model shapes."""
    parser = command_parser(
        "presets",
        "List the named model shapes usable with --model-preset, with their "
        "layers, hidden size, heads, vocabulary and parameter count.",
        epilog=f"presets: {', '.join(PRESETS)}",
    )
    parser.parse_args(list(argv or []))
    print(preset_table())
    return 0
