"""Optimizer and learning-rate schedule options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.rules import Section


@dataclass
class OptimizerConfig(Section):
    optimizer: str = flag_field(
        "adam",
        "optimizer (muon: Muon for hidden matrices, AdamW for the rest)",
        choices=["adam", "sgd", "muon"],
    )
    lr: Optional[float] = flag_field(None, "peak learning rate")
    min_lr: float = flag_field(0.0, "learning rate at the end of the decay")
    lr_decay_style: str = flag_field(
        "linear",
        "decay shape",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_wsd_decay_style: str = flag_field(
        "exponential",
        "decay shape of WSD's final phase",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    lr_decay_iters: Optional[int] = flag_field(None, "iterations of decay; default --train-iters")
    lr_decay_samples: Optional[int] = flag_field(None, "samples of decay; default --train-samples")
    lr_wsd_decay_iters: Optional[int] = flag_field(None, "iterations of WSD's final decay")
    lr_wsd_decay_samples: Optional[int] = flag_field(None, "samples of WSD's final decay")
    lr_warmup_iters: int = flag_field(0, "iterations of linear warm-up")
    lr_warmup_fraction: Optional[float] = flag_field(None, "warm-up as a fraction of the decay")
    lr_warmup_samples: int = flag_field(0, "samples of linear warm-up")
    lr_warmup_init: float = flag_field(0.0, "learning rate at the start of warm-up")
    decoupled_lr: Optional[float] = flag_field(None, "peak learning rate of the input embedding and output layer")
    decoupled_min_lr: Optional[float] = flag_field(
        None, "final learning rate of the input embedding and output layer; default --min-lr"
    )
    override_opt_param_scheduler: bool = flag_field(
        False,
        "take the schedule from the flags, not the checkpoint",
        flag="--override-opt_param-scheduler",
        aliases=("--override-opt-param-scheduler",),
    )
    use_checkpoint_opt_param_scheduler: bool = flag_field(
        False,
        "take the schedule from the checkpoint",
        flag="--use-checkpoint-opt_param-scheduler",
        aliases=("--use-checkpoint-opt-param-scheduler",),
    )
    weight_decay: float = flag_field(0.01, "decoupled weight decay (not on biases and norms)")
    start_weight_decay: Optional[float] = flag_field(
        None, "weight decay at the start of training; default --weight-decay"
    )
    end_weight_decay: Optional[float] = flag_field(None, "weight decay at the end of training; default --weight-decay")
    weight_decay_incr_style: str = flag_field(
        "constant",
        "how weight decay moves from --start-weight-decay to --end-weight-decay",
        choices=["constant", "linear", "cosine"],
    )
    clip_grad: float = flag_field(1.0, "clip the global gradient norm to this (0 = off)")
    adam_beta1: float = flag_field(0.9, "Adam beta1")
    adam_beta2: float = flag_field(0.999, "Adam beta2")
    adam_eps: float = flag_field(1e-8, "Adam epsilon")
    sgd_momentum: float = flag_field(0.9, "SGD momentum")
    muon_momentum: float = flag_field(0.9, "Muon momentum (an EMA of the gradients)")
    muon_split_qkv: bool = off_switch(
        "orthogonalise the fused QKV weight as one matrix (not per query, key, value)", flag="--muon-no-split-qkv"
    )
    muon_nesterov: bool = flag_field(False, "Nesterov momentum in Muon", aliases=("--muon-use-nesterov",))
    muon_scale_mode: str = flag_field(
        "spectral",
        "scale of the orthogonal update: sqrt(max(rows, cols)), sqrt(rows/cols) or sqrt(max(1, rows/cols))",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
    )
    muon_fp32_matmul_prec: str = flag_field(
        "medium",
        "Newton-Schulz precision: low and medium run its steps in bf16, high in fp32 (TF32 allowed)",
        choices=["low", "medium", "high"],
    )
    muon_coefficient_type: str = flag_field(
        "quintic",
        "Newton-Schulz coefficients per step",
        choices=["simple", "quintic", "polar_express", "aol"],
    )
    muon_num_ns_steps: int = flag_field(5, "Newton-Schulz steps")
    muon_tp_mode: str = flag_field(
        "duplicated",
        "tensor-parallel weights: gather and orthogonalise the full matrix (duplicated), "
        "distributed Newton-Schulz, or each shard alone (blockwise)",
        choices=["blockwise", "duplicated", "distributed"],
    )
    muon_use_syrk: bool = flag_field(False, "Megatron's Triton SYRK kernel for the Gram matrix (not available)")
    muon_extra_scale_factor: float = flag_field(1.0, "extra factor on Muon's update")
    muon_scalar_optimizer: str = flag_field(
        "adam",
        "optimizer of the parameters Muon does not update (embeddings, norms, biases)",
        choices=["adam", "lion"],
    )

    use_precision_aware_optimizer: bool = flag_field(
        False, "AdamW with the state dtypes below and optional CPU offload (docs/frontier.md)"
    )
    main_grads_dtype: str = flag_field(
        "fp32", "dtype of the optimizer's gradients (fp32 only)", choices=["fp32", "bf16"]
    )
    main_params_dtype: str = flag_field("fp32", "dtype of the main parameters (fp32 only)", choices=["fp32", "fp16"])
    exp_avg_dtype: str = flag_field("fp32", "dtype of Adam's first moment", choices=["fp32", "fp16", "bf16", "fp8"])
    exp_avg_sq_dtype: str = flag_field("fp32", "dtype of Adam's second moment", choices=["fp32", "fp16", "bf16", "fp8"])
    optimizer_cpu_offload: bool = flag_field(
        False, "keep optimizer state on the CPU and step there (--optimizer-offload-fraction)"
    )
    optimizer_offload_fraction: float = flag_field(
        1.0, "fraction of the parameters (by elements) whose state is offloaded"
    )

    def problems(self) -> list[str]:
        """Learning rates and warm-up."""
        found = []
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            found.append("--decoupled-min-lr needs --decoupled-lr")
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            found.append("--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples both given")
        if self.lr is not None and self.min_lr > self.lr:
            found.append(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.optimizer == "muon":
            found.extend(self._muon_problems())
        found.extend(self._precision_problems())
        return found

    def _precision_problems(self) -> list[str]:
        """Megatron's rules: state dtypes and offload need the precision-aware AdamW."""
        found = []
        lowered = [
            f"--{name.replace('_', '-')} {value}"
            for name, value in (
                ("exp_avg_dtype", self.exp_avg_dtype),
                ("exp_avg_sq_dtype", self.exp_avg_sq_dtype),
            )
            if value != "fp32"
        ]
        if self.optimizer_cpu_offload:
            lowered.append("--optimizer-cpu-offload")
            if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
                found.append(f"--optimizer-offload-fraction {self.optimizer_offload_fraction}: must be within [0, 1]")
        if lowered and not self.use_precision_aware_optimizer:
            found.append(f"{', '.join(lowered)}: needs --use-precision-aware-optimizer")
        if self.use_precision_aware_optimizer and self.optimizer != "adam":
            found.append(f"--use-precision-aware-optimizer: only with --optimizer adam (not {self.optimizer})")
        return found

    def _muon_problems(self) -> list[str]:
        found = []
        steps, kind = self.muon_num_ns_steps, self.muon_coefficient_type
        per_cycle = {"quintic": 5, "aol": 4}.get(kind)
        if steps < 1 or (per_cycle and steps % per_cycle):
            found.append(
                f"--muon-num-ns-steps {steps}: the {kind} coefficients need a positive multiple "
                f"of {per_cycle or 1} steps; change it or --muon-coefficient-type"
            )
        if kind == "polar_express" and steps < 8:
            found.append(f"--muon-num-ns-steps {steps}: polar_express needs at least 8 steps")
        return found
        return found
