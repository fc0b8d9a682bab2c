"""`gigatron pretrain <family> [flags]`: build everything a run needs, then hand it to the loop.

Order (Megatron's): flags -> parallel context -> seeds -> tokenizer -> model chunks wrapped in
DistributedDataParallel -> optimizer and learning-rate schedule -> checkpoint -> datasets and
iterators (resumed at the consumed sample counts) -> train() -> final evaluations.
Everything family-specific (model, forward step and losses, datasets, FLOPs) comes from the
family's record in gigatron.families. Works alone and under `torchrun --nproc-per-node N`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gigatron.checkpoint.megatron_args import parse_config_with_checkpoint_args
from gigatron.config import GigatronConfig, validate_config
from gigatron.config.validate import freeze_config, params_dtype
from gigatron.errors import GigatronError
from gigatron.families import ModelFamily, family_names, get_family
from gigatron.families.accepted import check_family_config
from gigatron.faults import name_distributed_failures
from gigatron.models.embedding import resolve_vocab_size
from gigatron.models.moe.spec import MoESpec
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.schedules import ScheduleConfig
from gigatron.training.flops import device_peak_flops, precision_name
from gigatron.training.loop import Run, TrainResult, TrainState, train
from gigatron.training.metrics import (
    MetricsLogger,
    count_active_parameters,
    count_parameters,
    default_metrics_path,
    gather_from_ranks,
    memory_footprint,
)


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def parse_pretrain_config(
    argv: Sequence[str], world_size: int | None = None, family: str | ModelFamily = "gpt"
) -> GigatronConfig:
    """Flags of `gigatron pretrain <family>`, validated for a training run."""
    family = get_family(family) if isinstance(family, str) else family
    world_size = _world_size() if world_size is None else world_size
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


def set_determinism(cfg: GigatronConfig) -> None:
    """--deterministic-mode: only deterministic kernels (an error names any op without one)."""
    if not cfg.training.deterministic_mode:
        return
    # cuBLAS needs a fixed workspace to be deterministic; must be set before the first matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def apply_process_settings(cfg: GigatronConfig) -> None:
    """Process-wide switches some flags ask for: --logging-level (the root logger's level, as
    in Megatron; gigatron's loggers are `gigatron.*`) and --disable-bf16-reduced-precision-matmul
    (cuBLAS bf16 products then reduce in fp32)."""
    if cfg.logging.logging_level is not None:
        logging.getLogger().setLevel(cfg.logging.logging_level)
    if cfg.model.disable_bf16_reduced_precision_matmul:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def build_run_tokenizer(cfg: GigatronConfig) -> Any:
    """The tokenizer of the run; --mock-data with --vocab-size needs no files (NullTokenizer)."""
    from gigatron.data.tokenizers import build_tokenizer

    tok = cfg.tokenizer
    if tok.tokenizer_type is None:
        if cfg.data.mock_data and tok.vocab_size is not None:
            tok = dataclasses.replace(tok, tokenizer_type="NullTokenizer")
        else:
            raise GigatronError(
                "--tokenizer-type is required (e.g. GPT2BPETokenizer with --vocab-file and "
                "--merge-file), or use --mock-data --vocab-size N"
            )
    return build_tokenizer(tok)


def dataset_sample_counts(cfg: GigatronConfig, train_iters: int, global_batch: int):
    """(train, valid, test) samples to ask of the datasets (Megatron's formulas)."""
    t = cfg.training
    train = t.train_samples if t.train_samples is not None else train_iters * global_batch
    evaluations = (train_iters // t.eval_interval + 1) if t.eval_interval else 1
    evaluations += 1 if t.eval_at_start else 0
    valid = evaluations * t.eval_iters * global_batch
    test = t.eval_iters * global_batch
    return train, valid, test


def _grad_dtype(cfg: GigatronConfig) -> torch.dtype:
    t = cfg.training
    if t.fp16 and not cfg.parallel.accumulate_allreduce_grads_in_fp32:
        return torch.float16
    if t.bf16 and cfg.parallel.grad_reduce_in_bf16:
        return torch.bfloat16  # --grad-reduce-in-bf16: halves the buffer and the reduction
    # bf16 gradients lose too much when summed over micro-batches: Megatron accumulates in fp32.
    return torch.float32


def wrap_for_data_parallel(cfg: GigatronConfig, pctx: ParallelContext, chunk: Any) -> Any:
    """A model chunk in its data-parallel wrapper: FSDP2 when asked (docs/data_parallel.md),
    else DistributedDataParallel."""
    from gigatron.parallel.data_parallel import DistributedDataParallel
    from gigatron.parallel.fully_sharded import (
        COMM_DTYPES,
        FullyShardedDataParallel,
        uses_fully_sharded,
    )

    p = cfg.parallel
    if uses_fully_sharded(p, pctx.dp_size):
        comm = p.megatron_fsdp_grad_comm_dtype
        reduce_dtype = (
            COMM_DTYPES[comm] if comm != "auto" else _grad_dtype(cfg)  # auto: as DDP would
        )
        return FullyShardedDataParallel(chunk, pctx, p, params_dtype(cfg), reduce_dtype)
    return DistributedDataParallel(chunk, pctx, p, grad_dtype=_grad_dtype(cfg))


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
    from gigatron.checkpoint.formats import load_checkpoint, save_checkpoint
    from gigatron.checkpoint.torch_format import loaded_message
    from gigatron.data.loader import build_data_iterator
    from gigatron.optim import build_optimizer
    from gigatron.optim.batch_schedule import build_num_microbatches_calculator
    from gigatron.optim.lr_schedule import build_lr_scheduler
    from gigatron.parallel.random import seed_everything

    family = get_family(family) if isinstance(family, str) else family
    set_determinism(cfg)
    apply_process_settings(cfg)
    pctx = ParallelContext.from_config(cfg)
    owns_process_group = dist.is_initialized() and pctx.world_size > 1
    metrics: MetricsLogger | None = None
    saver = None
    try:
        t, ckpt = cfg.training, cfg.checkpoint
        seed_everything(t.seed, pctx)

        tokenizer = build_run_tokenizer(cfg)
        vocab_size = resolve_vocab_size(
            cfg, cfg.parallel.tensor_model_parallel_size, tokenizer.vocab_size
        )

        chunks = family.build_model(cfg, pctx, vocab_size=tokenizer.vocab_size)
        # The model-parallel random stream lives in the model; checkpoints carry its state.
        rng_tracker = getattr(chunks[0], "rng", None)
        model = [wrap_for_data_parallel(cfg, pctx, chunk) for chunk in chunks]
        optimizer = build_optimizer(cfg, model, pctx)
        scheduler = build_lr_scheduler(cfg, optimizer)
        calculator = build_num_microbatches_calculator(cfg, pctx.dp_size)
        global_batch = calculator.global_batch_size
        if t.train_iters is not None:
            train_iters = t.train_iters
        else:
            train_iters = calculator.train_iters_for_samples(t.train_samples)

        state = TrainState()
        if ckpt.load:
            loaded = load_checkpoint(
                ckpt.load, model, optimizer, scheduler, pctx, cfg, rng_tracker=rng_tracker
            )
            # The checkpoint holds the consumed train and validation samples, so both data
            # streams continue where they stopped.
            state = _state_from_loaded(loaded, cfg)
            if ckpt.ckpt_convert_format is not None:
                # Megatron's convert-on-load: write the loaded state in the other format, stop.
                _gather_for_save(model, ckpt.ckpt_convert_format)
                save_checkpoint(
                    ckpt.ckpt_convert_save, state.iteration, model, optimizer, scheduler, pctx,
                    cfg, extra={**_state_to_saved(state), "gigatron_family": family.name},
                    rng_tracker=rng_tracker, ckpt_format=ckpt.ckpt_convert_format,
                )  # fmt: skip
                if pctx.rank == 0:
                    print(
                        f"converted checkpoint {ckpt.load} (iteration {state.iteration}) to "
                        f"{ckpt.ckpt_convert_format} in {ckpt.ckpt_convert_save}",
                        file=stream or sys.stdout,
                        flush=True,
                    )
                return TrainResult(iteration=state.iteration, exit_reason="converted"), None

        train_n, valid_n, test_n = dataset_sample_counts(cfg, train_iters, global_batch)
        train_ds, valid_ds, test_ds = family.build_datasets(
            cfg,
            tokenizer,
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

        metrics = MetricsLogger(
            default_metrics_path(cfg.logging.metrics_file, ckpt.save),
            pctx,
            train_iters=train_iters,
            start_iteration=state.iteration,
            tensorboard_dir=cfg.logging.tensorboard_dir,
            wandb_project=cfg.logging.wandb_project,
            wandb_exp_name=cfg.logging.wandb_exp_name,
            progress_bar=False if cfg.logging.no_progress_bar else progress_bar,
            stream=stream,
            loss_names=family.loss_names(cfg),
            log_throughput=cfg.logging.log_throughput,
            timing_log_level=cfg.logging.timing_log_level,
            tensorboard_timers=cfg.logging.log_timers_to_tensorboard,
            tensorboard_validation_ppl=cfg.logging.log_validation_ppl_to_tensorboard,
        )
        if ckpt.load and loaded["loaded"]:
            metrics.message(loaded_message(ckpt.load, loaded))
        precision = precision_name(t.bf16, t.fp16)

        start_iteration = state.iteration

        def startup_record() -> dict[str, Any]:
            footprint = memory_footprint(model, optimizer)
            per_rank = gather_from_ranks({"rank": pctx.rank, **footprint}, pctx)
            moe = MoESpec.from_config(cfg)
            active = (
                {
                    "active_parameters": count_active_parameters(
                        model, pctx, moe.topk, moe.num_experts
                    )
                }
                if moe is not None
                else {}
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
                "train_iters": train_iters,
                "global_batch_size": global_batch,
                "start_iteration": start_iteration,
                "bytes_per_rank": per_rank,
            }

        if ckpt.async_save and ckpt.save:
            from gigatron.checkpoint.async_save import AsyncCheckpointSaver

            saver = AsyncCheckpointSaver(
                pctx,
                on_complete=lambda iteration: metrics.message(
                    f"saved checkpoint at iteration {iteration} to {ckpt.save} (async save done)"
                ),
            )

        def save(current: TrainState) -> str | None:
            _gather_for_save(model, ckpt.ckpt_format)
            extra = {**_state_to_saved(current), "gigatron_family": family.name}
            if saver is not None:
                saver.save(
                    ckpt.save, current.iteration, model, optimizer, scheduler, cfg, extra,
                    rng_tracker,
                )  # fmt: skip
                return f"saving checkpoint at iteration {current.iteration} in the background"
            save_checkpoint(
                ckpt.save, current.iteration, model, optimizer, scheduler, pctx, cfg,
                extra=extra, rng_tracker=rng_tracker,
            )  # fmt: skip
            return None

        schedule_config = ScheduleConfig(
            seq_length=cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            hidden_size=cfg.model.hidden_size,
            pipeline_dtype=params_dtype(cfg),
            sequence_parallel=cfg.parallel.sequence_parallel,
            per_token_loss=cfg.parallel.calculate_per_token_loss,
            grad_scale_func=optimizer.scale_loss,
            microbatch_group_size=cfg.parallel.microbatch_group_size_per_vp_stage,
            stage_shapes=(
                family.pipeline_stage_shapes(cfg, pctx)
                if family.pipeline_stage_shapes is not None and pctx.pp_size > 1
                else None
            ),
        )
        run = Run(
            cfg=cfg,
            pctx=pctx,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            batch_calculator=calculator,
            forward_step=family.make_forward_step(cfg, pctx),
            schedule_config=schedule_config,
            metrics=metrics,
            train_iters=train_iters,
            vocab_size=vocab_size,
            flops_per_iteration=lambda batch: family.flops_per_iteration(cfg, batch, vocab_size),
            loss_names=family.loss_names(cfg),
            iteration_reports=(
                partial(family.iteration_reports, cfg, pctx)
                if family.iteration_reports is not None
                else None
            ),
            train_iterator=(
                None  # nothing left to train: only the final evaluations run
                if t.skip_train or state.iteration >= train_iters
                else iterator(train_ds, state.consumed_train_samples)
            ),
            valid_iterator=iterator(valid_ds, state.consumed_valid_samples, cycle=True),
            test_iterator=iterator(test_ds, 0, cycle=True),
            state=state,
            save_checkpoint=save if ckpt.save else None,
            after_iteration=saver.poll if saver is not None else None,
            peak_flops=device_peak_flops(pctx.device, precision),
            startup_record=startup_record,
            evaluate_on_early_exit=evaluate_on_early_exit,
        )
        # A collective that times out or loses its peer is named while the groups still exist.
        result = name_distributed_failures(train, run)
        if saver is not None:
            saver.close()  # the last checkpoint is complete before the run ends
            saver = None
        return result, ([m.module for m in model] if keep_model else None)
    finally:
        if saver is not None:
            saver.abandon()  # an error: the save in flight stays unpublished
        if metrics is not None:
            metrics.close()
        if owns_process_group:
            dist.destroy_process_group()


def _state_from_loaded(loaded: Any, cfg: GigatronConfig) -> TrainState:
    """TrainState from what load_checkpoint returned (iteration 0 with --finetune)."""
    values = loaded if isinstance(loaded, dict) else {"iteration": int(loaded or 0)}
    if cfg.checkpoint.finetune:
        return TrainState()
    return TrainState(
        iteration=int(values.get("iteration", 0)),
        consumed_train_samples=int(values.get("consumed_train_samples", 0)),
        consumed_valid_samples=int(values.get("consumed_valid_samples", 0)),
        skipped_iterations=int(values.get("skipped_iterations", 0)),
        floating_point_operations_so_far=float(
            values.get("num_floating_point_operations_so_far", 0)
        ),
    )


def _gather_for_save(model: list[Any], ckpt_format: str) -> None:
    """FSDP chunks gather their full weights on every dp rank before a torch-format save (whose
    writers then call `state_dict()` alone); torch_dist writes each rank's shards instead."""
    if ckpt_format == "torch_dist":
        return
    for chunk in model:
        if hasattr(chunk, "gather_for_save"):
            chunk.gather_for_save()


def _state_to_saved(state: TrainState) -> dict[str, Any]:
    return {
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "skipped_iterations": state.skipped_iterations,
        "num_floating_point_operations_so_far": state.floating_point_operations_so_far,
    }


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
    cfg = parse_pretrain_config(argv[1:], family=family)
    pretrain(cfg, family=family)  # every way a run ends without an exception is a clean exit
    return 0
