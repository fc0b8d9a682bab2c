"""Multi-latent attention (DeepSeek-V2/V3): queries and keys/values pass through low-rank
latents; a few channels per head carry RoPE, with one rotary key shared by all heads.

    q      = up_q(norm(down_q(x)))          [s, b, np, qk + pe]   (or linear_q_proj(x))
    latent, k_pe = split(down_kv(x))        [s, b, r], [s, b, pe]
    k_nope, v = split(up_kv(norm(latent)))  [s, b, np, qk], [s, b, np, v]
    k      = [k_nope, rope(k_pe) for every head],  q = [q_nope, rope(q_pe)]
    out    = linear_proj(attention(q, k, v))    scale mscale(f, mscale_all_dim)^2 / sqrt(qk + pe)

Parameter names are Megatron-Core's: `linear_q_proj` or `linear_q_down_proj` + `q_layernorm` +
`linear_q_up_proj`, `linear_kv_down_proj`, `kv_layernorm`, `linear_kv_up_proj`, `linear_proj`
(the latent norms exist with `--qk-layernorm`, as in Megatron's spec; DeepSeek sets it). The
down projections are replicated over tensor parallelism (each rank computes the whole latent;
under sequence parallelism on its slice of the sequence, and their weights are then marked
`sequence_parallel`); the up projections and the output are split by heads like the other
attention. The static KV cache holds the up-projected keys and values; a cache that stores
latents (`inference_cache.stores_latents`, the paged cache) holds per position only the normed
latent and the rotated shared key, [r + pe], and up-projects every cached latent at each step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gigatron.models.transformer import (
    Attention,
    CoreAttention,
    Mask,
    Norm,
    Rotary,
    apply_rotary,
    column_linear,
    row_linear,
    selective_recompute_modules,
)
from gigatron.models.transformer_config import TransformerConfig
from gigatron.models.yarn import yarn_mscale
from gigatron.parallel.collectives import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG, recompute
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    divide,
    set_tensor_parallel_attributes,
)


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every tensor-parallel rank (MLA's down projections). Under
    sequence parallelism each rank sees a slice of the sequence: partial gradients, summed over
    tp (`sequence_parallel`)."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig, pctx) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=pctx.device)
        )
        set_tensor_parallel_attributes(
            self.weight, False, init="normal", init_std=config.init_method_std
        )
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def mla_softmax_scale(config: TransformerConfig) -> float:
    """mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)."""
    mscale = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class MLASelfAttention(Attention):
    """Multi-latent self-attention with the `SelfAttention` interface (see the module docstring):
    `forward(x [s(/tp), b, h], attention_mask, rotary, inference_cache=None)`."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        core_attention: Callable[..., nn.Module] | None = None,
    ) -> None:
        super().__init__(config, layer_number, rng)
        self.pctx = pctx
        self.sequence_parallel = config.sequence_parallel
        self.heads = divide(config.num_attention_heads, pctx.tp_size, "--num-attention-heads")
        self.qk_head_dim, self.pe_dim = config.qk_head_dim, config.qk_pos_emb_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        q_head = self.qk_head_dim + self.pe_dim
        total_heads = config.num_attention_heads

        def column(input_size: int, output_size: int) -> ColumnParallelLinear:
            return column_linear(config, pctx, input_size, output_size, bias=False)

        def latent_norm(size: int) -> nn.Module | None:
            return Norm(config, pctx, size) if config.qk_layernorm else None

        if config.q_lora_rank is None:
            self.linear_q_proj = column(config.hidden_size, total_heads * q_head)
        else:
            self.linear_q_down_proj = ReplicatedLinear(
                config.hidden_size, config.q_lora_rank, config, pctx
            )
            self.q_layernorm = latent_norm(config.q_lora_rank)
            self.linear_q_up_proj = column(config.q_lora_rank, total_heads * q_head)
        self.linear_kv_down_proj = ReplicatedLinear(
            config.hidden_size, self.kv_lora_rank + self.pe_dim, config, pctx
        )
        self.kv_layernorm = latent_norm(self.kv_lora_rank)
        self.linear_kv_up_proj = column(
            self.kv_lora_rank, total_heads * (self.qk_head_dim + self.v_head_dim)
        )
        core_config = dataclasses.replace(
            config, kv_channels=q_head, softmax_scale=mla_softmax_scale(config)
        )
        self.core_attention = (core_attention or CoreAttention)(
            core_config, pctx, layer_number, rng
        )
        self.linear_proj = row_linear(
            config, pctx, total_heads * self.v_head_dim, config.hidden_size
        )
        self.recompute_up_proj = "mla_up_proj" in selective_recompute_modules(config)

    def kv_cache_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, key channels), (heads, value channels) of this rank's KV-cache entries."""
        return (self.heads, self.qk_head_dim + self.pe_dim), (self.heads, self.v_head_dim)

    def latent_cache_shape(self) -> tuple[int, int]:
        """(1, latent + rotary key channels): one cache entry per position in a latent cache."""
        return (1, self.kv_lora_rank + self.pe_dim)

    def _query_input(self, x: torch.Tensor) -> torch.Tensor:
        """The full query (no query latent), or the (normed) query latent."""
        if hasattr(self, "linear_q_proj"):
            return self.linear_q_proj(x)
        latent = self.linear_q_down_proj(x)
        return self.q_layernorm(latent) if self.q_layernorm is not None else latent

    def _query_heads(self, q_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q without RoPE, q's RoPE part) [s, b, heads, ...] from `_query_input`."""
        q = q_in if hasattr(self, "linear_q_proj") else self.linear_q_up_proj(q_in)
        seq, batch = q.shape[:2]
        return q.view(seq, batch, self.heads, -1).split([self.qk_head_dim, self.pe_dim], dim=-1)

    def forward(
        self, x: Tensor, attention_mask: Mask = None, rotary: Rotary = None, inference_cache=None
    ) -> Tensor:
        q_in = self._query_input(x)
        latent, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pe_dim], -1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        if getattr(inference_cache, "stores_latents", False):
            q_nope, q_pe = self._query_heads(q_in)
            return self._attend_latents(q_nope, q_pe, latent, k_pe, rotary, inference_cache)
        if self.recompute_up_proj and self.training:
            # --recompute-modules mla_up_proj: keep the latents, redo the up projections and RoPE.
            q, k, v = recompute(self._up_project, q_in, latent, k_pe, rotary, rng=self.rng)
        else:
            q, k, v = self._up_project(q_in, latent, k_pe, rotary)
        return self.attend(q, k, v, attention_mask, inference_cache)

    def _up_project(self, q_in, latent, k_pe, rotary) -> tuple[torch.Tensor, ...]:
        """(q, k, v) [s, b, heads, ...] from the latents: up projections, then RoPE."""
        q_nope, q_pe = self._query_heads(q_in)
        seq, batch = q_nope.shape[:2]
        kv = self.linear_kv_up_proj(latent).view(seq, batch, self.heads, -1)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        # The rotary key is shared by this rank's heads: the whole sequence, and its gradient
        # summed over the tensor-parallel ranks' heads.
        if self.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.pctx)
        else:
            k_pe = copy_to_tp_region(k_pe, self.pctx)
        k_pe = k_pe.unsqueeze(2)
        if rotary is not None:
            q_pe, k_pe = apply_rotary(q_pe, *rotary), apply_rotary(k_pe, *rotary)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], dim=-1)
        return q, k, v

    def _attend_latents(self, q_nope, q_pe, latent, k_pe, rotary, cache) -> torch.Tensor:
        """Generation with a latent cache: store [latent, rope(k_pe)], attend over every cached
        position's up-projected keys and values."""
        k_pe = k_pe.unsqueeze(2)
        if rotary is not None:
            q_pe, k_pe = apply_rotary(q_pe, *rotary), apply_rotary(k_pe, *rotary)
        entries = cache.update_latent(self.layer_number, torch.cat([latent, k_pe[:, :, 0]], -1))
        latents, keys_pe = entries.split([self.kv_lora_rank, self.pe_dim], dim=-1)
        length, batch = latents.shape[:2]
        kv = self.linear_kv_up_proj(latents).view(length, batch, self.heads, -1)
        k_nope, v = kv.split([self.qk_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, keys_pe.unsqueeze(2).expand(-1, -1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        context = self.core_attention(q, k, v, cache.attention_mask_for(self.core_attention))
        return self.linear_proj(context)
