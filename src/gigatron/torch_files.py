"""Reading torch files without running code from them: `safe_load` (tensors and plain values
only) and the allow-list that admits the files Megatron-LM wrote (their enums, numpy values and
signals become inert stand-ins).

A bottom module: the optimizers (optim/) read their `distrib_optim.pt` with it, and the
checkpoint formats (checkpoint/) read everything else.
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
import signal
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import _weights_only_unpickler

from gigatron.errors import GigatronError


class StoredValue:
    """An instance of a class gigatron does not import (a Megatron enum value): its class name
    and the arguments it was stored with; nothing of it runs."""

    def __init__(self, qualified_name: str, args: tuple = ()) -> None:
        self.qualified_name, self.args = qualified_name, args

    @property
    def value(self) -> Any:
        return self.args[0] if len(self.args) == 1 else self.args

    def __repr__(self) -> str:
        return f"{self.qualified_name}({', '.join(map(repr, self.args))})"

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _inert_class(qualified_name: str) -> type:
    """A stand-in for an unknown Megatron class: calling it (how enum values are unpickled)
    or creating it gives a StoredValue."""

    class Inert(StoredValue):
        def __new__(cls, *args: Any) -> StoredValue:
            value = StoredValue.__new__(StoredValue)
            StoredValue.__init__(value, qualified_name, args)
            return value

        def __init__(self, *args: Any) -> None:  # the value is built by __new__
            pass

    Inert.__qualname__ = Inert.__name__ = qualified_name.rsplit(".", 1)[-1]
    return Inert


def enum_member(cls: Any, name: str) -> Any:
    """`builtins.getattr` for unpicklers: Python 3.11.0-3.11.4 pickle an enum member as
    `getattr(its class, its name)`. Only a member of an enum class the unpickler admitted, or of
    a Megatron class's inert stand-in (a StoredValue holding the member's name), is returned."""
    if isinstance(cls, type) and issubclass(cls, StoredValue):
        return cls(name)
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr of {name!r} on {cls!r} is not allowed")


def _allowed_globals() -> dict[str, Any]:
    allowed = dict(_weights_only_unpickler._get_allowed_globals())
    numpy_core = getattr(np, "_core", None) or np.core
    allowed.update(
        {
            "argparse.Namespace": argparse.Namespace,
            "_io.BytesIO": io.BytesIO,  # Transformer Engine's _extra_state (older versions)
            "signal.Signals": signal.Signals,
            "builtins.frozenset": frozenset,
            "builtins.bytes": bytes,
            "builtins.slice": slice,
            "builtins.getattr": enum_member,  # how Python 3.11.0-3.11.4 pickle enum members
            "numpy.ndarray": np.ndarray,
            "numpy.dtype": np.dtype,
            "numpy.core.multiarray._reconstruct": numpy_core.multiarray._reconstruct,
            "numpy._core.multiarray._reconstruct": numpy_core.multiarray._reconstruct,
            "numpy.core.multiarray.scalar": numpy_core.multiarray.scalar,
            "numpy._core.multiarray.scalar": numpy_core.multiarray.scalar,
        }
    )
    # Python 3.11's global enums pickle a signal as `signal.SIGTERM`, not `Signals(15)`
    allowed.update({f"signal.{member.name}": member for member in signal.Signals})
    for dtype_class in vars(np.dtypes).values():
        if isinstance(dtype_class, type):
            allowed[f"numpy.dtypes.{dtype_class.__name__}"] = dtype_class
    return allowed


class _MegatronUnpickler(pickle.Unpickler):
    allowed: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol-2 pickles
        qualified = f"{module}.{name}"
        if qualified in self.allowed:
            return self.allowed[qualified]
        if module == "megatron" or module.startswith("megatron."):
            return _inert_class(qualified)
        raise pickle.UnpicklingError(f"GLOBAL {qualified} is not allowed")


def _pickle_module() -> types.ModuleType:
    module = types.ModuleType("gigatron_megatron_unpickler")
    _MegatronUnpickler.allowed = _allowed_globals()
    module.Unpickler = _MegatronUnpickler  # type: ignore[attr-defined]
    module.load = lambda file, **kw: _MegatronUnpickler(file, **kw).load()  # type: ignore[attr-defined]
    module.__dict__["UnpicklingError"] = pickle.UnpicklingError
    return module


def load_megatron_file(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Read a Megatron-LM `model_optim_rng.pt` with the allow-list above. Raises
    pickle.UnpicklingError for anything else (other globals, or `args` not a Namespace)."""
    state = torch.load(
        path, map_location="cpu", weights_only=False, pickle_module=_pickle_module(), mmap=mmap
    )
    if not isinstance(state, dict) or not isinstance(state.get("args"), argparse.Namespace):
        raise pickle.UnpicklingError("objects outside a Megatron-LM checkpoint")
    return state


def load_megatron_object(data: bytes) -> Any:
    """An object Megatron-LM saved with torch.save inside a checkpoint (a torch_dist
    ShardedObject such as its random states), read with the allow-list above."""
    return torch.load(
        io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=_pickle_module()
    )


def safe_load(path: Path, mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True; anything needing arbitrary unpickling is refused.
    `mmap`: tensors stay in the file until read (for converting one tensor at a time)."""
    try:
        # argparse.Namespace is plain data (Megatron-written files keep their args in one).
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        # A file Megatron-LM wrote (enums, numpy and signals in its args) has its own allow-list.
        try:
            return load_megatron_file(path, mmap=mmap)
        except pickle.UnpicklingError as megatron_exc:
            if "GLOBAL" in str(megatron_exc):
                exc = megatron_exc  # the global that no allow-list admits
        # torch's message also suggests weights_only=False; keep only the line naming the culprit.
        lines = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
        culprit = f" ({lines[0]})" if lines else ""
        raise GigatronError(
            f"{path}: refused to load: the file contains pickled Python objects or code, not "
            f"only tensors and plain values{culprit}. gigatron never runs code from a "
            "checkpoint; if you trust the file, re-save its tensors with a trusted tool"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise GigatronError(
            f"{path}: not a readable checkpoint file ({type(exc).__name__}: {exc}); it may be "
            "truncated or corrupt: load an earlier iteration with --ckpt-step"
        ) from None
    if not isinstance(state, dict):
        raise GigatronError(f"{path}: not a gigatron/Megatron checkpoint (top level is not a dict)")
    return state
