"""Derived defaults and every cross-field rule, in one place.

Each rule that fails adds one line naming the flags and the fix; all lines are reported together.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

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
    model_parallel = (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    return world_size // model_parallel


def finalize_config(cfg: GigatronConfig, world_size: int | None = None) -> GigatronConfig:
    """Fill the values Megatron derives from others (ffn size, kv channels, batch sizes, ...)."""
    m, t, p = cfg.model, cfg.training, cfg.parallel
    if m.model_preset:
        from gigatron.config.presets import apply_preset

        apply_preset(cfg, m.model_preset)
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
    if (
        m.hidden_size is not None
        and m.num_attention_heads
        and m.kv_channels is None
        and m.hidden_size % m.num_attention_heads == 0
    ):
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if not m.group_query_attention and m.num_attention_heads:
        m.num_query_groups = m.num_attention_heads
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        # Megatron's rule: the same script runs at any tensor-parallel size.
        p.sequence_parallel = False
        warnings.warn(
            "--sequence-parallel needs --tensor-model-parallel-size > 1; turned off", stacklevel=2
        )
    if m.max_position_embeddings is None and m.seq_length is not None:
        m.max_position_embeddings = max(m.seq_length, m.decoder_seq_length or 0)
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # --no-position-embedding's older meaning
    if cfg.moe.num_experts and cfg.moe.moe_ffn_hidden_size is None:
        cfg.moe.moe_ffn_hidden_size = m.ffn_hidden_size
    if cfg.moe.num_experts and p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = p.tensor_model_parallel_size
    if world_size is not None and t.micro_batch_size is not None and t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * max(1, data_parallel_size(cfg, world_size))
    if p.num_virtual_stages_per_pipeline_rank is None and p.num_layers_per_virtual_pipeline_stage:
        if m.num_layers and p.pipeline_model_parallel_size:
            per_stage = m.num_layers // p.pipeline_model_parallel_size
            p.num_virtual_stages_per_pipeline_rank = max(
                1, per_stage // p.num_layers_per_virtual_pipeline_stage
            )
    return cfg


def _positive(problems: list[str], value: int | float | None, flag: str) -> None:
    if value is not None and value <= 0:
        problems.append(f"{flag} is {value}; it must be positive")


def _context_parallel_rules(cfg: GigatronConfig, problems: list[str]) -> None:
    m, p = cfg.model, cfg.parallel
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if len(p.cp_comm_type) not in (1, m.num_layers or 1):
        problems.append(
            f"--cp-comm-type has {len(p.cp_comm_type)} values; give one, or one per layer "
            f"({m.num_layers})"
        )
    if cp <= 1 or m.seq_length is None:
        return
    if m.seq_length % (2 * cp):
        problems.append(
            f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
            f"= {2 * cp} (each rank holds two of 2 x cp equal chunks); change one of them"
        )
    elif p.sequence_parallel and (m.seq_length // cp) % tp:
        problems.append(
            f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
            f"--tensor-model-parallel-size {tp} (--sequence-parallel splits each rank's part)"
        )
    heads = (m.num_attention_heads or 0) // max(tp, 1)
    if "a2a" in p.cp_comm_type and heads % cp:
        problems.append(
            f"--cp-comm-type a2a: the {heads} attention heads per tensor-parallel rank do not "
            f"divide over --context-parallel-size {cp}; use p2p or allgather"
        )


def _checkpoint_rules(cfg: GigatronConfig, problems: list[str]) -> None:
    c = cfg.checkpoint
    if c.ckpt_convert_format is not None and (c.ckpt_convert_save is None or c.load is None):
        problems.append(
            f"--ckpt-convert-format {c.ckpt_convert_format} converts the --load checkpoint into "
            "--ckpt-convert-save DIR; give both"
        )
    if c.ckpt_convert_save is not None and c.ckpt_convert_format is None:
        problems.append("--ckpt-convert-save needs --ckpt-convert-format torch or torch_dist")
    if c.async_save and c.ckpt_format != "torch_dist":
        problems.append(
            f"--async-save works with --ckpt-format torch_dist (not {c.ckpt_format}); add "
            "--ckpt-format torch_dist or leave --async-save out"
        )


def _attention_variant_rules(cfg: GigatronConfig, problems: list[str]) -> None:
    """Sliding windows, softmax sinks, gated activations, YaRN and multi-latent attention."""
    from gigatron.config.model import parse_window_size, parse_window_skip_freq

    m, p = cfg.model, cfg.parallel
    try:
        parse_window_size(m.window_size)
        parse_window_skip_freq(m.window_attn_skip_freq, m.num_layers or 0)
    except GigatronError as error:
        problems.append(str(error))
    if m.window_attn_skip_freq is not None and m.window_size is None:
        problems.append("--window-attn-skip-freq needs --window-size")
    if p.context_parallel_size > 1 and (m.window_size or m.softmax_type != "vanilla"):
        problems.append(
            "--window-size / --softmax-type: the context-parallel attention has no sliding "
            "window or softmax sinks; use --context-parallel-size 1"
        )
    if m.swiglu + m.quick_geglu + m.geglu > 1:
        problems.append(
            "--swiglu, --quick-geglu and --geglu: more than one given; choose one gated activation"
        )
    gated = m.swiglu or m.quick_geglu or m.geglu
    if not gated and (m.glu_linear_offset or m.activation_func_clamp_value is not None):
        problems.append(
            "--glu-linear-offset / --activation-func-clamp-value act on gated MLPs; add "
            "--swiglu or --quick-geglu"
        )
    if m.activation_func_clamp_value is not None and m.activation_func_clamp_value <= 0:
        problems.append(
            f"--activation-func-clamp-value {m.activation_func_clamp_value} must be > 0"
        )
    if m.rope_type == "yarn" and not m.multi_latent_attention:
        problems.append(
            "--rope-type yarn selects the RoPE of multi-latent attention; for other attention "
            "use --position-embedding-type yarn"
        )
    if m.multi_latent_attention and p.context_parallel_size > 1:
        problems.append(
            "--multi-latent-attention: the context-parallel attention assumes equal key and "
            "value head sizes; use --context-parallel-size 1"
        )
    if m.mtp_num_layers is not None:
        if m.mtp_num_layers < 1:
            problems.append(f"--mtp-num-layers {m.mtp_num_layers} must be at least 1")
        if p.context_parallel_size > 1:
            problems.append(
                "--mtp-num-layers: multi-token prediction shifts whole sequences; use "
                "--context-parallel-size 1"
            )
        if p.pipeline_model_parallel_size > 1 and m.position_embedding_type == "learned_absolute":
            problems.append(
                "--mtp-num-layers with pipeline parallelism embeds tokens on the last stage "
                "too, without learned position embeddings there; use --position-embedding-type "
                "rope (or none)"
            )
    if m.rotary_scaling_factor <= 0:
        problems.append(f"--rotary-scaling-factor {m.rotary_scaling_factor} must be positive")


def _fsdp_rules(cfg: GigatronConfig, problems: list[str], world_size: int | None) -> None:
    """Fully sharded data parallelism (parallel/fully_sharded.py): what it composes with."""
    p, t = cfg.parallel, cfg.training
    if p.use_torch_fsdp2 and p.use_megatron_fsdp:
        problems.append("--use-torch-fsdp2 and --use-megatron-fsdp: give one")
    if p.use_torch_fsdp2 and p.use_distributed_optimizer:
        problems.append(
            "--use-torch-fsdp2 shards the optimizer state itself; drop --use-distributed-optimizer"
        )
    fsdp = p.use_torch_fsdp2 or p.use_megatron_fsdp
    if not fsdp and p.megatron_fsdp_grad_comm_dtype != "auto":
        problems.append("--megatron-fsdp-grad-comm-dtype needs --use-megatron-fsdp")
    if not p.use_megatron_fsdp and p.data_parallel_sharding_strategy != "optim_grads_params":
        problems.append("--data-parallel-sharding-strategy needs --use-megatron-fsdp")
    sharded = p.use_torch_fsdp2 or (
        p.use_megatron_fsdp
        and p.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")
    )
    if not sharded:
        return
    if world_size is not None and data_parallel_size(cfg, world_size) == 1:
        # DistributedDataParallel runs instead, which composes with everything.
        warnings.warn(
            "fully sharded data parallelism at data-parallel size 1 has nothing to shard; the "
            "model is trained unsharded",
            stacklevel=2,
        )
        return
    for enabled, what in (
        (p.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1"),
        (p.context_parallel_size > 1, "--context-parallel-size > 1"),
        (bool(cfg.moe.num_experts), "--num-experts (expert parallelism)"),
        (t.fp16, "--fp16 (use --bf16)"),
    ):
        if enabled:
            problems.append(
                f"fully sharded data parallelism (--use-torch-fsdp2 / --use-megatron-fsdp) with "
                f"{what} is not available yet; use --use-distributed-optimizer instead"
            )


def validate_config(
    cfg: GigatronConfig, world_size: int | None = None, for_training: bool = False
) -> None:
    """Raise GigatronError listing every broken rule; `for_training` also requires the flags a
    training run cannot do without."""
    m, t, p, o = cfg.model, cfg.training, cfg.parallel, cfg.optimizer
    problems: list[str] = []

    if for_training:
        for value, flag in (
            (m.num_layers, "--num-layers"),
            (m.hidden_size, "--hidden-size"),
            (m.num_attention_heads, "--num-attention-heads"),
            (m.seq_length, "--seq-length"),
            (t.micro_batch_size, "--micro-batch-size"),
            (o.lr, "--lr"),
        ):
            if value is None:
                problems.append(f"{flag} is required to train (or give --model-preset / --config)")
        if t.train_iters is None and t.train_samples is None:
            problems.append("give the training length with --train-iters or --train-samples")

    for value, flag in (
        (m.num_layers, "--num-layers"),
        (m.hidden_size, "--hidden-size"),
        (m.num_attention_heads, "--num-attention-heads"),
        (m.seq_length, "--seq-length"),
        (t.micro_batch_size, "--micro-batch-size"),
        (t.global_batch_size, "--global-batch-size"),
        (t.train_iters, "--train-iters"),
        (p.tensor_model_parallel_size, "--tensor-model-parallel-size"),
        (p.pipeline_model_parallel_size, "--pipeline-model-parallel-size"),
        (p.context_parallel_size, "--context-parallel-size"),
        (p.expert_model_parallel_size, "--expert-model-parallel-size"),
    ):
        _positive(problems, value, flag)

    if t.train_iters is not None and t.train_samples is not None:
        problems.append("--train-iters and --train-samples both given; keep one")
    if t.fp16 and t.bf16:
        problems.append("--fp16 and --bf16 both given; choose one precision")
    if m.hidden_size and m.num_attention_heads and m.kv_channels is None:
        if m.hidden_size % m.num_attention_heads:
            problems.append(
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                f"{m.num_attention_heads}; change one, or set --kv-channels"
            )
    if (
        m.num_attention_heads
        and m.group_query_attention
        and m.num_attention_heads % m.num_query_groups
    ):
        problems.append(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--num-query-groups {m.num_query_groups}"
        )
    tp = p.tensor_model_parallel_size
    if m.num_attention_heads and tp > 0 and m.num_attention_heads % tp:
        problems.append(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole heads"
        )
    if m.group_query_attention and tp > 1 and m.num_query_groups % tp:
        problems.append(
            f"--num-query-groups {m.num_query_groups} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole key/value groups"
        )
    if m.ffn_hidden_size and tp > 0 and m.ffn_hidden_size % tp:
        problems.append(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by tp {tp}")
    if (
        m.seq_length is not None
        and m.max_position_embeddings is not None
        and m.position_embedding_type == "learned_absolute"
        and m.seq_length > m.max_position_embeddings
    ):
        problems.append(
            f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
            f"{m.max_position_embeddings}; raise the latter"
        )
    if not 0.0 < m.rotary_percent <= 1.0:
        problems.append(f"--rotary-percent {m.rotary_percent} must lie in (0, 1]")
    for value, flag in (
        (m.attention_dropout, "--attention-dropout"),
        (m.hidden_dropout, "--hidden-dropout"),
    ):
        if not 0.0 <= value < 1.0:
            problems.append(f"{flag} {value} must lie in [0, 1)")
    if not 0.0 < cfg.data.mask_prob < 1.0:
        problems.append(f"--mask-prob {cfg.data.mask_prob} must lie in (0, 1)")
    if not 0.0 <= cfg.data.short_seq_prob <= 1.0:
        problems.append(f"--short-seq-prob {cfg.data.short_seq_prob} must lie in [0, 1]")
    if cfg.data.split is not None:
        from gigatron.data.builder import parse_split

        try:
            parse_split(cfg.data.split)
        except GigatronError as error:
            problems.append(str(error))
    if cfg.data.reset_attention_mask and not cfg.data.create_attention_mask_in_dataloader:
        problems.append(
            "--reset-attention-mask needs the mask the data loader builds; drop "
            "--no-create-attention-mask-in-dataloader"
        )
    problems.extend(refused_settings(cfg))
    _attention_variant_rules(cfg, problems)
    _context_parallel_rules(cfg, problems)
    _fsdp_rules(cfg, problems, world_size)
    if p.grad_reduce_in_bf16 and not t.bf16:
        problems.append("--grad-reduce-in-bf16 needs --bf16")
    if p.grad_reduce_in_bf16 and p.accumulate_allreduce_grads_in_fp32:
        problems.append(
            "--grad-reduce-in-bf16 and --accumulate-allreduce-grads-in-fp32 contradict; give one"
        )
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        problems.append("--decoupled-min-lr needs --decoupled-lr")
    if p.overlap_param_gather and not (p.use_distributed_optimizer and p.overlap_grad_reduce):
        problems.append(
            "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce"
        )
    if p.num_layers_per_virtual_pipeline_stage and p.num_virtual_stages_per_pipeline_rank:
        derived = (
            m.num_layers
            // p.pipeline_model_parallel_size
            // p.num_layers_per_virtual_pipeline_stage
            if m.num_layers
            else None
        )
        if derived != p.num_virtual_stages_per_pipeline_rank:
            problems.append(
                "give only one of --num-layers-per-virtual-pipeline-stage and "
                "--num-virtual-stages-per-pipeline-rank"
            )
    if m.recompute_granularity == "full" and (
        m.recompute_method is None or m.recompute_num_layers is None
    ):
        problems.append(
            "--recompute-granularity full needs --recompute-method and --recompute-num-layers"
        )
    if o.lr_warmup_fraction is not None and (o.lr_warmup_iters or o.lr_warmup_samples):
        problems.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both given")
    if o.lr is not None and o.min_lr > o.lr:
        problems.append(f"--min-lr {o.min_lr} is above --lr {o.lr}")
    if (
        t.train_samples is not None
        and t.train_samples > 0
        and (o.lr_decay_iters or o.lr_warmup_iters)
    ):
        problems.append(
            "with --train-samples, give the schedule in samples (--lr-decay-samples, "
            "--lr-warmup-samples), not in iterations"
        )
    if t.rampup_batch_size is not None and t.train_iters is not None:
        problems.append("--rampup-batch-size works with --train-samples; replace --train-iters")

    if world_size is not None:
        model_parallel = tp * p.pipeline_model_parallel_size * p.context_parallel_size
        if model_parallel > 0 and world_size % model_parallel:
            launch = (
                f" (one process per rank: `torchrun --nproc-per-node {model_parallel} -m "
                "gigatron.cli ...` with the same arguments)"
                if world_size == 1
                else ""
            )
            problems.append(
                f"world size {world_size} is not divisible by tp {tp} x pp "
                f"{p.pipeline_model_parallel_size} x cp {p.context_parallel_size} = {model_parallel}; "
                f"change the parallel sizes or the number of processes{launch}"
            )
        elif model_parallel > 0 and t.micro_batch_size and t.global_batch_size:
            dp = world_size // model_parallel
            if t.global_batch_size % (t.micro_batch_size * dp):
                problems.append(
                    f"--global-batch-size {t.global_batch_size} is not divisible by "
                    f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} = "
                    f"{t.micro_batch_size * dp}"
                )
            elif (
                p.pipeline_model_parallel_size > 1
                and (p.num_virtual_stages_per_pipeline_rank or 1) > 1
            ):
                from gigatron.parallel.schedules import check_pipeline_schedule

                try:
                    check_pipeline_schedule(
                        p.pipeline_model_parallel_size,
                        t.global_batch_size // (t.micro_batch_size * dp),
                        p.num_virtual_stages_per_pipeline_rank,
                        p.microbatch_group_size_per_vp_stage,
                    )
                except GigatronError as error:
                    problems.append(str(error))

    problems.extend(moe_problems(cfg, world_size))
    _checkpoint_rules(cfg, problems)

    if problems:
        raise GigatronError("invalid configuration:\n  - " + "\n  - ".join(problems))


def moe_problems(cfg: GigatronConfig, world_size: int | None = None) -> list[str]:
    """The Mixture-of-Experts rules (Megatron's, plus what gigatron does not implement)."""
    import dataclasses

    from gigatron.config.moe import MoEConfig, moe_layer_pattern

    m, e, p = cfg.model, cfg.moe, cfg.parallel
    problems: list[str] = []
    if e.num_experts is None:
        changed = [
            "--" + f.name.replace("_", "-")
            for f in dataclasses.fields(MoEConfig)
            if getattr(e, f.name) != (f.default if f.default is not dataclasses.MISSING else None)
        ]
        if changed:
            problems.append(f"{', '.join(changed)} need --num-experts (an MoE model)")
        if p.expert_model_parallel_size > 1:
            problems.append(
                f"--expert-model-parallel-size {p.expert_model_parallel_size} needs --num-experts"
            )
        return problems
    if m.geglu:
        problems.append(
            "--geglu: MoE experts have SwiGLU or GeLU MLPs only; use --swiglu or drop --geglu"
        )
    experts, ep, tp = e.num_experts, p.expert_model_parallel_size, p.tensor_model_parallel_size
    if experts < 1:
        return [f"--num-experts {experts} must be positive (leave it out for a dense model)"]
    if ep > 0 and experts % ep:
        problems.append(
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}; "
            "every expert-parallel rank holds the same number of experts"
        )
    etp = p.expert_tensor_parallel_size or tp
    if etp not in (1, tp):
        problems.append(
            f"--expert-tensor-parallel-size {etp}: must be 1 or the tensor-parallel size {tp}"
        )
    if m.add_bias_linear and etp > 1:
        problems.append(
            f"MoE experts with biases (the default without --disable-bias-linear) and "
            f"--expert-tensor-parallel-size {etp}: not supported; add --disable-bias-linear "
            "or use --expert-tensor-parallel-size 1"
        )
    if not 1 <= e.moe_router_topk <= experts:
        problems.append(f"--moe-router-topk {e.moe_router_topk} must lie in [1, {experts}]")
    softmax_after_topk = e.moe_router_score_function == "softmax" and not e.moe_router_pre_softmax
    if e.moe_router_topk == 1 and softmax_after_topk:
        if e.moe_router_load_balancing_type != "sinkhorn":
            problems.append(
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a "
                "softmax over one logit is constant: the router would get no gradient)"
            )
    if e.moe_router_group_topk is not None or e.moe_router_num_groups is not None:
        groups, group_topk = e.moe_router_num_groups, e.moe_router_group_topk
        if groups is None or group_topk is None:
            problems.append(
                "group-limited routing needs both --moe-router-num-groups and "
                "--moe-router-group-topk"
            )
        elif experts % groups or not 1 <= group_topk <= groups:
            problems.append(
                f"--moe-router-num-groups {groups} must divide --num-experts {experts} and "
                f"--moe-router-group-topk {group_topk} must lie in [1, {groups}]"
            )
        elif e.moe_router_topk < group_topk or (
            e.moe_router_topk > group_topk * (experts // groups)
        ):
            problems.append(
                f"--moe-router-topk {e.moe_router_topk}: must lie between "
                f"--moe-router-group-topk {group_topk} and the experts in the selected groups "
                f"({group_topk * (experts // groups)})"
            )
    if e.moe_router_enable_expert_bias and e.moe_router_score_function == "softmax":
        problems.append(
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid or "
            "sqrtsoftplus"
        )
    balancing = e.moe_router_load_balancing_type
    if e.moe_aux_loss_coeff < 0:
        problems.append(f"--moe-aux-loss-coeff {e.moe_aux_loss_coeff} must not be negative")
    elif e.moe_aux_loss_coeff > 0 and balancing not in ("aux_loss", "seq_aux_loss"):
        problems.append(
            f"--moe-aux-loss-coeff {e.moe_aux_loss_coeff} has no effect with "
            f"--moe-router-load-balancing-type {balancing}; use aux_loss or seq_aux_loss, or "
            "drop the coefficient"
        )
    if e.moe_expert_capacity_factor is not None:
        if e.moe_expert_capacity_factor <= 0:
            problems.append(
                f"--moe-expert-capacity-factor {e.moe_expert_capacity_factor} must be positive "
                "(leave it out for dropless routing)"
            )
        if balancing == "sinkhorn":
            problems.append(
                "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss or none load "
                "balancing, not sinkhorn"
            )
    elif e.moe_pad_expert_input_to_capacity:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if e.moe_input_jitter_eps is not None and not 0.0 < e.moe_input_jitter_eps < 1.0:
        problems.append(f"--moe-input-jitter-eps {e.moe_input_jitter_eps} must lie in (0, 1)")
    if e.moe_shared_expert_gate and e.moe_shared_expert_intermediate_size is None:
        problems.append("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    for value, flag, divisor in (
        (e.moe_ffn_hidden_size, "--moe-ffn-hidden-size", etp),
        (e.moe_shared_expert_intermediate_size, "--moe-shared-expert-intermediate-size", tp),
    ):
        if value is not None and (value < 1 or value % divisor):
            problems.append(f"{flag} {value} must be a positive multiple of {divisor}")
    if tp > 1 and not p.sequence_parallel and m.seq_length and m.seq_length % tp:
        problems.append(
            f"--seq-length {m.seq_length}: MoE layers split the sequence over the "
            f"{tp} tensor-parallel ranks; use a multiple of {tp}"
        )
    if m.num_layers:
        try:
            if not any(moe_layer_pattern(e.moe_layer_freq, m.num_layers)):
                problems.append(f"--moe-layer-freq {e.moe_layer_freq} makes no layer an MoE layer")
        except GigatronError as error:
            problems.append(str(error))
    if world_size is not None and ep > 0 and etp > 0:
        block = world_size // max(1, p.pipeline_model_parallel_size)
        if block % (ep * etp):
            problems.append(
                f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} does "
                f"not divide the {block} tensor x context x data-parallel ranks of a pipeline "
                "stage; change the expert-parallel sizes or the number of processes"
            )
    return problems
