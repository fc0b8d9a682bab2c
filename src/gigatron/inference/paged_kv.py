"""A paged key/value cache: fixed-size blocks from one pool, a block table per request.

Each attention layer of this rank holds one pool of `num_blocks x block_size` positions for keys
and one for values ([positions, groups, channels]; multi-latent attention: its compressed
latent and rotary key, one entry per position). Which blocks a request owns is the engine's
business (`inference.block_pool.BlockPool`, rank 0); every step brings each row's block table,
and position p of a row lives at `table[p // block_size] * block_size + p % block_size`.
Block 0 is scratch: padding writes there, and table entries 0 (blocks freed out of a sliding
window) read from there under the mask.

A step is laid out in one of two ways (the same interface as `inference.kv_cache.KVCache`, so
the model does not know which cache it has):
- packed (attention-only models): the step's tokens of every request one after another in a
  single row ([1, total tokens]); each layer reads the requests' cached keys one after another
  and a block-diagonal causal mask keeps requests apart. No padding: a step mixing a prefill
  chunk with decode tokens costs only its real tokens.
- padded (models with Mamba layers, whose recurrent state needs one row per request; and steps
  that return logits at every position): rows right-padded to the step's width.

Mamba layers keep their per-request states beside the blocks (`cache.mamba`, one state per
request slot, as in the static cache).
"""

from __future__ import annotations

import torch
from torch import nn

from gigatron.inference.kv_cache import attention_cache_shapes, cache_bytes
from gigatron.inference.mamba_state import MambaStateCache, mamba_mixers


def _attention_layers(model_chunks: list[nn.Module]) -> dict[int, tuple[nn.Module, tuple]]:
    """Layer number -> (attention module, (key entry shape, value entry shape)); a latent
    attention stores one entry per position (its `latent_cache_shape()`) and no value."""
    layers = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            shapes = attention_cache_shapes(module)
            if shapes is not None and hasattr(module, "latent_cache_shape"):
                shapes = (module.latent_cache_shape(), (0,))
            if shapes is not None:
                layers[module.layer_number] = (module, shapes)
    return layers


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def kv_bytes_per_block(model_chunks: list[nn.Module], block_size: int, dtype=None) -> int:
    """Bytes one block takes over every attention layer of this rank's chunks."""
    total = 0
    for module, (key, value) in _attention_layers(model_chunks).values():
        size = torch.empty((), dtype=dtype or next(module.parameters()).dtype).element_size()
        total += (_numel(key) + _numel(value)) * size * block_size
    return total


def shared_window(model_chunks: list[nn.Module]) -> int | None:
    """The left sliding window every attention layer of the chunks has (the smallest), or None
    when some layer sees the whole past (then no block may be freed early)."""
    windows = []
    for module, _ in _attention_layers(model_chunks).values():
        window = getattr(getattr(module, "core_attention", None), "window", None)
        if window is None or window[0] < 0:
            return None
        windows.append(window[0])
    return min(windows) if windows else None


class PagedKVCache:
    """Block pools of every attention layer of `model_chunks` and the Mamba layers' states of
    `max_requests` request slots (see the module docstring)."""

    def __init__(
        self,
        model_chunks: list[nn.Module],
        max_requests: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_batch_size = max_requests
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        for number, (module, (key, value)) in _attention_layers(model_chunks).items():
            weight = next(module.parameters())
            kwargs = {"dtype": dtype or weight.dtype, "device": device or weight.device}
            self.keys[number] = torch.zeros((num_blocks * block_size, *key), **kwargs)
            self.values[number] = torch.zeros((num_blocks * block_size, *value), **kwargs)
        mixers = mamba_mixers(model_chunks)
        self.mamba = MambaStateCache(mixers, max_requests, device) if mixers else None
        if not self.keys and self.mamba is None:
            raise ValueError("PagedKVCache: the model has no attention or Mamba layers to cache")
        self.window = shared_window(model_chunks)
        buffers = self.keys or self.mamba.ssm
        self.device = next(iter(buffers.values())).device
        self.packs = self.mamba is None  # a recurrent state needs one row per request
        self.stores_latents = True  # multi-latent attention: latents, not keys and values
        self.attention_mask: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def bytes(self) -> int:
        """Memory held by the block pools and the Mamba states."""
        return cache_bytes(self.keys, self.values, self.mamba)

    def begin_step(
        self,
        slots: list[int],
        starts: list[int],
        tokens: list[list[int]],
        block_tables: list[list[int]],
        packed: bool,
        all_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lay out a step: row r feeds `tokens[r]` at positions `starts[r]...` of the request in
        slot `slots[r]`, whose positions live in `block_tables[r]`. Returns the model's inputs
        (tokens, position ids), [rows, width] padded or [1, total] packed."""
        if packed and (not self.packs or all_logits):
            raise ValueError("PagedKVCache: this step cannot be packed")
        lengths = [len(t) for t in tokens]
        if self.mamba is not None:
            self.mamba.begin_step(slots, starts, lengths)
        device, bs = self.device, self.block_size
        rows, width = len(tokens), max(lengths)
        lengths_t = torch.tensor(lengths, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        ends_t = starts_t + lengths_t
        widest = max(len(t) for t in block_tables)
        tables = torch.zeros(rows, max(widest, 1), dtype=torch.long)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)

        def flat(positions: torch.Tensor) -> torch.Tensor:
            blocks = (positions // bs).clamp(max=tables.shape[1] - 1)
            return tables.gather(1, blocks) * bs + positions % bs

        offsets = torch.arange(width)[None, :]
        q_real = offsets < lengths_t[:, None]
        q_pos = starts_t[:, None] + offsets  # [rows, width]
        k_pos = torch.arange(int(ends_t.max()))[None, :].expand(rows, -1)
        k_real = k_pos < ends_t[:, None]
        row_ids = torch.arange(rows)[:, None]
        ids = torch.zeros(rows, width, dtype=torch.long)
        for row, row_tokens in enumerate(tokens):
            ids[row, : len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
        write = torch.where(q_real, flat(q_pos), 0)
        read = torch.where(k_real, flat(k_pos), 0)
        if packed:
            q_seg, k_seg = row_ids.expand_as(q_pos)[q_real], row_ids.expand_as(k_pos)[k_real]
            ids, q_pos, write = ids[q_real][None], q_pos[q_real][None], write[q_real][None]
            read, k_pos = read[k_real][None], k_pos[k_real][None]
            q_seg, k_seg = q_seg[None], k_seg[None]
            last = torch.cumsum(lengths_t, 0) - 1
            self._select = (last, torch.zeros_like(last))
        else:
            q_seg = row_ids.expand_as(q_pos)
            k_seg = torch.where(k_real, row_ids, -1)
            self._select = None if all_logits else (lengths_t - 1, torch.arange(rows))
        self._write = write.t().contiguous().to(device)  # [n, b]
        self._read = read.t().contiguous().to(device)  # [r, b]
        self._q_pos, self._k_pos = q_pos.to(device), k_pos.to(device)
        masked = (k_seg[:, None, :] != q_seg[:, :, None]) | (k_pos[:, None, :] > q_pos[:, :, None])
        self.attention_mask = masked.unsqueeze(1).to(device)  # [b, 1, n, r], True = masked
        self._masks = {}
        if self._select is not None:
            self._select = tuple(t.to(device) for t in self._select)
        return ids.to(device), q_pos.to(device)

    def attention_mask_for(self, core_attention) -> torch.Tensor:
        """This step's mask for a core attention module, with its sliding window if it has one."""
        window = getattr(core_attention, "window", None)
        if window is None or window[0] < 0:
            return self.attention_mask
        left = window[0]
        if left not in self._masks:
            outside = self._k_pos[:, None, :] < self._q_pos[:, :, None] - left
            self._masks[left] = self.attention_mask | outside.unsqueeze(1)
        return self._masks[left]

    def update(
        self, layer_number: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's `key`, `value` [n, b, ...] for layer `layer_number` in their
        blocks; return the keys and values attention reads, [r, b, ...]."""
        k_pool, v_pool = self.keys[layer_number], self.values[layer_number]
        k_pool.index_put_((self._write,), key.to(k_pool.dtype))
        v_pool.index_put_((self._write,), value.to(v_pool.dtype))
        return k_pool[self._read], v_pool[self._read]

    def update_latent(self, layer_number: int, entry: torch.Tensor) -> torch.Tensor:
        """Store this step's latent entries [n, b, c] of a multi-latent attention layer; return
        every position's entry the step reads, [r, b, c]."""
        pool = self.keys[layer_number]
        pool[:, 0].index_put_((self._write,), entry.to(pool.dtype))
        return pool[self._read][:, :, 0]

    def select_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final hidden states [n, b, h] reduced to one per request, [1, requests, h] (all
        of them for a step that wants every position's logits)."""
        if self._select is None:
            return hidden
        positions, rows = self._select
        return hidden[positions, rows].unsqueeze(0)
