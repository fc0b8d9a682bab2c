"""Weight map between gigatron hybrid-model state dicts of pure Mamba stacks (full tensors, as at
tp = 1) and Hugging Face `Mamba2ForCausalLM` state dicts, both directions.

The mixer's tensors have the same names and layouts on both sides (in_proj [z; x; B; C; dt],
conv1d over [x; B; C], per-head dt_bias / A_log / D, the grouped gated norm), so the map only
renames, and pads (import) or cuts (export) the vocabulary rows. A tied output layer has no
tensor of its own on the gigatron side.
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import export_ends, pad_rows

StateDict = dict[str, torch.Tensor]

_MIXER = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D")
_MIXER += ("norm.weight", "out_proj.weight")


def _layer_names(num_layers: int) -> list[tuple[str, str]]:
    """(Hugging Face name, gigatron name) of every layer weight, in layer order."""
    names = []
    for i in range(num_layers):
        theirs, ours = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        names.append((theirs + "norm.weight", ours + "norm.weight"))
        names += [(f"{theirs}mixer.{name}", f"{ours}mixer.{name}") for name in _MIXER]
    return names


class Mamba2HFAdapter:
    """The mamba family's Hugging Face adapter (`Mamba2ForCausalLM`)."""

    hf_class_name = "Mamba2ForCausalLM"
    model_types = ("mamba2",)
    auto_class = "AutoModelForCausalLM"

    def config_from_hf(self, hf_config: Any) -> dict[str, Any]:
        """gigatron ModelConfig values (plus `vocab_size`) for a Hugging Face Mamba2Config."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        unsupported = [
            (c.get("use_bias", False), "use_bias=True (Megatron's mixer has no linear biases)"),
            (not c.get("use_conv_bias", True), "use_conv_bias=False"),
            (c.get("conv_kernel", 4) != 4, f"conv_kernel={c.get('conv_kernel')} (4 only)"),
            (c.get("hidden_act", "silu") != "silu", f"hidden_act={c.get('hidden_act')}"),
            (
                tuple(c.get("time_step_limit", (0.0, float("inf")))) != (0.0, float("inf")),
                "a time_step_limit",
            ),
        ]
        for bad, what in unsupported:
            if bad:
                raise GigatronError(f"Mamba2 config: {what} is not supported by gigatron")
        layers = c["num_hidden_layers"]
        return {
            "num_layers": layers,
            "hybrid_layer_pattern": "M" * layers,
            "hidden_size": c["hidden_size"],
            # Megatron requires the flag even for attention-free stacks; it sizes nothing here.
            "num_attention_heads": 1,
            "mamba_state_dim": c["state_size"],
            "mamba_head_dim": c["head_dim"],
            "mamba_num_groups": c["n_groups"],
            "mamba_num_heads": c["num_heads"],
            "normalization": "RMSNorm",
            "layernorm_epsilon": c.get("layer_norm_epsilon", 1e-5),
            "position_embedding_type": "none",
            "add_bias_linear": False,
            "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
            "vocab_size": c["vocab_size"],
        }

    def from_hf(self, hf: StateDict, num_layers: int, num_heads: int | None, padded_vocab: int):
        """Mamba2ForCausalLM state dict -> gigatron state dict (`num_heads` is unused: the
        mixer's layouts need no regrouping)."""
        embedding = hf["backbone.embeddings.weight"]
        sd: StateDict = {
            "embedding.word_embeddings.weight": pad_rows(embedding, padded_vocab),
            "decoder.final_layernorm.weight": hf["backbone.norm_f.weight"],
        }
        head = hf.get("lm_head.weight")
        if head is not None and not torch.equal(head, embedding):
            sd["output_layer.weight"] = pad_rows(head, padded_vocab)
        sd.update({ours: hf[theirs] for theirs, ours in _layer_names(num_layers)})
        return sd

    def to_hf(self, sd: StateDict, num_layers: int, num_heads: int | None, vocab_size: int):
        """gigatron state dict of a pure Mamba stack -> Mamba2ForCausalLM state dict."""
        for name in sd:
            if name.startswith("decoder.layers.") and ".mixer." not in name:
                if not name.endswith(".norm.weight"):
                    raise GigatronError(
                        f"{name}: Mamba2ForCausalLM holds Mamba layers only; export a stack "
                        "whose pattern is all M"
                    )
        hf = export_ends(
            sd, vocab_size, "backbone.embeddings.weight", "backbone.norm_f.weight", False
        )
        hf.update({theirs: sd[ours] for theirs, ours in _layer_names(num_layers)})
        return hf
