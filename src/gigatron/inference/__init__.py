"""Generation: a static KV cache, vocab-parallel sampling, continuous batching, and the
`generate`, `serve` and `text-generation-cli` commands (docs/inference.md)."""

from gigatron.inference.engine import Completion, InferenceEngine, SamplingParams
from gigatron.inference.kv_cache import KVCache
from gigatron.inference.runner import ModelRunner, StepPlan, StepResult

__all__ = [
    "Completion",
    "InferenceEngine",
    "KVCache",
    "ModelRunner",
    "SamplingParams",
    "StepPlan",
    "StepResult",
]
