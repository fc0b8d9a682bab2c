"""Derived defaults and every cross-field rule, in one place.

Each rule that fails adds one line naming the flags and the fix; all lines are reported together.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

from gigatron.config.moe import moe_layer_pattern
from gigatron.config.parallel import check_pipeline_schedule
from gigatron.config.presets import apply_preset
from gigatron.config.refusals import refused_settings
from gigatron.errors import GigatronError

if TYPE_CHECKING:  # root.py calls into this module: a runtime import would be a cycle
    import torch

    from gigatron.config.root import GigatronConfig


def params_dtype(cfg: GigatronConfig) -> torch.dtype:
    """The dtype of model parameters and activations: bf16 / fp16 under --bf16 / --fp16."""
    # Imported here: commands that only parse flags (preprocess, merge) never load torch.
    import torch

    if cfg.training.bf16:
        return torch.bfloat16
    if cfg.training.fp16:
        return torch.float16
    return torch.float32


def data_parallel_size(cfg: GigatronConfig, world_size: int) -> int:
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    return world_size // model_parallel


def finalize_config(cfg: GigatronConfig, world_size: int | None = None) -> GigatronConfig:
    """Fill the values Megatron derives from others (ffn size, kv channels, batch sizes, ...)."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    if m.model_preset:
        apply_preset(cfg, m.model_preset)
    _finalize_switches(cfg)
    _finalize_model_shape(cfg)
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        # Megatron's rule: the same script runs at any tensor-parallel size.
        p.sequence_parallel = False
        warnings.warn("--sequence-parallel needs --tensor-model-parallel-size > 1; turned off", stacklevel=2)
    if cfg.moe.num_experts and cfg.moe.moe_ffn_hidden_size is None:
        cfg.moe.moe_ffn_hidden_size = m.ffn_hidden_size
    if cfg.moe.num_experts and p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = p.tensor_model_parallel_size
    if world_size is not None and t.micro_batch_size is not None and t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * max(1, data_parallel_size(cfg, world_size))
    if p.num_virtual_stages_per_pipeline_rank is None and p.num_layers_per_virtual_pipeline_stage:
        if m.num_layers and p.pipeline_model_parallel_size:
            per_stage = m.num_layers // p.pipeline_model_parallel_size
            p.num_virtual_stages_per_pipeline_rank = max(1, per_stage // p.num_layers_per_virtual_pipeline_stage)
    return cfg


def _finalize_switches(cfg: GigatronConfig) -> None:
    """Flags that stand for others: --recompute-activations, --checkpoint-activations,
    Megatron-FSDP's optimizer-only sharding."""
    m, p = cfg.model, cfg.parallel
    if m.recompute_activations:
        m.recompute_granularity = "selective"
    if p.use_megatron_fsdp and p.data_parallel_sharding_strategy == "optim":
        # Megatron-FSDP's ZeRO-1: the distributed optimizer's sharding.
        p.use_distributed_optimizer = True
    if m.checkpoint_activations:
        # Megatron's old flag: full recompute, uniform groups (of the old default of 1 layer).
        m.recompute_granularity = "full"
        m.recompute_method = "uniform"
        if m.recompute_num_layers is None:
            m.recompute_num_layers = 1


def _finalize_model_shape(cfg: GigatronConfig) -> None:
    """Layer count, sequence length, MLP and head sizes, query groups, positions."""
    m = cfg.model
    pattern = m.hybrid_layer_pattern or m.hybrid_override_pattern
    if m.num_layers is None and pattern:
        m.num_layers = len(pattern)  # a hybrid stack's layer count is its pattern's (Megatron)
    # Encoder-decoder models (T5), as Megatron: the encoder's values stand in for the shared ones.
    if m.num_layers is None and m.encoder_num_layers is not None:
        m.num_layers = m.encoder_num_layers
    if m.seq_length is None and m.encoder_seq_length is not None:
        m.seq_length = m.encoder_seq_length
    if m.hidden_size is not None and m.ffn_hidden_size is None:
        if m.swiglu:
            # Keeps the parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
            m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64
        else:
            m.ffn_hidden_size = 4 * m.hidden_size
    heads = m.num_attention_heads
    if m.hidden_size is not None and heads and m.kv_channels is None and m.hidden_size % heads == 0:
        m.kv_channels = m.hidden_size // heads
    if not m.group_query_attention and heads:
        m.num_query_groups = heads
    if m.max_position_embeddings is None and m.seq_length is not None:
        m.max_position_embeddings = max(m.seq_length, m.decoder_seq_length or 0)
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # --no-position-embedding's older meaning


def freeze_config(cfg: GigatronConfig) -> GigatronConfig:
    """Make every section read-only (the last step of parse -> finalize -> validate -> freeze at
    a command's edge): code that builds or runs a model can no longer change the run's options."""
    for section in dataclasses.fields(cfg):
        getattr(cfg, section.name).freeze()
    return cfg


def _training_requirements(cfg: GigatronConfig) -> list[str]:
    """The flags a training run cannot do without."""
    m, t = cfg.model, cfg.training
    found = [
        f"{flag} is required to train (or give --model-preset / --config)"
        for value, flag in (
            (m.num_layers, "--num-layers"),
            (m.hidden_size, "--hidden-size"),
            (m.num_attention_heads, "--num-attention-heads"),
            (m.seq_length, "--seq-length"),
            (t.micro_batch_size, "--micro-batch-size"),
            (cfg.optimizer.lr, "--lr"),
        )
        if value is None
    ]
    if t.train_iters is None and t.train_samples is None:
        found.append("give the training length with --train-iters or --train-samples")
    return found


def _tensor_parallel_rules(cfg: GigatronConfig) -> list[str]:
    """Whole heads, key/value groups and MLP columns on each tensor-parallel rank."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    found = []
    if m.num_attention_heads and tp > 0 and m.num_attention_heads % tp:
        found.append(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole heads"
        )
    if m.group_query_attention and tp > 1 and m.num_query_groups % tp:
        found.append(
            f"--num-query-groups {m.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole key/value "
            "groups"
        )
    if m.ffn_hidden_size and tp > 0 and m.ffn_hidden_size % tp:
        found.append(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by tp {tp}")
    return found


def _context_parallel_rules(cfg: GigatronConfig) -> list[str]:
    m, p = cfg.model, cfg.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    found = []
    if len(p.cp_comm_type) not in (1, m.num_layers or 1):
        found.append(f"--cp-comm-type has {len(p.cp_comm_type)} values; give one, or one per layer ({m.num_layers})")
    if cp <= 1 or m.seq_length is None:
        return found
    if m.seq_length % (2 * cp):
        found.append(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
            f"= {2 * cp} (each rank holds two of 2 x cp equal chunks); change one of them"
        )
    elif p.sequence_parallel and (m.seq_length // cp) % tp:
        found.append(
            f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits each rank's part)"
        )
    heads = (m.num_attention_heads or 0) // max(tp, 1)
    if "a2a" in p.cp_comm_type and heads % cp:
        found.append(
            f"--cp-comm-type a2a: the {heads} attention heads per tensor-parallel rank do not "
            f"divide over --context-parallel-size {cp}; use p2p or allgather"
        )
    return found


def _attention_parallel_rules(cfg: GigatronConfig) -> list[str]:
    """What sliding windows, sinks, multi-latent attention and multi-token prediction do not
    compose with."""
    m, p = cfg.model, cfg.parallel
    found = []
    if p.context_parallel_size > 1 and (m.window_size or m.softmax_type != "vanilla"):
        found.append(
            "--window-size / --softmax-type: the context-parallel attention has no sliding "
            "window or softmax sinks; use --context-parallel-size 1"
        )
    if m.multi_latent_attention and p.context_parallel_size > 1:
        found.append(
            "--multi-latent-attention: the context-parallel attention assumes equal key and "
            "value head sizes; use --context-parallel-size 1"
        )
    if m.mtp_num_layers is not None and p.context_parallel_size > 1:
        found.append("--mtp-num-layers: multi-token prediction shifts whole sequences; use --context-parallel-size 1")
    if (
        m.mtp_num_layers is not None
        and p.pipeline_model_parallel_size > 1
        and m.position_embedding_type == "learned_absolute"
    ):
        found.append(
            "--mtp-num-layers with pipeline parallelism embeds tokens on the last stage "
            "too, without learned position embeddings there; use --position-embedding-type "
            "rope (or none)"
        )
    return found


def _fsdp_rules(cfg: GigatronConfig, world_size: int | None) -> list[str]:
    """Fully sharded data parallelism (parallel/fully_sharded.py): what it composes with."""
    p, t = cfg.parallel, cfg.training
    if not p.fully_sharded:
        return []
    if world_size is not None and data_parallel_size(cfg, world_size) == 1:
        # DistributedDataParallel runs instead, which composes with everything.
        warnings.warn(
            "fully sharded data parallelism at data-parallel size 1 has nothing to shard; the "
            "model is trained unsharded",
            stacklevel=2,
        )
        return []
    return [
        f"fully sharded data parallelism (--use-torch-fsdp2 / --use-megatron-fsdp) with "
        f"{what} is not available yet; use --use-distributed-optimizer instead"
        for enabled, what in (
            (p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
            (p.context_parallel_size > 1, "--context-parallel-size > 1"),
            (bool(cfg.moe.num_experts), "--num-experts (expert parallelism)"),
            (t.fp16, "--fp16 (use --bf16)"),
            (bool(cfg.checkpoint.save_hf), "--save-hf"),
            (cfg.model.lora_dora, "--lora-dora"),
            (cfg.optimizer.optimizer == "muon", "--optimizer muon"),
        )
        if enabled
    ]


def _schedule_rules(cfg: GigatronConfig) -> list[str]:
    """Precision of the gradient reduction, virtual pipeline stages, the lr schedule's unit."""
    m, t, p, o = cfg.model, cfg.training, cfg.parallel, cfg.optimizer
    found = []
    if p.grad_reduce_in_bf16 and not t.bf16:
        found.append("--grad-reduce-in-bf16 needs --bf16")
    if p.num_layers_per_virtual_pipeline_stage and p.num_virtual_stages_per_pipeline_rank:
        derived = (
            m.num_layers // p.pipeline_model_parallel_size // p.num_layers_per_virtual_pipeline_stage
            if m.num_layers
            else None
        )
        if derived != p.num_virtual_stages_per_pipeline_rank:
            found.append(
                "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"
            )
    if p.pipeline_schedule == "dualpipev" and (not m.untie_embeddings_and_output_weights or m.mtp_num_layers):
        found.append(
            "--pipeline-schedule dualpipev puts the first and the last stage on rank 0, where a "
            "tied output weight (or the multi-token prediction's embedding) would be a second "
            "copy of the word embedding; add --untie-embeddings-and-output-weights and drop "
            "--mtp-num-layers, or use another schedule"
        )
    if t.train_samples is not None and t.train_samples > 0 and (o.lr_decay_iters or o.lr_warmup_iters):
        found.append(
            "with --train-samples, give the schedule in samples (--lr-decay-samples, "
            "--lr-warmup-samples), not in iterations"
        )
    return found


def _world_size_rules(cfg: GigatronConfig, world_size: int | None) -> list[str]:
    """The process count against the parallel sizes and the batch sizes."""
    t, p = cfg.training, cfg.parallel
    if world_size is None:
        return []
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    model_parallel = tp * pp * cp
    if model_parallel > 0 and world_size % model_parallel:
        launch = (
            f" (one process per rank: `torchrun --nproc-per-node {model_parallel} -m "
            "gigatron.cli ...` with the same arguments)"
            if world_size == 1
            else ""
        )
        return [
            f"world size {world_size} is not divisible by tp {tp} x pp {pp} x cp {cp} = "
            f"{model_parallel}; change the parallel sizes or the number of processes{launch}"
        ]
    if model_parallel <= 0 or not (t.micro_batch_size and t.global_batch_size):
        return []
    dp = world_size // model_parallel
    if t.global_batch_size % (t.micro_batch_size * dp):
        return [
            f"--global-batch-size {t.global_batch_size} is not divisible by "
            f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} = "
            f"{t.micro_batch_size * dp}"
        ]
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if p.pipeline_schedule == "dualpipev" and microbatches < 2 * pp:
        return [
            f"--pipeline-schedule dualpipev: {microbatches} micro-batches per iteration, it "
            f"needs at least 2 x the pipeline size = {2 * pp}; raise --global-batch-size"
        ]
    interleaved = (p.num_virtual_stages_per_pipeline_rank or 1) > 1
    if pp > 1 and interleaved and p.pipeline_schedule != "dualpipev":
        try:
            check_pipeline_schedule(
                pp,
                t.global_batch_size // (t.micro_batch_size * dp),
                p.num_virtual_stages_per_pipeline_rank,
                p.microbatch_group_size_per_vp_stage,
            )
        except GigatronError as error:
            return [str(error)]
    return []


def validate_config(cfg: GigatronConfig, world_size: int | None = None, for_training: bool = False) -> None:
    """Raise GigatronError listing every broken rule: each section's own (`problems()`), then
    those across sections; `for_training` also requires the flags a training run cannot do
    without."""
    problems = _training_requirements(cfg) if for_training else []
    for section in dataclasses.fields(cfg):
        problems += getattr(cfg, section.name).problems()
    problems += refused_settings(cfg)
    problems += _tensor_parallel_rules(cfg)
    problems += _attention_parallel_rules(cfg)
    problems += _context_parallel_rules(cfg)
    problems += _fsdp_rules(cfg, world_size)
    problems += _schedule_rules(cfg)
    problems += _world_size_rules(cfg, world_size)
    problems += moe_problems(cfg, world_size)
    if problems:
        raise GigatronError("invalid configuration:\n  - " + "\n  - ".join(problems))


def moe_problems(cfg: GigatronConfig, world_size: int | None = None) -> list[str]:
    """The Mixture-of-Experts rules across sections (the MoE section's own: MoEConfig)."""
    e, p = cfg.moe, cfg.parallel
    if e.num_experts is None:
        ep = p.expert_model_parallel_size
        return [f"--expert-model-parallel-size {ep} needs --num-experts"] if ep > 1 else []
    if e.num_experts < 1:
        return []  # MoEConfig.problems says so
    return _expert_layout_rules(cfg) + _expert_shape_rules(cfg, world_size)


def _expert_layout_rules(cfg: GigatronConfig) -> list[str]:
    """Experts over expert-parallel ranks, expert tensor parallelism and the MLP kind."""
    m, e, p = cfg.model, cfg.moe, cfg.parallel
    experts, ep, tp = e.num_experts, p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    found = []
    if m.geglu:
        found.append("--geglu: MoE experts have SwiGLU or GeLU MLPs only; use --swiglu or drop --geglu")
    if ep > 0 and experts % ep:
        found.append(
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}; "
            "every expert-parallel rank holds the same number of experts"
        )
    if etp not in (1, tp):
        found.append(f"--expert-tensor-parallel-size {etp}: must be 1 or the tensor-parallel size {tp}")
    if m.add_bias_linear and etp > 1:
        found.append(
            f"MoE experts with biases (the default without --disable-bias-linear) and "
            f"--expert-tensor-parallel-size {etp}: not supported; add --disable-bias-linear "
            "or use --expert-tensor-parallel-size 1"
        )
    return found


def _expert_shape_rules(cfg: GigatronConfig, world_size: int | None) -> list[str]:
    """Expert MLP sizes over tensor-parallel ranks, the MoE layers, the expert grid."""

    m, e, p = cfg.model, cfg.moe, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    found = [
        f"{flag} {value} must be a positive multiple of {divisor}"
        for value, flag, divisor in (
            (e.moe_ffn_hidden_size, "--moe-ffn-hidden-size", etp),
            (e.moe_shared_expert_intermediate_size, "--moe-shared-expert-intermediate-size", tp),
        )
        if value is not None and (value < 1 or value % divisor)
    ]
    if tp > 1 and not p.sequence_parallel and m.seq_length and m.seq_length % tp:
        found.append(
            f"--seq-length {m.seq_length}: MoE layers split the sequence over the "
            f"{tp} tensor-parallel ranks; use a multiple of {tp}"
        )
    if m.num_layers:
        try:
            if not any(moe_layer_pattern(e.moe_layer_freq, m.num_layers)):
                found.append(f"--moe-layer-freq {e.moe_layer_freq} makes no layer an MoE layer")
        except GigatronError as error:
            found.append(str(error))
    if world_size is not None and ep > 0 and etp > 0:
        block = world_size // max(1, p.pipeline_model_parallel_size)
        if block % (ep * etp):
            found.append(
                f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does "
                f"not divide the {block} tensor x context x data-parallel ranks of a pipeline "
                "stage; change the expert-parallel sizes or the number of processes"
            )
    return found
