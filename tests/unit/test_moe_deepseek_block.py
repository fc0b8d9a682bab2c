"""The MoE layer with DeepSeek-V3 routing (sigmoid scores, expert-score correction bias,
group-limited top-k, normalised and scaled weights, a shared expert) equals Hugging Face's
`DeepseekV3MoE` block given the same weights. (The whole DeepSeek-V3 model uses multi-head latent
attention, which gigatron does not have, so the comparison is at the MoE block.)"""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from gigatron.config.root import GigatronConfig
from gigatron.models.moe import MoELayer, MoESpec
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext

HIDDEN, EXPERTS, FFN = 32, 8, 16


def test_deepseek_v3_moe_block_matches_hugging_face():
    torch.manual_seed(0)
    hf_config = DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=FFN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        # Megatron scores a group by its best topk / group_topk experts, Hugging Face by its best
        # 2: equal here as in DeepSeek-V3 itself (8 / 4).
        n_group=2,
        topk_group=1,
        n_shared_experts=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    block = DeepseekV3MoE(hf_config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.normal_(0.0, 0.2)

    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 1, HIDDEN, 4, 8
    m.swiglu, m.add_bias_linear, m.ffn_hidden_size = True, False, FFN
    e = cfg.moe
    e.num_experts, e.moe_router_topk, e.moe_ffn_hidden_size = EXPERTS, 2, FFN
    e.moe_router_score_function, e.moe_router_enable_expert_bias = "sigmoid", True
    e.moe_router_num_groups, e.moe_router_group_topk = 2, 1
    e.moe_router_topk_scaling_factor, e.moe_router_dtype = 2.5, "fp32"
    e.moe_shared_expert_intermediate_size = 2 * FFN
    layer = MoELayer(
        TransformerConfig.from_config(cfg), MoESpec.from_config(cfg), ParallelContext.single(), 1
    ).eval()
    shared = block.shared_experts
    weights = {
        "router.weight": block.gate.weight,
        "router.expert_bias": block.gate.e_score_correction_bias,
        "experts.linear_fc1.weight": block.experts.gate_up_proj,
        "experts.linear_fc2.weight": block.experts.down_proj,
        "shared_experts.linear_fc1.weight": torch.cat(
            [shared.gate_proj.weight, shared.up_proj.weight]
        ),
        "shared_experts.linear_fc2.weight": shared.down_proj.weight,
    }
    layer.load_state_dict({k: v.detach().clone() for k, v in weights.items()}, strict=True)

    x = torch.randn(2, 8, HIDDEN)  # [batch, seq, hidden]
    with torch.no_grad():
        expected = block(x)
        got = layer(x.transpose(0, 1).contiguous()).transpose(0, 1)
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error
    # The bias changed some choices: without it the output differs.
    with torch.no_grad():
        layer.router.expert_bias.zero_()
        unbiased = layer(x.transpose(0, 1).contiguous()).transpose(0, 1)
    assert ((unbiased - expected).norm() / expected.norm()).item() > 1e-3
