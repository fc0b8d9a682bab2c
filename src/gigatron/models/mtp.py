"""Multi-token prediction (DeepSeek-V3; Megatron-Core's MultiTokenPredictionBlock): after the
decoder, `--mtp-num-layers` D more layers, layer k predicting the token k + 1 positions ahead.

Layer k takes the previous depth's hidden states h (the decoder's output after its final norm
for k = 1) and the embeddings of the input tokens shifted k positions left (the vacated end
positions hold token 0), and computes

    h_k = final_layernorm(layer(eh_proj([enorm(embed(tokens << k)); hnorm(h)])))

with `layer` a transformer layer like the decoder's last one (its MoE or dense MLP); the shared
output layer turns each h_k into logits. The GPT family's loss (families/gpt/) compares depth
k's logits with the labels shifted k positions left (the loss mask shifted likewise), adds
`--mtp-loss-scaling-factor` / D x the sum of the depths' mean losses to the main loss and reports
`mtp_loss`. Names are Megatron's: `mtp.layers.{k-1}.enorm`, `.hnorm`, `.eh_proj`,
`.mtp_model_layer.*`, `.final_layernorm`. Generation does not run these layers.
"""

from __future__ import annotations

import torch
from torch import nn

from gigatron.models.transformer import LayerParts, TransformerLayer
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.collectives import scatter_to_sequence_parallel_region
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import ColumnParallelLinear


def shift_left(x: torch.Tensor, steps: int) -> torch.Tensor:
    """x [b, s, ...] moved `steps` positions left along dim 1; the last `steps` positions are 0."""
    out = torch.zeros_like(x)
    if steps < x.shape[1]:
        out[:, : x.shape[1] - steps] = x[:, steps:]
    return out


class MultiTokenPredictionLayer(nn.Module):
    """One depth: `forward(hidden, embedded, attention_mask, rotary) -> hidden` (see the module
    docstring); tensors in the block's layout [s(/tp), b, h]."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        depth: int,
        rng: ModelParallelRNG,
        parts: LayerParts,
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.sequence_parallel = config.sequence_parallel
        self.enorm = parts.norm(config, pctx)
        self.hnorm = parts.norm(config, pctx)
        self.eh_proj = ColumnParallelLinear(
            2 * config.hidden_size,
            config.hidden_size,
            pctx,
            bias=False,
            gather_output=True,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            dtype=config.params_dtype,
        )
        # Numbered after the decoder's layers (MoE routers and reports tell them apart).
        self.mtp_model_layer = TransformerLayer(config, pctx, config.num_layers + depth, rng, parts)
        self.final_layernorm = parts.norm(config, pctx)

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:  # eh_proj gathered the sequence: keep this rank's slice
            x = scatter_to_sequence_parallel_region(x, self.pctx)
        x = self.mtp_model_layer(x, attention_mask, rotary)
        return self.final_layernorm(x)


class MultiTokenPredictionBlock(nn.Module):
    """The D layers; `forward(tokens, position_ids, hidden, embedding, attention_mask, rotary)`
    returns each depth's hidden states [s(/tp), b, h]."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        rng: ModelParallelRNG,
        parts: LayerParts,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MultiTokenPredictionLayer(config, pctx, depth, rng, parts)
            for depth in range(1, config.mtp_num_layers + 1)
        )

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        hidden: torch.Tensor,
        embedding: nn.Module,
        attention_mask: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> list[torch.Tensor]:
        outputs = []
        for depth, layer in enumerate(self.layers, start=1):
            shifted = shift_left(tokens, depth)
            positions = None if position_ids is None else shift_left(position_ids, depth)
            hidden = layer(hidden, embedding(shifted, positions), attention_mask, rotary)
            outputs.append(hidden)
        return outputs
