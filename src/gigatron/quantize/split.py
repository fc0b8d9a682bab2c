"""The calibration's model split over tensor/pipeline-parallel processes (`gigatron quantize
--tensor-model-parallel-size T --pipeline-model-parallel-size P` under torchrun).

Each process builds its (tp, pp) position's chunk of the model, cut from the reader's full
tensors as a conversion cuts them (checkpoint/layout.py), and a calibration sample runs through
the pipeline schedule (forward only, as `gigatron evaluate` scores): every linear layer's inputs
are seen on the stage that owns it. A column-parallel layer's inputs are the same on every
tensor-parallel rank; a row-parallel layer's are split along the features, so they are gathered
(in the weight's column order) before statistics such as X^T X are formed. The statistics of
each stage then go to the first process, which quantizes every layer once, from the reader's
full weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gigatron.checkpoint.layout import (
    OUTPUT_WEIGHT,
    WORD_EMBEDDING,
    build_target_layout,
    check_target,
)
from gigatron.config.validate import params_dtype
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.schedules import ScheduleConfig, forward_backward
from gigatron.parallel.tensor_parallel import RowParallelLinear, merge_partitions


def is_split(pctx: ParallelContext) -> bool:
    """Whether the calibration's model is split over tensor- or pipeline-parallel processes."""
    return pctx.tp_size * pctx.pp_size > 1


class SplitModel:
    """This process's chunk of the model at the tp x pp layout of `pctx`, called like a chunk
    (`model(tokens, None)`: one forward pass of every stage, through the pipeline schedule)."""

    def __init__(self, model: Any, vocab_size: int, pctx: ParallelContext) -> None:
        tp, pp = pctx.tp_size, pctx.pp_size
        check_split(model, tp, pp)
        layout = build_target_layout(model.cfg, tp, pp, None, 1, vocab_size, model.family)
        cfg = layout.cfg
        cfg.parallel.sequence_parallel = False  # whole sequences: the inputs as one process has
        cfg.parallel.context_parallel_size = 1
        self.pctx, self.dtype = pctx, params_dtype(cfg)
        self.chunks = get_family(model.family).build_model(cfg, pctx, vocab_size=vocab_size)
        rank = layout.positions[(pctx.tp_rank, pctx.pp_rank, 0)]
        for chunk in self.chunks:
            state = chunk.state_dict()
            for name, value in state.items():
                source = name if name in model.source else None
                if source is None and name == OUTPUT_WEIGHT:  # tied: the last stage's copy
                    source = WORD_EMBEDDING
                if source is not None:
                    full = model.source.tensor(source)
                    state[name] = layout.slice(name, full, tuple(value.shape), rank)
            chunk.load_state_dict(state, strict=True)
            chunk.eval()
        self.hidden_size = self.chunks[0].config.hidden_size

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """This stage's modules, by their names in the whole model (layers by global index)."""
        for chunk in self.chunks:
            yield from chunk.named_modules()

    def __call__(self, tokens: torch.Tensor, _positions: Any = None) -> None:
        config = ScheduleConfig(
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
            hidden_size=self.hidden_size, pipeline_dtype=self.dtype,
        )  # fmt: skip

        def step(iterator: Iterator, chunk: nn.Module) -> tuple[torch.Tensor, Any]:
            return chunk(next(iterator), None), _no_loss

        forward_backward(step, iter([tokens]), self.chunks, 1, self.pctx, config, True)

    def full_input(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A layer's whole input: a row-parallel layer's feature slices gathered over tp."""
        if not isinstance(module, RowParallelLinear) or not module.input_is_parallel:
            return x
        parts = [torch.empty_like(x) for _ in range(self.pctx.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.pctx.group("tp"))
        return merge_partitions(parts, x.dim() - 1, module.weight.partition_stride)

    def gather_expert_features(self, x: torch.Tensor) -> torch.Tensor:
        """Grouped experts' fc2 input [rows, ffn / etp] as [rows, ffn]: each expert-tp rank's
        slice of the features, in rank order (fc2's weight is split along them contiguously);
        every rank holds all the rows (no sequence parallelism here)."""
        pctx = self.pctx
        if pctx.etp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(pctx.etp_size)]
        dist.all_gather(parts, x.contiguous(), group=pctx.group("expert_tp"))
        return torch.cat(parts, dim=-1)


def check_split(model: Any, tp: int, pp: int) -> None:
    """Refuse, with quantize's flag names, a layout the model does not split into."""
    try:
        check_target(model.cfg, tp, pp, None, 1, model.family)  # heads, layers, ... divide
    except GigatronError as error:
        text = str(error).replace("--target-tensor-parallel-size", "--tensor-model-parallel-size")
        text = text.replace("--target-pipeline-parallel-size", "--pipeline-model-parallel-size")
        raise GigatronError(text) from None


def _no_loss(_output: torch.Tensor) -> tuple[torch.Tensor, int, dict]:
    return torch.zeros(()), 1, {}


def largest_over_tp(stats: dict[str, torch.Tensor], pctx: ParallelContext) -> None:
    """Each statistic (in place) as its largest over the tensor-parallel ranks (a maximum over
    the heads: each rank's core attention sees its own)."""
    if pctx.tp_size == 1:
        return
    for key in sorted(stats):
        dist.all_reduce(stats[key], op=dist.ReduceOp.MAX, group=pctx.group("tp"))


def stats_on_first(stats: dict[str, torch.Tensor], pctx: ParallelContext) -> dict:
    """Every stage's statistics on process 0 (an empty dict elsewhere): the first tp and dp
    rank of each stage sends its own (the others hold the same)."""
    if pctx.world_size == 1:
        return stats
    mine = stats if pctx.tp_rank == 0 and pctx.dp_rank == 0 else {}
    gathered: list[Any] | None = [None] * pctx.world_size if pctx.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if gathered else {}
