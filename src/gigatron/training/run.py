"""Building a run: the pieces `pretrain`, `finetune`, `evaluate` and the inference loader share.

`build_run(cfg, family)` assembles, in Megatron's order, the process settings and parallel
context (`build_context`), seeds, the tokenizer (`data.tokenizers.build_run_tokenizer`), the batch-size calculator,
the model chunks in their data-parallel wrappers with the optimizer and learning-rate schedule
(`build_model_and_optimizer`), and the checkpoint under `--load` (`load_or_init`); it prints the
arguments (rank 0) and writes the run's config beside the checkpoint (`write_run_config`).
Commands use the builders alone where they need only some pieces (the inference loader: context,
tokenizer, model). `build_metrics` makes the run's MetricsLogger.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn

from gigatron.checkpoint.formats import load_checkpoint
from gigatron.checkpoint.retrofit import loads_gpt_into_retro, retrofit
from gigatron.checkpoint.upcycling import upcycle
from gigatron.config import GigatronConfig
from gigatron.config.root import config_to_dict
from gigatron.config.validate import params_dtype
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import ModelFamily
from gigatron.models.compile import compile_layers
from gigatron.models.lora import LoRASpec, adapted_layers, add_lora_adapters
from gigatron.optim import build_optimizer
from gigatron.optim.batch_schedule import build_num_microbatches_calculator
from gigatron.optim.lr_schedule import build_lr_scheduler
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.data_parallel import DistributedDataParallel
from gigatron.parallel.fully_sharded import (
    COMM_DTYPES,
    FullyShardedDataParallel,
    uses_fully_sharded,
)
from gigatron.parallel.random import seed_everything
from gigatron.training.loop import TrainState
from gigatron.training.metrics import MetricsLogger, default_metrics_path

# The run's configuration, written beside the checkpoints in --save (readable by --config).
CONFIG_FILENAME = "config.yaml"
# Threads of a single-process run when OMP_NUM_THREADS does not say (see choose_threads).
MAX_DEFAULT_THREADS = 4


# ---- threads ------------------------------------------------------------------------------
def choose_threads(environ: Mapping[str, str], cpus: int) -> int | None:
    """Intra-op threads for this process, or None to leave torch's choice alone.

    OMP_NUM_THREADS, when set, decides (torchrun sets 1 for several processes per node).
    Otherwise a single-process run takes half the CPUs it may use, at most MAX_DEFAULT_THREADS:
    torch's default (every core) is several times slower on a machine other work also uses."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    if int(environ.get("WORLD_SIZE", "1")) > 1:
        return None
    return max(1, min(MAX_DEFAULT_THREADS, cpus // 2))


def apply_thread_choice(environ: Mapping[str, str] | None = None) -> int:
    """Set the thread count of a command's process (called once, at the command's edge);
    returns the count in use."""
    environ = os.environ if environ is None else environ
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = choose_threads(environ, cpus or 1)
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


# ---- process settings and the parallel context --------------------------------------------
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


def build_context(cfg: GigatronConfig) -> ParallelContext:
    """The run's ParallelContext (process groups under torchrun)."""
    return ParallelContext.from_config(cfg)


# ---- model, optimizer, schedules ----------------------------------------------------------
def grad_dtype(cfg: GigatronConfig) -> torch.dtype:
    """The dtype gradients are accumulated and reduced in."""
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
    p = cfg.parallel
    if uses_fully_sharded(p, pctx.dp_size):
        comm = p.megatron_fsdp_grad_comm_dtype
        reduce_dtype = COMM_DTYPES[comm] if comm != "auto" else grad_dtype(cfg)  # auto: as DDP
        return FullyShardedDataParallel(chunk, pctx, p, params_dtype(cfg), reduce_dtype)
    return DistributedDataParallel(chunk, pctx, p, grad_dtype=grad_dtype(cfg))


def build_model_and_optimizer(
    cfg: GigatronConfig, pctx: ParallelContext, chunks: list[nn.Module]
) -> tuple[list[Any], Any, Any]:
    """(wrapped model chunks, optimizer, learning-rate schedule) for the given chunks; with
    --torch-compile each transformer layer is compiled first (models/compile.py)."""
    if cfg.training.torch_compile:
        compile_layers(chunks)
    model = [wrap_for_data_parallel(cfg, pctx, chunk) for chunk in chunks]
    optimizer = build_optimizer(cfg, model, pctx)
    return model, optimizer, build_lr_scheduler(cfg, optimizer)


# ---- checkpoint ---------------------------------------------------------------------------
def state_from_loaded(loaded: Any, cfg: GigatronConfig) -> TrainState:
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


def state_to_saved(state: TrainState) -> dict[str, Any]:
    """The TrainState counters a checkpoint stores (Megatron's key names)."""
    return {
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "skipped_iterations": state.skipped_iterations,
        "num_floating_point_operations_so_far": state.floating_point_operations_so_far,
    }


def gather_for_save(model: list[Any], ckpt_format: str) -> None:
    """FSDP chunks gather their full weights on every dp rank before a torch-format save (whose
    writers then call `state_dict()` alone); torch_dist writes each rank's shards instead."""
    if ckpt_format == "torch_dist":
        return
    for chunk in model:
        if hasattr(chunk, "gather_for_save"):
            chunk.gather_for_save()


def load_or_init(
    cfg: GigatronConfig, pctx: ParallelContext, model: list[Any], optimizer: Any, scheduler: Any
) -> tuple[TrainState, Any]:
    """(TrainState, what load_checkpoint returned) from --load, or a fresh state and None.
    The checkpoint holds the consumed train and validation samples, so both data streams
    continue where they stopped."""
    if not cfg.checkpoint.load:
        return TrainState(), None
    rng_tracker = getattr(model[0].module, "rng", None)
    loaded = load_checkpoint(
        cfg.checkpoint.load, model, optimizer, scheduler, pctx, cfg, rng_tracker=rng_tracker
    )
    return state_from_loaded(loaded, cfg), loaded


def load_pretrained(cfg: GigatronConfig, pctx: ParallelContext, chunks: list[nn.Module]) -> None:
    """Load --pretrained-checkpoint's weights (weights only, any format) into unwrapped chunks."""
    path = cfg.checkpoint.pretrained_checkpoint
    if not path:
        return
    if not os.path.isdir(path):
        raise GigatronError(f"--pretrained-checkpoint {path}: no such directory")
    weights_only = dataclasses.replace(  # its latest iteration, in whichever format it is
        cfg.checkpoint, finetune=True, load=path, save=None, auto_detect_ckpt_format=True,
        ckpt_step=None,
    )  # fmt: skip
    try:
        load_checkpoint(
            path, chunks, None, None, pctx, dataclasses.replace(cfg, checkpoint=weights_only)
        )
    except GigatronError as error:  # name the flag the user gave
        raise GigatronError(str(error).replace("--load ", "--pretrained-checkpoint ", 1)) from None


def prepare_chunks(cfg: GigatronConfig, pctx: ParallelContext, chunks: list[nn.Module]) -> None:
    """The family's chunks before their wrappers: --pretrained-checkpoint's weights, then LoRA's
    adapters (the rest frozen; docs/lora.md)."""
    load_pretrained(cfg, pctx, chunks)
    spec = LoRASpec.from_config(cfg)
    if spec is not None:
        add_lora_adapters(chunks, spec, pctx, cfg.training.seed)


# ---- what the user sees -------------------------------------------------------------------
def build_metrics(
    cfg: GigatronConfig,
    pctx: ParallelContext,
    train_iters: int,
    loss_names: tuple[str, ...],
    start_iteration: int = 0,
    stream: Any = None,
    progress_bar: bool | None = None,
) -> MetricsLogger:
    """The run's MetricsLogger, configured by the logging flags."""
    log = cfg.logging
    return MetricsLogger(
        default_metrics_path(log.metrics_file, cfg.checkpoint.save),
        pctx,
        train_iters=train_iters,
        start_iteration=start_iteration,
        tensorboard_dir=log.tensorboard_dir,
        wandb_project=log.wandb_project,
        wandb_exp_name=log.wandb_exp_name,
        progress_bar=False if log.no_progress_bar else progress_bar,
        stream=stream,
        loss_names=loss_names,
        log_throughput=log.log_throughput,
        timing_log_level=log.timing_log_level,
        tensorboard_timers=log.log_timers_to_tensorboard,
        tensorboard_validation_ppl=log.log_validation_ppl_to_tensorboard,
    )


def format_arguments(cfg: GigatronConfig) -> str:
    """Every configuration value, one per line, sorted by name, in a framed block."""
    values = {
        name: value for section in config_to_dict(cfg).values() for name, value in section.items()
    }
    width = max(len(name) for name in values) + 2
    lines = [f"  {name} {'.' * (width - len(name))} {values[name]!r}" for name in sorted(values)]
    return "\n".join(
        [
            "=" * 24 + " run arguments " + "=" * 24,
            *lines,
            "=" * 22 + " end of arguments " + "=" * 23,
        ]
    )


def print_arguments(cfg: GigatronConfig, pctx: ParallelContext, print_line: Callable) -> None:
    """The arguments block, on rank 0 only."""
    if pctx.rank == 0:
        print_line(format_arguments(cfg))


def write_run_config(
    cfg: GigatronConfig, save_dir: str | None, pctx: ParallelContext
) -> str | None:
    """Write the config as YAML (per section, `--config` reads it back) to `save_dir` on rank 0;
    returns its path (None without --save)."""
    if not save_dir:
        return None
    path = os.path.join(save_dir, CONFIG_FILENAME)
    if pctx.rank == 0:
        partial = path + ".tmp"
        try:
            os.makedirs(save_dir, exist_ok=True)
            with open(partial, "w", encoding="utf-8") as handle:
                yaml.safe_dump(config_to_dict(cfg), handle, sort_keys=False)
            os.replace(partial, path)
        except OSError as error:
            raise GigatronError(
                f"--save {save_dir}: cannot write {CONFIG_FILENAME} there ({error.strerror}); "
                "give a directory this user can write"
            ) from None
    return path


# ---- the whole run ------------------------------------------------------------------------
@dataclass
class RunParts:
    """What build_run assembled."""

    cfg: GigatronConfig
    family: ModelFamily
    pctx: ParallelContext
    tokenizer: Any
    calculator: Any
    # Whether this run started torch.distributed (and so must end it).
    owns_process_group: bool
    model: list[Any] = field(default_factory=list)
    optimizer: Any = None
    scheduler: Any = None
    train_iters: int = 0
    state: TrainState = field(default_factory=TrainState)
    loaded: Any = None  # what load_checkpoint returned (None without --load)

    @property
    def rng_tracker(self) -> Any:
        """The model-parallel random stream of the model (checkpoints carry its state)."""
        return getattr(self.model[0].module, "rng", None) if self.model else None

    def close(self) -> None:
        """End the process group this run started."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


ChunkBuilder = Callable[[GigatronConfig, ParallelContext, int], list[nn.Module]]


def build_run(
    cfg: GigatronConfig,
    family: ModelFamily,
    print_line: Callable[[str], None] = print,
    prepare: Callable[[RunParts], None] | None = None,
    build_chunks: ChunkBuilder | None = None,
    write_config: bool = True,
) -> RunParts:
    """Context, seeds, tokenizer, batch calculator, model, optimizer, schedule and checkpoint.

    `prepare(parts)` runs before the model is built (fine-tuning sets --train-iters from its
    data there); `build_chunks(cfg, pctx, vocab_size)` replaces the family's model builder.
    On an error the process group this call started is ended."""
    set_determinism(cfg)
    apply_process_settings(cfg)
    pctx = build_context(cfg)
    parts = RunParts(cfg, family, pctx, None, None, dist.is_initialized() and pctx.world_size > 1)
    try:
        seed_everything(cfg.training.seed, pctx)
        parts.tokenizer = build_run_tokenizer(cfg)  # may set --tokenizer-type: print after it
        print_arguments(cfg, pctx, print_line)
        parts.calculator = build_num_microbatches_calculator(cfg, pctx.dp_size)
        if prepare is not None:
            prepare(parts)
        builder = build_chunks or (
            lambda c, p, vocab_size: family.build_model(c, p, vocab_size=vocab_size)
        )
        chunks = builder(cfg, pctx, parts.tokenizer.vocab_size)
        if build_chunks is None:
            prepare_chunks(cfg, pctx, chunks)
        elif cfg.model.lora_target_modules and not any(adapted_layers(c) for c in chunks):
            raise GigatronError(
                "--lora-target-modules: this command builds its own model and takes no LoRA "
                "adapters; use gigatron pretrain (e.g. gpt --sft)"
            )
        parts.model, parts.optimizer, parts.scheduler = build_model_and_optimizer(cfg, pctx, chunks)
        t = cfg.training
        parts.train_iters = (
            t.train_iters
            if t.train_iters is not None
            else parts.calculator.train_iters_for_samples(t.train_samples)
        )
        if cfg.moe.moe_use_upcycling:  # --load holds the dense model: docs/frontier.md
            vocab = parts.tokenizer.vocab_size
            print_line(upcycle(cfg, pctx, parts.model, lambda c, p: builder(c, p, vocab)))
            parts.optimizer.reload_model_params()
            parts.state, parts.loaded = TrainState(), {"loaded": False}  # a fresh MoE run
        elif loads_gpt_into_retro(cfg, family.name):  # retro-fitting: docs/retro.md
            print_line(retrofit(cfg, pctx, parts.model, parts.tokenizer.vocab_size))
            parts.optimizer.reload_model_params()
            parts.state, parts.loaded = TrainState(), {"loaded": False}
        else:
            parts.state, parts.loaded = load_or_init(
                cfg, pctx, parts.model, parts.optimizer, parts.scheduler
            )
        if write_config:
            write_run_config(cfg, cfg.checkpoint.save, pctx)
        return parts
    except BaseException:
        parts.close()
        raise
