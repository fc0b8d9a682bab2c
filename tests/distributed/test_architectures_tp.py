"""Architectures of gpt-oss and DeepSeek (sliding windows, sinks, multi-latent attention,
multi-token prediction) at tensor parallel size 2, with and without sequence parallelism, equal
the single-process model: logits (every depth's with MTP), the loss with its MTP part, and every
gradient (gathered to full tensors)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.families.gpt import gpt_loss
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.grad_sync import finalize_model_grads
from helpers import TINY_MLA
from parallel_helpers import gather_tensor_parallel, tiny_tp_config

pytestmark = pytest.mark.distributed

SEQ, BATCH, VOCAB = 16, 2, 100

FLAVORS = {
    # Sliding windows on odd layers, learned sinks, query/key norms, YaRN, clamped quick GeGLU.
    "gpt-oss": dict(
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        normalization="RMSNorm",
        position_embedding_type="yarn",
        rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=8,
        window_size="(3,0)",
        window_attn_skip_freq="2",
        softmax_type="learnable",
        qk_layernorm=True,
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.5,
        layernorm_zero_centered_gamma=True,
    ),
    # gpt-oss's MoE: router and expert biases, clamped quick-GeGLU experts (whole per rank).
    "gpt-oss-moe": dict(
        num_attention_heads=4,
        normalization="RMSNorm",
        softmax_type="learnable",
        quick_geglu=True,
        glu_linear_offset=1.0,
        activation_func_clamp_value=0.5,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
    ),
    # Multi-latent attention with both latents and their norms, YaRN with mscale.
    "deepseek": dict(
        num_attention_heads=4,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        **TINY_MLA,
        rotary_scaling_factor=4.0,
        mscale_all_dim=0.7,
        yarn_original_max_position_embeddings=8,
    ),
    # Two multi-token prediction depths after the decoder.
    "mtp": dict(num_attention_heads=4, position_embedding_type="rope", mtp_num_layers=2),
    # A full query projection, plain RoPE, no latent norms.
    "mla-rope": dict(
        num_attention_heads=4,
        multi_latent_attention=True,
        rope_type="rope",
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
    ),
}


def _config(flavor: str, tp: int, sequence_parallel: bool) -> GigatronConfig:
    cfg = tiny_tp_config(SEQ, tp, sequence_parallel)
    m = cfg.model
    m.init_method_std = 0.2  # large enough that norms, clamps and sinks see varied values
    for key, value in FLAVORS[flavor].items():
        setattr(cfg.moe if key.startswith(("num_experts", "moe_")) else m, key, value)
    if cfg.moe.num_experts:
        cfg.parallel.expert_tensor_parallel_size = 1  # expert biases need whole experts
    return cfg


def _all_logits(output) -> list[torch.Tensor]:
    """The main logits and, with multi-token prediction, each depth's."""
    return [output[0], *output[1]] if isinstance(output, tuple) else [output]


def _compare(rank: int, world_size: int) -> None:
    pctx = ParallelContext.from_sizes(tp=world_size, etp=1)
    single = ParallelContext.single()
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    loss_mask = torch.ones(BATCH, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    for flavor in FLAVORS:
        (reference,) = build_model(_config(flavor, 1, False), single)
        ref_output = reference(tokens, positions)
        ref_loss, _, ref_reports = gpt_loss(labels, loss_mask, single, 0.3, ref_output)
        ref_loss.backward()
        ref_params = dict(reference.named_parameters())
        for sequence_parallel in (False, True):
            case = f"{flavor} sp={sequence_parallel}"
            (model,) = build_model(_config(flavor, world_size, sequence_parallel), pctx)
            for name, param in model.named_parameters():
                full = gather_tensor_parallel(param.detach(), param, pctx, experts_whole=True)
                assert torch.equal(full, ref_params[name]), (case, name)
            output = model(tokens, positions)
            for logits, expected in zip(_all_logits(output), _all_logits(ref_output), strict=True):
                parts = [torch.empty_like(logits.contiguous()) for _ in range(world_size)]
                dist.all_gather(parts, logits.contiguous(), group=pctx.group("tp"))
                torch.testing.assert_close(torch.cat(parts, -1), expected, rtol=1e-4, atol=1e-5)
            loss, _, reports = gpt_loss(labels, loss_mask, pctx, 0.3, output)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=case)
            assert reports.keys() == ref_reports.keys()
            loss.backward()
            finalize_model_grads([model], pctx)
            for name, param in model.named_parameters():
                grad = gather_tensor_parallel(param.grad, param, pctx, experts_whole=True)
                if getattr(param, "expert_parallel", False) and pctx.size("expert_dp") > 1:
                    # Each tp rank routes its slice of the sequence: partial expert gradients
                    # (DistributedDataParallel sums them over expert_dp).
                    dist.all_reduce(grad, group=pctx.group("expert_dp"))
                expected = ref_params[name].grad
                torch.testing.assert_close(
                    grad, expected, rtol=1e-4, atol=2e-5, msg=f"{case} {name}"
                )


def test_architectures_at_tp2_match_single_process() -> None:
    run_distributed(_compare, 2)


def _compare_expert_parallel(rank: int, world_size: int) -> None:
    """gpt-oss's MoE at ep = 2 (both ranks on the same batch): the same logits and loss; every
    expert sees both ranks' copies of its tokens, so expert gradients are twice the single
    model's, the others equal."""
    pctx = ParallelContext.from_sizes(ep=world_size)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    mask = torch.ones(BATCH, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    (reference,) = build_model(_config("gpt-oss-moe", 1, False), ParallelContext.single())
    ref_output = reference(tokens, positions)
    ref_loss, _, _ = gpt_loss(labels, mask, ParallelContext.single(), 0.3, ref_output)
    ref_loss.backward()
    cfg = _config("gpt-oss-moe", 1, False)
    cfg.parallel.expert_model_parallel_size = world_size
    (model,) = build_model(cfg, pctx)
    loss, _, _ = gpt_loss(labels, mask, pctx, 0.3, model(tokens, positions))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    local = 4 // world_size
    for name, param in model.named_parameters():
        expected = dict(reference.named_parameters())[name].grad
        if getattr(param, "expert_parallel", False):
            expected = 2 * expected[rank * local : (rank + 1) * local]
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=2e-5, msg=name)
    assert model.decoder.layers["0"].mlp.experts.linear_fc2.bias.grad.abs().sum() > 0


def test_gpt_oss_moe_at_ep2_matches_single_process() -> None:
    run_distributed(_compare_expert_parallel, 2)


def _mtp_config(pp: int, tied: bool) -> GigatronConfig:
    cfg = _config("mtp", 1, False)
    cfg.model.num_layers, cfg.model.untie_embeddings_and_output_weights = 4, not tied
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.training.micro_batch_size, cfg.training.global_batch_size = BATCH, 2 * BATCH
    return cfg


def _mtp_pipeline(rank: int, world_size: int) -> None:
    """Multi-token prediction on the last of 2 pipeline stages (its own copy of the word
    embedding, tied to the output layer or not): the 1F1B schedule gives the single-process
    losses (`lm_loss`, `mtp_loss`) and gradients, embedding copies summed over the stages."""
    from gigatron.families.gpt import forward_step
    from gigatron.parallel.schedules import ScheduleConfig, forward_backward

    generator = torch.Generator().manual_seed(11)
    batches = [
        {
            "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "loss_mask": torch.ones(BATCH, SEQ),
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
        }
        for _ in range(2)
    ]
    schedule = ScheduleConfig(seq_length=SEQ, micro_batch_size=BATCH, hidden_size=64)
    pctx = ParallelContext.from_sizes(pp=world_size)
    for tied in (True, False):

        def run(cfg, context):
            chunks = build_model(cfg, context)
            step = partial(forward_step, context, mtp_scaling_factor=0.3)
            reports = forward_backward(step, iter(batches), chunks, 2, context, schedule)
            finalize_model_grads(chunks, context)
            return chunks[0], reports

        reference, ref_reports = run(_mtp_config(1, tied), ParallelContext.single())
        model, reports = run(_mtp_config(world_size, tied), pctx)
        if pctx.is_pipeline_last_stage():
            assert hasattr(model, "embedding") and model.mtp is not None
            for name in ("lm_loss", "mtp_loss"):
                got = torch.stack([r[name] for r in reports]).sum(0)
                expected = torch.stack([r[name] for r in ref_reports]).sum(0)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
        ref_params = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            expected = ref_params[name]
            assert torch.equal(param.detach(), expected.detach()), (tied, name)
            torch.testing.assert_close(
                param.grad, expected.grad, rtol=1e-4, atol=2e-5, msg=f"tied={tied} {name}"
            )


def test_multi_token_prediction_with_pipeline_parallelism() -> None:
    run_distributed(_mtp_pipeline, 2)
