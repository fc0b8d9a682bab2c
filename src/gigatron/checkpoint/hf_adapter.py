"""Streaming runs of the families' Hugging Face maps (the adapter protocol:
families/hf_adapter.py), and the lookup of the family that reads a `model_type`.

The maps take whole state dicts; `gigatron convert` still streams them. `run_windowed` runs a
map once per *window* (the tensors of one layer, or those outside every layer): the view it gets
returns real tensors for the window's names and shape-only `meta` tensors for all others, so each
pass reads one layer and the outputs that come out real are exactly that layer's. A map that
cannot run on meta tensors is run once on everything (correct, not streaming).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch

from gigatron.errors import GigatronError
from gigatron.families import family_names, get_family

Tensor = torch.Tensor
_WINDOW = re.compile(r"^(.*?\.\d+)\.")


class TensorSource(Protocol):
    """Named tensors read on demand."""

    def names(self) -> list[str]: ...

    def __contains__(self, name: object) -> bool: ...

    def tensor(self, name: str) -> Tensor: ...

    def meta(self, name: str) -> Tensor: ...


def window_of(name: str) -> str:
    """The window of a tensor name: its prefix up to the first number (one layer, e.g.
    `model.layers.3`), or "" for tensors outside the layers."""
    match = _WINDOW.match(name)
    return match.group(1) if match else ""


class WindowView(Mapping):
    """A read-only state dict over `source`: real tensors for the names of `window`, meta
    tensors for the rest (`window` None: meta only). Names read for real are added to `used`."""

    def __init__(self, source: TensorSource, window: str | None, used: set[str]) -> None:
        self.source, self.window, self.used = source, window, used

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.source:
            raise KeyError(name)
        if self.window is not None and (self.window == "*" or window_of(name) == self.window):
            self.used.add(name)
            return self.source.tensor(name)
        return self.source.meta(name)

    def __contains__(self, name: object) -> bool:
        return name in self.source

    def __iter__(self) -> Iterator[str]:
        return iter(self.source.names())

    def __len__(self) -> int:
        return len(self.source.names())


def _aliases(out: dict[str, Tensor]) -> set[str]:
    """Names whose tensor is the very object of an earlier name (tied weights written once)."""
    seen: set[int] = set()
    dropped = set()
    for name, tensor in out.items():
        if id(tensor) in seen:
            dropped.add(name)
        seen.add(id(tensor))
    return dropped


class WindowedMap:
    """A map (view -> state dict) over a source, planned once, then run window by window."""

    def __init__(self, fn: Callable[[Mapping], dict[str, Tensor]], source: TensorSource) -> None:
        self.fn, self.source = fn, source
        self.used: set[str] = set()
        try:
            planned = fn(WindowView(source, None, set()))
            self.streaming = True
        except (NotImplementedError, RuntimeError):
            planned = fn(WindowView(source, "*", set()))  # no meta kernel: one real pass
            self.streaming = False
        self.dropped = _aliases(planned)
        self.plan = {
            n: torch.empty(t.shape, dtype=t.dtype, device="meta")
            for n, t in planned.items()
            if n not in self.dropped
        }
        order = dict.fromkeys(window_of(n) for n in source.names())
        self.windows = list(order) if self.streaming else ["*"]

    def outputs(self) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) for every planned output, one window at a time."""
        done: set[str] = set()
        for window in self.windows:
            out = self.fn(WindowView(self.source, window, self.used))
            for name, tensor in out.items():
                if name in self.dropped or name in done or tensor.is_meta:
                    continue
                done.add(name)
                yield name, tensor
            del out
        missing = set(self.plan) - done
        if missing:
            raise GigatronError(
                f"the weight map mixes tensors of different layers in {sorted(missing)[:3]}; it "
                "cannot be streamed"
            )


def call_map(method: Callable, *args: Any, hf_config: dict[str, Any] | None) -> dict[str, Tensor]:
    """Call an adapter's `from_hf`/`to_hf`, passing `hf_config=` when it takes it."""
    if "hf_config" in inspect.signature(method).parameters:
        return method(*args, hf_config=hf_config)
    return method(*args)


def adapter_for(model_type: str) -> tuple[str, Any]:
    """(family name, adapter) of the family whose adapter reads `model_type`."""

    known = []
    for name in family_names():
        adapter = get_family(name).hf_adapter
        types = tuple(getattr(adapter, "model_types", ()) or ())
        known += types
        if model_type in types:
            return name, adapter
    raise GigatronError(
        f"config.json: model_type {model_type!r} has no gigatron adapter; supported: "
        f"{', '.join(sorted(known))}"
    )
