"""Flags of Megatron's example scripts that change a run (issue 19): decoupled learning rates,
the step batch-size schedule, selective recompute of more modules, the old
--checkpoint-activations, bf16 gradient reduction, the family's default tokenizer, and the
TensorBoard switches. Values are checked against hand-computed numbers or a run without the
flag."""

from __future__ import annotations

import io

import pytest
import torch

from gigatron.config import parse_config
from gigatron.errors import GigatronError
from gigatron.models import build_model
from gigatron.optim import build_lr_scheduler
from gigatron.optim.batch_schedule import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
    parse_step_batch_size_schedule,
)
from gigatron.optim.optimizer import get_param_groups, make_torch_optimizer
from gigatron.parallel.context import ParallelContext
from gigatron.training.metrics import MetricsLogger
from gigatron.training.pretrain import parse_pretrain_config
from gigatron.training.run import grad_dtype

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--padded-vocab-size", "128",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # fmt: skip


# ---- --decoupled-lr ---------------------------------------------------------------------------
def test_decoupled_lr_gives_embedding_and_output_their_own_schedule():
    cfg = parse_config(
        [*MODEL, "--untie-embeddings-and-output-weights", "--lr", "1e-3", "--min-lr", "1e-4",
         "--decoupled-lr", "5e-4", "--decoupled-min-lr", "5e-5", "--lr-decay-style", "linear",
         "--lr-decay-iters", "10", "--train-iters", "10", "--global-batch-size", "2"],
        world_size=1,
    )  # fmt: skip
    (model,) = build_model(cfg, ParallelContext.single())
    groups = get_param_groups([model], cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr)
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled = [g for g in groups if "max_lr" in g]
    assert sorted(names[id(p)] for p in decoupled[0]["params"]) == [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    ]
    scheduler = build_lr_scheduler(cfg, make_torch_optimizer(cfg, groups))
    scheduler.step(increment=4 * 2)  # 4 of 10 iterations: r = 0.4 of a linear decay
    lrs = {("max_lr" in g): g["lr"] for g in scheduler.optimizer.param_groups}
    assert lrs[False] == pytest.approx(1e-4 + 0.6 * (1e-3 - 1e-4))
    assert lrs[True] == pytest.approx(5e-5 + 0.6 * (5e-4 - 5e-5))


def test_decoupled_min_lr_defaults_to_min_lr_and_needs_decoupled_lr():
    (group,) = [
        g for g in get_param_groups([torch.nn.Embedding(4, 2)], decoupled_lr=None) if "max_lr" in g
    ] or [None]
    assert group is None  # no decoupled group without --decoupled-lr
    with pytest.raises(GigatronError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_config(["--decoupled-min-lr", "1e-5"])


# ---- --step-batch-size-schedule ------------------------------------------------------------------
def test_step_schedule_thresholds_are_tokens():
    schedule = parse_step_batch_size_schedule("0:16 2.4B:320 4.8B:624 12B:1536", 2048)
    assert schedule == [(0, 16), (1171875, 320), (2343750, 624), (5859375, 1536)]
    assert parse_step_batch_size_schedule("0:8,1K:16", None) == [(0, 8), (1000, 16)]


def test_step_schedule_batches_and_iterations():
    calc = NumMicroBatchesCalculator(4, 1, 2, None, [(0, 2), (5, 4), (13, 8)])
    assert calc.global_batch_size == 8
    sizes = []
    consumed = 0
    while consumed < 30:
        calc.update(consumed)
        sizes.append(calc.get_current_global_batch_size())
        consumed += sizes[-1]
    # 0, 2, 4 -> batch 2; 6 -> 4 (>= 5), 10 -> 4; 14 -> 8 (>= 13), 22 -> 8.
    assert sizes == [2, 2, 2, 4, 4, 8, 8]
    assert calc.get() == 4  # 8 / (micro 1 x dp 2)
    assert calc.train_iters_for_samples(30) == 7
    assert calc.train_iters_for_samples(22) == 6


@pytest.mark.parametrize(
    "text, message",
    [
        ("16:2 32:4", "the first threshold must be 0"),
        ("0:2 0:4", "thresholds must increase"),
        ("0:2 x:4", "is not a number"),
        ("0-2", "is not THRESHOLD:BATCH"),
    ],
)
def test_step_schedule_errors(text, message):
    with pytest.raises(GigatronError, match=message):
        parse_step_batch_size_schedule(text, 16)


def test_step_schedule_sizes_must_divide_when_reached():
    cfg = parse_config(
        [*MODEL, "--step-batch-size-schedule", "0:2 32:3", "--lr", "1e-3", "--train-iters", "2"],
        world_size=1,
    )  # fmt: skip
    calc = build_num_microbatches_calculator(cfg, 1)  # 32 tokens = 2 samples at --seq-length 16
    calc.update(1)
    with pytest.raises(GigatronError, match="global batch size 3 is not divisible"):
        calc.update(2)
    with pytest.raises(GigatronError, match="give one"):
        NumMicroBatchesCalculator(4, 1, 1, [2, 2, 8], [(0, 2)])


# ---- recompute ----------------------------------------------------------------------------------
@pytest.mark.parametrize("modules", [["mlp"], ["layernorm"], ["core_attn", "mlp", "layernorm"]])
def test_recompute_modules_give_the_same_gradients_and_recompute(modules):
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    results, calls = [], []
    for extra in ([], ["--recompute-granularity", "selective", "--recompute-modules", *modules]):
        cfg = parse_config([*MODEL, *extra])
        (model,) = build_model(cfg, ParallelContext.single())
        model.train()
        forwards: dict[str, int] = {"mlp": 0, "layernorm": 0}
        layer = model.decoder.layers["0"]
        for key, module in (("mlp", layer.mlp), ("layernorm", layer.input_layernorm)):
            module.register_forward_pre_hook(
                lambda *_, k=key, f=forwards: f.__setitem__(k, f[k] + 1)
            )
        model(tokens, positions).float().pow(2).mean().backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
        calls.append(forwards)
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], rtol=0, atol=0, msg=name)
    # Run again in backward: the recomputed modules only.
    assert calls[0] == {"mlp": 1, "layernorm": 1}
    assert calls[1] == {key: 2 if key in modules else 1 for key in ("mlp", "layernorm")}


def test_checkpoint_activations_is_full_uniform_recompute():
    m = parse_config(["--checkpoint-activations"]).model
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )


# ---- precision, tokenizer -----------------------------------------------------------------------
def test_grad_reduce_in_bf16():
    cfg = parse_config(["--bf16", "--grad-reduce-in-bf16"])
    assert grad_dtype(cfg) == torch.bfloat16
    assert grad_dtype(parse_config(["--bf16"])) == torch.float32
    with pytest.raises(GigatronError, match="--grad-reduce-in-bf16 needs --bf16"):
        parse_config(["--grad-reduce-in-bf16"])


def test_vocab_and_merge_files_default_to_the_gpt2_tokenizer(shared_data):
    flags = [*MODEL, "--lr", "1e-3", "--train-iters", "1", "--mock-data",
             "--vocab-file", str(shared_data / "gpt2-vocab.json"),
             "--merge-file", str(shared_data / "gpt2-merges.txt")]  # fmt: skip
    assert parse_pretrain_config(flags, world_size=1).tokenizer.tokenizer_type == (
        "GPT2BPETokenizer"
    )
    bert = parse_pretrain_config(
        [*MODEL, "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--vocab-file", "v.txt"],
        world_size=1,
        family="bert",
    )
    assert bert.tokenizer.tokenizer_type == "BertWordPieceLowerCase"


# ---- TensorBoard switches -----------------------------------------------------------------------
class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key: str, value: float, step: int) -> None:
        self.scalars[key] = value

    def close(self) -> None:
        pass


def _logger(tmp_path, **switches) -> tuple[MetricsLogger, FakeWriter]:
    logger = MetricsLogger(
        str(tmp_path / "m.jsonl"), ParallelContext.single(), stream=io.StringIO(), **switches
    )
    writer = FakeWriter()
    logger._tensorboard = writer
    return logger, writer


@pytest.mark.parametrize("enabled", [False, True])
def test_tensorboard_switches(tmp_path, enabled):
    logger, writer = _logger(
        tmp_path, tensorboard_timers=enabled, tensorboard_validation_ppl=enabled
    )
    record = {
        "iteration": 1, "lm_loss": 2.0, "iteration_time_s": 0.1, "time_optimizer_ms": 3.0,
        **({"memory_max_rss_bytes": 1e9} if enabled else {}),
    }  # fmt: skip
    logger.log_iteration(record)
    logger.log_evaluation({"iteration": 1, "split": "valid", "lm_loss": 2.0})
    assert ("optimizer-time" in writer.scalars) is enabled
    assert ("valid lm loss ppl" in writer.scalars) is enabled
    assert ("mem/max_rss_bytes" in writer.scalars) is enabled
    assert writer.scalars["valid lm loss"] == 2.0
    logger.close()


# ---- fully sharded data parallelism: flags and rules ---------------------------------------
def test_megatron_fsdp_strategies_map_to_the_wrappers():
    from gigatron.parallel.fully_sharded import fsdp_strategy, uses_fully_sharded

    def parallel(*flags):
        return parse_config(list(flags), world_size=4).parallel

    zero1 = parallel("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim")
    assert zero1.use_distributed_optimizer and not uses_fully_sharded(zero1, 4)
    plain = parallel("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard")
    assert not plain.use_distributed_optimizer and not uses_fully_sharded(plain, 4)
    zero2 = parallel("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads")
    assert fsdp_strategy(zero2) == "optim_grads" and uses_fully_sharded(zero2, 4)
    zero3 = parallel("--use-torch-fsdp2")
    assert fsdp_strategy(zero3) == "optim_grads_params" and uses_fully_sharded(zero3, 4)
    assert not uses_fully_sharded(zero3, 1)  # nothing to shard at dp = 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-torch-fsdp2", "--use-distributed-optimizer"], "drop --use-distributed-optimizer"),
        (["--use-torch-fsdp2", "--use-megatron-fsdp"], "give one"),
        (["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"], "not available yet"),
        (["--use-torch-fsdp2", "--fp16"], "--fp16 \\(use --bf16\\)"),
        (["--data-parallel-sharding-strategy", "optim"], "needs --use-megatron-fsdp"),
        (["--megatron-fsdp-grad-comm-dtype", "bf16"], "needs --use-megatron-fsdp"),
    ],
)
def test_fsdp_rules(flags, message):
    with pytest.raises(GigatronError, match=message):
        parse_config(flags, world_size=4)


def test_fsdp_at_dp1_warns_that_nothing_is_sharded():
    with pytest.warns(UserWarning, match="nothing to shard"):
        parse_config(["--use-torch-fsdp2"], world_size=1)


# ---- process settings and memory ------------------------------------------------------------
def test_logging_level_and_reduced_precision_matmul(monkeypatch):
    import logging

    from gigatron.training.run import apply_process_settings

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        apply_process_settings(
            parse_config(["--logging-level", "40", "--disable-bf16-reduced-precision-matmul"])
        )
        assert root.level == logging.ERROR
        assert matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


@pytest.mark.parametrize("level, calls", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_levels(monkeypatch, level, calls):
    from gigatron.training import profiling

    emptied: list[int] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    cuda = torch.device("cuda")
    profiling.empty_unused_memory(level, 2, cuda)  # after forward-backward
    profiling.empty_unused_memory(level, 1, cuda)  # after the optimizer step
    profiling.empty_unused_memory(level, 1, torch.device("cpu"))  # no cache on a CPU
    assert len(emptied) == calls


def test_memory_scalars_on_cpu():
    from gigatron.training.profiling import memory_scalars

    (value,) = memory_scalars(torch.device("cpu")).values()
    assert value > 10 * 2**20  # this process holds torch: more than 10 MiB resident
