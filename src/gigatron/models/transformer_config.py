"""`TransformerConfig`: the resolved model options every layer reads (Megatron's name for it).

Derived values (ffn size, kv channels, query groups) are computed by
`config.validate.finalize_config` (on a copy: building a model never changes the run's
configuration); the parameter dtype by `config.validate.params_dtype`. The fields the layers read
as they are come from `ModelConfig` (MODEL_FIELDS); only the resolved ones are declared here.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from gigatron.config.model import ModelConfig, parse_window_size, parse_window_skip_freq
from gigatron.config.validate import finalize_config, params_dtype
from gigatron.errors import GigatronError
from gigatron.models import mup
from gigatron.models.fused import PYTORCH, Kernels, select_kernels
from gigatron.parallel.context import resolve_device


@dataclass(frozen=True, kw_only=True)
class TransformerOptions:
    """The options whose type or value the model resolves from the configuration (a required
    shape, parsed windows, YaRN defaults) or takes from other sections; `TransformerConfig` adds
    the `ModelConfig` fields the layers read as they are."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    max_position_embeddings: int | None
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    # False for bidirectional encoders (BERT): attention with no mask then sees every position.
    causal_attention: bool = True
    # Sliding-window attention: (left, right) keys around each query (-1: unbounded), on the
    # layers `window_attn_skip_freq` selects (None: all; an int N: all but every N-th; a list).
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    # None: 1 / sqrt(kv_channels).
    softmax_scale: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # The fused kernels the layers call (models/fused.py; PYTORCH: none).
    kernels: Kernels = PYTORCH

    @classmethod
    def from_config(cls, cfg, **overrides) -> TransformerOptions:
        """From a GigatronConfig (a finalised copy of it: `cfg` itself is never changed);
        `overrides` replace fields (a family sets e.g. `causal_attention=False`)."""

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
        with warnings.catch_warnings():  # the command's own finalize_config already warned
            warnings.simplefilter("ignore")
            cfg = finalize_config(copy.deepcopy(cfg))
        m = cfg.model
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
            softmax_scale=mup.softmax_scale(m, m.kv_channels),
            seed=cfg.training.seed,
            kernels=select_kernels(
                m,
                resolve_device(cfg.parallel.device).type,
                cfg.parallel.tensor_model_parallel_size,
            ),
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
    def hidden_init_std(self) -> float:
        """Std of the hidden matrices (µP: init_method_std / sqrt(width multiplier))."""
        return self.init_method_std / math.sqrt(mup.width_mult(self))

    @property
    def output_init_std(self) -> float:
        """Std of the layers that write into the residual stream (linear_proj, linear_fc2)."""
        return self.hidden_init_std / math.sqrt(2.0 * self.num_layers)


# Multi-latent attention's ModelConfig fields (the GPT family accepts them).
MLA_FIELDS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
)

# The ModelConfig fields the layers read as they are: TransformerConfig takes their types and
# defaults from ModelConfig (one declaration, config/model.py).
MODEL_FIELDS = (
    "position_embedding_type",
    "rotary_percent",
    "rotary_base",
    "rotary_seq_len_interpolation_factor",
    "use_rope_scaling",
    "rope_scaling_factor",
    "normalization",
    "layernorm_epsilon",
    "swiglu",
    "geglu",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "openai_gelu",
    "add_bias_linear",
    "add_qkv_bias",
    "untie_embeddings_and_output_weights",
    "attention_dropout",
    "hidden_dropout",
    "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32",
    "apply_residual_connection_post_layernorm",
    "init_method_std",
    "use_flash_attn",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",  # with selective recompute: which parts (None = core_attn)
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "qk_layernorm",
    "layernorm_zero_centered_gamma",
    "softmax_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_correction_range_round_to_int",
    "rope_type",
    *MLA_FIELDS,
    "mtp_num_layers",
    "use_mup",
    "mup_base_hidden_size",
    "mup_embedding_mult",
    "mup_output_mult",
    "mup_base_head_dim",
    "mup_attn_scale_power",
)


def _model_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    hints = typing.get_type_hints(ModelConfig)
    declared = {field.name: field for field in dataclasses.fields(ModelConfig)}
    return [
        (name, hints[name], dataclasses.field(default=declared[name].default))
        for name in MODEL_FIELDS
    ]


TransformerConfig = dataclasses.make_dataclass(
    "TransformerConfig",
    _model_fields(),
    bases=(TransformerOptions,),
    frozen=True,
    kw_only=True,
)
TransformerConfig.__module__ = __name__  # (make_dataclass's `module` is Python 3.12+)
TransformerConfig.__doc__ = (
    "The model options the layers read, with Megatron's derived defaults resolved."
)
