"""Building an engine: from model chunks in memory (`build_engine`), or from a training
checkpoint (`load_for_inference`), in the layout it was saved with."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch import nn

from gigatron.checkpoint.dist_format import COMMON_FILENAME, read_metadata
from gigatron.checkpoint.formats import detect_format, load_checkpoint, saved_header
from gigatron.checkpoint.megatron_convert import gigatron_config_dict
from gigatron.checkpoint.torch_format import (
    locate_iteration,
    saved_layout,
)
from gigatron.config import config_from_dict
from gigatron.config.checkpoint_args import PRECISION, apply_checkpoint_flags
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.inference.arguments import dynamic_settings
from gigatron.inference.block_pool import BlockPool
from gigatron.inference.draft_speculative import DraftProposer
from gigatron.inference.engine import InferenceEngine, validate_engine_sizes
from gigatron.inference.runner import ModelRunner
from gigatron.inference.scheduler import BlockScheduler, DynamicSettings
from gigatron.models.activation_quant import quantize_kv_cache, quantize_linear_inputs
from gigatron.models.lora import LoRASpec, add_lora_adapters
from gigatron.models.t5 import T5Model
from gigatron.parallel.context import ParallelContext
from gigatron.training.run import build_context


def build_engine(
    model_chunks: list[nn.Module],
    pctx: ParallelContext,
    tokenizer: Any = None,
    max_batch_size: int = 8,
    max_sequence_length: int | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dynamic: DynamicSettings | None = None,
    draft: nn.Module | None = None,
    num_speculative_tokens: int = 0,
) -> InferenceEngine:
    """An engine over this rank's chunks. The context defaults to the model's
    (`max_position_embeddings`, else `seq_length`); `vocab_size` (the real one, unpadded) to the
    tokenizer's; generation stops at the tokenizer's end-of-document token. `dynamic`: the
    dynamic engine (paged KV cache, `max_batch_size` request slots; inference/scheduler.py).
    `draft` (rank 0's, a full single-process model): speculative decoding with
    `num_speculative_tokens` drafts per round (inference/draft_speculative.py)."""
    config = model_chunks[0].config
    context = config.max_position_embeddings
    max_sequence_length = max_sequence_length or context
    if max_sequence_length is None:
        raise GigatronError("--max-sequence-length: the model does not say its context; give it")
    if context is not None and config.position_embedding_type == "learned_absolute":
        if max_sequence_length > context:
            raise GigatronError(
                f"--max-sequence-length {max_sequence_length}: the model has learned position "
                f"embeddings for {context} positions only; use at most {context}"
            )
    validate_engine_sizes(max_batch_size, max_sequence_length)
    if vocab_size is None:
        vocab_size = tokenizer.vocab_size if tokenizer is not None else model_chunks[0].vocab_size
    block_size = dynamic.block_size if dynamic is not None else None
    buffer_bytes = dynamic.buffer_bytes if dynamic is not None else None
    runner = ModelRunner(
        model_chunks, pctx, vocab_size, max_batch_size, max_sequence_length,
        block_size=block_size, kv_buffer_bytes=buffer_bytes,
    )  # fmt: skip
    eod = getattr(tokenizer, "eod", None)
    stops = (eod,) if eod is not None else ()
    scheduler = None if dynamic is None else dynamic_scheduler(runner, dynamic)
    proposer = None
    if num_speculative_tokens and _any_rank(runner.cache.mamba is not None, pctx):
        raise GigatronError(
            "speculative decoding: the target has Mamba layers, whose recurrent state cannot be "
            "rewound past a rejected draft; use an attention-only model"
        )
    if draft is not None and pctx.rank == 0:
        proposer = DraftProposer(
            draft, num_speculative_tokens, vocab_size, max_batch_size, max_sequence_length
        )
    return InferenceEngine(
        runner, tokenizer, default_stop_token_ids=stops, seed=seed, scheduler=scheduler,
        proposer=proposer,
    )  # fmt: skip


def _any_rank(flag: bool, pctx: ParallelContext) -> bool:
    """Whether `flag` holds on any rank (every rank must raise the same errors)."""
    if pctx.world_size == 1:
        return flag
    box = torch.tensor([int(flag)], device=pctx.device)
    torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX)
    return bool(box)


def dynamic_scheduler(runner: ModelRunner, dynamic: DynamicSettings) -> BlockScheduler:
    """The block scheduler over a runner's paged cache (prefix caching needs attention-only
    models: a recurrent state cannot start from a cached prefix)."""
    cache = runner.cache
    if dynamic.prefix_caching and cache.mamba is not None:
        raise GigatronError(
            "--inference-dynamic-batching-prefix-caching: the model has Mamba layers, whose "
            "recurrent state cannot start from a cached prefix; drop the flag"
        )
    pool = BlockPool(cache.num_blocks, cache.block_size, prefix_caching=dynamic.prefix_caching)
    return BlockScheduler(
        pool, runner.max_batch_size, dynamic.max_tokens, dynamic.chunked_prefill, cache.window
    )


@dataclass
class LoadedModel:
    cfg: Any
    pctx: ParallelContext
    chunks: list[nn.Module]
    tokenizer: Any
    iteration: int


# Called by generate and serve right after loading: may replace `chunks` with modules the engine
# runs instead (a Retro checkpoint's retrieval, tasks/retro_generate.py).
Attach = Callable[[LoadedModel, argparse.Namespace], None]


def load_for_inference(args: argparse.Namespace, data_parallel: bool = False) -> LoadedModel:
    """Read the checkpoint's configuration, start the process groups for its tensor/pipeline
    layout (under torchrun), build the model and load the weights. With `data_parallel`
    (evaluation) the world may hold several copies of that layout (dp = world / (tp x pp))."""

    load_dir = Path(args.load)
    located = locate_iteration(load_dir, args.ckpt_step) if load_dir.is_dir() else None
    if located is None:
        raise GigatronError(
            f"--load {load_dir}: no checkpoint there (no latest_checkpointed_iteration.txt); "
            "point it at a directory written by `gigatron pretrain ... --save`"
        )
    iteration_dir, iteration, _ = located
    if detect_format(iteration_dir) == "torch_dist":
        cfg, family = _torch_dist_config(iteration_dir, load_dir, data_parallel, args)
        return _build_and_load(cfg, family, args, load_dir, iteration)
    layout = saved_layout(iteration_dir)
    if layout is None:
        raise GigatronError(f"--load {load_dir}: {iteration_dir} holds no mp_rank_* directories")
    tp, pp, ep = layout
    if ep > 1:
        raise GigatronError(
            f"--load {load_dir}: saved with expert-parallel size {ep}; generation runs at "
            "expert-parallel size 1: convert it first with gigatron convert-checkpoint "
            "--target-expert-parallel-size 1"
        )
    first = saved_header(iteration_dir)
    saved = first.get("args")
    if isinstance(saved, argparse.Namespace):  # Megatron-LM's own file (core or legacy layout)
        saved = gigatron_config_dict(saved)
    if not isinstance(saved, dict) or not saved:
        raise GigatronError(
            f"--load {load_dir}: the checkpoint holds no gigatron configuration ('args'); only "
            "checkpoints written by gigatron can be loaded for generation"
        )
    cfg = config_from_dict(saved, source=f"{iteration_dir} args")
    if (cfg.parallel.expert_model_parallel_size or 1) > 1:
        raise GigatronError(
            f"--load {load_dir}: saved with expert-parallel size "
            f"{cfg.parallel.expert_model_parallel_size}; generation runs at expert-parallel size "
            "1: convert it first with gigatron convert-checkpoint --target-expert-parallel-size 1"
        )
    family = first.get("gigatron_family", "gpt")
    _check_generates(family, load_dir, args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if data_parallel and world % (tp * pp) == 0:
        pass
    elif world != tp * pp:
        raise GigatronError(
            f"--load {load_dir}: saved with tensor-parallel {tp} x pipeline-parallel {pp}; "
            f"start {tp * pp} process(es) (torchrun --nproc-per-node {tp * pp} ...), this run "
            f"has {world}, or convert it with gigatron convert-checkpoint"
        )
    cfg.parallel.num_virtual_stages_per_pipeline_rank = (
        cfg.parallel.num_virtual_stages_per_pipeline_rank or None
    )
    return _build_and_load(cfg, family, args, load_dir, iteration)


def _check_generates(family: str, load_dir: Path, args: argparse.Namespace) -> None:
    if family == "retro" and getattr(args, "retro_project_dir", None):
        return  # generates with retrieval (tasks/retro_generate.py)
    if family == "retro":
        where = (
            "give --retro-project-dir, the `gigatron retro-preprocess` project of its database "
            "and index"
            if hasattr(args, "retro_project_dir")
            else "generate, serve and evaluate --task RETRO-QA run it, with --retro-project-dir"
        )
        raise GigatronError(
            f"--load {load_dir}: a Retro model, which generates with retrieval: {where} "
            "(docs/retro.md)"
        )
    if family != "t5" and not get_family(family).generation:  # T5: inference/t5_generation.py
        raise GigatronError(
            f"--load {load_dir}: a '{family}' model, which does not generate text; generate, "
            "serve and evaluate (WikiText perplexity, LAMBADA accuracy) need a GPT or hybrid "
            "Mamba (family 'mamba') language model (generate also takes a T5); evaluate a BERT "
            "checkpoint on MNLI, QQP or "
            "RACE with gigatron finetune"
        )


def _torch_dist_config(
    iteration_dir: Path, load_dir: Path, data_parallel: bool, args: argparse.Namespace
) -> tuple[Any, str]:
    """(config, family) for a torch_dist checkpoint, which loads at any layout: tensor-parallel
    = the process count (1 with `data_parallel`: one copy per process), pipeline, context and
    expert parallel 1, and the saved padded vocabulary."""

    common = saved_header(iteration_dir)
    saved = common.get("args")
    if not isinstance(saved, dict) or not saved:
        raise GigatronError(f"--load {load_dir}: the checkpoint holds no gigatron configuration")
    family = common.get("gigatron_family", "gpt")
    _check_generates(family, load_dir, args)
    cfg = config_from_dict(saved, source=f"{iteration_dir / COMMON_FILENAME} args")
    p = cfg.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p.tensor_model_parallel_size = 1 if data_parallel else world
    p.pipeline_model_parallel_size = p.context_parallel_size = 1
    p.expert_model_parallel_size = 1
    p.expert_tensor_parallel_size = None
    p.num_virtual_stages_per_pipeline_rank = p.num_layers_per_virtual_pipeline_stage = None
    p.decoder_first_pipeline_num_layers = p.decoder_last_pipeline_num_layers = None
    p.use_distributed_optimizer = False
    embedding = read_metadata(iteration_dir).state_dict_metadata.get(
        "model.embedding.word_embeddings.weight"
    )
    if embedding is not None:  # the padded size depends on the saved tp: keep the saved one
        cfg.model.padded_vocab_size = int(embedding.size[0])
    cfg.checkpoint.ckpt_format = "torch_dist"
    return cfg, family


def _build_and_load(
    cfg: Any, family: str, args: argparse.Namespace, load_dir: Path, iteration: int
) -> LoadedModel:
    apply_checkpoint_flags(cfg, args)  # Megatron's shape/layout/precision flags, if given
    p = cfg.parallel
    p.sequence_parallel = False  # nothing to split in one-token steps; weights are the same
    p.context_parallel_size = 1  # whole sequences on every rank; the weights do not depend on it
    p.device = args.device
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = True
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        if getattr(args, name, None):
            setattr(cfg.tokenizer, name, getattr(args, name))
    tokenizer = build_run_tokenizer(cfg)
    pctx = build_context(cfg)
    chunks = get_family(family).build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    # the step asked for, else the tracker's (a `release` checkpoint has no iter_ directory)
    step = getattr(args, "ckpt_step", None)
    load_checkpoint(load_dir, chunks, None, None, pctx, cfg, iteration=step)
    if getattr(args, "lora_checkpoint", None):
        add_saved_adapters(chunks, Path(args.lora_checkpoint), pctx, cfg)
    for chunk in chunks:
        chunk.eval()
    _quantize_activations(chunks, load_dir, step, cfg.parallel.tensor_model_parallel_size)
    return LoadedModel(cfg, pctx, chunks, tokenizer, iteration)


def _quantize_activations(chunks: list[nn.Module], load_dir: Path, step: Any, tp: int) -> None:
    """A W8A8 checkpoint (`gigatron quantize`'s header says its activation bits): its linear
    layers' inputs fake-quantized per token, as the exported model computes them."""
    located = locate_iteration(load_dir, step)
    info = saved_header(located[0]).get("quantization") if located else None
    if isinstance(info, dict) and info.get("activation_bits"):
        bits, scales = info["activation_bits"], info.get("input_scales")
        quantize_linear_inputs(chunks, info["layers"], bits, tp, static_scales=scales)
    if isinstance(info, dict) and info.get("kv_cache_scales"):
        quantize_kv_cache(chunks, info["kv_cache_scales"])


def add_saved_adapters(
    chunks: list[nn.Module], lora_dir: Path, pctx: ParallelContext, cfg: Any
) -> None:
    """Add the adapters of a LoRA run's checkpoint (`--lora-checkpoint`) to loaded chunks."""
    located = locate_iteration(lora_dir, None) if lora_dir.is_dir() else None
    if located is None:
        raise GigatronError(
            f"--lora-checkpoint {lora_dir}: no checkpoint there; give the --save directory of a "
            "LoRA run"
        )
    saved = saved_header(located[0]).get("args")
    spec = LoRASpec.from_config(config_from_dict(saved)) if isinstance(saved, dict) else None
    if spec is None:
        raise GigatronError(
            f"--lora-checkpoint {lora_dir}: not a LoRA run's checkpoint (no --lora-target-modules "
            "in its configuration)"
        )
    add_lora_adapters(chunks, spec, pctx, cfg.training.seed)
    adapters_cfg = dataclasses.replace(  # adapters are saved in torch format, whatever the base
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, auto_detect_ckpt_format=True)
    )
    try:
        load_checkpoint(lora_dir, chunks, None, None, pctx, adapters_cfg)
    except GigatronError as error:  # name the flag the user gave
        raise GigatronError(str(error).replace("--load ", "--lora-checkpoint ", 1)) from None


def engine_from_args(loaded: LoadedModel, args: argparse.Namespace) -> InferenceEngine:
    if isinstance(loaded.chunks[0], T5Model):
        raise GigatronError(
            f"--load {args.load}: a T5 model, which only `gigatron generate` runs; "
            "serve and evaluate need a GPT or hybrid Mamba language model"
        )
    draft = None
    if getattr(args, "speculative_draft_load", None) and loaded.pctx.rank == 0:
        draft = load_draft_model(args, loaded)
    return build_engine(
        loaded.chunks,
        loaded.pctx,
        loaded.tokenizer,
        max_batch_size=args.max_batch_size,
        max_sequence_length=args.max_sequence_length,
        seed=args.seed,
        dynamic=dynamic_settings(args),
        draft=draft,
        num_speculative_tokens=getattr(args, "num_speculative_tokens", 0),
    )


def run_on_engine(
    loaded: LoadedModel, args: argparse.Namespace, work: Callable[[InferenceEngine], int]
) -> int:
    """Build the engine `args` ask for and run `work(engine)` on rank 0; the other ranks follow
    (run the forward passes rank 0 asks for) until `work` returns."""
    engine = engine_from_args(loaded, args)
    if loaded.pctx.rank != 0:
        engine.runner.follow()
        return 0
    try:
        return work(engine)
    finally:
        engine.runner.stop_followers()


def load_draft_model(args: argparse.Namespace, target: LoadedModel) -> nn.Module:
    """The --speculative-draft-load checkpoint as one full model on this process (whatever the
    target's layout), with the target's device and --fp16/--bf16."""
    flag, load_dir = "--speculative-draft-load", Path(args.speculative_draft_load)
    located = locate_iteration(load_dir, None) if load_dir.is_dir() else None
    if located is None:
        raise GigatronError(
            f"{flag} {load_dir}: no checkpoint there (no latest_checkpointed_iteration.txt); "
            "point it at a directory written by `gigatron pretrain gpt ... --save`"
        )
    iteration_dir = located[0]
    header = saved_header(iteration_dir) if detect_format(iteration_dir) == "torch" else {}
    saved, family = header.get("args"), header.get("gigatron_family", "gpt")
    if saved_layout(iteration_dir) != (1, 1, 1) or not isinstance(saved, dict) or family != "gpt":
        raise GigatronError(
            f"{flag} {load_dir}: the draft runs as one process: give a gigatron GPT checkpoint "
            "in the torch format at tensor- and pipeline-parallel size 1 (gigatron "
            "convert-checkpoint --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1)"
        )
    cfg = config_from_dict(saved, source=f"{iteration_dir} args")
    apply_checkpoint_flags(cfg, args, only=PRECISION)
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = True
    for name in ("tokenizer_model", "vocab_file", "merge_file"):  # the tokenizer moved
        if getattr(args, name, None):
            setattr(cfg.tokenizer, name, getattr(args, name))
    tokenizer = build_run_tokenizer(cfg)
    if tokenizer.vocab_size != target.tokenizer.vocab_size:
        raise GigatronError(
            f"{flag} {load_dir}: a tokenizer of {tokenizer.vocab_size} tokens, the --load "
            f"model's has {target.tokenizer.vocab_size}; the draft must use the same tokenizer"
        )
    pctx = ParallelContext.single(target.pctx.device)
    chunks = get_family(family).build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
    load_checkpoint(load_dir, chunks, None, None, pctx, cfg)
    return chunks[0].eval()
