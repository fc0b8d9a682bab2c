"""The recurrent state of every Mamba layer of this rank, per cache slot, for generation.

A Mamba mixer needs no keys and values: everything it knows about the tokens before a step is
its convolution window (the last `width - 1` inputs of the short convolution, [slot, w - 1,
channels]) and its scan state ([slot, heads, head_dim, state_dim], float32). Both are fixed-size,
whatever the sequence length, and are allocated once.

A state cannot be rewound, so a slot's steps must follow each other: a step starting at position
0 begins a new sequence (the slot's state is zeroed), any other step must start where the slot's
last step ended. Rows are right-padded to the step's width; padded positions leave the state as
it is (the mixer gives them a zero step size and keeps the window of the real tokens).
"""

from __future__ import annotations

import torch
from torch import nn


def mamba_mixers(model_chunks: list[nn.Module]) -> dict[int, nn.Module]:
    """Layer number -> the mixer of each Mamba layer in `model_chunks`."""
    mixers = {}
    for chunk in model_chunks:
        for module in chunk.modules():
            mixer = getattr(module, "mixer", None)
            if mixer is not None and hasattr(mixer, "conv_channels"):
                mixers[module.layer_number] = mixer
    return mixers


class MambaStateCache:
    """Convolution windows and scan states of every Mamba layer, `max_batch_size` slots each."""

    def __init__(
        self,
        mixers: dict[int, nn.Module],
        max_batch_size: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        for number, mixer in mixers.items():
            weight = mixer.in_proj.weight
            where = device or weight.device
            window = mixer.conv1d.weight.shape[-1] - 1
            self.conv[number] = torch.zeros(
                max_batch_size, window, mixer.conv_channels, dtype=weight.dtype, device=where
            )
            self.ssm[number] = torch.zeros(
                max_batch_size,
                mixer.heads,
                mixer.head_dim,
                mixer.state_dim,
                dtype=torch.float32,
                device=where,
            )
        self.fed = [0] * max_batch_size  # tokens each slot's state has seen
        self.lengths: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._fresh: torch.Tensor | None = None

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.conv.values(), *self.ssm.values()))

    def copy_slots(self, sources: list[int]) -> None:
        """Slot i takes the states of slot `sources[i]` (beam search)."""
        device = next(iter(self.ssm.values())).device
        index = torch.tensor(sources, dtype=torch.long, device=device)
        for states in (self.conv, self.ssm):
            for state in states.values():
                state[: len(sources)] = state.index_select(0, index)
        self.fed[: len(sources)] = [self.fed[s] for s in sources]

    def begin_step(self, slots: list[int], starts: list[int], lengths: list[int]) -> None:
        """Record a step's rows (see the module docstring for the order steps must come in)."""
        for slot, start in zip(slots, starts):
            if start not in (0, self.fed[slot]):
                raise ValueError(
                    f"Mamba state of slot {slot}: a step starts at position {start} but the "
                    f"state holds {self.fed[slot]} tokens; a recurrent state cannot be rewound"
                )
        for slot, start, length in zip(slots, starts, lengths):
            self.fed[slot] = start + length
        device = next(iter(self.ssm.values())).device
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        self._fresh = torch.tensor([s == 0 for s in starts], device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)

    def read(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows of layer `layer_number`: (window [b, w - 1, c], state [b, h, p, n]),
        zero for rows that start a new sequence."""
        keep = ~self._fresh
        conv = self.conv[layer_number].index_select(0, self._slots)
        ssm = self.ssm[layer_number].index_select(0, self._slots)
        return conv * keep.view(-1, 1, 1).to(conv.dtype), ssm * keep.view(-1, 1, 1, 1)

    def write(self, layer_number: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store the rows' window and state after the step."""
        self.conv[layer_number].index_copy_(0, self._slots, conv.to(self.conv[layer_number].dtype))
        self.ssm[layer_number].index_copy_(0, self._slots, ssm.float())
