"""MoE upcycling (`--moe-use-upcycling`): the MoE run starts from a dense checkpoint under
`--load`, every expert a copy of the dense layer's MLP (Komatsuzaki et al., "Sparse Upcycling").

The dense model of the same layout (the run's flags without experts, the dense MLP of
`--moe-ffn-hidden-size`) loads the checkpoint's weights; every MoE parameter takes the dense
parameter of the same name, expert weights [local experts, ...] one copy of the dense MLP's
(same tensor-parallel shard) per expert; the router keeps its fresh initialisation. With
routing probabilities that sum to one over the chosen experts (softmax after top-k, or
`--moe-router-topk 1` with pre-softmax) and no dropped tokens, each MoE layer computes the dense
layer's output: the step-0 logits equal the dense model's. Granular upcycling
(`--moe-upcycling-granularity` > 1) is not available.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gigatron.checkpoint.formats import load_checkpoint
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext

EXPERTS = ".mlp.experts."
ROUTER = ".mlp.router."


def upcycling_problems(cfg: Any) -> list[str]:
    """Why this configuration cannot be upcycled exactly (empty when it can)."""
    e, found = cfg.moe, []
    if not cfg.checkpoint.load:
        found.append("--moe-use-upcycling needs --load: the dense checkpoint")
    if not e.num_experts:
        found.append("--moe-use-upcycling needs --num-experts")
    if e.moe_upcycling_granularity != 1:
        found.append(
            f"--moe-upcycling-granularity {e.moe_upcycling_granularity}: only 1 (each expert a "
            "copy of the dense MLP)"
        )
    if e.moe_shared_expert_intermediate_size:
        found.append("--moe-use-upcycling with shared experts: not available")
    probabilities_sum_to_one = (
        e.moe_router_score_function == "softmax"
        and (not e.moe_router_pre_softmax or e.moe_router_topk == 1)
        and e.moe_router_topk_scaling_factor in (None, 1.0)
    )
    if not probabilities_sum_to_one:
        found.append(
            "--moe-use-upcycling: the routing probabilities must sum to one over the chosen "
            "experts (softmax after top-k), or the upcycled model is not the dense one"
        )
    return found


def dense_config(cfg: Any) -> Any:
    """The run's configuration without experts: the dense model the checkpoint holds."""
    dense = copy.deepcopy(cfg)
    dense.moe.num_experts = None
    dense.moe.moe_use_upcycling = False
    dense.parallel.expert_model_parallel_size = 1
    dense.model.ffn_hidden_size = cfg.moe.moe_ffn_hidden_size or cfg.model.ffn_hidden_size
    dense.checkpoint.no_load_optim = dense.checkpoint.no_load_rng = True
    return dense


@torch.no_grad()
def upcycle(
    cfg: Any,
    pctx: ParallelContext,
    moe_chunks: list[nn.Module],
    build_dense: Callable[[Any, ParallelContext], list[nn.Module]],
) -> str:
    """Fill `moe_chunks` (wrapped or not) from the dense checkpoint under --load; the line to
    print."""
    problems = upcycling_problems(cfg)
    if problems:
        raise GigatronError("; ".join(problems))
    dense = dense_config(cfg)
    dense_chunks = build_dense(dense, pctx)
    loaded = load_checkpoint(cfg.checkpoint.load, dense_chunks, None, None, pctx, dense)
    for moe_chunk, dense_chunk in zip(moe_chunks, dense_chunks, strict=True):
        copy_dense_into_moe(getattr(moe_chunk, "module", moe_chunk), dense_chunk)
    return (
        f"upcycled the dense checkpoint {cfg.checkpoint.load} (iteration "
        f"{loaded.get('iteration', 0)}) into {cfg.moe.num_experts} experts per MoE layer"
    )


def copy_dense_into_moe(moe: nn.Module, dense: nn.Module) -> None:
    """Every MoE parameter from the dense one of its name; each expert a dense MLP copy."""
    dense_params = dict(dense.named_parameters())
    for name, param in moe.named_parameters():
        if ROUTER in name:
            continue
        source = dense_params.get(name.replace(EXPERTS, ".mlp."))
        if source is None:
            raise GigatronError(f"upcycling: the dense checkpoint has no weight for {name}")
        if EXPERTS in name:
            source = source.unsqueeze(0).expand_as(param)
        if source.shape != param.shape:
            raise GigatronError(
                f"upcycling: {name} {tuple(param.shape)} does not fit the dense "
                f"{tuple(source.shape)}; use the dense model's --ffn-hidden-size as "
                "--moe-ffn-hidden-size"
            )
        param.copy_(source)
