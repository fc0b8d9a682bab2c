"""Optimizers, loss scaling, gradient clipping, and the learning-rate and batch-size schedules."""

from gigatron.optim.batch_schedule import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)
from gigatron.optim.build import build_optimizer
from gigatron.optim.clip_grads import clip_grad_norm, count_zeros, get_grad_norm
from gigatron.optim.grad_scaler import (
    ConstantGradScaler,
    DynamicGradScaler,
    GradScaler,
    build_grad_scaler,
)
from gigatron.optim.lr_schedule import LRScheduler, build_lr_scheduler
from gigatron.optim.optimizer import (
    FP32Optimizer,
    GigatronOptimizer,
    MixedPrecisionOptimizer,
    get_param_groups,
    make_torch_optimizer,
)

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "FP32Optimizer",
    "GigatronOptimizer",
    "GradScaler",
    "LRScheduler",
    "MixedPrecisionOptimizer",
    "NumMicroBatchesCalculator",
    "build_grad_scaler",
    "build_lr_scheduler",
    "build_num_microbatches_calculator",
    "build_optimizer",
    "clip_grad_norm",
    "count_zeros",
    "get_grad_norm",
    "get_param_groups",
    "make_torch_optimizer",
]
