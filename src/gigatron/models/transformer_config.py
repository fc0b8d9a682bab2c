"""`TransformerConfig`: the resolved model options every layer reads (Megatron's name for it).

Derived values (ffn size, kv channels, query groups) are computed once, by
`config.validate.finalize_config`; the parameter dtype by `config.validate.params_dtype`. This
class only reads them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from gigatron.config.model import parse_window_size, parse_window_skip_freq
from gigatron.config.validate import finalize_config, params_dtype
from gigatron.errors import GigatronError


@dataclass(frozen=True)
class TransformerConfig:
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
    rotary_seq_len_interpolation_factor: float | None = None
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    normalization: str = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    swiglu: bool = False
    geglu: bool = False
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    openai_gelu: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    apply_residual_connection_post_layernorm: bool = False
    init_method_std: float = 0.02
    use_flash_attn: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # With selective recompute: which parts (Megatron's --recompute-modules; None = core_attn).
    recompute_modules: list[str] | None = None
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    # False for bidirectional encoders (BERT): attention with no mask then sees every position.
    causal_attention: bool = True
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    qk_layernorm: bool = False
    layernorm_zero_centered_gamma: bool = False
    # Sliding-window attention: (left, right) keys around each query (-1: unbounded), on the
    # layers `window_attn_skip_freq` selects (None: all; an int N: all but every N-th; a list).
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    softmax_type: str = "vanilla"
    # None: 1 / sqrt(kv_channels).
    softmax_scale: float | None = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_correction_range_round_to_int: bool = True
    multi_latent_attention: bool = False
    rope_type: str | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int | None = None

    @classmethod
    def from_config(cls, cfg, **overrides) -> TransformerConfig:
        """From a GigatronConfig (finalised here if it was not yet); `overrides` replace fields
        (a family sets e.g. `causal_attention=False`)."""

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
        finalize_config(cfg)
        if m.kv_channels is None:
            raise GigatronError(
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                f"{m.num_attention_heads}; change one, or set --kv-channels"
            )
        if m.num_attention_heads % m.num_query_groups:
            raise GigatronError(
                f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                f"--num-query-groups {m.num_query_groups}"
            )
        values = {
            field.name: getattr(m, field.name)
            for field in dataclasses.fields(cls)
            if hasattr(m, field.name)
        }
        values.update(
            window_size=parse_window_size(m.window_size),
            window_attn_skip_freq=parse_window_skip_freq(m.window_attn_skip_freq, m.num_layers),
            yarn_original_max_position_embeddings=m.yarn_original_max_position_embeddings or 4096,
            yarn_beta_fast=32.0 if m.yarn_beta_fast is None else m.yarn_beta_fast,
            yarn_beta_slow=1.0 if m.yarn_beta_slow is None else m.yarn_beta_slow,
            max_position_embeddings=m.max_position_embeddings or m.seq_length,
            sequence_parallel=cfg.parallel.sequence_parallel
            and cfg.parallel.tensor_model_parallel_size > 1,
            params_dtype=params_dtype(cfg),
            seed=cfg.training.seed,
        )
        values.update(overrides)
        return cls(**values)

    @property
    def gated_linear_unit(self) -> bool:
        """Whether MLPs are gated (fc1 holds [gate; up]): SwiGLU, GeGLU or quick GeGLU."""
        return self.swiglu or self.geglu or self.quick_geglu

    def is_window_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (1-based) uses sliding-window attention (Megatron's
        rule: with an int N, every N-th layer keeps full attention)."""
        if self.window_size is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        if isinstance(freq, int):
            return layer_number % freq != 0
        return bool(freq[layer_number - 1])

    @property
    def output_init_std(self) -> float:
        """Std of the layers that write into the residual stream (linear_proj, linear_fc2)."""
        return self.init_method_std / math.sqrt(2.0 * self.num_layers)
