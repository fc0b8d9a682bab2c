"""Checkpoints: Megatron's per-rank `torch` layout with atomic saves and weights-only loads."""

from gigatron.checkpoint.torch_format import (
    CHECKPOINT_VERSION,
    TRACKER_FILENAME,
    checkpoint_file,
    get_rng_state,
    load_checkpoint,
    read_tracker,
    safe_load,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "CHECKPOINT_VERSION",
    "TRACKER_FILENAME",
    "checkpoint_file",
    "get_rng_state",
    "load_checkpoint",
    "read_tracker",
    "safe_load",
    "save_checkpoint",
    "set_rng_state",
]
