"""Fine-grained activation offloading (`--fine-grained-activation-offloading --offload-modules
...`, Megatron's flags; docs/activation_offload.md).

While a chosen module of a transformer layer runs forward in training, every tensor autograd
saves for its backward (its input and intermediates, not its parameters) and holding at least
`--min-offloaded-tensor-size` elements is copied to host memory (pinned when the model is on a
GPU) and the device copy released; backward copies it back when it needs it. The values are the
same bytes, so losses and gradients equal the run without offloading exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gigatron.errors import GigatronError

# --offload-modules: the submodule of a TransformerLayer whose forward is offloaded (the norms
# are found by the layer's own names: pre- or post-norm layers).
OFFLOADABLE = {
    "attn_norm": "first_norm",
    "qkv_linear": "self_attention.linear_qkv",
    "core_attn": "self_attention.core_attention",
    "attn_proj": "self_attention.linear_proj",
    "mlp_norm": "second_norm",
}


@dataclass
class OffloadCounter:
    """What the hooks moved to the host: tensors and bytes, per --offload-modules name."""

    tensors: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = self.tensors.get(name, 0) + 1
        self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()


class ModuleOffload:
    """Saved-tensor hooks active during one module's forward (training only)."""

    def __init__(self, name: str, module: nn.Module, min_size: int, counter: OffloadCounter):
        self.name, self.module, self.min_size, self.counter = name, module, min_size, counter
        self.context: Any = None
        self.parameter_storages: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage().data_ptr()
        if tensor.numel() < self.min_size or storage in self.parameter_storages:
            return tensor
        self.counter.add(self.name, tensor)
        host = torch.empty_strided(
            tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu",
            pin_memory=tensor.is_cuda,
        )  # fmt: skip
        host.copy_(tensor, non_blocking=tensor.is_cuda)
        return (tensor.device, host)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=host.is_pinned())

    def enter(self, module: nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.context.__enter__()

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def _submodule(layer: nn.Module, path: str) -> nn.Module | None:
    if path in ("first_norm", "second_norm"):
        return getattr(layer, getattr(layer, f"{path}_name"))
    module = layer
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def check_offload(cfg: Any) -> None:
    """Megatron's rules for the flags, and gigatron's: no offloading with recomputation or
    --torch-compile."""
    model = cfg.model
    names = model.offload_modules or []
    if not model.fine_grained_activation_offloading:
        if names:
            raise GigatronError("--offload-modules needs --fine-grained-activation-offloading")
        return
    if not names:
        raise GigatronError(
            "--fine-grained-activation-offloading needs --offload-modules (any of "
            f"{', '.join(OFFLOADABLE)})"
        )
    unknown = sorted(set(names) - set(OFFLOADABLE))
    if unknown:
        raise GigatronError(
            f"--offload-modules {' '.join(unknown)}: not offloadable in gigatron; choose from "
            f"{', '.join(OFFLOADABLE)}"
        )
    if "attn_proj" in names and "core_attn" not in names:
        raise GigatronError(
            "--offload-modules attn_proj: its input is core_attn's output, which core_attn's "
            "backward keeps anyway; add core_attn"
        )
    if model.recompute_granularity is not None or cfg.training.torch_compile:
        other = "--recompute-granularity" if model.recompute_granularity else "--torch-compile"
        raise GigatronError(
            f"--fine-grained-activation-offloading with {other}: not combined yet; choose one"
        )
    if model.min_offloaded_tensor_size < 0:
        raise GigatronError(
            f"--min-offloaded-tensor-size {model.min_offloaded_tensor_size} must be >= 0"
        )


def install_activation_offload(chunk: nn.Module, cfg: Any) -> OffloadCounter | None:
    """Hooks on the chosen modules of every transformer layer of `chunk` (None: not asked)."""
    check_offload(cfg)
    model = cfg.model
    if not model.fine_grained_activation_offloading:
        return None
    counter = OffloadCounter()
    for layer in chunk.modules():
        if not hasattr(layer, "first_norm_name"):  # a TransformerLayer
            continue
        for name in model.offload_modules:
            module = _submodule(layer, OFFLOADABLE[name])
            if module is None:
                continue
            hooks = ModuleOffload(name, module, model.min_offloaded_tensor_size, counter)
            module.register_forward_pre_hook(hooks.enter)
            module.register_forward_hook(hooks.leave, always_call=True)
    chunk.activation_offload = counter
    return counter
