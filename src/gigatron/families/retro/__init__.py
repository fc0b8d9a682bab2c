"""The Retro family (`gigatron pretrain retro`): a GPT with chunked cross-attention to
retrieved neighbours (models/retro.py), trained on the GPT dataset + the neighbour tokens of a
Retro project (--retro-project-dir, written by `gigatron retro-preprocess`; docs/retro.md).

The loss is the GPT's (`lm_loss`); a gpt checkpoint under --load is retro-fitted
(checkpoint/retrofit.py).
"""

from __future__ import annotations

import dataclasses
from functools import partial

from gigatron.config.retro import RetroConfig
from gigatron.errors import GigatronError
from gigatron.families import gpt
from gigatron.families.gpt import FAMILY as GPT_FAMILY
from gigatron.families.registry import ModelFamily
from gigatron.families.retro.dataset import build_retro_datasets
from gigatron.models.retro import (
    RetroSpec,
    build_retro_model,
    context_shape,
    retro_layer_numbers,
)
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline import chunk_layer_ranges, pipeline_tensor_shape


def make_forward_step(cfg, pctx: ParallelContext):
    loss_in_model = cfg.model.cross_entropy_loss_fusion
    return partial(
        gpt.forward_step, pctx, loss_in_model=loss_in_model, model_inputs=("neighbour_tokens",)
    )


def loss_names(cfg) -> tuple[str, ...]:
    return ("lm_loss",)


def validate(cfg) -> None:
    """What the Retro model and its data need, and what it cannot do (yet)."""
    m, p, r = cfg.model, cfg.parallel, cfg.retro
    retro_layer_numbers(m.num_layers)
    if m.seq_length % r.retro_gpt_chunk_length:
        raise GigatronError(
            f"--retro-gpt-chunk-length {r.retro_gpt_chunk_length} does not divide --seq-length "
            f"{m.seq_length}; give a chunk length that does (Megatron's is 64)"
        )
    retrieved = r.retro_gpt_chunk_length * r.retro_num_retrieved_chunks
    tp = p.tensor_model_parallel_size
    if p.sequence_parallel and tp > 1 and retrieved % tp:
        raise GigatronError(
            f"--sequence-parallel: the {retrieved} neighbour tokens (chunk length x "
            f"--retro-num-retrieved-chunks) do not split over --tensor-model-parallel-size {tp}"
        )
    virtual = (p.num_virtual_stages_per_pipeline_rank or 1) > 1 or (
        p.num_layers_per_virtual_pipeline_stage is not None
    )
    unsupported = [
        flag
        for value, flag in (
            (virtual, "virtual pipeline stages"),
            (p.context_parallel_size > 1, "--context-parallel-size > 1"),
            (m.recompute_granularity == "full", "--recompute-granularity full"),
        )
        if value
    ]
    if unsupported:
        raise GigatronError(
            f"{', '.join(unsupported)}: not built for Retro (its pipeline stages pass the "
            "neighbours along with the hidden states, one model chunk per rank); drop the "
            "flag(s) for gigatron pretrain retro"
        )


def pipeline_stage_shapes(cfg, pctx: ParallelContext):
    """What each Retro stage sends forward: [hidden states, neighbours], the neighbours embedded
    until the stage that holds the encoder's layer, encoded from there on (models/retro.py)."""
    m, p = cfg.model, cfg.parallel
    spec = RetroSpec.from_config(cfg)
    micro_batch = cfg.training.micro_batch_size
    hidden = pipeline_tensor_shape(
        m.seq_length, micro_batch, m.hidden_size, pctx.tp_size, 1, p.sequence_parallel
    )
    ranges = chunk_layer_ranges(
        m.num_layers,
        pctx.pp_size,
        None,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )
    encoder_index = retro_layer_numbers(m.num_layers)[0] - 1  # 0-based

    def stage_shapes(stage: int) -> list[tuple[int, ...]]:
        encoded = ranges[stage][0].stop > encoder_index
        return [hidden, context_shape(spec, m.seq_length, micro_batch, m.hidden_size, encoded)]

    return stage_shapes


# --sft: InstructRetro's instruction tuning (families/retro/sft.py; no packing).
ACCEPTED_FIELDS = frozenset(field.name for field in dataclasses.fields(RetroConfig)) | {
    "sft",
    "sft_tokenizer_prompt_format",
}
DEFAULT_TOKENIZER_TYPE = GPT_FAMILY.default_tokenizer_type


# Trained like a GPT (its FLOPs count the decoder: docs/retro.md); no Hugging Face map, no
# generation, no MoE reports.
FAMILY = ModelFamily.from_namespace(
    globals(),
    description="Retro: a GPT with chunked cross-attention to retrieved neighbours",
    build_model=build_retro_model,
    build_datasets=build_retro_datasets,
    flops_per_iteration=GPT_FAMILY.flops_per_iteration,
)
