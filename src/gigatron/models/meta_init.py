"""`--init-model-with-meta-device`: a chunk's parameters are created on the meta device (no
memory) and materialised on this rank's device just before they are initialised.

Every parameter of gigatron's layers is allocated with `torch.empty` and gets its values from
`initialize_parameters` (drawn from its own seed, full size on the CPU, then sliced), so the values
do not depend on where the empty tensor first lived: materialised and eager models are bit
identical at every layout. Buffers (rotary frequencies, expert biases) are computed by other
factories and stay real. The saving is the uninitialised parameter storage an eager build
allocates before the copy (on a GPU: the whole model, held while the next layers are drawn).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gigatron.errors import GigatronError

META = torch.device("meta")


class _EmptyOnMeta(TorchFunctionMode):
    """`torch.empty` (the allocator of every parameter) returns meta tensors."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": META}
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta(enabled: bool = True) -> Iterator[None]:
    """Inside: modules built allocate their parameters on the meta device (when `enabled`)."""
    if not enabled:
        yield
        return
    with _EmptyOnMeta():
        yield


def materialize(module: nn.Module, device: torch.device) -> int:
    """Give every meta parameter of `module` uninitialised storage on `device` (attributes,
    `requires_grad` and sharing between modules kept); the number materialised. A meta parameter
    without an `init` attribute would stay uninitialised: a GigatronError."""
    replaced: dict[int, nn.Parameter] = {}
    for owner_name, owner in module.named_modules():
        for name, param in list(owner._parameters.items()):  # noqa: SLF001 - torch's registry
            if param is None or param.device.type != "meta":
                continue
            if getattr(param, "init", None) is None:
                raise GigatronError(
                    f"--init-model-with-meta-device: parameter {owner_name}.{name} has no "
                    "initialiser, so it cannot be built on the meta device; drop the flag"
                )
            new = replaced.get(id(param))
            if new is None:
                new = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = new
            owner._parameters[name] = new  # noqa: SLF001
    return len(replaced)
