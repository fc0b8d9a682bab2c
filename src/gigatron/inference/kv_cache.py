"""A static key/value cache for generation.

One buffer pair per attention layer of this rank, shaped [max_sequence, max_batch, groups, hn]
(the block's [seq, batch, ...] layout; `groups` are this tensor-parallel rank's key/value groups,
so grouped-query attention caches only its few key/value heads). The buffers are allocated once,
when the cache is built, and never resized: shapes stay static (CUDA graphs, torch.compile).

Each batch row is a *slot* holding one sequence. A forward step covers some slots; row `r` of
the step feeds `lengths[r]` new tokens (right-padded to the step's width `n`) at cache positions
`starts[r] ...`. `begin_step` computes, once for all layers: where the new keys go, how many
cached positions attention reads, and the attention mask (causal within the step, and no key
past a row's own end), so sequences of different lengths share one step.

Mamba layers (hybrid models) keep a fixed-size recurrent state per slot instead of keys and
values: `cache.mamba` (`inference.mamba_state.MambaStateCache`, None without Mamba layers).
"""

from __future__ import annotations

import torch
from torch import nn

from gigatron.inference.mamba_state import MambaStateCache, mamba_mixers


def attention_cache_shapes(module: nn.Module) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(groups, key channels), (groups, value channels) of an attention module's cache entries
    (`kv_cache_shapes()` where keys and values differ, as in multi-latent attention); None for
    modules that are not attention."""
    if not hasattr(module, "layer_number"):
        return None
    if hasattr(module, "kv_cache_shapes"):
        return module.kv_cache_shapes()
    if hasattr(module, "linear_qkv"):
        return (module.groups, module.kv_channels), (module.groups, module.kv_channels)
    return None


def cache_bytes(keys: dict, values: dict, mamba: MambaStateCache | None) -> int:
    """Bytes of a cache's key and value buffers and Mamba states."""
    kv = sum(t.numel() * t.element_size() for t in (*keys.values(), *values.values()))
    return kv + (mamba.bytes() if mamba is not None else 0)


class KVCache:
    """Key/value buffers of every attention layer of `model_chunks`, and the states of its Mamba
    layers (see the module docstring)."""

    def __init__(
        self,
        model_chunks: list[nn.Module],
        max_batch_size: int,
        max_sequence_length: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_sequence_length = max_sequence_length
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        for chunk in model_chunks:
            for module in chunk.modules():
                shapes = attention_cache_shapes(module)
                if shapes is None:
                    continue
                weight = next(module.parameters())
                kwargs = {"dtype": dtype or weight.dtype, "device": device or weight.device}
                rows = (max_sequence_length, max_batch_size)
                self.keys[module.layer_number] = torch.zeros((*rows, *shapes[0]), **kwargs)
                self.values[module.layer_number] = torch.zeros((*rows, *shapes[1]), **kwargs)
        mixers = mamba_mixers(model_chunks)
        self.mamba = MambaStateCache(mixers, max_batch_size, device) if mixers else None
        if not self.keys and self.mamba is None:
            raise ValueError("KVCache: the model has no attention or Mamba layers to cache")
        buffers = self.keys or self.mamba.ssm
        self.device = next(iter(buffers.values())).device
        self.attention_mask: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._write_positions: torch.Tensor | None = None
        self._read_length = 0
        self._select: torch.Tensor | None = None

    def bytes(self) -> int:
        """Memory held by the buffers."""
        return cache_bytes(self.keys, self.values, self.mamba)

    def copy_slots(self, sources: list[int]) -> None:
        """Slot i takes what slot `sources[i]` holds (all read before any is written): beam
        search's reordering of its beams."""
        index = torch.tensor(sources, dtype=torch.long, device=self.device)
        count = len(sources)
        for buffers in (self.keys, self.values):
            for buffer in buffers.values():
                buffer[:, :count] = buffer.index_select(1, index)
        if self.mamba is not None:
            self.mamba.copy_slots(sources)

    def begin_step(
        self,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        width: int,
        all_logits: bool = False,
    ) -> None:
        """Prepare a forward step of `width` tokens per row over `slots` (see the module
        docstring). `all_logits`: the model returns logits at every position of the step
        (prompt log-probs), else only at each row's last real token."""
        device = self.device
        if any(s + width > self.max_sequence_length for s in starts):
            raise ValueError("KVCache: a step would write past the cache's sequence length")
        if self.mamba is not None:
            self.mamba.begin_step(slots, starts, lengths)
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device)
        ends_t = starts_t + torch.tensor(lengths, dtype=torch.long, device=device)
        offsets = torch.arange(width, device=device)
        query_positions = starts_t[:, None] + offsets[None, :]  # [b, n]
        self._read_length = int(max(starts)) + width
        keys = torch.arange(self._read_length, device=device)
        masked = (keys[None, None, :] > query_positions[:, :, None]) | (
            keys[None, None, :] >= ends_t[:, None, None]
        )
        self.attention_mask = masked.unsqueeze(1)  # [b, 1, n, read_length], True = masked
        self._write_positions = query_positions.t()  # [n, b]
        self._slots = slots_t
        self._contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        last = ends_t - starts_t - 1
        self._select = None if all_logits else last

    def position_ids(self, starts: list[int], width: int) -> torch.Tensor:
        """[b, n] positions of a step's tokens (pad positions continue the count)."""
        starts_t = torch.tensor(starts, dtype=torch.long, device=self.device)
        return starts_t[:, None] + torch.arange(width, device=self.device)[None, :]

    def attention_mask_for(self, core_attention) -> torch.Tensor:
        """This step's mask for a core attention module: with a sliding window
        (`core_attention.window` = (left, right)), keys before each query's window are masked too."""
        window = getattr(core_attention, "window", None)
        if window is None or window[0] < 0:
            return self.attention_mask
        queries = self._write_positions.t()[:, None, :, None]  # [b, 1, n, 1]
        keys = torch.arange(self._read_length, device=self.device)
        return self.attention_mask | (keys < queries - window[0])

    def update(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's `key`, `value` [n, b, groups, hn] for layer `layer_number`; return
        the keys and values attention reads, [read_length, b, groups, hn]."""
        k_buffer, v_buffer = self.keys[layer_number], self.values[layer_number]
        index = (self._write_positions, self._slots[None, :])
        k_buffer.index_put_(index, key.to(k_buffer.dtype))
        v_buffer.index_put_(index, value.to(v_buffer.dtype))
        if self._contiguous:
            first = int(self._slots[0])
            rows = slice(first, first + self._slots.numel())
            return k_buffer[: self._read_length, rows], v_buffer[: self._read_length, rows]
        return (
            k_buffer[: self._read_length].index_select(1, self._slots),
            v_buffer[: self._read_length].index_select(1, self._slots),
        )

    def select_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states [n, b, h] reduced to those the step wants logits for."""
        if self._select is None:
            return hidden
        rows = torch.arange(hidden.shape[1], device=hidden.device)
        return hidden[self._select, rows].unsqueeze(0)  # [1, b, h]
