"""`gigatron pretrain <family> [flags]`: build everything a run needs, then hand it to the loop.

Order (Megatron's): flags -> `training.run.build_run` (parallel context, seeds, tokenizer, model
chunks wrapped in DistributedDataParallel, optimizer and learning-rate schedule, checkpoint) ->
datasets and iterators (resumed at the consumed sample counts) -> train() -> final evaluations.
Everything family-specific (model, forward step and losses, datasets, FLOPs) comes from the
family's record in gigatron.families. Works alone and under `torchrun --nproc-per-node N`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gigatron.checkpoint.async_save import AsyncCheckpointSaver
from gigatron.checkpoint.formats import save_checkpoint
from gigatron.checkpoint.hf_during_training import hf_adapter_of, save_hf
from gigatron.checkpoint.megatron_args import parse_config_with_checkpoint_args
from gigatron.checkpoint.torch_format import loaded_message
from gigatron.config import GigatronConfig, validate_config
from gigatron.config.validate import freeze_config, params_dtype
from gigatron.data.loader import build_data_iterator
from gigatron.errors import GigatronError
from gigatron.families import ModelFamily, family_names, get_family
from gigatron.families.accepted import check_family_config
from gigatron.faults import RestartLedger, name_distributed_failures
from gigatron.models.embedding import resolve_vocab_size
from gigatron.models.flops import device_peak_flops, precision_name
from gigatron.models.moe.spec import MoESpec
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.schedules import ScheduleConfig
from gigatron.training.loop import Run, TrainResult, TrainState, train
from gigatron.training.metrics import (
    MetricsLogger,
    count_active_parameters,
    count_parameters,
    count_parameters_by_kind,
    gather_from_ranks,
    memory_footprint,
)
from gigatron.training.resilience_inprocess import (
    abort_process_groups,
    active_world_size,
    restarting_in_process,
)
from gigatron.training.run import (
    RunParts,
    apply_thread_choice,
    build_metrics,
    build_run,
    gather_for_save,
    state_to_saved,
)


def launch_world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_pretrain_config(
    argv: Sequence[str], world_size: int | None = None, family: str | ModelFamily = "gpt"
) -> GigatronConfig:
    """Flags of `gigatron pretrain <family>`, validated for a training run."""
    family = get_family(family) if isinstance(family, str) else family
    world_size = launch_world_size() if world_size is None else world_size
    world_size = active_world_size(argv, world_size)  # in-process restart's spares do not train
    # A Megatron-LM checkpoint under --load gives the model shape the flags leave out.
    cfg = parse_config_with_checkpoint_args(
        list(argv), prog=f"gigatron pretrain {family.name}", world_size=world_size
    )
    validate_config(cfg, world_size=world_size, for_training=True)
    tok = cfg.tokenizer
    if tok.tokenizer_type is None and tok.vocab_file and family.default_tokenizer_type:
        tok.tokenizer_type = family.default_tokenizer_type  # Megatron's entry-point default
    check_family_config(family, cfg)
    if cfg.data.mock_data is False and not (cfg.data.data_path or cfg.data.train_data_path):
        raise GigatronError(
            "no training data: give --data-path PREFIX (from `gigatron preprocess`), "
            "--train-data-path, or --mock-data with --vocab-size for synthetic tokens"
        )
    if cfg.training.eval_interval is not None and cfg.training.eval_interval <= 0:
        raise GigatronError(f"--eval-interval {cfg.training.eval_interval} must be positive")
    if cfg.training.full_validation:
        raise GigatronError(
            "--full-validation is not supported yet; validate on --eval-iters batches instead"
        )
    if cfg.logging.log_interval <= 0:
        raise GigatronError(f"--log-interval {cfg.logging.log_interval} must be positive")
    if cfg.checkpoint.save_interval is not None and cfg.checkpoint.save_interval <= 0:
        raise GigatronError(f"--save-interval {cfg.checkpoint.save_interval} must be positive")
    return freeze_config(cfg)  # building and running the model never changes it


def dataset_sample_counts(cfg: GigatronConfig, train_iters: int, global_batch: int):
    """(train, valid, test) samples to ask of the datasets (Megatron's formulas)."""
    t = cfg.training
    train = t.train_samples if t.train_samples is not None else train_iters * global_batch
    evaluations = (train_iters // t.eval_interval + 1) if t.eval_interval else 1
    evaluations += 1 if t.eval_at_start else 0
    valid = evaluations * t.eval_iters * global_batch
    test = t.eval_iters * global_batch
    return train, valid, test


def pretrain(
    cfg: GigatronConfig,
    stream: Any = None,
    family: str | ModelFamily = "gpt",
    progress_bar: bool | None = None,
    keep_model: bool = False,
    evaluate_on_early_exit: bool = False,
) -> tuple[TrainResult, Any]:
    """Run pretraining for a validated config. Returns the result and, with `keep_model`, the
    unwrapped model chunks (quickstart samples from them); otherwise None.
    `evaluate_on_early_exit` validates once more when an exit condition stops the run."""
    options = (stream, family, progress_bar, keep_model, evaluate_on_early_exit)
    if not cfg.parallel.inprocess_restart:
        return _pretrain_attempt(cfg, *options)
    print_line = partial(print, file=stream or sys.stdout, flush=True)
    return restarting_in_process(cfg, lambda c: _pretrain_attempt(c, *options), print_line)


def _pretrain_attempt(
    cfg: GigatronConfig,
    stream: Any,
    family: str | ModelFamily,
    progress_bar: bool | None,
    keep_model: bool,
    evaluate_on_early_exit: bool,
) -> tuple[TrainResult, Any]:
    """One attempt of `pretrain` (in-process restarts make several)."""
    family = get_family(family) if isinstance(family, str) else family
    print_line = partial(print, file=stream or sys.stdout, flush=True)
    parts = build_run(cfg, family, print_line=print_line)
    metrics: MetricsLogger | None = None
    saver = None
    try:
        if cfg.checkpoint.load and cfg.checkpoint.ckpt_convert_format is not None:
            return _convert_on_load(parts, print_line), None
        iterators = _data_iterators(parts)
        metrics = build_metrics(
            cfg, parts.pctx, parts.train_iters, family.loss_names(cfg), parts.state.iteration,
            stream=stream, progress_bar=progress_bar,
        )  # fmt: skip
        if cfg.checkpoint.load and parts.loaded["loaded"]:
            metrics.message(loaded_message(cfg.checkpoint.load, parts.loaded))
        saver = _async_saver(parts, metrics)
        run = _loop_run(parts, metrics, iterators, saver, evaluate_on_early_exit)
        ledger = RestartLedger.open()  # torchrun --max-restarts: where each round got to
        if ledger is not None:
            ledger.begin(parts.state.iteration, metrics.message)
            run.after_iteration = _record_progress(run.state, ledger, run.after_iteration)
        # A collective that times out or loses its peer is named while the groups still exist.
        result = name_distributed_failures(train, run)
        if saver is not None:
            saver.close()  # the last checkpoint is complete before the run ends
            saver = None
        return result, ([m.module for m in parts.model] if keep_model else None)
    except Exception:
        if cfg.parallel.inprocess_restart:
            for chunk in parts.model:
                if isinstance(chunk, DistributedDataParallel):
                    chunk.release()  # its hooks kept the failed groups open
            abort_process_groups()  # the other ranks' collectives with this one fail now
        raise
    finally:
        if saver is not None:
            saver.abandon()  # an error: the save in flight stays unpublished
        if metrics is not None:
            metrics.close()
        parts.close()


def _convert_on_load(parts: RunParts, print_line: Any) -> TrainResult:
    """Megatron's convert-on-load: write the loaded state in the other format, stop."""
    ckpt, state = parts.cfg.checkpoint, parts.state
    gather_for_save(parts.model, ckpt.ckpt_convert_format)
    save_checkpoint(
        ckpt.ckpt_convert_save, state.iteration, parts.model, parts.optimizer, parts.scheduler,
        parts.pctx, parts.cfg, extra={**state_to_saved(state), "gigatron_family": parts.family.name},
        rng_tracker=parts.rng_tracker, ckpt_format=ckpt.ckpt_convert_format,
    )  # fmt: skip
    if parts.pctx.rank == 0:
        print_line(
            f"converted checkpoint {ckpt.load} (iteration {state.iteration}) to "
            f"{ckpt.ckpt_convert_format} in {ckpt.ckpt_convert_save}"
        )
    return TrainResult(iteration=state.iteration, exit_reason="converted")


def _data_iterators(parts: RunParts) -> tuple[Any, Any, Any]:
    """(train, valid, test) iterators of the family's datasets, resumed at the consumed
    sample counts (train None when nothing is left to train: only the evaluations run)."""
    cfg, pctx, state = parts.cfg, parts.pctx, parts.state
    t = cfg.training
    train_n, valid_n, test_n = dataset_sample_counts(
        cfg, parts.train_iters, parts.calculator.global_batch_size
    )
    train_ds, valid_ds, test_ds = parts.family.build_datasets(
        cfg,
        parts.tokenizer,
        (train_n, valid_n if t.eval_iters else None, test_n if t.eval_iters else None),
        pctx,
    )
    if not t.eval_iters:
        valid_ds = test_ds = None

    def iterator(dataset: Any, consumed: int, cycle: bool = False):
        # A DataLoader draws its base seed from torch's global generator when its iterator
        # is made; fork it so that a resumed run's restored random state stays untouched.
        with torch.random.fork_rng(devices=[]):
            return build_data_iterator(
                dataset, t.micro_batch_size, consumed, pctx,
                num_workers=cfg.data.num_workers, cycle=cycle,
            )  # fmt: skip

    nothing_to_train = t.skip_train or state.iteration >= parts.train_iters
    return (
        None if nothing_to_train else iterator(train_ds, state.consumed_train_samples),
        iterator(valid_ds, state.consumed_valid_samples, cycle=True),
        iterator(test_ds, 0, cycle=True),
    )


def startup_record(parts: RunParts, vocab_size: int, precision: str) -> Callable[[], dict]:
    """The start-up record (sizes, layout; LoRA's trainable parameters), measured after the
    first step."""
    model, pctx, cfg = parts.model, parts.pctx, parts.cfg
    start_iteration = parts.state.iteration

    def record() -> dict[str, Any]:
        per_rank = gather_from_ranks(
            {"rank": pctx.rank, **memory_footprint(model, parts.optimizer)}, pctx
        )
        moe = MoESpec.from_config(cfg)
        active = (
            {"active_parameters": count_active_parameters(model, pctx, moe.topk, moe.num_experts)}
            if moe is not None
            else {}
        )
        if cfg.model.lora_target_modules:  # LoRA: the adapters alone train
            active["trainable_parameters"] = sum(
                count_parameters_by_kind(model, pctx, trainable_only=True)
            )
        return {
            "parameters": count_parameters(model, pctx),
            **active,
            "world_size": pctx.world_size,
            "tp": pctx.tp_size,
            "pp": pctx.pp_size,
            "dp": pctx.dp_size,
            "cp": pctx.cp_size,
            "precision": precision,
            "device": str(pctx.device),
            "padded_vocab_size": vocab_size,
            "train_iters": parts.train_iters,
            "global_batch_size": parts.calculator.global_batch_size,
            "start_iteration": start_iteration,
            "bytes_per_rank": per_rank,
        }

    return record


def _record_progress(
    state: TrainState, ledger: RestartLedger, then: Callable[[], None] | None
) -> Any:
    """The loop's after-iteration hook: record the completed iteration, then `then` (it holds
    the state, not the Run: a Run referring to itself would outlive the command and keep its
    data-loader workers running at exit)."""

    def after_iteration() -> None:
        ledger.completed(state.iteration)
        if then is not None:
            then()

    return after_iteration


def _async_saver(parts: RunParts, metrics: MetricsLogger) -> Any:
    """An AsyncCheckpointSaver with --async-save (and --save), else None."""
    ckpt = parts.cfg.checkpoint
    if not (ckpt.async_save and ckpt.save):
        return None
    return AsyncCheckpointSaver(
        parts.pctx,
        on_complete=lambda iteration: metrics.message(
            f"saved checkpoint at iteration {iteration} to {ckpt.save} (async save done)"
        ),
    )


def _checkpoint_writer(parts: RunParts, saver: Any) -> Callable[[TrainState], str | None]:
    """The loop's save_checkpoint: a synchronous save, or one handed to the async saver."""
    cfg, ckpt = parts.cfg, parts.cfg.checkpoint
    if ckpt.save_hf:
        hf_adapter_of(parts.family)  # a family without a config.json writer: refused up front

    def save(current: TrainState) -> str | None:
        notes = [save_gigatron(current)] if ckpt.save else []
        if ckpt.save_hf:
            folder = save_hf(
                ckpt.save_hf, current.iteration, parts.model, parts.pctx, cfg, parts.family,
                parts.tokenizer.vocab_size,
            )  # fmt: skip
            notes.append(f"saved Hugging Face folder {folder}")
        return "; ".join(notes)

    def save_gigatron(current: TrainState) -> str:
        gather_for_save(parts.model, ckpt.ckpt_format)
        extra = {**state_to_saved(current), "gigatron_family": parts.family.name}
        if saver is not None:
            saver.save(
                ckpt.save, current.iteration, parts.model, parts.optimizer, parts.scheduler, cfg,
                extra, parts.rng_tracker,
            )  # fmt: skip
            return f"saving checkpoint at iteration {current.iteration} in the background"
        save_checkpoint(
            ckpt.save, current.iteration, parts.model, parts.optimizer, parts.scheduler,
            parts.pctx, cfg, extra=extra, rng_tracker=parts.rng_tracker,
        )  # fmt: skip
        return f"saved checkpoint at iteration {current.iteration} to {ckpt.save}"

    return save


def _schedule_config(parts: RunParts) -> ScheduleConfig:
    cfg, pctx, family = parts.cfg, parts.pctx, parts.family
    return ScheduleConfig(
        seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.training.micro_batch_size,
        hidden_size=cfg.model.hidden_size,
        pipeline_dtype=params_dtype(cfg),
        sequence_parallel=cfg.parallel.sequence_parallel,
        per_token_loss=cfg.parallel.calculate_per_token_loss,
        grad_scale_func=parts.optimizer.scale_loss,
        microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage,
        pipeline_schedule=cfg.parallel.pipeline_schedule,
        overlap_p2p_comm=cfg.parallel.overlap_p2p_comm,
        stage_shapes=(
            family.pipeline_stage_shapes(cfg, pctx)
            if family.pipeline_stage_shapes is not None and pctx.pp_size > 1
            else None
        ),
    )


def _loop_run(
    parts: RunParts,
    metrics: MetricsLogger,
    iterators: tuple[Any, Any, Any],
    saver: Any,
    evaluate_on_early_exit: bool,
) -> Run:
    """The loop's Run for a pretraining run."""
    cfg, pctx, family = parts.cfg, parts.pctx, parts.family
    t = cfg.training
    vocab_size = resolve_vocab_size(
        cfg, cfg.parallel.tensor_model_parallel_size, parts.tokenizer.vocab_size
    )
    precision = precision_name(t.bf16, t.fp16)
    return Run(
        cfg=cfg,
        pctx=pctx,
        model=parts.model,
        optimizer=parts.optimizer,
        scheduler=parts.scheduler,
        batch_calculator=parts.calculator,
        forward_step=family.make_forward_step(cfg, pctx),
        schedule_config=_schedule_config(parts),
        metrics=metrics,
        train_iters=parts.train_iters,
        vocab_size=vocab_size,
        flops_per_iteration=lambda batch: family.flops_per_iteration(cfg, batch, vocab_size),
        loss_names=family.loss_names(cfg),
        iteration_reports=(
            partial(family.iteration_reports, cfg, pctx)
            if family.iteration_reports is not None
            else None
        ),
        train_iterator=iterators[0],
        valid_iterator=iterators[1],
        test_iterator=iterators[2],
        state=parts.state,
        save_checkpoint=(
            _checkpoint_writer(parts, saver)
            if cfg.checkpoint.save or cfg.checkpoint.save_hf
            else None
        ),
        after_iteration=saver.poll if saver is not None else None,
        peak_flops=device_peak_flops(pctx.device, precision),
        startup_record=startup_record(parts, vocab_size, precision),
        evaluate_on_early_exit=evaluate_on_early_exit,
    )


def main(argv: Sequence[str]) -> int:
    """`gigatron pretrain <family> [flags]`."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: gigatron pretrain <family> [flags]   "
            "(gigatron pretrain gpt --help lists the flags)\nfamilies:"
        )
        for name in family_names():
            print(f"  {name:8s} {get_family(name).description}")
        return 0
    family = get_family(argv[0])
    apply_thread_choice()  # a single process: a few threads (docs/training.md)
    cfg = parse_pretrain_config(argv[1:], family=family)
    pretrain(cfg, family=family)  # every way a run ends without an exception is a clean exit
    return 0
