"""Model shape and architecture options (Megatron's transformer flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.moe import evaluate_layer_pattern
from gigatron.config.rules import Section, fraction_problem, positive_problems
from gigatron.errors import GigatronError


@dataclass
class ModelConfig(Section):
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
    decoder_seq_length: Optional[int] = flag_field(None, "decoder sequence length of an encoder-decoder model (T5)")
    max_position_embeddings: Optional[int] = flag_field(None, "size of the position table; default --seq-length")
    position_embedding_type: str = flag_field(
        "learned_absolute",
        "position encoding (yarn: RoPE with YaRN frequency scaling; relative: T5's bucketed "
        "attention bias, the t5 family only)",
        choices=["learned_absolute", "rope", "yarn", "relative", "none"],
    )
    relative_attention_num_buckets: int = flag_field(
        32, "buckets of the relative position bias (--position-embedding-type relative)"
    )
    relative_attention_max_distance: int = flag_field(
        128, "distance from which relative positions share the last bucket (relative)"
    )
    add_position_embedding: bool = off_switch(
        "older spelling of --position-embedding-type none (no effect with rope or yarn)", flag="--no-position-embedding"
    )
    rope_type: Optional[str] = flag_field(
        None,
        "RoPE of multi-latent attention (other attention: --position-embedding-type)",
        choices=["rope", "yarn"],
        default_help="yarn with --multi-latent-attention",
    )
    rotary_scaling_factor: float = flag_field(1.0, "YaRN: context extension factor")
    mscale: float = flag_field(1.0, "YaRN: attention temperature (mscale) coefficient")
    mscale_all_dim: float = flag_field(0.0, "YaRN: mscale coefficient of all dimensions (DeepSeek's mscale_all_dim)")
    yarn_original_max_position_embeddings: Optional[int] = flag_field(
        None, "YaRN: context length the model was trained at", default_help="4096"
    )
    yarn_beta_fast: Optional[float] = flag_field(None, "YaRN: rotations where extrapolation ends", default_help="32")
    yarn_beta_slow: Optional[float] = flag_field(None, "YaRN: rotations where interpolation starts", default_help="1")
    yarn_correction_range_round_to_int: bool = off_switch(
        "YaRN: keep the correction range's ends fractional (gpt-oss) instead of rounding them to whole channels"
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
        "gated GeLU MLP (T5 v1.1's gated-gelu; with --openai-gelu the tanh GeLU it uses); a gigatron flag",
    )
    quick_geglu: bool = flag_field(False, "gated MLP with quick GeLU, x * sigmoid(1.702 x) (gpt-oss style)")
    glu_linear_offset: float = flag_field(0.0, "gated MLPs: act(gate) * (up + offset) (gpt-oss: 1.0)")
    activation_func_clamp_value: Optional[float] = flag_field(
        None, "gated MLPs: clamp the gate to <= v and the linear half to [-v, v] (gpt-oss: 7.0)"
    )
    qk_layernorm: bool = flag_field(False, "normalise each query and key head (before RoPE)")
    layernorm_zero_centered_gamma: bool = flag_field(
        False,
        "norm weights are stored zero-centred: y = norm(x) * (1 + weight)",
        flag="--apply-layernorm-1p",
    )
    window_size: Optional[str] = flag_field(
        None,
        "sliding-window attention '(left,right)': query i sees keys i-left .. i+right (-1: unbounded); e.g. '(127,0)'",
    )
    window_attn_skip_freq: Optional[str] = flag_field(
        None,
        "which layers keep full attention with --window-size: N (every N-th layer, 1-based) or "
        "a list pattern such as '[1,1,0]*2' (1 = window)",
        default_help="every layer windowed",
    )
    softmax_type: str = flag_field(
        "vanilla",
        "attention softmax: vanilla, off-by-one (a zero logit added), learnable (a learned "
        "per-head sink logit, gpt-oss)",
        choices=["vanilla", "off-by-one", "learnable"],
    )
    add_bias_linear: bool = off_switch("drop the biases of all linear layers", flag="--disable-bias-linear")
    add_qkv_bias: bool = flag_field(False, "keep a bias on the QKV projection even with --disable-bias-linear")
    openai_gelu: bool = flag_field(
        False, "tanh approximation of GeLU (what GPT-2 used; needed to import GPT-2 weights)"
    )
    untie_embeddings_and_output_weights: bool = flag_field(
        False, "give the output layer its own weight instead of the input embedding"
    )
    attention_dropout: float = flag_field(0.1, "dropout on attention probabilities")
    hidden_dropout: float = flag_field(0.1, "dropout on the residual branches")
    apply_query_key_layer_scaling: bool = flag_field(False, "scale Q.K by 1/layer_number (numerical safety in fp16)")
    attention_softmax_in_fp32: bool = flag_field(False, "compute the attention softmax in fp32")
    apply_residual_connection_post_layernorm: bool = flag_field(
        False, "take each residual from the norm's output instead of its input (pre-norm layers)"
    )
    post_layernorm: bool = flag_field(
        False,
        "the original BERT layout: a norm after each residual addition and on the embeddings, "
        "no final norm (needed to use Hugging Face BERT weights)",
    )
    bert_binary_head: bool = off_switch(
        "drop BERT's sentence-order head (and its loss); samples are then one segment", flag="--bert-no-binary-head"
    )
    init_method_std: float = flag_field(0.02, "std of the normal weight initialisation")
    make_vocab_size_divisible_by: int = flag_field(
        128, "pad the vocabulary to a multiple of this times the tensor-parallel size"
    )
    padded_vocab_size: Optional[int] = flag_field(None, "use exactly this padded vocabulary size")
    use_flash_attn: bool = flag_field(False, "use the flash-attn package when it is installed")
    # Implementation selectors: gigatron has one implementation of each (config/equivalents.py
    # says which one, docs/training.md explains).
    transformer_impl: str = flag_field(
        "transformer_engine",
        "layer implementation; gigatron's PyTorch layers compute what both Megatron choices do",
        choices=["local", "transformer_engine", "inference_optimized"],
    )
    attention_backend: str = flag_field(
        "auto",
        "attention kernel; gigatron uses PyTorch's scaled_dot_product_attention, which picks a "
        "flash, memory-efficient or math kernel by itself",
        choices=["flash", "fused", "unfused", "local", "auto"],
    )
    masked_softmax_fusion: bool = off_switch("no fused masked softmax kernel")
    bias_gelu_fusion: bool = off_switch("no fused bias + GeLU kernel")
    bias_swiglu_fusion: bool = off_switch(
        "SwiGLU by PyTorch operations, not the fused kernel (CUDA; docs/performance.md)"
    )
    bias_dropout_fusion: bool = off_switch("no fused bias + dropout + add kernel")
    apply_rope_fusion: bool = off_switch(
        "RoPE by PyTorch operations, not the fused kernel (CUDA; docs/performance.md)", flag="--no-rope-fusion"
    )
    cross_entropy_loss_fusion: bool = flag_field(
        False,
        "the output layer and the loss in one fused kernel that never holds the logits "
        "(CUDA, tp 1; docs/performance.md)",
    )
    disable_bf16_reduced_precision_matmul: bool = flag_field(
        False, "bf16 matrix products reduce in fp32 (cuBLAS reduced-precision reduction off)"
    )
    init_model_with_meta_device: bool = flag_field(
        False, "build the model on the meta device, then materialise only this rank's shards"
    )
    spec: Optional[list[str]] = flag_field(
        None, "Megatron layer-spec module [function]; only the specs gigatron builds", nargs="*"
    )
    fp8: Optional[str] = flag_field(
        None,
        "fp8 training of the transformer layers' linear layers (torchao float8; "
        "docs/performance.md): e4m3 everywhere, or hybrid (e5m2 gradients)",
        flag="--fp8-format",
        choices=["e4m3", "hybrid"],
    )
    fp8_recipe: str = flag_field(
        "delayed",
        "fp8 scaling: tensorwise or rowwise (torchao's dynamic scaling); Megatron's other "
        "recipes are Transformer Engine's",
        choices=["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom"],
    )
    fp8_amax_history_len: int = flag_field(1, "fp8 amax history length (Transformer Engine)")
    fp8_amax_compute_algo: str = flag_field(
        "most_recent", "fp8 amax algorithm (Transformer Engine)", choices=["most_recent", "max"]
    )
    fp8_param_gather: bool = flag_field(False, "gather parameters in fp8 (Transformer Engine)")
    model_preset: Optional[str] = flag_field(
        None,
        "named model shape (see `gigatron presets`), overridden by explicit flags",
        flag="--model-preset",
    )
    recompute_granularity: Optional[str] = flag_field(None, "activation recomputation", choices=["full", "selective"])
    recompute_method: Optional[str] = flag_field(
        None, "which layers to recompute with full granularity", choices=["uniform", "block"]
    )
    recompute_num_layers: Optional[int] = flag_field(None, "layers per recompute unit or block")
    recompute_activations: bool = flag_field(False, "shorthand for --recompute-granularity selective")
    checkpoint_activations: bool = flag_field(
        False, "old name of --recompute-granularity full (--recompute-method uniform, 1 layer)"
    )
    recompute_modules: Optional[list[str]] = flag_field(
        None,
        "with --recompute-granularity selective: the modules to recompute",
        choices=[
            "core_attn",
            "mlp",
            "layernorm",
            "moe",
            "moe_act",
            "shared_experts",
            "mla_up_proj",
        ],
        default_help="core_attn",
    )
    mamba_state_dim: int = flag_field(128, "state size of each Mamba head (N)")
    mamba_head_dim: int = flag_field(64, "channels per Mamba head (P)")
    mamba_num_groups: int = flag_field(8, "groups sharing the B and C projections of Mamba heads")
    mamba_num_heads: Optional[int] = flag_field(None, "Mamba heads; default 2 * hidden / --mamba-head-dim")
    multi_latent_attention: bool = flag_field(
        False, "multi-latent attention (DeepSeek-V2/V3): keys and values from a low-rank latent"
    )
    q_lora_rank: Optional[int] = flag_field(None, "MLA: rank of the query latent (None: a full query projection)")
    kv_lora_rank: int = flag_field(32, "MLA: rank of the key/value latent")
    qk_head_dim: int = flag_field(128, "MLA: query/key channels per head without RoPE")
    qk_pos_emb_head_dim: int = flag_field(64, "MLA: query/key channels per head with RoPE")
    v_head_dim: int = flag_field(128, "MLA: value channels per head")
    mtp_num_layers: Optional[int] = flag_field(
        None, "multi-token prediction: extra layers, each predicting one more token ahead"
    )
    mtp_loss_scaling_factor: float = flag_field(0.1, "multi-token prediction: weight of the mean of the MTP losses")
    hybrid_layer_pattern: Optional[str] = flag_field(
        None, "hybrid stack, one symbol per layer: M Mamba, * attention, - MLP (e.g. M-M*-M-)"
    )
    hybrid_override_pattern: Optional[str] = flag_field(None, "older name of --hybrid-layer-pattern")
    hybrid_attention_ratio: float = flag_field(
        0.0, "without a pattern: fraction of the --num-layers layers that are attention layers"
    )
    hybrid_mlp_ratio: float = flag_field(
        0.0, "without a pattern: fraction of the --num-layers layers that are MLP layers"
    )
    lora_target_modules: list[str] = flag_field(
        [],
        "LoRA: add low-rank adapters to these linear layers and freeze the rest of the model (docs/lora.md)",
        nargs="+",
        choices=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    )
    lora_rank: int = flag_field(32, "LoRA: rank of the adapters")
    lora_alpha: float = flag_field(32.0, "LoRA: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = flag_field(0.0, "LoRA: dropout on the adapters' input")
    lora_dora: bool = flag_field(
        False,
        "LoRA: DoRA (weight-decomposed adapters): a learned magnitude per output row of each "
        "adapted weight (PEFT's use_dora; docs/lora.md)",
    )
    use_mup: bool = flag_field(False, "maximal update parametrization: width-scaled init, learning rates and output")
    mup_base_hidden_size: Optional[int] = flag_field(
        None, "µP: the base (proxy) model's hidden size", default_help="--hidden-size"
    )
    mup_embedding_mult: float = flag_field(1.0, "µP: multiplier on the embedding output")
    mup_output_mult: float = flag_field(1.0, "µP: multiplier on the logits (1.0 with --use-mup: base / hidden size)")
    mup_base_head_dim: Optional[float] = flag_field(
        None, "µP: softmax scale sqrt(this) / kv_channels**power (None: 1 / kv_channels**power)"
    )
    mup_attn_scale_power: float = flag_field(
        1.0, "µP: power of kv_channels in the softmax scale (0.5: standard attention)"
    )
    fine_grained_activation_offloading: bool = flag_field(
        False, "offload the activations saved by --offload-modules to host memory"
    )
    offload_modules: list[str] = flag_field(
        [],
        "with --fine-grained-activation-offloading: attn_norm, qkv_linear, core_attn, attn_proj, "
        "mlp_norm (docs/activation_offload.md)",
        nargs="+",
    )
    min_offloaded_tensor_size: int = flag_field(
        1024 * 1024, "offload only saved tensors of at least this many elements"
    )

    def problems(self) -> list[str]:
        """The shape's own rules, then the attention and MLP variants', then LoRA's and µP's."""
        found = self.shape_problems() + self.variant_problems() + self.lora_problems()
        return found + self.mup_problems()

    def mup_problems(self) -> list[str]:
        """µP's base width (docs/mup.md)."""
        base = self.mup_base_hidden_size
        if base is not None and base <= 0:
            return [f"--mup-base-hidden-size {base} must be positive"]
        given = [
            flag
            for flag, value, default in (
                ("--mup-base-hidden-size", base, None),
                ("--mup-embedding-mult", self.mup_embedding_mult, 1.0),
                ("--mup-output-mult", self.mup_output_mult, 1.0),
                ("--mup-base-head-dim", self.mup_base_head_dim, None),
                ("--mup-attn-scale-power", self.mup_attn_scale_power, 1.0),
            )
            if value != default
        ]
        if given and not self.use_mup:
            return [f"{', '.join(given)}: µP settings; add --use-mup (or drop them)"]
        return []

    def lora_problems(self) -> list[str]:
        """LoRA's rank and dropout (docs/lora.md)."""
        if not self.lora_target_modules:
            return ["--lora-dora: adapts the --lora-target-modules; name them"] * self.lora_dora
        found = positive_problems(((self.lora_rank, "--lora-rank"),))
        found += fraction_problem(self.lora_dropout, "--lora-dropout", False, True)
        if self.lora_dora and self.lora_dropout:
            found.append(
                f"--lora-dora with --lora-dropout {self.lora_dropout}: DoRA's magnitude term "
                "reads the undropped input here; use --lora-dropout 0"
            )
        return found

    def shape_problems(self) -> list[str]:
        """Sizes, heads, positions, dropouts and recompute."""
        found = positive_problems(
            (
                (self.num_layers, "--num-layers"),
                (self.hidden_size, "--hidden-size"),
                (self.num_attention_heads, "--num-attention-heads"),
                (self.seq_length, "--seq-length"),
            )
        )
        heads = self.num_attention_heads
        if self.hidden_size and heads and self.kv_channels is None and self.hidden_size % heads:
            found.append(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{heads}; change one, or set --kv-channels"
            )
        if heads and self.group_query_attention and heads % self.num_query_groups:
            found.append(
                f"--num-attention-heads {heads} is not divisible by --num-query-groups {self.num_query_groups}"
            )
        if (
            self.seq_length is not None
            and self.max_position_embeddings is not None
            and self.position_embedding_type == "learned_absolute"
            and self.seq_length > self.max_position_embeddings
        ):
            found.append(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings "
                f"{self.max_position_embeddings}; raise the latter"
            )
        found += fraction_problem(self.rotary_percent, "--rotary-percent", True, False)
        found += fraction_problem(self.attention_dropout, "--attention-dropout", False, True)
        found += fraction_problem(self.hidden_dropout, "--hidden-dropout", False, True)
        if self.recompute_granularity == "full" and (
            self.recompute_method is None or self.recompute_num_layers is None
        ):
            found.append("--recompute-granularity full needs --recompute-method and --recompute-num-layers")
        return found

    def variant_problems(self) -> list[str]:
        """Sliding windows, gated activations, YaRN, multi-token prediction."""
        found = []
        try:
            parse_window_size(self.window_size)
            parse_window_skip_freq(self.window_attn_skip_freq, self.num_layers or 0)
        except GigatronError as error:
            found.append(str(error))
        if self.window_attn_skip_freq is not None and self.window_size is None:
            found.append("--window-attn-skip-freq needs --window-size")
        if self.swiglu + self.quick_geglu + self.geglu > 1:
            found.append("--swiglu, --quick-geglu and --geglu: more than one given; choose one gated activation")
        gated = self.swiglu or self.quick_geglu or self.geglu
        if not gated and (self.glu_linear_offset or self.activation_func_clamp_value is not None):
            found.append(
                "--glu-linear-offset / --activation-func-clamp-value act on gated MLPs; add --swiglu or --quick-geglu"
            )
        clamp = self.activation_func_clamp_value
        if clamp is not None and clamp <= 0:
            found.append(f"--activation-func-clamp-value {clamp} must be > 0")
        if self.rope_type == "yarn" and not self.multi_latent_attention:
            found.append(
                "--rope-type yarn selects the RoPE of multi-latent attention; for other "
                "attention use --position-embedding-type yarn"
            )
        if "mla_up_proj" in (self.recompute_modules or []) and not self.multi_latent_attention:
            found.append(
                "--recompute-modules mla_up_proj recomputes multi-latent attention's up "
                "projections; add --multi-latent-attention or drop mla_up_proj"
            )
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            found.append(f"--mtp-num-layers {self.mtp_num_layers} must be at least 1")
        if self.rotary_scaling_factor <= 0:
            found.append(f"--rotary-scaling-factor {self.rotary_scaling_factor} must be positive")
        return found + self.fp8_problems()

    def fp8_problems(self) -> list[str]:
        """fp8 is torchao's dynamic scaling: tensorwise or rowwise recipes only."""
        if self.fp8 is not None and self.fp8_recipe not in ("tensorwise", "rowwise"):
            return [
                f"--fp8-recipe {self.fp8_recipe}: not available (Transformer Engine's); gigatron's "
                "fp8 scales from each step's amax: give --fp8-recipe tensorwise or rowwise"
            ]
        if self.fp8 is None and self.fp8_recipe != "delayed":
            return [f"--fp8-recipe {self.fp8_recipe} needs --fp8-format e4m3|hybrid"]
        return []


def parse_window_size(text: str | None) -> tuple[int, int] | None:
    """'(left,right)' or 'left,right' -> (left, right)."""
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in str(text).strip("() ").split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or any(v < -1 for v in values):
        raise GigatronError(f"--window-size {text}: not a pair of integers >= -1; give e.g. '(127,0)'")
    return values


def parse_window_skip_freq(text: str | None, num_layers: int) -> int | tuple[int, ...] | None:
    """`--window-attn-skip-freq`: an int N, or a list pattern of one 0/1 per layer."""
    if text is None:
        return None

    text = str(text).strip()
    if "[" not in text:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise GigatronError(
                f"--window-attn-skip-freq {text}: not a positive integer or a list pattern; give e.g. 2 or '[1,0]*2'"
            )
        return value
    try:
        pattern = evaluate_layer_pattern(text)
    except GigatronError:
        pattern = [-1]
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise GigatronError(
            f"--window-attn-skip-freq {text}: gives {len(pattern)} entries; it needs one 0 or 1 "
            f"per layer ({num_layers} layers)"
        )
    return tuple(pattern)
