"""`build_model_chunks`: this rank's pipeline chunks of any family, initialised identically to
the one-process model (with fp8 products under --fp8-format: models/fp8.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.embedding import resolve_vocab_size
from gigatron.models.fp8 import apply_fp8
from gigatron.models.meta_init import materialize, parameters_on_meta
from gigatron.models.offload import install_activation_offload
from gigatron.models.transformer import LayerParts
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.context_parallel import context_parallel_core_attention
from gigatron.parallel.pipeline import chunk_layer_ranges
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import initialize_parameters

# make_chunk(padded_vocab, pre_process, post_process, layer_numbers, rng) -> one chunk
ChunkFactory = Callable[[int, bool, bool, range, ModelParallelRNG], nn.Module]


def build_model_chunks(
    cfg, pctx: ParallelContext, vocab_size: int | None, make_chunk: ChunkFactory
) -> list[nn.Module]:
    """One chunk per virtual pipeline stage of this rank, layers from `chunk_layer_ranges`; the
    first chunk of the first stage embeds, the last chunk of the last stage has the output
    layer. `vocab_size` is the tokenizer's (unpadded; see `resolve_vocab_size`)."""
    p = cfg.parallel
    vp = p.num_virtual_stages_per_pipeline_rank or 1
    if vp > 1 and pctx.pp_size == 1:
        raise GigatronError(
            "virtual pipeline stages need --pipeline-model-parallel-size > 1; drop "
            "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"
        )
    padded = resolve_vocab_size(cfg, pctx.tp_size, vocab_size)
    v_shape = is_v_shape(cfg)
    ranges = chunk_layer_ranges(
        cfg.model.num_layers,
        pctx.pp_size,
        vp,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
        v_shape,
    )[pctx.pp_rank]
    # The V (DualPipeV) ends where it starts: rank 0's chunk 1 holds the output layer.
    last_rank = 0 if v_shape else pctx.pp_size - 1
    seed = cfg.training.seed
    rng = ModelParallelRNG.for_rank(seed, pctx)
    chunks = []
    on_meta = cfg.model.init_model_with_meta_device
    for index, layers in enumerate(ranges):
        with parameters_on_meta(on_meta):
            chunk = make_chunk(
                padded,
                pctx.is_pipeline_first_stage() and index == 0,
                pctx.pp_rank == last_rank and index == len(ranges) - 1,
                layers,
                rng,
            )
        if on_meta:
            materialize(chunk, pctx.device)
        initialize_parameters(
            chunk,
            seed,
            pctx.tp_rank,
            pctx.tp_size,
            pctx.ep_rank,
            pctx.ep_size,
            pctx.etp_rank,
            pctx.etp_size,
        )
        apply_fp8(chunk, cfg, pctx.device.type, micro_batch_tokens(cfg, pctx))
        install_activation_offload(chunk, cfg)
        chunks.append(chunk)
    return chunks


def is_v_shape(cfg) -> bool:
    """Whether the chunks are placed in DualPipeV's V (rank 0 holds the first and the last
    stage; config/validate.py refuses a tied output weight there)."""
    return getattr(cfg.parallel, "pipeline_schedule", "1f1b") == "dualpipev"


def micro_batch_tokens(cfg, pctx: ParallelContext) -> int | None:
    """The tokens of a micro-batch on this rank (its part of the sequence under cp); None when
    the run has no micro-batch size (conversions, inference)."""
    micro_batch, seq = cfg.training.micro_batch_size, cfg.model.seq_length
    if micro_batch is None or seq is None:
        return None
    return micro_batch * seq // pctx.cp_size


def layer_parts_for_run(cfg, pctx: ParallelContext, parts: LayerParts | None) -> LayerParts:
    """`parts` (or the defaults) with the attention that crosses context-parallel ranks when
    --context-parallel-size > 1 (`--cp-comm-type`; a2a wraps the given core attention)."""
    parts = parts or LayerParts()
    if pctx.cp_size == 1:
        return parts
    core = context_parallel_core_attention(cfg.parallel.cp_comm_type, parts.core_attention)
    return dataclasses.replace(parts, core_attention=core)
