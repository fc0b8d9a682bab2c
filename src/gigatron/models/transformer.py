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
from torch import Tensor, nn

from gigatron.errors import GigatronError
from gigatron.models.activations import mlp_activation
from gigatron.models.cpu_attention import causal_attention_with_dropout
from gigatron.models.dropout import dropout, dropout_unscaled
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG, recompute
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    set_tensor_parallel_attributes,
)

# The arguments of every layer's forward: `(x, attention_mask, rotary, inference_cache)`.
Mask = Tensor | None
Rotary = tuple[Tensor, Tensor] | None


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight), with the contract's parameter attributes.

    `hidden_size` defaults to the model's (query/key norms give the head size). With
    `--apply-layernorm-1p` the weight is stored zero-centred (initialised to 0, used as
    1 + weight), so weight decay pulls the scale towards 1."""

    def __init__(
        self, config: TransformerConfig, pctx: ParallelContext, hidden_size: int | None = None
    ) -> None:
        super().__init__()
        self.kind = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.kernel = config.kernels.rms_norm if self.kind == "RMSNorm" else None
        shape = (hidden_size or config.hidden_size,)
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=config.params_dtype, device=pctx.device)
        )
        set_tensor_parallel_attributes(
            self.weight, False, init="zeros" if self.zero_centered else "ones"
        )
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
            self.weight.fill_(0.0 if self.zero_centered else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.kind == "LayerNorm":
            return F.layer_norm(x, x.shape[-1:], weight, self.bias, self.eps)
        if self.kernel is not None:
            return self.kernel(x, weight, self.eps)
        # Statistics in float32 (as Llama does), result in the input dtype.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype)


def llama3_scaled_frequencies(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_positions: int = 8192,
) -> torch.Tensor:
    """Llama 3.1's RoPE scaling (Megatron's --use-rope-scaling): wavelengths longer than
    original_positions / low_freq_factor are stretched by `factor`, those shorter than
    original_positions / high_freq_factor kept, and the band between interpolated smoothly."""
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_positions / wavelength - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    low = wavelength > original_positions / low_freq_factor
    high = wavelength < original_positions / high_freq_factor
    return torch.where(low, inv_freq / factor, torch.where(high, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """RoPE tables: cos/sin [seq, batch, 1, rotary_dim] for given positions (no parameters)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_base: int,
        seq_len_interpolation_factor: float | None = None,
        rope_scaling_factor: float | None = None,
    ) -> None:
        super().__init__()
        self.dim = int(kv_channels * rotary_percent)
        self.dim -= self.dim % 2
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
        inv_freq = 1.0 / (rotary_base**exponents)
        if rope_scaling_factor is not None:
            inv_freq = llama3_scaled_frequencies(inv_freq, rope_scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interpolation = seq_len_interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [batch, seq]
        positions = position_ids.t().float()
        if self.interpolation:
            positions = positions / self.interpolation
        freqs = positions.unsqueeze(-1) * self.inv_freq.to(position_ids.device)
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


def rotate_query_key(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` on queries and keys (the PyTorch path of the fused RoPE kernel)."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _flash_attn_func():
    try:
        # why: optional flash-attn kernels
        from flash_attn import flash_attn_func
    except ImportError as error:
        raise GigatronError(
            "--use-flash-attn: the flash-attn package is not installed; "
            "`pip install flash-attn` (GPU only) or drop the flag to use PyTorch's SDPA"
        ) from error
    return flash_attn_func


class CoreAttention(nn.Module):
    """softmax(q k^T * scale + mask) v on this rank's heads; q [s, b, np, hk], k [s, b, ng, hk],
    v [s, b, ng, hv] -> [s, b, np * hv]. With no mask, attention is causal unless
    `config.causal_attention` is False (then every position sees every other). The scale is
    `config.softmax_scale`, default 1 / sqrt(kv_channels). The mask is bool (True = masked) or a
    float bias [b or 1, np, sq, sk] added to the scores (T5's relative positions).

    Sliding windows (`--window-size (left,right)` on the layers `is_window_layer` picks): query i
    sees keys i-left .. i+right, as a band added to the causal or data mask (a mask whose query
    and key lengths differ, the KV cache's, already holds the band: `KVCache.attention_mask_for`).
    Softmax sinks (`--softmax-type`): one more logit per head in every softmax, learned
    (`softmax_offset` [np], split over tp) or 0 (off-by-one), whose probability is dropped.

    Paths: flash-attn (`--use-flash-attn`, causal masks only, no window or sinks), an explicit
    one when sinks, `--apply-query-key-layer-scaling` or `--attention-softmax-in-fp32` ask for
    control of the softmax (and on CPU with dropout and a data mask, eager), causal attention
    with dropout on CPU block by block (models/cpu_attention.py; docs/performance.md), and
    PyTorch's scaled_dot_product_attention otherwise.
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
        self.window = config.window_size if config.is_window_layer(layer_number) else None
        offset = _softmax_offset(config, pctx)
        if offset is None or isinstance(offset, nn.Parameter):
            self.softmax_offset = offset
        else:
            self.register_buffer("softmax_offset", offset, persistent=False)
        self.use_flash = config.use_flash_attn
        if self.use_flash:
            _flash_attn_func()  # fail at build time, not at the first step
        self.explicit = (
            config.apply_query_key_layer_scaling
            or config.attention_softmax_in_fp32
            or self.softmax_offset is not None
        )
        self.layer_coeff = layer_number if config.apply_query_key_layer_scaling else 1
        self.softmax_in_fp32 = (
            config.attention_softmax_in_fp32
            or config.apply_query_key_layer_scaling
            or self.softmax_offset is not None
        )
        self.scale = config.softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        seq, batch, heads, _ = q.shape
        dropout_p = self.dropout if self.training else 0.0
        plain = self.window is None and self.softmax_offset is None
        with self._dropout_stream(dropout_p):
            if self.use_flash and attention_mask is None and self.causal and plain:
                out = _flash_attn_func()(
                    q.transpose(0, 1),
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    dropout_p=dropout_p,
                    causal=True,
                    softmax_scale=self.scale,
                )
                return out.transpose(0, 1).reshape(seq, batch, -1)
            if self.window is not None:
                attention_mask = self._windowed(attention_mask, seq, k.shape[0], q.device)
            qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hn]
            if plain and attention_mask is None and self._cpu_blocks(q, k, dropout_p):
                kb, vb = _repeat_groups(qb, kb, vb)
                out = causal_attention_with_dropout(qb, kb, vb, dropout_p, self.scale)
            elif self.explicit or _sdpa_falls_back(q, dropout_p):
                out = self._explicit(qb, kb, vb, attention_mask, dropout_p)
            else:
                out = F.scaled_dot_product_attention(
                    qb,
                    kb,
                    vb,
                    attn_mask=_sdpa_mask(attention_mask, qb.dtype),
                    dropout_p=dropout_p,
                    is_causal=attention_mask is None and self.causal,
                    scale=self.scale,
                    enable_gqa=kb.shape[1] != qb.shape[1],
                )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _cpu_blocks(self, q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
        """Whether causal attention with dropout takes models/cpu_attention.py's operator (on
        CPU, as many queries as keys, without the explicit path's options), eager or compiled."""
        return (
            self.causal
            and 0 < dropout_p < 1
            and q.device.type == "cpu"
            and q.shape[0] == k.shape[0]
            and not self.explicit
        )

    def _dropout_stream(self, dropout_p: float) -> contextlib.AbstractContextManager:
        """The model-parallel stream while dropout draws: heads are split over tp, so masks
        differ between tp ranks. None when nothing is drawn, nor inside a compiled layer
        (--torch-compile: dynamo cannot swap generator states, so every tp rank draws its heads'
        masks from the same stream there; docs/performance.md)."""
        if dropout_p == 0 or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return self.rng.fork()

    def _windowed(
        self, mask: torch.Tensor | None, s_q: int, s_k: int, device: torch.device
    ) -> torch.Tensor | None:
        """`mask` (True = masked) with the sliding-window band, for aligned queries and keys."""
        if mask is not None and mask.shape[-2] != mask.shape[-1]:
            return mask  # the KV cache's mask, which holds the band already
        queries = torch.arange(s_k - s_q, s_k, device=device)[:, None]
        keys = torch.arange(s_k, device=device)[None, :]
        band = window_band(queries, keys, self.window)
        if mask is None and self.causal:
            band = band | (keys > queries)
        return band if mask is None else mask | band

    def _explicit(self, q, k, v, attention_mask, dropout_p):
        k, v = _repeat_groups(q, k, v)
        # Dividing by layer_number before the product and multiplying back inside the fp32
        # softmax keeps fp16 scores in range (query-key layer scaling).
        scores = torch.matmul(q * (self.scale / self.layer_coeff), k.transpose(-1, -2))
        if self.softmax_in_fp32:
            scores = scores.float()
        if self.layer_coeff != 1:
            scores = scores * self.layer_coeff
        if attention_mask is None and self.causal:
            s_q, s_k = scores.shape[-2:]
            attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        if attention_mask is not None and attention_mask.is_floating_point():
            scores = scores + attention_mask.to(scores.dtype)
        elif attention_mask is not None:  # in place: the product's own buffer, not saved
            scores = scores.masked_fill_(attention_mask, torch.finfo(scores.dtype).min)
        if self.softmax_offset is None:
            probs = scores.softmax(dim=-1)
        else:
            sink = self.softmax_offset.to(scores.dtype).view(1, -1, 1, 1)
            sink = sink.expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        probs, scale = dropout_unscaled(probs.to(v.dtype), dropout_p, training=dropout_p > 0)
        out = torch.matmul(probs, v)
        return out if scale == 1.0 else out * scale  # the keep scale on [b, n, s, hn]


def _repeat_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [b, groups, s, h] with each query group's heads repeated to q's heads."""
    repeats = q.shape[1] // k.shape[1]
    if repeats == 1:
        return k, v
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


def _sdpa_falls_back(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether SDPA would run its math fallback (CPU with dropout, eager), which also scans
    the scores for fully masked rows: the explicit path computes the same, cheaper."""
    return dropout_p > 0 and q.device.type == "cpu" and not torch.compiler.is_compiling()


def _sdpa_mask(attention_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Data masks are bool, True where attention is forbidden (SDPA's bool mask is True where it
    is allowed), or a float bias added to the scores (T5's relative positions)."""
    if attention_mask is None:
        return None
    if attention_mask.is_floating_point():
        return attention_mask.to(dtype)
    return ~attention_mask


def window_band(queries: torch.Tensor, keys: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """True where key position `keys` lies outside query position `queries`' window
    (left, right); -1 leaves a side unbounded (broadcasting positions)."""
    left, right = window
    outside = torch.zeros(torch.broadcast_shapes(queries.shape, keys.shape), dtype=torch.bool)
    outside = outside.to(keys.device)
    if left >= 0:
        outside = outside | (keys < queries - left)
    if right >= 0:
        outside = outside | (keys > queries + right)
    return outside


def _softmax_offset(config: TransformerConfig, pctx: ParallelContext) -> torch.Tensor | None:
    """The sink logits of this rank's heads: a parameter (learnable), zeros (off-by-one), or None."""
    if config.softmax_type == "vanilla":
        return None
    heads = divide(config.num_attention_heads, pctx.tp_size, "--num-attention-heads")
    if config.softmax_type == "off-by-one":
        return torch.zeros(heads, dtype=torch.float32, device=pctx.device)
    offset = nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=pctx.device))
    set_tensor_parallel_attributes(offset, True, 0, 1, "normal", config.init_method_std)
    return offset


def qk_norm(config: TransformerConfig, pctx: ParallelContext, size: int) -> nn.Module:
    """A norm over each query or key head (`--qk-layernorm`). Its weight is replicated but each
    tensor-parallel rank sees only its heads: the partial gradients are summed over tp."""
    norm = Norm(config, pctx, size)
    for param in norm.parameters():
        param.sequence_parallel = pctx.tp_size > 1
    return norm


def _linear_options(config, bias: bool | None) -> dict:
    return dict(
        bias=config.add_bias_linear if bias is None else bias,
        sequence_parallel=config.sequence_parallel,
        dtype=config.params_dtype,
    )


def column_linear(
    config, pctx: ParallelContext, input_size: int, output_size: int, bias=None, stride=1
) -> ColumnParallelLinear:
    """A column-parallel layer of the model (its sequence parallelism, init and dtype; `bias`
    defaults to --add-bias-linear)."""
    options = _linear_options(config, bias)
    return ColumnParallelLinear(
        input_size, output_size, pctx, init_std=config.hidden_init_std, stride=stride, **options
    )


def row_linear(
    config, pctx: ParallelContext, input_size: int, output_size: int, bias=None
) -> RowParallelLinear:
    """A row-parallel output projection of the model (initialised with the output std)."""
    options = _linear_options(config, bias)
    return RowParallelLinear(
        input_size, output_size, pctx, init_std=config.output_init_std, **options
    )


class Attention(nn.Module):
    """What the attention variants share (self-attention, multi-latent attention, T5's
    cross-attention): the core attention on this rank's heads, selectively recomputed, over the
    KV cache when generating, then the output projection. Subclasses register `core_attention`
    and `linear_proj` (`row_linear`) where their parameter order puts them."""

    core_attention: nn.Module
    linear_proj: RowParallelLinear

    def __init__(self, config: TransformerConfig, layer_number: int, rng: ModelParallelRNG) -> None:
        super().__init__()
        self.layer_number = layer_number  # 1-based, global: names this layer's KV-cache slot
        self.recompute_core = "core_attn" in selective_recompute_modules(config)
        self.rng = rng

    def split_heads(self, config: TransformerConfig, pctx: ParallelContext) -> None:
        """This rank's `heads` and `groups` (query groups) of `kv_channels` channels."""
        tp = pctx.tp_size
        self.heads = divide(config.num_attention_heads, tp, "--num-attention-heads")
        self.groups = divide(config.num_query_groups, tp, "--num-query-groups")
        self.kv_channels = config.kv_channels

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_cache=None,
    ) -> torch.Tensor:
        """linear_proj(core_attention(q, k, v)); `inference_cache` (generation, an
        `inference.KVCache`): k and v go into the cache and attention runs over every cached
        position, with the cache's mask."""
        if inference_cache is not None:
            k, v = inference_cache.update(self.layer_number, k, v)
            attention_mask = inference_cache.attention_mask_for(self.core_attention)
        if self.recompute_core and self.training:
            context = recompute(self.core_attention, q, k, v, attention_mask, rng=self.rng)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context)


class SelfAttention(Attention):
    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
        core_attention: Callable[..., nn.Module] | None = None,
    ) -> None:
        super().__init__(config, layer_number, rng)
        self.split_heads(config, pctx)
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * config.kv_channels
        bias = config.add_bias_linear or config.add_qkv_bias
        self.linear_qkv = column_linear(config, pctx, config.hidden_size, qkv_size, bias)
        factory = core_attention or CoreAttention
        self.core_attention = factory(config, pctx, layer_number, rng)
        if config.qk_layernorm:
            self.q_layernorm = qk_norm(config, pctx, config.kv_channels)
            self.k_layernorm = qk_norm(config, pctx, config.kv_channels)
        else:
            self.q_layernorm = self.k_layernorm = None
        proj_in = config.num_attention_heads * config.kv_channels
        self.linear_proj = row_linear(config, pctx, proj_in, config.hidden_size)
        self.rotate = config.kernels.rope or rotate_query_key

    def forward(
        self, x: Tensor, attention_mask: Mask = None, rotary: Rotary = None, inference_cache=None
    ) -> Tensor:
        """`inference_cache`: see `Attention.attend`."""
        qkv = self.linear_qkv(x)
        seq, batch = qkv.shape[:2]
        qkv = qkv.view(seq, batch, self.groups, self.heads_per_group + 2, self.kv_channels)
        # split (not indexing): its backward is one concatenation, where three slices would each
        # allocate and fill a zero tensor of the whole qkv shape.
        q, k, v = torch.split(qkv, [self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(seq, batch, self.heads, self.kv_channels)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary is not None:
            q, k = self.rotate(q, k, *rotary)
        return self.attend(q, k, v, attention_mask, inference_cache)


class MLP(nn.Module):
    """linear_fc1 -> activation (GeLU, or a gated unit on the fused [gate; up] output: SwiGLU,
    GeGLU (T5 v1.1), quick GeGLU; see models/activations.py) -> linear_fc2.
    `ffn_hidden_size` defaults to the config's (MoE shared experts give their own)."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        layer_number: int | None = None,
        rng: ModelParallelRNG | None = None,
        ffn_hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        gated = config.gated_linear_unit
        self.activation = mlp_activation(config)
        ffn = ffn_hidden_size or config.ffn_hidden_size
        fc1_out = ffn * (2 if gated else 1)
        stride = 2 if gated else 1
        self.linear_fc1 = column_linear(config, pctx, config.hidden_size, fc1_out, stride=stride)
        self.linear_fc2 = row_linear(config, pctx, ffn, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


@dataclass(frozen=True)
class LayerParts:
    """What a `TransformerLayer` is assembled from, chosen when the model is built.

    `core_attention(config, pctx, layer_number, rng)`: attention on this rank's heads (SDPA by
    default; ring attention or flash-attn plug in here). `mlp(config, pctx, layer_number, rng)`:
    the feed-forward part (dense by default; MoE plugs in here). `norm(config, pctx)`: the norm.
    `post_norm`: the original BERT layout, a norm after each residual addition instead of before
    each sublayer (and no final norm). `self_attention(config, pctx, layer_number, rng,
    core_attention=...)`: the attention module around the core attention (`SelfAttention` by
    default; multi-latent attention plugs in here).
    """

    core_attention: Callable[..., nn.Module] = CoreAttention
    mlp: Callable[..., nn.Module] = MLP
    norm: Callable[..., nn.Module] = Norm
    post_norm: bool = False
    self_attention: Callable[..., nn.Module] | None = None


def selective_recompute_modules(config: TransformerConfig) -> tuple[str, ...]:
    """The parts recomputed in backward under --recompute-granularity selective (none otherwise):
    --recompute-modules, by default the core attention (Megatron's default)."""
    if config.recompute_granularity != "selective":
        return ()
    return tuple(config.recompute_modules or ("core_attn",))


class ResidualLayer(nn.Module):
    """A layer adding its branches to the residual stream: `residual_add(x, branch)` = x +
    dropout(branch), the dropout mask drawn per tp rank under sequence parallelism (each rank
    holds a different slice of the sequence then)."""

    def __init__(self, config: TransformerConfig, layer_number: int, rng: ModelParallelRNG):
        super().__init__()
        self.layer_number = layer_number  # 1-based, global
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.rng = rng

    def residual_add(self, residual: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        # Inside a compiled layer every tp rank draws from the same stream (see _dropout_stream).
        draws = self.training and self.hidden_dropout > 0 and not torch.compiler.is_compiling()
        fork = self.rng.fork() if self.sequence_parallel and draws else contextlib.nullcontext()
        with fork:
            return residual + dropout(branch, self.hidden_dropout, self.training)


class TransformerLayer(ResidualLayer):
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
        super().__init__(config, layer_number, rng)
        parts = parts or LayerParts()
        self.post_norm = parts.post_norm
        self.residual_from_norm = config.apply_residual_connection_post_layernorm
        first_norm, second_norm = (
            ("post_attention_layernorm", "post_mlp_layernorm")
            if parts.post_norm
            else ("input_layernorm", "pre_mlp_layernorm")
        )
        self.first_norm_name, self.second_norm_name = first_norm, second_norm
        setattr(self, first_norm, parts.norm(config, pctx))
        self.self_attention = (parts.self_attention or SelfAttention)(
            config, pctx, layer_number, rng, core_attention=parts.core_attention
        )
        setattr(self, second_norm, parts.norm(config, pctx))
        self.mlp = parts.mlp(config, pctx, layer_number, rng)
        modules = selective_recompute_modules(config)
        # "mlp" names the dense MLP; an MoE layer (it has a router) is Megatron's "moe" module.
        self.recompute_mlp = ("moe" if hasattr(self.mlp, "router") else "mlp") in modules
        self.recompute_norm = "layernorm" in modules

    def forward(
        self, x: Tensor, attention_mask: Mask = None, rotary: Rotary = None, inference_cache=None
    ) -> Tensor:
        first = self._maybe_recompute(getattr(self, self.first_norm_name), self.recompute_norm)
        second = self._maybe_recompute(getattr(self, self.second_norm_name), self.recompute_norm)
        mlp = self._maybe_recompute(self.mlp, self.recompute_mlp)
        cache = {} if inference_cache is None else {"inference_cache": inference_cache}
        if self.post_norm:
            attn = self.self_attention(x, attention_mask, rotary, **cache)
            x = first(self.residual_add(x, attn))
            return second(self.residual_add(x, mlp(x)))
        normed = first(x)
        attn = self.self_attention(normed, attention_mask, rotary, **cache)
        x = self.residual_add(normed if self.residual_from_norm else x, attn)
        normed = second(x)
        return self.residual_add(normed if self.residual_from_norm else x, mlp(normed))

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
        self, x: Tensor, attention_mask: Mask = None, rotary: Rotary = None, inference_cache=None
    ) -> Tensor:
        """`inference_cache` (generation) is passed to every layer as a keyword argument; layers
        from a `layer_builder` that cannot take it are training-only."""
        if inference_cache is None:
            x = self.run_layers(x, attention_mask, rotary)
        else:
            for layer in self.layers.values():
                x = layer(x, attention_mask, rotary, inference_cache=inference_cache)
        return self.final_layernorm(x) if self.final_layernorm is not None else x

    def run_layers(self, x: torch.Tensor, *args) -> torch.Tensor:
        """x through every layer (`layer(x, *args)`), fully recomputed in backward as the block's
        recomputation settings say (when training)."""
        layers = list(self.layers.values())
        if not (self.recompute_full and self.training):
            return _run_layers(layers)(x, *args)
        n = self.recompute_num_layers
        if self.recompute_method == "uniform":
            for start in range(0, len(layers), n):
                x = recompute(_run_layers(layers[start : start + n]), x, *args, rng=self.rng)
            return x
        for index, layer in enumerate(layers):
            x = recompute(layer, x, *args, rng=self.rng) if index < n else layer(x, *args)
        return x


def _run_layers(layers: list[nn.Module]):
    def run(x, *args):
        for layer in layers:
            x = layer(x, *args)
        return x

    return run
