"""Shared by the multi-process tests (importable as `parallel_helpers`, beside tests/helpers.py):
a tensor-parallel shard gathered back into the full tensor to compare with one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gigatron.config.root import GigatronConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import merge_partitions


def tiny_tp_config(seq_length: int, tp: int, sequence_parallel: bool) -> GigatronConfig:
    """2 layers of hidden 64, a vocabulary padded to 128 rows, no dropout, at tensor-parallel
    size `tp`; the caller sets the heads and the architecture."""
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.seq_length = 2, 64, seq_length
    m.padded_vocab_size = 128
    m.attention_dropout = m.hidden_dropout = 0.0
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.sequence_parallel = sequence_parallel
    return cfg


def gather_tensor_parallel(
    tensor: torch.Tensor, param: torch.nn.Parameter, pctx: ParallelContext, experts_whole=False
) -> torch.Tensor:
    """The full tensor of `param`'s shard `tensor` (its value or gradient) over the tp group; a
    replicated parameter's tensor as it is, and an expert's too when `experts_whole` (etp = 1)."""
    if not getattr(param, "tensor_model_parallel", False) or pctx.tp_size == 1:
        return tensor
    if experts_whole and getattr(param, "expert_parallel", False):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(pctx.tp_size)]
    dist.all_gather(parts, tensor.contiguous(), group=pctx.group("tp"))
    return merge_partitions(parts, param.partition_dim, param.partition_stride)
