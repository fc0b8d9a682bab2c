"""Model FLOPs shared by every family, and model FLOPs utilisation (MFU).

The count follows the Megatron-LM papers (Narayanan et al. 2021; Korthikanti et al. 2022): only
matrix multiplications count, a multiply-add is 2 FLOPs, and the backward pass costs twice the
forward pass, so one training iteration is 3x the forward FLOPs. For a plain GPT (hidden h, MLP 4h,
full multi-head attention) this is

    72 * B * s * l * h^2 * (1 + s / (6h) + V / (12 * l * h))

(B samples, s tokens each, l layers, V padded vocabulary). Attention is counted over the full s x s
score matrix (no causal halving), as Megatron does. Activation recomputation is not counted: MFU
measures useful model work. `forward_flops_per_token` is the general per-token form (grouped-query
attention, SwiGLU, a kv_channels other than h/heads, MoE layers); each family's iteration count
is in its folder (families/gpt/flops.py, the mamba and t5 records).
"""

from __future__ import annotations

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
    a layer's attention FLOPs per token (multi-latent attention: families/gpt/flops.py)."""
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
