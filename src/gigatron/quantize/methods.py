"""The quantization methods `gigatron quantize` offers (no torch: its --help stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    calibration: str | None = None  # the calibration the method needs (None: optional GPTQ)
    activation_bits: int | None = None  # inputs quantized per token at run time (None: not)

    @property
    def per_channel(self) -> bool:
        """One weight scale per output row (W8A8), not per group of --group-size."""
        return self.activation_bits is not None

    @property
    def code_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


METHODS = {
    m.name: m
    for m in (
        Method("int8-weight", 8),
        Method("int4-weight", 4),
        Method("int4-awq", 4, "awq"),
        Method("int8-smoothquant", 8, "smoothquant", activation_bits=8),
    )
}
