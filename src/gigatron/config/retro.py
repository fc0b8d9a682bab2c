"""Retro options (Megatron's `retro` flags, `--retro-*`): the neighbour store `pretrain retro`
reads and the shape of the Retro model (its chunked cross-attention and neighbour encoder).

Only the `retro` family accepts them (families/retro/); the preprocessing command
(`gigatron retro-preprocess`) parses its own flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field
from gigatron.config.rules import Section, positive_problems


@dataclass
class RetroConfig(Section):
    retro_project_dir: Optional[str] = flag_field(
        None,
        "Retro project directory written by `gigatron retro-preprocess` (its neighbour files for each split)",
    )
    retro_gpt_chunk_length: int = flag_field(
        64, "tokens per chunk: each chunk attends to the neighbours retrieved for the one before"
    )
    retro_encoder_layers: int = flag_field(2, "layers of the neighbour encoder")
    retro_encoder_hidden_dropout: float = flag_field(0.1, "hidden dropout of the neighbour encoder")
    retro_encoder_attention_dropout: float = flag_field(
        0.1, "attention dropout of the neighbour encoder's self-attention"
    )
    retro_num_neighbors: int = flag_field(2, "neighbours retrieved for each chunk")
    retro_num_retrieved_chunks: int = flag_field(
        2, "chunks retrieved per neighbour: the neighbour and its continuation"
    )
    retro_attention_gate: float = flag_field(
        1.0,
        "scale of the chunked cross-attention's output (0 closes it: the decoder is then the "
        "GPT it was retro-fitted from)",
    )

    def problems(self) -> list[str]:
        return positive_problems(
            [
                (self.retro_gpt_chunk_length, "--retro-gpt-chunk-length"),
                (self.retro_encoder_layers, "--retro-encoder-layers"),
                (self.retro_num_neighbors, "--retro-num-neighbors"),
                (self.retro_num_retrieved_chunks, "--retro-num-retrieved-chunks"),
            ]
        )
