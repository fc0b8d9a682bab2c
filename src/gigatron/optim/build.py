"""`build_optimizer`: the optimizer the flags ask for (its own module, so that optimizer.py and
distributed_optimizer.py do not import each other)."""

from __future__ import annotations

from typing import Any

from torch import nn

from gigatron.optim.distributed_optimizer import DistributedOptimizer
from gigatron.optim.fully_sharded_optimizer import FullyShardedOptimizer
from gigatron.optim.grad_scaler import build_grad_scaler
from gigatron.optim.muon import MatrixOrthogonalizer, MuonSettings, mark_qkv_weights, per_matrix
from gigatron.optim.optimizer import (
    FP32Optimizer,
    GigatronOptimizer,
    MixedPrecisionOptimizer,
    make_torch_optimizer,
    param_groups_for,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.fully_sharded import FullyShardedDataParallel


def build_optimizer(
    cfg: Any, model_chunks: list[nn.Module], pctx: ParallelContext
) -> GigatronOptimizer:
    """The optimizer the flags ask for: FSDP2's sharded parameters stepped in place, the
    distributed optimizer, mixed precision with fp32 main parameters under --bf16/--fp16, or
    plain fp32."""
    grad_scaler = build_grad_scaler(cfg)
    if any(isinstance(chunk, FullyShardedDataParallel) for chunk in model_chunks):
        return FullyShardedOptimizer(
            make_torch_optimizer(cfg, param_groups_for(cfg, model_chunks)), cfg, model_chunks, pctx
        )
    if cfg.parallel.use_distributed_optimizer:
        return DistributedOptimizer(cfg, model_chunks, pctx, grad_scaler=grad_scaler)
    orthogonalize = None
    if cfg.optimizer.optimizer == "muon":
        mark_qkv_weights(cfg, model_chunks)
        orthogonalize = per_matrix(MatrixOrthogonalizer(MuonSettings.from_config(cfg), pctx))
    optimizer = make_torch_optimizer(cfg, param_groups_for(cfg, model_chunks), orthogonalize)
    if cfg.training.bf16 or cfg.training.fp16:
        return MixedPrecisionOptimizer(optimizer, cfg, model_chunks, pctx, grad_scaler)
    return FP32Optimizer(optimizer, cfg, model_chunks, pctx, grad_scaler=None)
