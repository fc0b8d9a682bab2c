"""Model FLOPs per iteration and model FLOPs utilisation (MFU).

The count follows the Megatron-LM papers (Narayanan et al. 2021; Korthikanti et al. 2022): only
matrix multiplications count, a multiply-add is 2 FLOPs, and the backward pass costs twice the
forward pass, so one training iteration is 3x the forward FLOPs. For a plain GPT (hidden h, MLP 4h,
full multi-head attention) this is

    72 * B * s * l * h^2 * (1 + s / (6h) + V / (12 * l * h))

(B samples, s tokens each, l layers, V padded vocabulary). Attention is counted over the full s x s
score matrix (no causal halving), as Megatron does. Activation recomputation is not counted: MFU
measures useful model work. The general form below also covers grouped-query attention
(fewer key/value heads), SwiGLU (three MLP matrices) and a kv_channels other than h/heads.

MoE layers count the work a token does (Megatron's formula): its top-k routed experts and the
shared experts; not the experts it skips, and (as Megatron) not the small router GEMM.
"""

from __future__ import annotations

from typing import Any

import torch

# Dense (no sparsity) peak matrix throughput in FLOP/s, by device name fragment and precision.
# fp32 means plain fp32 matmuls (TF32 off, torch's default for matmul on Ampere and later).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
}


def forward_flops_per_token(
    num_layers: int,
    hidden_size: int,
    seq_length: int,
    vocab_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    swiglu: bool = False,
    num_moe_layers: int = 0,
    moe_active_ffn: int = 0,
    attention_flops: float | None = None,
) -> float:
    """Matmul FLOPs of one token's forward pass through the whole model (logits included).
    `num_moe_layers` of the layers are MoE layers whose MLP work is that of a dense MLP of hidden
    size `moe_active_ffn` (top-k x expert size + shared expert size). `attention_flops` replaces
    a layer's attention FLOPs per token (multi-latent attention: `mla_flops_per_token`)."""
    h = hidden_size
    query_size = num_attention_heads * kv_channels
    kv_size = num_query_groups * kv_channels
    qkv = 2 * h * (query_size + 2 * kv_size)
    # Q.K^T and probabilities.V, each 2 * s * query_size per token.
    attention = 2 * 2 * seq_length * query_size
    projection = 2 * query_size * h
    matrices = 3 if swiglu else 2
    mlp = 2 * matrices * h * ffn_hidden_size
    moe_mlp = 2 * matrices * h * moe_active_ffn
    logits = 2 * h * vocab_size
    dense_layers = num_layers - num_moe_layers
    if attention_flops is None:
        attention_flops = qkv + attention + projection
    return num_layers * attention_flops + dense_layers * mlp + num_moe_layers * moe_mlp + logits


def mla_flops_per_token(m: Any) -> float:
    """One multi-latent attention layer's matmul FLOPs per token (a ModelConfig): the down and up
    projections, Q.K^T over qk + pe channels, probabilities.V over v channels, the output."""
    h, heads, s = m.hidden_size, m.num_attention_heads, m.seq_length
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    if m.q_lora_rank:
        query = h * m.q_lora_rank + m.q_lora_rank * heads * q_head
    else:
        query = h * heads * q_head
    key_value = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
    key_value += m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
    scores = s * heads * (q_head + m.v_head_dim)
    return 2 * (query + key_value + scores + heads * m.v_head_dim * h)


def model_flops_per_iteration(
    model_cfg: Any,
    global_batch_size: int,
    vocab_size: int,
    head_flops_per_token: float = 0.0,
    moe: Any = None,
) -> float:
    """Training FLOPs (forward + backward) of one iteration of `global_batch_size` samples of a
    finalised model config; `head_flops_per_token` adds a family's extra head (e.g. BERT's);
    `moe` (a models.moe.MoESpec) makes its layers MoE layers."""
    m = model_cfg
    moe_layers = len(moe.moe_layer_numbers) if moe is not None else 0
    active = moe.topk * moe.ffn_hidden_size + (moe.shared_expert_size or 0) if moe else 0
    depths = m.mtp_num_layers or 0  # multi-token prediction: D more layers, projections, logits
    per_token = forward_flops_per_token(
        num_layers=m.num_layers + depths,
        hidden_size=m.hidden_size,
        seq_length=m.seq_length,
        vocab_size=vocab_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        swiglu=m.swiglu or m.geglu or m.quick_geglu,  # any gated MLP: three matrices
        num_moe_layers=moe_layers,
        moe_active_ffn=active,
        attention_flops=mla_flops_per_token(m) if m.multi_latent_attention else None,
    )
    per_token += depths * (2 * 2 * m.hidden_size * m.hidden_size + 2 * m.hidden_size * vocab_size)
    return 3.0 * (per_token + head_flops_per_token) * global_batch_size * m.seq_length


def precision_name(bf16: bool, fp16: bool) -> str:
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def device_peak_flops(device: torch.device | str, precision: str) -> float | None:
    """Peak FLOP/s of one device of this kind, or None when unknown (CPUs, unlisted GPUs)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).upper()
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in name:
            return peaks.get(precision)
    return None


def mfu(flops_per_iteration: float, iteration_time_s: float, num_devices: int, peak: float | None):
    """Achieved FLOP/s over the peak of all devices; None when the peak is unknown."""
    if peak is None or iteration_time_s <= 0 or num_devices <= 0:
        return None
    return flops_per_iteration / iteration_time_s / (peak * num_devices)
