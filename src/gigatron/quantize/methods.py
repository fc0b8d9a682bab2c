"""The quantization methods `gigatron quantize` offers (no torch: its --help stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    calibration: str | None = None  # the calibration the method needs (None: optional GPTQ)

    @property
    def code_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


METHODS = {
    m.name: m
    for m in (Method("int8-weight", 8), Method("int4-weight", 4), Method("int4-awq", 4, "awq"))
}
