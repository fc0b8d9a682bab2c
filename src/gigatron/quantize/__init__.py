"""Post-training quantization (docs/quantization.md): `gigatron quantize`."""
