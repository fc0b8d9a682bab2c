"""YaRN rotary embeddings (context extension by frequency interpolation) and the choice of a
model's rotary tables.

YaRN keeps the high-frequency RoPE channels (those that rotate more than `beta_fast` times over
the original context) as they are, divides the low-frequency ones (fewer than `beta_slow`
rotations) by `rotary_scaling_factor`, and ramps linearly in between; cos and sin are multiplied
by the attention "concentration" factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)
with mscale(s, m) = 0.1 m ln(s) + 1 (1 for s <= 1). Same numbers as Megatron-Core's
YarnRotaryEmbedding and Hugging Face's "yarn" rope type.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gigatron.models.transformer import RotaryEmbedding
from gigatron.models.transformer_config import TransformerConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """The YaRN temperature term: 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, context: int) -> float:
    """The channel pair index whose frequency makes `rotations` turns over `context` tokens."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inverse_frequencies(
    dim: int,
    base: float,
    factor: float,
    context: int,
    beta_fast: float,
    beta_slow: float,
    round_to_int: bool = True,
) -> torch.Tensor:
    """The blended inverse frequencies [dim / 2]; `round_to_int` widens the correction range to
    whole channels."""
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    interpolated = extrapolated / factor
    low = _correction_dim(beta_fast, dim, base, context)
    high = _correction_dim(beta_slow, dim, base, context)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of one channel
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: the original frequency, 0: the interpolated one
    return interpolated * (1 - keep) + extrapolated * keep


class YarnRotaryEmbedding(nn.Module):
    """YaRN tables: cos/sin [seq, batch, 1, dim] (already multiplied by the concentration
    factor) for given positions; the same interface as `RotaryEmbedding`."""

    def __init__(self, dim: int, config: TransformerConfig) -> None:
        super().__init__()
        self.dim = dim
        factor = config.rotary_scaling_factor
        inv_freq = yarn_inverse_frequencies(
            dim,
            config.rotary_base,
            factor,
            config.yarn_original_max_position_embeddings,
            config.yarn_beta_fast,
            config.yarn_beta_slow,
            config.yarn_correction_range_round_to_int,
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.concentration = yarn_mscale(factor, config.mscale) / yarn_mscale(
            factor, config.mscale_all_dim
        )

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.t().float().unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
        return angles.cos() * self.concentration, angles.sin() * self.concentration


def rotary_embedding(config: TransformerConfig) -> nn.Module | None:
    """The model's rotary tables: multi-latent attention rotates `qk_pos_emb_head_dim` channels
    (`--rope-type`, default yarn); other attention `kv_channels * rotary_percent` channels with
    `--position-embedding-type rope` or `yarn`; None without rotary embeddings."""
    if config.multi_latent_attention:
        if (config.rope_type or "yarn") == "yarn":
            return YarnRotaryEmbedding(config.qk_pos_emb_head_dim, config)
        return RotaryEmbedding(config.qk_pos_emb_head_dim, 1.0, config.rotary_base)
    if config.position_embedding_type == "rope":
        return RotaryEmbedding(
            config.kv_channels,
            config.rotary_percent,
            config.rotary_base,
            seq_len_interpolation_factor=config.rotary_seq_len_interpolation_factor,
            rope_scaling_factor=config.rope_scaling_factor if config.use_rope_scaling else None,
        )
    if config.position_embedding_type == "yarn":
        dim = int(config.kv_channels * config.rotary_percent)
        return YarnRotaryEmbedding(dim - dim % 2, config)
    return None
