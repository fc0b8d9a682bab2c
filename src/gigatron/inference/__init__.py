"""Generation: a static KV cache, vocab-parallel sampling, continuous batching, and the
`generate`, `serve` and `text-generation-cli` commands (docs/inference.md)."""

import importlib
from typing import Any

# Loaded on first use (PEP 562): `gigatron text-generation-cli` and the commands' --help import
# this package and must not pay for torch.
_EXPORTS = {
    "Completion": "gigatron.inference.engine",
    "InferenceEngine": "gigatron.inference.engine",
    "SamplingParams": "gigatron.inference.engine",
    "KVCache": "gigatron.inference.kv_cache",
    "ModelRunner": "gigatron.inference.runner",
    "StepPlan": "gigatron.inference.runner",
    "StepResult": "gigatron.inference.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gigatron.inference' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
