"""The quantization methods `gigatron quantize` offers (no torch: its --help stays fast)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    calibration: str | None = None  # the calibration the method needs (None: optional GPTQ)
    activation_bits: int | None = None  # inputs quantized at run time (None: not)
    number: str = "int"  # "int" codes, or "float" (fp8 e4m3)
    weight_scales: str = "group"  # one weight scale per "group", output row ("channel"), "tensor"

    @property
    def per_channel(self) -> bool:
        """Weight scales not per group of --group-size (per output row, or per tensor)."""
        return self.weight_scales != "group"

    @property
    def code_range(self) -> tuple[int, int]:
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


METHODS = {
    m.name: m
    for m in (
        Method("int8-weight", 8),
        Method("int4-weight", 4),
        Method("int4-awq", 4, "awq"),
        Method("int8-smoothquant", 8, "smoothquant", activation_bits=8, weight_scales="channel"),
        Method("fp8-channel", 8, "fp8", activation_bits=8, number="float", weight_scales="channel"),
        Method("fp8-tensor", 8, "fp8", activation_bits=8, number="float", weight_scales="tensor"),
    )
}
