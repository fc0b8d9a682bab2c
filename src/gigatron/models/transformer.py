"""The transformer: norms, rotary embeddings, attention, MLP, the layer built from swappable parts
(`LayerParts`), and the block.

Tensors inside the block are laid out [seq, batch, hidden] (Megatron's layout: sequence
parallelism splits dim 0). Every linear layer is tensor-parallel (at tp = 1 the collectives are
no-ops), so the same code is the single-device model.

Weight layouts (what checkpoints and the Hugging Face mapping rely on):
- `self_attention.linear_qkv.weight` [ng * (np/ng + 2) * hn, h]: rows grouped per query group
  (the np/ng query heads of the group, then its key head, then its value head), so a tp split
  of dim 0 gives each rank whole groups.
- `mlp.linear_fc1.weight` with SwiGLU: [2 * ffn, h] = [gate; up] fused in one matrix (one GEMM
  instead of two), `partition_stride = 2`: each rank holds [gate_r; up_r].
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG, recompute
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    set_tensor_parallel_attributes,
)


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight), with the contract's parameter attributes."""

    def __init__(self, config: TransformerConfig, pctx: ParallelContext) -> None:
        super().__init__()
        self.kind = config.normalization
        self.eps = config.layernorm_epsilon
        shape = (config.hidden_size,)
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=config.params_dtype, device=pctx.device)
        )
        set_tensor_parallel_attributes(self.weight, False, init="ones")
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(
                torch.empty(shape, dtype=config.params_dtype, device=pctx.device)
            )
            set_tensor_parallel_attributes(self.bias, False, init="zeros")
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Under sequence parallelism each tp rank normalises its own slice of the sequence,
            # so these replicated weights get partial gradients (summed by finalize_model_grads).
            param.sequence_parallel = config.sequence_parallel
        with torch.no_grad():
            self.weight.fill_(1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        # Statistics in float32 (as Llama does), result in the input dtype.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables: cos/sin [seq, batch, 1, rotary_dim] for given positions (no parameters)."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_base: int) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        self.dim -= self.dim % 2
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [batch, seq]
        freqs = position_ids.t().float().unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        angles = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [seq, batch, heads, hn] (rotate-half form, as
    Megatron and Hugging Face Llama)."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as error:
        raise GigatronError(
            "--use-flash-attn: the flash-attn package is not installed; "
            "`pip install flash-attn` (GPU only) or drop the flag to use PyTorch's SDPA"
        ) from error
    return flash_attn_func


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(hn) + mask) v on this rank's heads; q [s, b, np, hn], k/v
    [s, b, ng, hn] -> [s, b, np * hn]. With no mask, attention is causal unless
    `config.causal_attention` is False (then every position sees every other).

    Paths: flash-attn (`--use-flash-attn`, causal masks only), an explicit one when
    `--apply-query-key-layer-scaling` or `--attention-softmax-in-fp32` ask for control of the
    softmax precision, and PyTorch's scaled_dot_product_attention otherwise.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
    ) -> None:
        super().__init__()
        self.causal = config.causal_attention
        self.dropout = config.attention_dropout
        self.rng = rng
        self.use_flash = config.use_flash_attn
        if self.use_flash:
            _flash_attn_func()  # fail at build time, not at the first step
        self.explicit = config.apply_query_key_layer_scaling or config.attention_softmax_in_fp32
        self.layer_coeff = layer_number if config.apply_query_key_layer_scaling else 1
        self.softmax_in_fp32 = (
            config.attention_softmax_in_fp32 or config.apply_query_key_layer_scaling
        )
        self.scale = 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        seq, batch, heads, _ = q.shape
        dropout_p = self.dropout if self.training else 0.0
        # Heads are split over tp, so dropout here must differ between tp ranks.
        with self.rng.fork():
            if self.use_flash and attention_mask is None and self.causal:
                out = _flash_attn_func()(
                    q.transpose(0, 1),
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    dropout_p=dropout_p,
                    causal=True,
                    softmax_scale=self.scale,
                )
                return out.transpose(0, 1).reshape(seq, batch, -1)
            qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
            if self.explicit:
                out = self._explicit(qb, kb, vb, attention_mask, dropout_p)
            else:
                out = F.scaled_dot_product_attention(
                    qb,
                    kb,
                    vb,
                    # Data masks are True where attention is forbidden; SDPA's bool mask is
                    # True where it is allowed.
                    attn_mask=None if attention_mask is None else ~attention_mask,
                    dropout_p=dropout_p,
                    is_causal=attention_mask is None and self.causal,
                    scale=self.scale,
                    enable_gqa=kb.shape[1] != qb.shape[1],
                )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _explicit(self, q, k, v, attention_mask, dropout_p):
        repeats = q.shape[1] // k.shape[1]
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        # Dividing by layer_number before the product and multiplying back inside the fp32
        # softmax keeps fp16 scores in range (query-key layer scaling).
        scores = torch.matmul(q * (self.scale / self.layer_coeff), k.transpose(-1, -2))
        if self.softmax_in_fp32:
            scores = scores.float()
        scores = scores * self.layer_coeff
        if attention_mask is None and self.causal:
            s_q, s_k = scores.shape[-2:]
            attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1).to(v.dtype)
        probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, v)


class SelfAttention(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        core_attention: Callable[..., nn.Module] | None = None,
    ) -> None:
        super().__init__()
        tp = pctx.tp_size
        self.layer_number = layer_number  # 1-based, global: names this layer's KV-cache slot
        self.heads = divide(config.num_attention_heads, tp, "--num-attention-heads")
        self.groups = divide(config.num_query_groups, tp, "--num-query-groups")
        self.kv_channels = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * config.kv_channels
        proj_in = config.num_attention_heads * config.kv_channels
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            pctx,
            bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            dtype=config.params_dtype,
        )
        factory = core_attention or CoreAttention
        self.core_attention = factory(config, pctx, layer_number, rng)
        self.linear_proj = RowParallelLinear(
            proj_in,
            config.hidden_size,
            pctx,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            init_std=config.output_init_std,
            dtype=config.params_dtype,
        )
        self.recompute_core = "core_attn" in selective_recompute_modules(config)
        self.rng = rng

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_cache=None,
    ) -> torch.Tensor:
        """`inference_cache` (generation only, an `inference.KVCache`): this step's keys and
        values are written into the cache and attention runs over every cached position, with the
        cache's mask (the core attention part is unchanged)."""
        qkv = self.linear_qkv(x)
        seq, batch = qkv.shape[:2]
        qkv = qkv.view(seq, batch, self.groups, self.heads_per_group + 2, self.kv_channels)
        # split (not indexing): its backward is one concatenation, where three slices would each
        # allocate and fill a zero tensor of the whole qkv shape.
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(seq, batch, self.heads, self.kv_channels)
        k, v = k.squeeze(3), v.squeeze(3)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
            k = apply_rotary(k, *rotary)
        if inference_cache is not None:
            k, v = inference_cache.update(self.layer_number, k, v)
            attention_mask = inference_cache.attention_mask
        if self.recompute_core and self.training:
            context = recompute(self.core_attention, q, k, v, attention_mask, rng=self.rng)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context)


class MLP(nn.Module):
    """linear_fc1 -> GeLU, or SwiGLU on the fused [gate; up] output -> linear_fc2."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int | None = None,
        rng: ModelParallelRNG | None = None,
    ) -> None:
        super().__init__()
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        fc1_out = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_out,
            pctx,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            stride=2 if config.swiglu else 1,
            dtype=config.params_dtype,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            pctx,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            init_std=config.output_init_std,
            dtype=config.params_dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


@dataclass(frozen=True)
class LayerParts:
    """What a `TransformerLayer` is assembled from, chosen when the model is built.

    `core_attention(config, pctx, layer_number, rng)`: attention on this rank's heads (SDPA by
    default; ring attention or flash-attn plug in here). `mlp(config, pctx, layer_number, rng)`:
    the feed-forward part (dense by default; MoE plugs in here). `norm(config, pctx)`: the norm.
    `post_norm`: the original BERT layout, a norm after each residual addition instead of before
    each sublayer (and no final norm).
    """

    core_attention: Callable[..., nn.Module] = CoreAttention
    mlp: Callable[..., nn.Module] = MLP
    norm: Callable[..., nn.Module] = Norm
    post_norm: bool = False


def selective_recompute_modules(config: TransformerConfig) -> tuple[str, ...]:
    """The parts recomputed in backward under --recompute-granularity selective (none otherwise):
    --recompute-modules, by default the core attention (Megatron's default)."""
    if config.recompute_granularity != "selective":
        return ()
    return tuple(config.recompute_modules or ("core_attn",))


class TransformerLayer(nn.Module):
    """Pre-norm: x + drop(attn(norm(x))), then + drop(mlp(norm(x))). Post-norm (BERT's original
    layout): norm(x + drop(attn(x))), then norm(h + drop(mlp(h))).
    `--apply-residual-connection-post-layernorm` (pre-norm only) takes the residual from the norm's
    output instead of its input."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        parts: LayerParts | None = None,
    ) -> None:
        super().__init__()
        parts = parts or LayerParts()
        self.layer_number = layer_number  # 1-based, global
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.post_norm = parts.post_norm
        self.residual_from_norm = config.apply_residual_connection_post_layernorm
        self.rng = rng
        first_norm, second_norm = (
            ("post_attention_layernorm", "post_mlp_layernorm")
            if parts.post_norm
            else ("input_layernorm", "pre_mlp_layernorm")
        )
        self.first_norm_name, self.second_norm_name = first_norm, second_norm
        setattr(self, first_norm, parts.norm(config, pctx))
        self.self_attention = SelfAttention(
            config, pctx, layer_number, rng, core_attention=parts.core_attention
        )
        setattr(self, second_norm, parts.norm(config, pctx))
        self.mlp = parts.mlp(config, pctx, layer_number, rng)
        modules = selective_recompute_modules(config)
        # "mlp" names the dense MLP; an MoE layer (it has a router) is Megatron's "moe" module.
        self.recompute_mlp = "mlp" in modules and not hasattr(self.mlp, "router")
        self.recompute_norm = "layernorm" in modules

    def _dropout_context(self):
        # Sequence-parallel slices differ between tp ranks, so their dropout masks must too.
        return self.rng.fork() if self.sequence_parallel else contextlib.nullcontext()

    def _residual_add(self, residual: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        with self._dropout_context():
            return residual + F.dropout(branch, self.hidden_dropout, self.training)

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_cache=None,
    ) -> torch.Tensor:
        first = self._maybe_recompute(getattr(self, self.first_norm_name), self.recompute_norm)
        second = self._maybe_recompute(getattr(self, self.second_norm_name), self.recompute_norm)
        mlp = self._maybe_recompute(self.mlp, self.recompute_mlp)
        cache = {} if inference_cache is None else {"inference_cache": inference_cache}
        if self.post_norm:
            attn = self.self_attention(x, attention_mask, rotary, **cache)
            x = first(self._residual_add(x, attn))
            return second(self._residual_add(x, mlp(x)))
        normed = first(x)
        attn = self.self_attention(normed, attention_mask, rotary, **cache)
        x = self._residual_add(normed if self.residual_from_norm else x, attn)
        normed = second(x)
        return self._residual_add(normed if self.residual_from_norm else x, mlp(normed))

    def _maybe_recompute(self, module: nn.Module, enabled: bool) -> Callable[..., torch.Tensor]:
        """`module`, or a call that recomputes it in backward (selective --recompute-modules)."""
        if not (enabled and self.training):
            return module
        return lambda x: recompute(module, x, rng=self.rng)


class TransformerBlock(nn.Module):
    """The layers of one model chunk (named by global index) and, on the last stage, the final
    norm (`final_norm`). Layers are `TransformerLayer`s built from `parts`, or whatever
    `layer_builder(config, pctx, layer_number, rng)` returns (e.g. Mamba mixers); a layer's forward
    is `(x, attention_mask, rotary) -> x`.
    Full recomputation: `uniform` recomputes groups of recompute_num_layers layers, `block`
    recomputes the first recompute_num_layers layers of the chunk one by one."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_numbers: range,
        final_norm: bool,
        rng: ModelParallelRNG,
        parts: LayerParts | None = None,
        layer_builder: Callable[..., nn.Module] | None = None,
    ) -> None:
        super().__init__()
        parts = parts or LayerParts()
        if layer_builder is None:

            def layer_builder(config, pctx, number, rng):
                return TransformerLayer(config, pctx, number, rng, parts)

        self.layers = nn.ModuleDict(
            {str(i): layer_builder(config, pctx, i + 1, rng) for i in layer_numbers}
        )
        self.final_layernorm = parts.norm(config, pctx) if final_norm else None
        self.rng = rng
        self.recompute_full = config.recompute_granularity == "full"
        self.recompute_method = config.recompute_method or "uniform"
        self.recompute_num_layers = config.recompute_num_layers or 1

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        inference_cache=None,
    ) -> torch.Tensor:
        """`inference_cache` (generation) is passed to every layer as a keyword argument; layers
        from a `layer_builder` that cannot take it are training-only."""
        layers = list(self.layers.values())
        if inference_cache is not None:
            for layer in layers:
                x = layer(x, attention_mask, rotary, inference_cache=inference_cache)
        elif self.recompute_full and self.training:
            if self.recompute_method == "uniform":
                n = self.recompute_num_layers
                for start in range(0, len(layers), n):
                    group = layers[start : start + n]
                    x = recompute(_run_layers(group), x, attention_mask, rotary, rng=self.rng)
            else:
                for index, layer in enumerate(layers):
                    if index < self.recompute_num_layers:
                        x = recompute(layer, x, attention_mask, rotary, rng=self.rng)
                    else:
                        x = layer(x, attention_mask, rotary)
        else:
            for layer in layers:
                x = layer(x, attention_mask, rotary)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x


def _run_layers(layers: list[nn.Module]):
    def run(x, attention_mask, rotary):
        for layer in layers:
            x = layer(x, attention_mask, rotary)
        return x

    return run
