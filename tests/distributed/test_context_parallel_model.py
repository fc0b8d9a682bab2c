"""Context-parallel models equal the one-process model: the family's forward step (batch split,
loss over the whole sequences) and backward through DistributedDataParallel give the same loss
reports and every gradient, for GPT with RoPE + GQA, GPT-2 style (learned positions, a reset
attention mask) and BERT (bidirectional, padding), with each --cp-comm-type (and one per layer),
at cp = 4, cp = 2 (two data-parallel replicas) and tp 2 x cp 2 with sequence parallelism; and
a GPT with MoE layers at cp = 4 and at cp 2 x dp 2 with its experts over ep = 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.grad_sync import finalize_model_grads
from parallel_helpers import gather_tensor_parallel

pytestmark = pytest.mark.distributed

SEQ, BATCH, VOCAB = 32, 2, 96
FLAVORS = ("llama", "gpt2", "bert")
# One type for every layer, or one per layer (the model has two).
COMM_TYPES = (["p2p"], ["a2a"], ["allgather"], ["a2a", "p2p"])


def _config(flavor: str, tp: int = 1, cp: int = 1, comm: list[str] = ("p2p",)) -> GigatronConfig:
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.seq_length = 2, 64, SEQ
    m.padded_vocab_size = 128
    m.attention_dropout = m.hidden_dropout = 0.0
    m.num_attention_heads = 4
    if flavor == "llama":
        m.num_attention_heads = 8
        m.group_query_attention, m.num_query_groups = True, 4
        m.position_embedding_type = "rope"
        m.swiglu, m.normalization, m.add_bias_linear = True, "RMSNorm", False
        m.untie_embeddings_and_output_weights = True
    p = cfg.parallel
    p.tensor_model_parallel_size, p.context_parallel_size = tp, cp
    p.sequence_parallel = tp > 1
    p.cp_comm_type = list(comm)
    return cfg


def _batch(flavor: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(17)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) < 0.7).float()
    if flavor == "bert":
        padding = torch.ones(BATCH, SEQ, dtype=torch.long)
        padding[1, 21:] = 0  # a padded sample: its padding spans the chunks of several ranks
        return {
            "tokens": tokens,
            "token_types": (torch.arange(SEQ) >= 12).long().expand(BATCH, SEQ),
            "labels": labels,
            "loss_mask": loss_mask * padding,
            "padding_mask": padding,
            "is_random": torch.tensor([0, 1]),
        }
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
    }
    if flavor == "gpt2":
        # Two documents per sample (reset attention mask, reset position ids).
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        mask[11:, :11] = True
        batch["attention_mask"] = mask.expand(BATCH, 1, SEQ, SEQ)
        batch["position_ids"] = torch.cat([torch.arange(11), torch.arange(SEQ - 11)]).expand(
            BATCH, SEQ
        )
    return batch


def _step(flavor: str, cfg: GigatronConfig, pctx: ParallelContext):
    """One micro-batch through the family's forward step and loss, backward, gradients
    finished as the training loop does; returns (reports, {name: full gradient})."""
    family = get_family("bert" if flavor == "bert" else "gpt")
    (model,) = family.build_model(cfg, pctx, VOCAB)
    chunk = DistributedDataParallel(model, pctx, cfg.parallel)
    forward_step = family.make_forward_step(cfg, pctx)
    output, loss_fn = forward_step(iter([_batch(flavor)]), chunk)
    loss, num_tokens, reports = loss_fn(output)
    (loss / num_tokens).backward()
    finalize_model_grads([chunk], pctx)
    grads = {
        name: gather_tensor_parallel(p.main_grad, p, pctx) for name, p in model.named_parameters()
    }
    return reports, grads


def _moe_config(cp: int = 1, ep: int = 1) -> GigatronConfig:
    cfg = _config("llama", cp=cp)
    e = cfg.moe
    e.num_experts, e.moe_router_topk, e.moe_layer_freq = 4, 2, "[1,1]"
    e.moe_aux_loss_coeff, e.moe_z_loss_coeff = 1e-2, 1e-3
    cfg.parallel.expert_model_parallel_size = ep
    return finalize_config(cfg)  # the MoE layers read the derived --ffn-hidden-size


def _compare_moe() -> None:
    """MoE layers under cp: routers see this rank's tokens, experts (also split over ep ranks
    carved out of dp x cp) get every rank's tokens; dense and router gradients, and the expert
    gradients where experts are whole, match one process."""
    ref_reports, ref_grads = _step("llama", _moe_config(), ParallelContext.single())
    for cp, ep in ((4, 1), (2, 2)):
        case = f"moe cp={cp} ep={ep}"
        reports, grads = _step(
            "llama", _moe_config(cp, ep), ParallelContext.from_sizes(cp=cp, ep=ep)
        )
        torch.testing.assert_close(reports["lm_loss"], ref_reports["lm_loss"], msg=case)
        compared = 0
        for name, grad in grads.items():
            if grad.shape == ref_grads[name].shape:  # experts split over ep are left out
                compared += "experts" in name
                torch.testing.assert_close(
                    grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}"
                )
        assert compared == (4 if ep == 1 else 0), case


def _compare(rank: int, world_size: int) -> None:
    single = ParallelContext.single()
    references = {flavor: _step(flavor, _config(flavor), single) for flavor in FLAVORS}
    for tp, cp in ((1, 4), (1, 2), (2, 2)):
        pctx = ParallelContext.from_sizes(tp=tp, cp=cp)
        for flavor in FLAVORS:
            ref_reports, ref_grads = references[flavor]
            for comm in COMM_TYPES:
                case = f"{flavor} tp={tp} cp={cp} {'+'.join(comm)}"
                reports, grads = _step(flavor, _config(flavor, tp, cp, comm), pctx)
                assert reports.keys() == ref_reports.keys(), case
                for name, value in reports.items():
                    torch.testing.assert_close(
                        value, ref_reports[name], rtol=1e-5, atol=1e-5, msg=f"{case} {name}"
                    )
                for name, grad in grads.items():
                    torch.testing.assert_close(
                        grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}"
                    )
        dist.barrier()
    _compare_moe()


def test_context_parallel_models_match_single_process() -> None:
    run_distributed(_compare, 4)
