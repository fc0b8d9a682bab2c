"""The optimizer the training loop steps: fp32, or mixed precision with fp32 main parameters.

`build_optimizer(cfg, model_chunks, pctx)` returns an object with the contract of
docs/architecture.md ("Optimizer"): `step() -> (success, grad_norm, num_zeros)`, `zero_grad()`,
`get_loss_scale()`, `scale_loss(loss)`, `param_groups`, `state_dict()`, `load_state_dict()`.

Gradients are read from `param.main_grad` (the DistributedDataParallel buffer) when it exists,
else from `param.grad`. The update itself is torch's: `adam` is torch.optim.AdamW (Adam with
decoupled weight decay, Megatron's "adam"; its fused kernel on CPU and CUDA), `sgd` is
torch.optim.SGD with momentum.

`GigatronOptimizer.step` is a template the distributed optimizer reuses:
    prepare_grads()            gradients -> main params' .grad; unscale + overflow check (fp16)
    clip_grad_norm(max_norm)   global norm over all ranks, one clip coefficient
    count_zeros()              (only with --log-num-zeros-in-grad)
    step_with_ready_grads()    inner optimizer step, then main params -> model params
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.optim import clip_grads
from gigatron.optim.grad_scaler import GradScaler
from gigatron.optim.muon import QKV_ATTRIBUTE, Muon, MuonSettings, Orthogonalize, is_muon_matrix
from gigatron.optim.mup import mup_param_groups
from gigatron.optim.offload import DTYPES, PrecisionAwareAdamW
from gigatron.parallel.context import ParallelContext

# Attributes that drive de-duplication in the grad norm and checkpoint gathering; the fp32 main
# copy of a parameter must carry them too.
PARAM_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "sequence_parallel",
    "shared_embedding",
    "shared_position_embedding",
    "expert_parallel",
    QKV_ATTRIBUTE,
)


def copy_param_attributes(source: torch.Tensor, target: torch.Tensor) -> None:
    for name in PARAM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(target, name, getattr(source, name))


def model_gradient(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer reads: `main_grad` (DDP buffer view) when present."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    return param.grad


# Parameters that --decoupled-lr applies to (Megatron's `is_embedding_or_output_parameter`): the
# input word embedding and the untied output layer.
DECOUPLED_LR_PARAMETERS = ("embedding.word_embeddings.weight", "output_layer.weight")


def is_embedding_or_output(name: str) -> bool:
    return name.endswith(DECOUPLED_LR_PARAMETERS)


def get_param_groups(
    model_chunks: Iterable[nn.Module],
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    muon: bool = False,
) -> list[dict[str, Any]]:
    """Groups with weight decay (matrices) and without (biases and 1-D norm weights); with
    `decoupled_lr` the word embedding and output layer get groups of their own whose schedule
    runs from `decoupled_lr` to `decoupled_min_lr` (default: the schedule's --min-lr). With
    `muon` the hidden layers' matrices form a group of their own, marked `"muon": True`."""
    decay, no_decay, decoupled, matrices = [], [], [], []
    seen: set[int] = set()
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if decoupled_lr is not None and is_embedding_or_output(name):
                decoupled.append(param)
            elif name.endswith(".bias") or param.dim() == 1:
                no_decay.append(param)
            elif muon and is_muon_matrix(name, param):
                matrices.append(param)
            else:
                decay.append(param)
    groups = []
    if matrices:
        groups.append({"params": matrices, "wd_mult": 1.0, "lr_mult": 1.0, "muon": True})
    if decay:
        groups.append({"params": decay, "wd_mult": 1.0, "lr_mult": 1.0})
    if no_decay:
        groups.append({"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0})
    if decoupled:
        group = {"params": decoupled, "wd_mult": 1.0, "lr_mult": 1.0, "max_lr": decoupled_lr}
        if decoupled_min_lr is not None:
            group["min_lr"] = decoupled_min_lr
        groups.append(group)
    if not groups:
        raise GigatronError("the model has no trainable parameters; nothing to optimize")
    return groups


def param_groups_for(cfg: Any, model_chunks: Iterable[nn.Module]) -> list[dict[str, Any]]:
    """`get_param_groups` with the run's --decoupled-lr / --decoupled-min-lr (and µP's rates)."""
    o = cfg.optimizer
    model_chunks = list(model_chunks)
    groups = get_param_groups(
        model_chunks, o.decoupled_lr, o.decoupled_min_lr, muon=o.optimizer == "muon"
    )
    return mup_param_groups(cfg, groups, model_chunks)


def make_torch_optimizer(
    cfg: Any, param_groups: list[dict[str, Any]], orthogonalize: Orthogonalize | None = None
) -> torch.optim.Optimizer:
    """torch.optim.AdamW, SGD or Muon (with AdamW for its non-matrix groups) over
    `param_groups` (lr/weight decay are set by the schedule); Muon needs `orthogonalize`."""
    o = cfg.optimizer
    lr = o.lr if o.lr is not None else 0.0
    for group in param_groups:
        group.setdefault("weight_decay", o.weight_decay * group.get("wd_mult", 1.0))
    adam_kwargs = {
        "lr": lr,
        "betas": (o.adam_beta1, o.adam_beta2),
        "eps": o.adam_eps,
        "weight_decay": o.weight_decay,
        # One fused kernel per parameter (CPU and CUDA) instead of about ten elementwise
        # passes; the same update to within float rounding.
        "fused": _fused_adam_supported(param_groups) or None,
    }
    if o.optimizer == "adam" and o.use_precision_aware_optimizer:
        return PrecisionAwareAdamW(
            param_groups,
            **{key: value for key, value in adam_kwargs.items() if key != "fused"},
            exp_avg_dtype=DTYPES[o.exp_avg_dtype],
            exp_avg_sq_dtype=DTYPES[o.exp_avg_sq_dtype],
            offload_fraction=o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0,
        )
    if o.optimizer == "adam":
        return torch.optim.AdamW(param_groups, **adam_kwargs)
    if o.optimizer == "muon":
        if orthogonalize is None:
            raise GigatronError("--optimizer muon: this optimizer wrapper does not support it")
        return Muon(param_groups, MuonSettings.from_config(cfg), orthogonalize, adam_kwargs)
    if o.optimizer == "sgd":
        return torch.optim.SGD(
            param_groups, lr=lr, momentum=o.sgd_momentum, weight_decay=o.weight_decay
        )
    raise GigatronError(f"--optimizer {o.optimizer}: unknown; choose adam, sgd or muon")


# Devices where torch (2.4 and later) has a fused AdamW kernel.
FUSED_ADAM_DEVICES = ("cpu", "cuda")


def _fused_adam_supported(param_groups: list[dict[str, Any]]) -> bool:
    params = [p for group in param_groups for p in group["params"]]
    return all(
        p.device.type in FUSED_ADAM_DEVICES and p.is_floating_point() and not _is_dtensor(p)
        for p in params
    )


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # FSDP2's sharded parameters: the foreach AdamW steps them (no fused kernel needed).
    return hasattr(tensor, "device_mesh")


class GigatronOptimizer:
    """Shared logic of every optimizer flavour (fp32, mixed precision, distributed)."""

    # The distributed optimizer sets this to the group its gradients are sharded over.
    sharded_group: str | None = None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: Any,
        model_chunks: list[nn.Module],
        pctx: ParallelContext,
        grad_scaler: GradScaler | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.cfg = cfg
        self.model_chunks = list(model_chunks)
        self.pctx = pctx
        self.grad_scaler = grad_scaler
        self.clip_grad = float(cfg.optimizer.clip_grad)
        self.log_num_zeros_in_grad = bool(getattr(cfg.logging, "log_num_zeros_in_grad", False))
        self._ones = torch.ones(1, dtype=torch.float32)

    # ---- the contract -----------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return self.grad_scaler.scale if self.grad_scaler is not None else self._ones

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale (what backward runs on)."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale.to(device=loss.device, dtype=loss.dtype)

    def zero_grad(self) -> None:
        """Zero the gradient buffers of the model and drop the main params' gradients."""
        for chunk in self.model_chunks:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
                for param in chunk.parameters():
                    param.grad = None
            else:
                for param in chunk.parameters():
                    param.grad = None
                    if getattr(param, "main_grad", None) is not None:
                        param.main_grad.zero_()
        for param in self.get_main_params():
            param.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """One update: (False, None, None) when fp16 overflowed and the step was skipped."""
        success, grad_norm, num_zeros = self.step_on_device()
        return success, None if grad_norm is None else float(grad_norm.item()), num_zeros

    @torch.no_grad()
    def step_on_device(self) -> tuple[bool, torch.Tensor | None, int | None]:
        """`step` with the gradient norm left a device tensor: no host synchronisation unless
        fp16's overflow check (the step is skipped or not) or --log-num-zeros-in-grad asks."""
        found_inf = self.prepare_grads()
        if found_inf:
            return False, None, None
        grad_norm = clip_grads.clip_grad_norm_tensor(
            self.get_main_params(), self.clip_grad, self.pctx, sharded_group=self.sharded_group
        )
        num_zeros = self.count_zeros() if self.log_num_zeros_in_grad else None
        success = self.step_with_ready_grads()
        return success, grad_norm, num_zeros

    # ---- pieces the subclasses provide or reuse ---------------------------------------------
    def get_main_params(self) -> list[torch.Tensor]:
        """The tensors the inner optimizer updates (their `.grad` is the gradient it uses)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def prepare_grads(self) -> bool:
        """Put the gradients on the main params; True if the step must be skipped (overflow)."""
        raise NotImplementedError

    def unscale_and_check_overflow(self) -> bool:
        """Divide main grads by the loss scale; update the scaler; True on inf/nan anywhere."""
        if self.grad_scaler is None:
            return False
        grads = [p.grad for p in self.get_main_params() if p.grad is not None]
        found_inf = clip_grads.unscale_and_check_overflow(
            grads, self.grad_scaler.inv_scale, self.pctx, self.sharded_group
        )
        self.grad_scaler.update(found_inf)
        return found_inf

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global grad norm before clipping; clips the main grads when `max_norm` > 0."""
        return clip_grads.clip_grad_norm(
            self.get_main_params(), max_norm, self.pctx, sharded_group=self.sharded_group
        )

    def count_zeros(self) -> int:
        return clip_grads.count_zeros(self.get_main_params(), self.pctx, self.sharded_group)

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        return True

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None:
            if "grad_scaler" in state:
                self.grad_scaler.load_state_dict(state["grad_scaler"])

    def reload_model_params(self) -> None:
        """Refresh main params from the model params (after loading weights only)."""


class FP32Optimizer(GigatronOptimizer):
    """Model parameters are fp32 and are updated directly."""

    def prepare_grads(self) -> bool:
        for param in self.get_main_params():
            if hasattr(param, "main_grad"):
                param.grad = param.main_grad
        return False

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        # .grad aliases the DDP buffer only for the step: a later backward must not accumulate
        # into it directly (the DDP hook adds .grad into main_grad, which would count it twice).
        for param in self.get_main_params():
            if hasattr(param, "main_grad"):
                param.grad = None
        return True


class MixedPrecisionOptimizer(GigatronOptimizer):
    """bf16/fp16 model params, each with an fp32 main copy that the inner optimizer updates.

    fp32 model params (if any) are stepped directly, as in FP32Optimizer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes `GigatronOptimizer`'s arguments."""
        super().__init__(*args, **kwargs)
        if self.cfg.training.fp16 and self.grad_scaler is None:
            raise GigatronError("--fp16 needs a loss scaler (dynamic by default, or --loss-scale)")
        # (model param, main param) for every trainable parameter, in param-group order.
        self.param_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            main_params = []
            for param in group["params"]:
                if param.dtype in (torch.float16, torch.bfloat16):
                    main = param.detach().clone().float()
                    copy_param_attributes(param, main)
                else:
                    main = param
                self.param_pairs.append((param, main))
                main_params.append(main)
            group["params"] = main_params
        # The inner optimizer keyed nothing yet (no step taken), so swapping params is safe.
        self.optimizer.state.clear()

    def prepare_grads(self) -> bool:
        for model_param, main_param in self.param_pairs:
            grad = model_gradient(model_param)
            if grad is None:
                main_param.grad = None
            elif main_param is model_param:
                model_param.grad = grad
            else:
                # .float() of an fp32 main_grad buffer is the buffer itself (no copy).
                main_param.grad = grad.float()
        return self.unscale_and_check_overflow()

    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        for model_param, main_param in self.param_pairs:
            if main_param is not model_param:
                model_param.data.copy_(main_param.data)
            elif hasattr(model_param, "main_grad"):
                model_param.grad = None  # see FP32Optimizer.step_with_ready_grads
        return True

    def reload_model_params(self) -> None:
        with torch.no_grad():
            for model_param, main_param in self.param_pairs:
                if main_param is not model_param:
                    main_param.copy_(model_param.float())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["fp32_from_fp16_params"] = [
            main.detach().clone() for model, main in self.param_pairs if main is not model
        ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        mains = [main for model, main in self.param_pairs if main is not model]
        saved = state.get("fp32_from_fp16_params")
        if saved is None:
            self.reload_model_params()
            return
        if len(saved) != len(mains):
            raise GigatronError(
                f"optimizer state holds {len(saved)} fp32 main parameters but the model has "
                f"{len(mains)}; the checkpoint was saved from a different model or precision "
                "(use --no-load-optim to load the weights only)"
            )
        with torch.no_grad():
            for main, value in zip(mains, saved):
                if main.shape != value.shape:
                    raise GigatronError(
                        f"optimizer state: a main parameter of shape {tuple(value.shape)} does "
                        f"not fit the model's {tuple(main.shape)}; use --no-load-optim"
                    )
                main.copy_(value)
