"""`gigatron finetune`: fine-tune a BERT checkpoint on MNLI, QQP (classification) or RACE
(multiple choice), Megatron's tasks/main.py flags: `--task`, `--train-data`, `--valid-data`,
`--pretrained-checkpoint`, `--epochs`, `--keep-last`, `--eval-micro-batch-size`, plus the model,
optimizer and parallel flags of `gigatron pretrain bert`.

The pretrained weights are loaded (weights only; the new head is initialised), the training set
is shuffled every epoch (seed + epoch) and cut into global batches, the generic loop trains each
epoch, then the accuracy on every `--valid-data` set is logged and written to metrics.jsonl, and
`--save` keeps the checkpoint of the best mean accuracy so far (the previous best is removed).
Tensor (and sequence) and data parallelism are supported; pipeline and context parallelism are
refused."""

from __future__ import annotations

import dataclasses
import itertools
import math
import shutil
import sys
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gigatron.checkpoint.formats import save_checkpoint, saved_header
from gigatron.checkpoint.torch_format import iteration_dir_name, locate_iteration
from gigatron.config import config_from_dict
from gigatron.config.checkpoint_args import PARAMETER_SHAPES, apply_checkpoint_flags
from gigatron.config.fields import flag_name
from gigatron.config.root import SECTIONS, config_from_namespace, field_section
from gigatron.config.tasks import FinetuneTaskConfig, task_config_from_namespace
from gigatron.config.tasks import build_finetune_parser as build_parser
from gigatron.config.validate import finalize_config, validate_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.families.accepted import check_family_config
from gigatron.families.gpt.flops import model_flops_per_iteration
from gigatron.models.bert import build_bert_model
from gigatron.models.flops import precision_name
from gigatron.models.lora import LoRASpec, add_lora_adapters
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.schedules import ScheduleConfig
from gigatron.tasks.glue import NUM_CLASSES, glue_samples
from gigatron.tasks.heads import BertClassifier
from gigatron.tasks.race import race_samples
from gigatron.training.loop import Run, train
from gigatron.training.pretrain import launch_world_size, startup_record
from gigatron.training.run import apply_thread_choice, build_metrics, build_run, load_pretrained

LOSS_NAMES = ("lm_loss",)  # Megatron's finetuning logs its cross entropy as 'lm loss'


# What a fine-tuning run does not do (a flag -> why); each is refused when set. Every flag of the
# data section is refused too: the samples come from --train-data and --valid-data.
_REFUSED = {
    "load": "resuming a fine-tuning run is not supported; start from --pretrained-checkpoint",
    "train_iters": "--epochs sets the iterations",
    "train_samples": "--epochs sets the samples",
    "rampup_batch_size": "fine-tuning keeps one batch size",
    "eval_at_start": "--epochs 0 evaluates the pretrained checkpoint",
    "full_validation": "every validation sample is scored after each epoch",
    "skip_train": "--epochs 0 evaluates the pretrained checkpoint",
    "ckpt_convert_format": "convert checkpoints with gigatron pretrain or convert-checkpoint",
    "ckpt_convert_save": "convert checkpoints with gigatron pretrain or convert-checkpoint",
    "async_save": "the best checkpoint is saved synchronously after its epoch",
    "save_hf": "export the best checkpoint with gigatron convert --to hf",
}


def _refuse(cfg, task: FinetuneTaskConfig) -> None:
    fields = {f.name: f for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    defaults = type(cfg)()
    refused = dict(_REFUSED)
    for data_field in dataclasses.fields(type(cfg.data)):
        refused[data_field.name] = "the data are --train-data and --valid-data"
    if cfg.data.sft:
        refused["sft"] = "supervised fine-tuning of GPT is gigatron pretrain gpt --sft"
    for name, why in refused.items():
        section = field_section(name)
        if getattr(getattr(cfg, section), name) != getattr(getattr(defaults, section), name):
            raise GigatronError(f"{flag_name(fields[name])}: not a gigatron finetune flag; {why}")
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1:
        raise GigatronError(
            "--pipeline-model-parallel-size/--context-parallel-size: gigatron finetune runs "
            "tensor and data parallelism only; set both to 1"
        )
    if p.use_torch_fsdp2 or p.use_megatron_fsdp:
        raise GigatronError(
            "--use-torch-fsdp2/--use-megatron-fsdp: gigatron finetune wraps the model in "
            "DistributedDataParallel (use --use-distributed-optimizer to shard optimizer state)"
        )
    t = cfg.training
    if t.eval_iters != defaults.training.eval_iters and not t.eval_interval:
        raise GigatronError(
            f"--eval-iters {t.eval_iters}: the validation loss is measured every --eval-interval "
            "iterations only; give --eval-interval too (the accuracy is measured after each "
            "epoch either way)"
        )
    if task.task is None:
        raise GigatronError("--task: missing; give --task MNLI, QQP or RACE")
    if task.epochs is None or task.epochs < 0:
        raise GigatronError("--epochs: missing or negative; give --epochs N (0: evaluate only)")
    if task.epochs > 0 and not task.train_data:
        raise GigatronError("--train-data: missing; give the training file(s) or directory")
    if not task.valid_data:
        raise GigatronError("--valid-data: missing; give the validation file(s) or directory")
    if task.eval_micro_batch_size is not None and task.eval_micro_batch_size < 1:
        raise GigatronError(f"--eval-micro-batch-size {task.eval_micro_batch_size}: must be >= 1")


def parse_finetune_args(argv: Sequence[str], world_size: int | None = None):
    """(GigatronConfig, FinetuneTaskConfig) from the command line, validated for training (the
    iteration count is set later from the data: `--epochs` x batches per epoch)."""
    namespace = build_parser().parse_args(list(argv))
    cfg = config_from_namespace(namespace)
    task = task_config_from_namespace(FinetuneTaskConfig, namespace)
    world_size = launch_world_size() if world_size is None else world_size
    _refuse(cfg, task)
    finalize_config(cfg, world_size=world_size)
    cfg.training.train_iters = 1  # a placeholder for the rules; the data decide
    validate_config(cfg, world_size=world_size, for_training=True)
    check_family_config(get_family("bert"), cfg)
    return cfg, task


# ---- data ---------------------------------------------------------------------------------------
def read_samples(task: str, path: str, tokenizer, seq_length: int) -> list[dict[str, Any]]:
    if task == "RACE":
        return race_samples(path, tokenizer, seq_length)
    if not Path(path).is_file():
        raise GigatronError(f"{path}: no such file; {task} data are GLUE TSV files")
    return glue_samples(task, path, tokenizer, seq_length)


def collate(samples: Sequence[dict[str, Any]], indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """A micro-batch of `samples[i]`; an index of -1 is padding (a copy of the first sample with
    weight 0, so that every rank runs the same number of micro-batches)."""
    picked = [samples[i] if i >= 0 else samples[0] for i in indices]
    batch = {k: torch.from_numpy(np.stack([s[k] for s in picked])) for k in picked[0]}
    batch["weight"] = torch.tensor([1.0 if i >= 0 else 0.0 for i in indices])
    return batch


def batches_per_epoch(num_samples: int, global_batch: int, keep_last: bool) -> int:
    rounding = math.ceil if keep_last else math.floor
    return int(rounding(num_samples / global_batch))


def epoch_batches(
    samples: Sequence[dict[str, Any]],
    epoch: int,
    seed: int,
    global_batch: int,
    micro_batch: int,
    pctx: ParallelContext,
    keep_last: bool,
) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches of one epoch: the samples in the order of a
    permutation seeded by seed + epoch, cut into global batches; rank r takes the r-th block of
    each. The last, incomplete global batch is dropped, or padded with `--keep-last`."""
    order = np.random.RandomState(seed + epoch).permutation(len(samples))
    per_rank = global_batch // pctx.dp_size
    for number in range(batches_per_epoch(len(samples), global_batch, keep_last)):
        chosen = list(order[number * global_batch : (number + 1) * global_batch])
        chosen += [-1] * (global_batch - len(chosen))
        mine = chosen[pctx.dp_rank * per_rank : (pctx.dp_rank + 1) * per_rank]
        for start in range(0, per_rank, micro_batch):
            yield collate(samples, mine[start : start + micro_batch])


def validation_batches(
    valid_sets: list[tuple[str, list[dict[str, Any]]]],
    seed: int,
    global_batch: int,
    pctx: ParallelContext,
    training: Any,
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of every validation sample, endlessly (--eval-iters of them per
    --eval-interval): the loop's validation loss, as Megatron's fine-tuning logs it."""
    samples = [sample for _, samples in valid_sets for sample in samples]
    for epoch in itertools.count():
        yield from epoch_batches(
            samples, epoch, seed, global_batch, training.micro_batch_size, pctx, keep_last=True
        )


# ---- model --------------------------------------------------------------------------------------
def classify(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[b, classes] logits; multiple-choice samples ([b, choices, s]) are scored as b x choices
    sequences and give [b, choices]."""
    tokens = batch["tokens"]
    choices = tokens.shape[1] if tokens.dim() == 3 else None
    seq = tokens.shape[-1]
    flat = {k: batch[k].reshape(-1, seq) for k in ("tokens", "token_types", "padding_mask")}
    positions = torch.arange(seq, device=tokens.device).expand(flat["tokens"].shape[0], seq)
    # Padded keys are masked for every query ([b, 1, 1, s], True = masked), as in pretraining.
    mask = (flat["padding_mask"] == 0)[:, None, None, :]
    logits = model(flat["tokens"], positions, mask, tokentype_ids=flat["token_types"])
    return logits.reshape(-1, choices) if choices is not None else logits


def classification_loss(batch: dict[str, torch.Tensor], logits: torch.Tensor):
    """Summed cross entropy of the real samples (weight 1), their count, and the report."""
    weight = batch["weight"]
    losses = F.cross_entropy(logits.float(), batch["label"], reduction="none") * weight
    total, count = losses.sum(), weight.sum()
    return total, count.clamp(min=1.0), {"lm_loss": torch.stack([total.detach(), count])}


def forward_step(pctx: ParallelContext, data_iterator: Iterator, model: nn.Module):
    """One micro-batch (the schedule's contract)."""
    batch = {k: v.to(pctx.device) for k, v in next(data_iterator).items()}
    return classify(model, batch), partial(classification_loss, batch)


@torch.no_grad()
def accuracy(
    model: nn.Module, samples: Sequence[dict[str, Any]], micro_batch: int, pctx: ParallelContext
) -> tuple[int, int]:
    """(correct, total) over every sample (none dropped), split over data-parallel ranks."""
    model.eval()
    n, dp = len(samples), pctx.dp_size
    per_rank = math.ceil(n / dp / micro_batch) * micro_batch
    indices = list(range(n)) + [-1] * (per_rank * dp - n)
    mine = indices[pctx.dp_rank * per_rank : (pctx.dp_rank + 1) * per_rank]
    counts = torch.zeros(2, dtype=torch.float64, device=pctx.device)
    try:
        for start in range(0, per_rank, micro_batch):
            batch = collate(samples, mine[start : start + micro_batch])
            batch = {k: v.to(pctx.device) for k, v in batch.items()}
            right = (classify(model, batch).argmax(-1) == batch["label"]).double()
            counts += torch.stack([(right * batch["weight"]).sum(), batch["weight"].sum()])
    finally:
        model.train()
    if pctx.size("dp") > 1:
        dist.all_reduce(counts, group=pctx.group("dp"))
    return int(counts[0].item()), int(counts[1].item())


def build_classifier(cfg, pctx: ParallelContext, vocab_size: int, task: FinetuneTaskConfig):
    """The BERT chunk with the pretrained weights loaded (if any), under the task's head. With
    --lora-target-modules the encoder is frozen with adapters on those layers (docs/lora.md);
    the new head (and pooler) train whole, as PEFT's `modules_to_save`."""

    (bert,) = build_bert_model(cfg, pctx, vocab_size=vocab_size)
    load_pretrained(cfg, pctx, [bert])
    spec = LoRASpec.from_config(cfg)
    if spec is not None:
        add_lora_adapters([bert], spec, pctx, cfg.training.seed)
    outputs = 1 if task.task == "RACE" else NUM_CLASSES[task.task]
    return BertClassifier(bert, outputs, cfg.model.hidden_dropout, cfg.training.seed)


# ---- the run ------------------------------------------------------------------------------------
def finetune(cfg, task: FinetuneTaskConfig, stream: Any = None) -> dict[str, Any]:
    """Fine-tune (or, with --epochs 0, evaluate); returns the accuracies of every epoch and the
    best one (every rank)."""
    data: dict[str, Any] = {}
    parts = build_run(
        cfg,
        get_family("bert"),
        print_line=partial(print, file=stream or sys.stdout, flush=True),
        prepare=partial(_prepare_data, task, data),
        build_chunks=lambda c, pctx, vocab_size: [build_classifier(c, pctx, vocab_size, task)],
        write_config=False,  # its --train-iters comes from the data: --config could not use it
    )
    metrics = None
    try:
        metrics = build_metrics(
            cfg, parts.pctx, cfg.training.train_iters, LOSS_NAMES, stream=stream
        )
        metrics.message(
            f"finetune {task.task}: {len(data['train'])} training samples, {data['per_epoch']} "
            f"iterations per epoch of {parts.calculator.global_batch_size}; validation sets: "
            + ", ".join(f"{path} ({len(s)})" for path, s in data["valid"])
        )
        return _train_epochs(_finetune_loop_run(parts, task, metrics, data), task, data)
    finally:
        if metrics is not None:
            metrics.close()
        parts.close()


def _prepare_data(task: FinetuneTaskConfig, data: dict[str, Any], parts: Any) -> None:
    """Read the samples into `data` and set --train-iters from them (before the model and the
    learning-rate schedule are built)."""
    cfg, tokenizer = parts.cfg, parts.tokenizer
    for name in ("cls", "sep", "pad"):
        if getattr(tokenizer, name, None) is None:
            raise GigatronError(
                f"--tokenizer-type {cfg.tokenizer.tokenizer_type}: has no [{name.upper()}] "
                "token; fine-tuning BERT needs a WordPiece tokenizer (BertWordPieceLowerCase)"
            )
    read = partial(read_samples, task.task, tokenizer=tokenizer, seq_length=cfg.model.seq_length)
    data["train"] = [s for path in task.train_data for s in read(path)] if task.epochs else []
    data["valid"] = [(path, read(path)) for path in task.valid_data]
    global_batch = parts.calculator.global_batch_size
    data["per_epoch"] = batches_per_epoch(len(data["train"]), global_batch, task.keep_last)
    if task.epochs and data["per_epoch"] == 0:
        raise GigatronError(
            f"--train-data: {len(data['train'])} samples, fewer than one global batch of "
            f"{global_batch}; lower --global-batch-size or add --keep-last"
        )
    cfg.training.train_iters = max(1, task.epochs * data["per_epoch"])  # the lr schedule's length


def _finetune_loop_run(
    parts: Any, task: FinetuneTaskConfig, metrics: Any, data: dict[str, Any]
) -> Any:
    """The loop's Run for the classifier (its train_iterator is set per epoch)."""
    cfg, t = parts.cfg, parts.cfg.training
    choices = 4 if task.task == "RACE" else 1
    run = Run(
        cfg=cfg, pctx=parts.pctx, model=parts.model, optimizer=parts.optimizer,
        scheduler=parts.scheduler, batch_calculator=parts.calculator,
        forward_step=partial(forward_step, parts.pctx),
        schedule_config=ScheduleConfig(
            seq_length=cfg.model.seq_length, micro_batch_size=t.micro_batch_size * choices,
            hidden_size=cfg.model.hidden_size, grad_scale_func=parts.optimizer.scale_loss,
        ),
        metrics=metrics, train_iters=0, vocab_size=parts.model[0].module.vocab_size,
        flops_per_iteration=lambda batch: model_flops_per_iteration(cfg.model, batch * choices, 0),
        loss_names=LOSS_NAMES, state=parts.state,
        startup_record=startup_record(
            parts, parts.model[0].module.vocab_size, precision_name(t.bf16, t.fp16)
        ),
    )  # fmt: skip
    if t.eval_interval:  # Megatron's validation loss every --eval-interval iterations
        global_batch = parts.calculator.global_batch_size
        run.valid_iterator = validation_batches(data["valid"], t.seed, global_batch, parts.pctx, t)
    return run


def _train_epochs(run: Any, task: FinetuneTaskConfig, data: dict[str, Any]) -> dict[str, Any]:
    """Train epoch by epoch, measure the accuracy after each, keep the best checkpoint."""
    t, pctx = run.cfg.training, run.pctx
    classifier = run.model[0].module
    eval_micro = task.eval_micro_batch_size or t.micro_batch_size
    history: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None

    def evaluate_now(epoch: int) -> dict[str, Any]:
        return evaluate_epoch(
            classifier, data["valid"], epoch, run.state.iteration, eval_micro, pctx, run.metrics,
            task.task,
        )  # fmt: skip

    if task.epochs == 0:
        history.append(evaluate_now(0))
    for epoch in range(1, task.epochs + 1):
        run.train_iterator = epoch_batches(
            data["train"], epoch, t.seed, run.batch_calculator.global_batch_size,
            t.micro_batch_size, pctx, task.keep_last,
        )  # fmt: skip
        run.train_iters = epoch * data["per_epoch"]
        result = train(run)
        run.startup_record = None  # logged by the first epoch
        record = evaluate_now(epoch)
        history.append(record)
        if best is None or record["mean_accuracy"] > best["mean_accuracy"]:
            previous, best = best, record
            if run.cfg.checkpoint.save:
                _save_best(run, task, record, previous)
        if result.exit_reason != "finished":
            break
    return {"task": task.task, "epochs": history, "best": best}


def evaluate_epoch(
    classifier: nn.Module,
    valid_sets: list[tuple[str, list[dict[str, Any]]]],
    epoch: int,
    iteration: int,
    micro_batch: int,
    pctx: ParallelContext,
    metrics: Any,
    task_name: str,
) -> dict[str, Any]:
    """The accuracy on every validation set, logged and written to metrics.jsonl."""
    scores = {}
    for path, samples in valid_sets:
        correct, total = accuracy(classifier, samples, micro_batch, pctx)
        scores[path] = correct / max(total, 1)
        metrics.write(
            {"type": "eval", "split": "valid", "task": task_name, "valid_data": path,
             "epoch": epoch, "iteration": iteration, "correct": correct, "total": total,
             "accuracy": scores[path]}
        )  # fmt: skip
        metrics.message(
            f" > |epoch: {epoch}| metrics for {path}: correct / total = {correct} / {total} = "
            f"{100 * scores[path]:.4f} %"
        )
    return {
        "epoch": epoch,
        "iteration": iteration,
        "accuracy": scores,
        "mean_accuracy": sum(scores.values()) / len(scores),
    }


def _save_best(run: Any, task: FinetuneTaskConfig, record: dict, previous: dict | None) -> None:
    """Save the new best checkpoint, then remove the previous best (rank 0)."""
    cfg, save_dir = run.cfg, run.cfg.checkpoint.save
    extra = {
        "consumed_train_samples": run.state.consumed_train_samples,
        "consumed_valid_samples": 0,
        "gigatron_finetune": {
            "task": task.task,
            "epoch": record["epoch"],
            "accuracy": record["accuracy"],
        },
    }
    save_checkpoint(
        save_dir, run.state.iteration, run.model, run.optimizer, run.scheduler, run.pctx, cfg,
        extra=extra, rng_tracker=run.model[0].module.rng,
    )  # fmt: skip
    if previous is not None and run.pctx.rank == 0 and previous["iteration"] != record["iteration"]:
        shutil.rmtree(
            Path(save_dir) / iteration_dir_name(previous["iteration"]), ignore_errors=True
        )
    run.metrics.message(
        f"saved the best checkpoint (epoch {record['epoch']}, mean accuracy "
        f"{record['mean_accuracy']:.4f}) to {save_dir}"
    )


def pretrained_config(path: str) -> Any:
    """The configuration saved in a gigatron checkpoint (torch or torch_dist), or None when it
    holds none that gigatron can read (its loader then says what is wrong)."""
    try:
        located = locate_iteration(Path(path)) if Path(path).is_dir() else None
        if located is None:
            return None
        saved = saved_header(located[0]).get("args")
        if not isinstance(saved, dict) or not saved:
            return None
        return config_from_dict(saved, source=f"{located[0]} args")
    except (GigatronError, OSError):
        return None


def check_pretrained_shapes(argv: Sequence[str], pretrained: str | None) -> None:
    """Megatron's model flags that fix parameter shapes must match --pretrained-checkpoint's:
    a difference is one error naming both values."""
    if not pretrained:
        return
    saved = pretrained_config(pretrained)
    if saved is not None:
        namespace = build_parser().parse_args(list(argv))
        apply_checkpoint_flags(saved, namespace, only=PARAMETER_SHAPES)


def main(argv: Sequence[str]) -> int:
    cfg, task = parse_finetune_args(argv)
    check_pretrained_shapes(argv, cfg.checkpoint.pretrained_checkpoint)
    apply_thread_choice()  # one process: a few threads (docs/training.md)
    finetune(cfg, task)
    return 0
