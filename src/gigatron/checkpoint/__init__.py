"""Checkpoints: Megatron's per-rank `torch` layout (torch_format.py, exported here) and the
sharded `torch_dist` layout (dist_format.py); checkpoint.formats dispatches between them."""

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
