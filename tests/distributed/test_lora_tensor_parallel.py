"""LoRA adapters at tensor parallel size 2, with and without sequence parallelism, equal the
single-process model, plain LoRA and DoRA (--lora-dora: a magnitude per output row): logits,
loss and every adapter gradient (gathered to full tensors); the base gets no gradient; folding
the adapters into the weights (`merge_adapters`) keeps the logits; an adapted chunk saves and
loads its adapters only. In the same launch, LoRA on an MoE
model's experts (per-expert adapters of the stacked expert weights) at ep 2 equals ep 1: loss and
every adapter gradient (expert adapters gathered over ep), and merging keeps the logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from gigatron.config.validate import finalize_config
from gigatron.families import get_family
from gigatron.families.gpt import gpt_loss
from gigatron.models import build_model
from gigatron.models.lora import LoRASpec, add_lora_adapters, is_adapter_name, merge_adapters
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from gigatron.parallel.tensor_parallel import parameter_seed, slice_for_rank
from parallel_helpers import gather_tensor_parallel, tiny_tp_config

pytestmark = pytest.mark.distributed

SEQ, BATCH, VOCAB = 16, 2, 100
SPEC = LoRASpec(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"), rank=4, alpha=8.0)
DORA = dataclasses.replace(SPEC, dora=True)


def _adapted_model(tp: int, sequence_parallel: bool, pctx: ParallelContext, spec=SPEC):
    cfg = tiny_tp_config(SEQ, tp, sequence_parallel)
    m = cfg.model
    m.num_attention_heads, m.group_query_attention, m.num_query_groups = 4, True, 2
    m.swiglu, m.normalization, m.position_embedding_type = True, "RMSNorm", "rope"
    (model,) = build_model(cfg, pctx)
    add_lora_adapters([model], spec, pctx, seed=5)
    # B starts at zero; give every adapter weight a full random value (the same on any layout),
    # DoRA's magnitudes (||W|| to start) a random factor.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_name(name):
                shape = list(param.shape)
                if param.tensor_model_parallel:
                    shape[param.partition_dim] *= pctx.tp_size
                gen = torch.Generator().manual_seed(parameter_seed(1, name))
                full = torch.randn(shape, generator=gen) * 0.1
                if param.tensor_model_parallel:
                    full = slice_for_rank(
                        full, param.partition_dim, param.partition_stride, pctx.tp_rank, tp
                    )
                param.copy_(param * (1 + full) if name.endswith("magnitude") else full)
    return model


def _gather_logits(logits: torch.Tensor, pctx: ParallelContext) -> torch.Tensor:
    parts = [torch.empty_like(logits.contiguous()) for _ in range(pctx.tp_size)]
    dist.all_gather(parts, logits.contiguous(), group=pctx.group("tp"))
    return torch.cat(parts, -1)


def _compare(rank: int, world_size: int) -> None:
    pctx = ParallelContext.from_sizes(tp=world_size)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    for spec in (SPEC, DORA):
        _compare_spec(spec, pctx, tokens, labels)


def _compare_spec(spec: LoRASpec, pctx: ParallelContext, tokens, labels) -> None:
    single, world_size = ParallelContext.single(), pctx.tp_size
    mask = torch.ones(BATCH, SEQ)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    reference = _adapted_model(1, False, single, spec)
    ref_logits = reference(tokens, positions)
    ref_loss, _, _ = gpt_loss(labels, mask, single, 0.0, ref_logits)
    ref_loss.backward()
    ref_params = dict(reference.named_parameters())
    trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_name(n) for n in trainable)
    # A and B (DoRA: and the magnitude) of 4 layers in each of 2 layers
    assert len(trainable) == 2 * 4 * (3 if spec.dora else 2)
    for sequence_parallel in (False, True):
        model = _adapted_model(world_size, sequence_parallel, pctx, spec)
        logits = model(tokens, positions)
        torch.testing.assert_close(_gather_logits(logits, pctx), ref_logits.detach())
        loss, _, _ = gpt_loss(labels, mask, pctx, 0.0, logits)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        finalize_model_grads([model], pctx)
        for name, param in model.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, name
                continue
            grad = gather_tensor_parallel(param.grad, param, pctx)
            expected = ref_params[name].grad
            assert expected.abs().sum() > 0, name
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)
    # An adapted chunk's state is its adapters; a state of adapters alone loads.
    state = model.state_dict()
    assert sorted(state) == sorted(n for n in dict(model.named_parameters()) if is_adapter_name(n))
    model.load_state_dict({k: torch.zeros_like(v) for k, v in state.items()})
    assert all(p.abs().sum() == 0 for n, p in model.named_parameters() if is_adapter_name(n))
    # Merged weights compute the adapted model.
    model = _adapted_model(world_size, False, pctx, spec)
    with torch.no_grad():
        adapted = _gather_logits(model(tokens, positions), pctx)
        merge_adapters([model])
        assert not any(is_adapter_name(n) for n in model.state_dict())
        merged = _gather_logits(model(tokens, positions), pctx)
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert (merged - ref_logits.detach()).abs().max() < 1e-4


def _moe_model(pctx: ParallelContext):
    cfg = tiny_tp_config(SEQ, 1, False)
    m, e = cfg.model, cfg.moe
    m.num_attention_heads, m.swiglu, m.normalization = 4, True, "RMSNorm"
    m.add_bias_linear = False
    e.num_experts, e.moe_router_topk, e.moe_layer_freq = 4, 2, "[1,1]"
    cfg.parallel.expert_model_parallel_size = pctx.ep_size
    cfg = finalize_config(cfg)
    (model,) = build_model(cfg, pctx)
    add_lora_adapters([model], SPEC, pctx, seed=5)
    with torch.no_grad():  # random B (the same experts' values on any layout)
        for name, param in model.named_parameters():
            if name.endswith("adapter.linear_out.weight"):
                parts = pctx.ep_size if getattr(param, "expert_parallel", False) else 1
                full = torch.randn(
                    (param.shape[0] * parts, *param.shape[1:]),
                    generator=torch.Generator().manual_seed(parameter_seed(1, name)),
                )
                param.copy_(full.chunk(parts)[pctx.ep_rank % parts] * 0.1)
    return cfg, model


def _moe_step(pctx: ParallelContext, batch: dict):
    cfg, model = _moe_model(pctx)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel)
    output, loss_fn = get_family("gpt").make_forward_step(cfg, pctx)(iter([batch]), chunk)
    loss, tokens, reports = loss_fn(output)
    (loss / tokens).backward()
    finalize_model_grads([chunk], pctx)
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.main_grad
            if getattr(param, "expert_parallel", False) and pctx.ep_size > 1:
                parts = [torch.empty_like(grad) for _ in range(pctx.ep_size)]
                dist.all_gather(parts, grad.contiguous(), group=pctx.group("ep"))
                grad = torch.cat(parts)
            grads[name] = grad
    return model, grads


def _compare_experts(rank: int, world_size: int) -> None:
    """Each dp rank trains its own sample; one process trains both."""
    generator = torch.Generator().manual_seed(3)
    batch = {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        "loss_mask": torch.ones(BATCH, SEQ),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
    }
    reference, ref_grads = _moe_step(ParallelContext.single(), batch)
    experts = [n for n in ref_grads if ".experts.linear_fc" in n]
    assert len(experts) == 2 * 2 * 2  # A and B of fc1 and fc2 in 2 layers
    pctx = ParallelContext.from_sizes(ep=world_size)
    mine = {k: v[rank : rank + 1] for k, v in batch.items()}
    model, grads = _moe_step(pctx, mine)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert ref_grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # Folding the expert adapters into the expert weights keeps the logits.
    tokens, positions = batch["tokens"], batch["position_ids"]
    with torch.no_grad():
        reference.eval()
        adapted = reference(tokens, positions)
        merge_adapters([reference])
        assert not any(is_adapter_name(n) for n in reference.state_dict())
        torch.testing.assert_close(reference(tokens, positions), adapted, rtol=1e-5, atol=1e-5)


def test_lora_at_tp2_matches_single_process() -> None:
    run_distributed(_compare, 2)
    run_distributed(_compare_experts, 2)
