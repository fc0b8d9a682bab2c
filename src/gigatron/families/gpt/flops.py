"""Model FLOPs of one training iteration of a GPT-family model (dense, grouped-query or
multi-latent attention, MoE layers, multi-token prediction), the count MFU divides by.

The count follows the Megatron-LM papers (see models/flops.py, which holds the per-token
transformer count every family shares): only matrix multiplications, a multiply-add is 2 FLOPs,
and one training iteration is 3x the forward FLOPs. MoE layers count the work a token does
(Megatron's formula): its top-k routed experts and the shared experts; not the experts it skips,
and (as Megatron) not the small router GEMM.
"""

from __future__ import annotations

from typing import Any

from gigatron.models.flops import forward_flops_per_token


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
