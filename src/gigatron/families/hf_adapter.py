"""The Hugging Face adapter protocol: what a family's `hf_adapter` (families/registry.py)
provides so `gigatron convert` (checkpoint/hf_convert.py) can move its weights both ways.

Required:
- `model_types`: the Hugging Face `model_type` values it reads (`config.json`), e.g. ("bert",);
- `config_from_hf(hf_config) -> dict`: gigatron config values (fields of any config section,
  e.g. ModelConfig and MoEConfig ones) plus `vocab_size`, for a Hugging Face config (a
  PretrainedConfig or its dict);
- `from_hf(hf, num_layers, num_heads, padded_vocab[, hf_config=]) -> dict`: Hugging Face state
  dict -> gigatron state dict of full (tp = 1) tensors;
- `to_hf(sd, num_layers, num_heads, vocab_size[, hf_config=]) -> dict`: the reverse.

Optional: `config_to_hf(cfg, vocab_size) -> dict` (a `config.json` for a model that was not
imported) and `to_hf_files(hf_state, hf_config) -> dict` (the names `save_pretrained` writes,
when they differ from the model's state dict, e.g. Mixtral's per-expert weights). Maps that need
more than the four numbers (grouped-query attention, MoE layers) take `hf_config=`.

The maps take whole state dicts of names to tensors and only index, slice, concatenate and
reshape them, so the converter can run them on `meta` tensors to plan, then one layer at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

StateDict = Mapping[str, torch.Tensor]


@runtime_checkable
class HFAdapter(Protocol):
    """A family's map between its gigatron state dict and Hugging Face's (see module doc)."""

    model_types: tuple[str, ...]

    def config_from_hf(self, hf_config: Any) -> dict[str, Any]: ...

    def from_hf(
        self, hf: StateDict, num_layers: int, num_heads: int, padded_vocab: int, **kwargs: Any
    ) -> dict[str, torch.Tensor]: ...

    def to_hf(
        self, sd: StateDict, num_layers: int, num_heads: int, vocab_size: int, **kwargs: Any
    ) -> dict[str, torch.Tensor]: ...
