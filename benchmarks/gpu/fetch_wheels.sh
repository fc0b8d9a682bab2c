#!/usr/bin/env bash
# Downloads the wheels the GPU run carries into .whl/ at the repository root (ignored by git):
# Megatron-Core, torchao and Liger-Kernel for the device image (Python 3.12, x86-64, torch 2.11
# + CUDA 13, Triton 3.6). Their own needs (torch, numpy, packaging, triton) are on the image.
# Usage: benchmarks/gpu/fetch_wheels.sh   (then see benchmarks/gpu/README.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
WHEELS=(
    megatron-core==0.16.1  # the reference GPTModel (local spec)
    torchao==0.17.0        # fp8 training; the release made for torch 2.11
    liger-kernel==0.8.5    # fused RMSNorm, RoPE, SwiGLU, linear cross entropy (Triton)
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
