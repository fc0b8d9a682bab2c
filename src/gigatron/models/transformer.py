"""The transformer: norms, rotary embeddings, attention, MLP, the pre-norm layer and the block.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG, recompute
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    set_tensor_parallel_attributes,
)


@dataclass(frozen=True)
class TransformerSpec:
    """The model options the layers read, with Megatron's derived defaults resolved."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    max_position_embeddings: int | None
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    init_method_std: float = 0.02
    use_flash_attn: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234

    @classmethod
    def from_config(cls, cfg) -> TransformerSpec:
        """From a GigatronConfig; derived values (ffn size, kv channels...) are filled as
        config.validate.finalize_config would, so an unfinalised config works too."""
        m = cfg.model
        missing = [
            flag
            for value, flag in (
                (m.num_layers, "--num-layers"),
                (m.hidden_size, "--hidden-size"),
                (m.num_attention_heads, "--num-attention-heads"),
            )
            if value is None
        ]
        if missing:
            raise GigatronError(
                f"{', '.join(missing)} not set; give the model shape or --model-preset"
            )
        ffn = m.ffn_hidden_size
        if ffn is None:
            ffn = int(4 * m.hidden_size * 2 / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size
        kv_channels = m.kv_channels or m.hidden_size // m.num_attention_heads
        groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        if m.num_attention_heads % groups:
            raise GigatronError(
                f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                f"--num-query-groups {groups}"
            )
        if cfg.training.bf16:
            dtype = torch.bfloat16
        elif cfg.training.fp16:
            dtype = torch.float16
        else:
            dtype = torch.float32
        granularity = m.recompute_granularity or ("selective" if m.recompute_activations else None)
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            ffn_hidden_size=ffn,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=groups,
            kv_channels=kv_channels,
            max_position_embeddings=m.max_position_embeddings or m.seq_length,
            position_embedding_type=m.position_embedding_type,
            rotary_percent=m.rotary_percent,
            rotary_base=m.rotary_base,
            normalization=m.normalization,
            layernorm_epsilon=m.layernorm_epsilon,
            swiglu=m.swiglu,
            openai_gelu=m.openai_gelu,
            add_bias_linear=m.add_bias_linear,
            add_qkv_bias=m.add_qkv_bias,
            untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            attention_dropout=m.attention_dropout,
            hidden_dropout=m.hidden_dropout,
            apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
            attention_softmax_in_fp32=m.attention_softmax_in_fp32,
            init_method_std=m.init_method_std,
            use_flash_attn=m.use_flash_attn,
            recompute_granularity=granularity,
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers,
            sequence_parallel=cfg.parallel.sequence_parallel
            and cfg.parallel.tensor_model_parallel_size > 1,
            params_dtype=dtype,
            seed=cfg.training.seed,
        )

    @property
    def output_init_std(self) -> float:
        """Std of the layers that write into the residual stream (linear_proj, linear_fc2)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)


class Norm(nn.Module):
    """LayerNorm (weight, bias) or RMSNorm (weight), with the contract's parameter attributes."""

    def __init__(self, spec: TransformerSpec, pctx: ParallelContext) -> None:
        super().__init__()
        self.kind = spec.normalization
        self.eps = spec.layernorm_epsilon
        shape = (spec.hidden_size,)
        self.weight = nn.Parameter(torch.empty(shape, dtype=spec.params_dtype, device=pctx.device))
        set_tensor_parallel_attributes(self.weight, False, init="ones")
        if self.kind == "LayerNorm":
            self.bias = nn.Parameter(
                torch.empty(shape, dtype=spec.params_dtype, device=pctx.device)
            )
            set_tensor_parallel_attributes(self.bias, False, init="zeros")
        else:
            self.register_parameter("bias", None)
        for param in self.parameters():
            # Under sequence parallelism each tp rank normalises its own slice of the sequence,
            # so these replicated weights get partial gradients (summed by finalize_model_grads).
            param.sequence_parallel = spec.sequence_parallel
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
    [s, b, ng, hn] -> [s, b, np * hn].

    Paths: flash-attn (`--use-flash-attn`, causal masks only), an explicit one when
    `--apply-query-key-layer-scaling` or `--attention-softmax-in-fp32` ask for control of the
    softmax precision, and PyTorch's scaled_dot_product_attention otherwise.
    """

    def __init__(self, spec: TransformerSpec, layer_number: int, rng: ModelParallelRNG) -> None:
        super().__init__()
        self.dropout = spec.attention_dropout
        self.rng = rng
        self.use_flash = spec.use_flash_attn
        if self.use_flash:
            _flash_attn_func()  # fail at build time, not at the first step
        self.explicit = spec.apply_query_key_layer_scaling or spec.attention_softmax_in_fp32
        self.layer_coeff = layer_number if spec.apply_query_key_layer_scaling else 1
        self.softmax_in_fp32 = spec.attention_softmax_in_fp32 or spec.apply_query_key_layer_scaling
        self.scale = 1.0 / math.sqrt(spec.kv_channels)

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
            if self.use_flash and attention_mask is None:
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
                    is_causal=attention_mask is None,
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
        if attention_mask is None:
            s_q, s_k = scores.shape[-2:]
            attention_mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(attention_mask, torch.finfo(scores.dtype).min)
        probs = scores.softmax(dim=-1).to(v.dtype)
        probs = F.dropout(probs, dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, v)


class SelfAttention(nn.Module):
    def __init__(
        self,
        spec: TransformerSpec,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
    ) -> None:
        super().__init__()
        tp = pctx.tp_size
        self.heads = divide(spec.num_attention_heads, tp, "--num-attention-heads")
        self.groups = divide(spec.num_query_groups, tp, "--num-query-groups")
        self.kv_channels = spec.kv_channels
        self.heads_per_group = spec.num_attention_heads // spec.num_query_groups
        qkv_size = spec.num_query_groups * (self.heads_per_group + 2) * spec.kv_channels
        proj_in = spec.num_attention_heads * spec.kv_channels
        self.linear_qkv = ColumnParallelLinear(
            spec.hidden_size,
            qkv_size,
            pctx,
            bias=spec.add_bias_linear or spec.add_qkv_bias,
            sequence_parallel=spec.sequence_parallel,
            init_std=spec.init_method_std,
            dtype=spec.params_dtype,
        )
        self.core_attention = CoreAttention(spec, layer_number, rng)
        self.linear_proj = RowParallelLinear(
            proj_in,
            spec.hidden_size,
            pctx,
            bias=spec.add_bias_linear,
            sequence_parallel=spec.sequence_parallel,
            init_std=spec.output_init_std,
            dtype=spec.params_dtype,
        )
        self.recompute_core = spec.recompute_granularity == "selective"
        self.rng = rng

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
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
        if self.recompute_core and self.training:
            context = recompute(self.core_attention, q, k, v, attention_mask, rng=self.rng)
        else:
            context = self.core_attention(q, k, v, attention_mask)
        return self.linear_proj(context)


class MLP(nn.Module):
    """linear_fc1 -> GeLU, or SwiGLU on the fused [gate; up] output -> linear_fc2."""

    def __init__(self, spec: TransformerSpec, pctx: ParallelContext) -> None:
        super().__init__()
        self.swiglu = spec.swiglu
        self.gelu_approximate = "tanh" if spec.openai_gelu else "none"
        fc1_out = spec.ffn_hidden_size * (2 if spec.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            spec.hidden_size,
            fc1_out,
            pctx,
            bias=spec.add_bias_linear,
            sequence_parallel=spec.sequence_parallel,
            init_std=spec.init_method_std,
            stride=2 if spec.swiglu else 1,
            dtype=spec.params_dtype,
        )
        self.linear_fc2 = RowParallelLinear(
            spec.ffn_hidden_size,
            spec.hidden_size,
            pctx,
            bias=spec.add_bias_linear,
            sequence_parallel=spec.sequence_parallel,
            init_std=spec.output_init_std,
            dtype=spec.params_dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)


class TransformerLayer(nn.Module):
    """Pre-norm layer: x + drop(attn(norm(x))), then + drop(mlp(norm(x)))."""

    def __init__(
        self,
        spec: TransformerSpec,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number  # 1-based, global
        self.hidden_dropout = spec.hidden_dropout
        self.sequence_parallel = spec.sequence_parallel
        self.rng = rng
        self.input_layernorm = Norm(spec, pctx)
        self.self_attention = SelfAttention(spec, pctx, layer_number, rng)
        self.pre_mlp_layernorm = Norm(spec, pctx)
        self.mlp = MLP(spec, pctx)

    def _dropout_context(self):
        # Sequence-parallel slices differ between tp ranks, so their dropout masks must too.
        return self.rng.fork() if self.sequence_parallel else contextlib.nullcontext()

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), attention_mask, rotary)
        with self._dropout_context():
            x = x + F.dropout(attn, self.hidden_dropout, self.training)
        mlp = self.mlp(self.pre_mlp_layernorm(x))
        with self._dropout_context():
            x = x + F.dropout(mlp, self.hidden_dropout, self.training)
        return x


class TransformerBlock(nn.Module):
    """The layers of one model chunk (named by global index) and, on the last stage, the final
    norm. Full recomputation: `uniform` recomputes groups of recompute_num_layers layers,
    `block` recomputes the first recompute_num_layers layers of the chunk one by one."""

    def __init__(
        self,
        spec: TransformerSpec,
        pctx: ParallelContext,
        layer_numbers: range,
        post_process: bool,
        rng: ModelParallelRNG,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(spec, pctx, i + 1, rng) for i in layer_numbers}
        )
        self.final_layernorm = Norm(spec, pctx) if post_process else None
        self.rng = rng
        self.recompute_full = spec.recompute_granularity == "full"
        self.recompute_method = spec.recompute_method or "uniform"
        self.recompute_num_layers = spec.recompute_num_layers or 1

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        layers = list(self.layers.values())
        if self.recompute_full and self.training:
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


def _run_layers(layers: list[TransformerLayer]):
    def run(x, attention_mask, rotary):
        for layer in layers:
            x = layer(x, attention_mask, rotary)
        return x

    return run
