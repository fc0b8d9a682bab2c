"""The quantization methods `gigatron quantize` offers (no torch: its --help stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    bits: int

    @property
    def code_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


METHODS = {m.name: m for m in (Method("int8-weight", 8), Method("int4-weight", 4))}
