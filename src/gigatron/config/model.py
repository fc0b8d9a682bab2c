"""Model shape and architecture options (Megatron's transformer flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field


@dataclass
class ModelConfig:
    num_layers: Optional[int] = flag_field(None, "number of transformer layers")
    encoder_num_layers: Optional[int] = flag_field(
        None, "encoder layers of an encoder-decoder model (T5); default --num-layers"
    )
    decoder_num_layers: Optional[int] = flag_field(
        None, "decoder layers of an encoder-decoder model (T5); default --num-layers"
    )
    hidden_size: Optional[int] = flag_field(None, "transformer hidden size")
    ffn_hidden_size: Optional[int] = flag_field(
        None, "MLP hidden size; default 4*hidden, or the SwiGLU size with --swiglu"
    )
    num_attention_heads: Optional[int] = flag_field(None, "number of attention heads")
    group_query_attention: bool = flag_field(False, "use grouped-query attention")
    num_query_groups: int = flag_field(1, "number of key/value groups with --group-query-attention")
    kv_channels: Optional[int] = flag_field(None, "projection size per head; default hidden/heads")
    seq_length: Optional[int] = flag_field(None, "sequence length of a training sample")
    encoder_seq_length: Optional[int] = flag_field(
        None, "encoder sequence length of an encoder-decoder model (T5); sets --seq-length"
    )
    decoder_seq_length: Optional[int] = flag_field(
        None, "decoder sequence length of an encoder-decoder model (T5)"
    )
    max_position_embeddings: Optional[int] = flag_field(
        None, "size of the position table; default --seq-length"
    )
    position_embedding_type: str = flag_field(
        "learned_absolute",
        "position encoding (relative: T5's bucketed attention bias, the t5 family only)",
        choices=["learned_absolute", "rope", "relative", "none"],
    )
    relative_attention_num_buckets: int = flag_field(
        32, "buckets of the relative position bias (--position-embedding-type relative)"
    )
    relative_attention_max_distance: int = flag_field(
        128, "distance from which relative positions share the last bucket (relative)"
    )
    rotary_percent: float = flag_field(1.0, "fraction of each head's channels that RoPE rotates")
    rotary_base: int = flag_field(10000, "RoPE base period")
    rotary_seq_len_interpolation_factor: Optional[float] = flag_field(
        None, "divide RoPE positions by this factor (linear position interpolation)"
    )
    use_rope_scaling: bool = flag_field(
        False,
        "Llama 3.1 RoPE frequency scaling (low/high frequency factors 1 and 4, 8192 positions)",
    )
    rope_scaling_factor: float = flag_field(8.0, "the scaling factor of --use-rope-scaling")
    normalization: str = flag_field("LayerNorm", "norm layer", choices=["LayerNorm", "RMSNorm"])
    layernorm_epsilon: float = flag_field(1e-5, "epsilon of the norm layers", flag="--norm-epsilon")
    swiglu: bool = flag_field(False, "gated SiLU MLP (Llama style)")
    geglu: bool = flag_field(
        False,
        "gated GeLU MLP (T5 v1.1's gated-gelu; with --openai-gelu the tanh GeLU it uses); "
        "a gigatron flag",
    )
    add_bias_linear: bool = flag_field(
        True, "drop the biases of all linear layers", flag="--disable-bias-linear", store_false=True
    )
    add_qkv_bias: bool = flag_field(
        False, "keep a bias on the QKV projection even with --disable-bias-linear"
    )
    openai_gelu: bool = flag_field(
        False, "tanh approximation of GeLU (what GPT-2 used; needed to import GPT-2 weights)"
    )
    untie_embeddings_and_output_weights: bool = flag_field(
        False, "give the output layer its own weight instead of the input embedding"
    )
    attention_dropout: float = flag_field(0.1, "dropout on attention probabilities")
    hidden_dropout: float = flag_field(0.1, "dropout on the residual branches")
    apply_query_key_layer_scaling: bool = flag_field(
        False, "scale Q.K by 1/layer_number (numerical safety in fp16)"
    )
    attention_softmax_in_fp32: bool = flag_field(False, "compute the attention softmax in fp32")
    apply_residual_connection_post_layernorm: bool = flag_field(
        False, "take each residual from the norm's output instead of its input (pre-norm layers)"
    )
    post_layernorm: bool = flag_field(
        False,
        "the original BERT layout: a norm after each residual addition and on the embeddings, "
        "no final norm (needed to use Hugging Face BERT weights)",
    )
    bert_binary_head: bool = flag_field(
        True,
        "drop BERT's sentence-order head (and its loss); samples are then one segment",
        flag="--bert-no-binary-head",
        store_false=True,
    )
    init_method_std: float = flag_field(0.02, "std of the normal weight initialisation")
    make_vocab_size_divisible_by: int = flag_field(
        128, "pad the vocabulary to a multiple of this times the tensor-parallel size"
    )
    padded_vocab_size: Optional[int] = flag_field(None, "use exactly this padded vocabulary size")
    use_flash_attn: bool = flag_field(False, "use the flash-attn package when it is installed")
    model_preset: Optional[str] = flag_field(
        None,
        "named model shape (see `gigatron presets`), overridden by explicit flags",
        flag="--model-preset",
    )
    recompute_granularity: Optional[str] = flag_field(
        None, "activation recomputation", choices=["full", "selective"]
    )
    recompute_method: Optional[str] = flag_field(
        None, "which layers to recompute with full granularity", choices=["uniform", "block"]
    )
    recompute_num_layers: Optional[int] = flag_field(None, "layers per recompute unit or block")
    recompute_activations: bool = flag_field(
        False, "shorthand for --recompute-granularity selective"
    )
    mamba_state_dim: int = flag_field(128, "state size of each Mamba head (N)")
    mamba_head_dim: int = flag_field(64, "channels per Mamba head (P)")
    mamba_num_groups: int = flag_field(8, "groups sharing the B and C projections of Mamba heads")
    mamba_num_heads: Optional[int] = flag_field(
        None, "Mamba heads; default 2 * hidden / --mamba-head-dim"
    )
    hybrid_layer_pattern: Optional[str] = flag_field(
        None, "hybrid stack, one symbol per layer: M Mamba, * attention, - MLP (e.g. M-M*-M-)"
    )
    hybrid_override_pattern: Optional[str] = flag_field(
        None, "older name of --hybrid-layer-pattern"
    )
    hybrid_attention_ratio: float = flag_field(
        0.0, "without a pattern: fraction of the --num-layers layers that are attention layers"
    )
    hybrid_mlp_ratio: float = flag_field(
        0.0, "without a pattern: fraction of the --num-layers layers that are MLP layers"
    )
