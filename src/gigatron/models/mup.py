"""µP (maximal update parametrization, `--use-mup`): the width multiplier and the model's
multipliers, under Megatron's rules (docs/mup.md).

With m = --hidden-size / --mup-base-hidden-size: hidden matrices are drawn with std
init_method_std / sqrt(m) (the residual-stream outputs also / sqrt(2 L)), embeddings and the
output layer keep init_method_std, the logits are multiplied by --mup-output-mult (1 / m unless
given), the embedding output by --mup-embedding-mult, and attention scores use
sqrt(--mup-base-head-dim) / kv_channels ** --mup-attn-scale-power. The optimizer's part (hidden
matrices' Adam lr and eps / m) is optim/optimizer.py's `mup_param_groups`.
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError


def width_mult(model: Any) -> float:
    """hidden_size / mup_base_hidden_size under --use-mup (1.0 without, or without a base)."""
    if not model.use_mup or model.mup_base_hidden_size is None:
        return 1.0
    return model.hidden_size / model.mup_base_hidden_size


def output_mult(model: Any) -> float:
    """The logits' multiplier: --mup-output-mult, whose default 1.0 means 1 / width under µP."""
    if not model.use_mup:
        return 1.0
    if model.mup_output_mult != 1.0:
        return model.mup_output_mult
    return 1.0 / width_mult(model)


def softmax_scale(model: Any, kv_channels: int) -> float | None:
    """µP's attention scale (None without µP: the layers' 1 / sqrt(kv_channels))."""
    if not model.use_mup:
        return None
    base = 1.0 if model.mup_base_head_dim is None else model.mup_base_head_dim**0.5
    return base / kv_channels**model.mup_attn_scale_power


def check_mup(cfg: Any, family: str = "gpt") -> None:
    """Refuse µP where gigatron does not scale every layer yet: only dense GPT models with
    standard attention, trained with Adam or SGD."""
    m = cfg.model
    if not m.use_mup:
        return
    reasons = []
    if family != "gpt":
        reasons.append(f"the {family} family")
    if cfg.moe.num_experts:
        reasons.append("MoE layers (--num-experts)")
    if m.multi_latent_attention:
        reasons.append("multi-latent attention")
    if m.hybrid_layer_pattern or m.hybrid_override_pattern:
        reasons.append("hybrid (Mamba) stacks")
    if m.mtp_num_layers:
        reasons.append("multi-token prediction")
    if cfg.optimizer.optimizer == "muon":
        reasons.append("--optimizer muon")
    if cfg.checkpoint.save_hf:
        reasons.append("--save-hf (Hugging Face models have no µP multipliers)")
    if reasons:
        raise GigatronError(
            f"--use-mup with {', '.join(reasons)}: µP is implemented for dense GPT models "
            "trained with Adam or SGD, not exported to Hugging Face; drop --use-mup or those "
            "settings"
        )


def refuse_hf_export(cfg: Any, where: str) -> None:
    """A µP model's multipliers and attention scale have no Hugging Face equivalent."""
    if cfg.model.use_mup:
        raise GigatronError(
            f"{where}: a µP model (--use-mup); its logit, embedding and attention multipliers "
            "have no Hugging Face equivalent, so it cannot be exported; use its gigatron "
            "checkpoint"
        )


def scale(hidden: torch.Tensor, mult: float) -> torch.Tensor:
    """`hidden * mult`, skipped (no extra op in the graph) when mult is 1."""
    return hidden if mult == 1.0 else hidden * mult
