"""GPT: embedding -> transformer block -> output layer, split into pipeline chunks.

One `GPTModel` is one model chunk: the first chunk holds the embedding (`pre_process`), the last
the final norm and output layer (`post_process`), and each holds a range of layers named by
their global index. Given labels (training without multi-token prediction) the last chunk returns
the per-token losses, computed over the logits it alone holds; otherwise it returns logits and
the loss is the family's (families/gpt/).
`build_model(cfg, pctx)` returns this rank's chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gigatron.models import mup
from gigatron.models.build import build_model_chunks, layer_parts_for_run
from gigatron.models.embedding import LanguageModelEmbedding
from gigatron.models.language_model import LanguageModelStage
from gigatron.models.logits_buffer import LogitsBuffer
from gigatron.models.mla import MLASelfAttention
from gigatron.models.moe.layer import moe_layer_parts
from gigatron.models.mtp import MultiTokenPredictionBlock
from gigatron.models.transformer import LayerParts, TransformerBlock
from gigatron.models.transformer_config import TransformerConfig
from gigatron.models.yarn import rotary_embedding
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.context_parallel import sequence_positions
from gigatron.parallel.tensor_parallel import vocab_parallel_cross_entropy


class GPTModel(LanguageModelStage):
    """One pipeline chunk of a GPT (see the module docstring and docs/architecture.md)."""

    def __init__(
        self, *stage: Any, parts: LayerParts | None = None, layer_builder=None, **stage_kw: Any
    ) -> None:
        """`stage`, `stage_kw`: `LanguageModelStage`'s arguments."""
        super().__init__(*stage, **stage_kw)
        config, pctx = self.config, self.pctx
        pre_process, post_process = self.pre_process, self.post_process
        self.share_embeddings = not config.untie_embeddings_and_output_weights
        # Multi-token prediction embeds tokens on the last stage too (Megatron's mtp_process):
        # there the chunk holds its own copy of the word embedding.
        mtp = bool(post_process and config.mtp_num_layers)
        if pre_process or mtp:
            self.embedding = LanguageModelEmbedding(config, pctx, self.vocab_size, self.rng)
        self.rotary = rotary_embedding(config)
        self.decoder = TransformerBlock(
            config, pctx, self.layer_numbers, post_process, self.rng, parts, layer_builder
        )
        self.mtp = None
        if mtp:
            self.mtp = MultiTokenPredictionBlock(config, pctx, self.rng, parts or LayerParts())
        if post_process:
            self.add_output_layer(False, self.share_embeddings, pre_process or mtp)
            self.logits_buffer = LogitsBuffer()
        # Copies of the word embedding on the first and last stages: gradients summed over the
        # embedding group (the tied output weight, or the MTP stage's embedding).
        if pctx.pp_size > 1 and (self.share_embeddings or config.mtp_num_layers):
            if pre_process or mtp:
                self.embedding.word_embeddings.weight.shared_embedding = True

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        inference_cache=None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Last stage: logits [batch, seq, vocab/tp] (a transposed view of the [seq, batch, ...]
        result: `.transpose(0, 1)` gives back the contiguous tensor); other stages: hidden
        states [seq(/tp with SP), batch, hidden].

        `inference_cache` (generation, an `inference.KVCache`): keys and values go into the
        cache, attention sees every cached position, and the last stage computes logits only at
        the positions the cache selects (the last real token of each row, or all of them).

        With multi-token prediction (`--mtp-num-layers`, training and evaluation) the last stage
        returns `(logits, [logits of depth 1, ..., depth D])` (models/mtp.py).

        `labels` [batch, seq] (training without multi-token prediction): the last stage returns
        the per-token losses [batch, seq] (float32) instead of the logits, through the fused
        linear cross entropy when it runs (`--cross-entropy-loss-fusion`, models/fused.py)."""
        if self.pre_process:
            hidden = mup.scale(self.embedding(tokens, position_ids), self.config.mup_embedding_mult)
        else:
            hidden = self.stage_input()

        rotary = None
        if self.rotary is not None:
            seq = hidden.shape[0] * (self.pctx.tp_size if self.config.sequence_parallel else 1)
            if position_ids is None:  # this rank's positions (its chunks under cp)
                position_ids = sequence_positions(seq, self.pctx, hidden.device).unsqueeze(0)
            rotary = self.rotary(position_ids)

        if inference_cache is None:
            hidden = self.decoder(hidden, attention_mask, rotary)
        else:
            hidden = self.decoder(hidden, attention_mask, rotary, inference_cache=inference_cache)
        if not self.post_process:
            return hidden
        if inference_cache is not None:
            hidden = inference_cache.select_hidden(hidden)
        hidden = mup.scale(hidden, mup.output_mult(self.config))  # µP: logits * output_mult
        if labels is not None and self.mtp is None and inference_cache is None:
            return self.token_losses(hidden, labels)
        logits = self.output_layer(hidden, self.output_weight())  # [s, b, vocab/tp]
        if self.mtp is None or inference_cache is not None:
            return logits.transpose(0, 1)
        depths = self.mtp(tokens, position_ids, hidden, self.embedding, attention_mask, rotary)
        weight = self.output_weight()
        return logits.transpose(0, 1), [
            self.output_layer(h, weight).transpose(0, 1) for h in depths
        ]

    def _logits_into_buffer(self, hidden: torch.Tensor) -> bool:
        """Whether the output layer's product goes into `logits_buffer` (models/logits_buffer.py):
        on CPU in float32 at tp = 1 (the layer itself keeps bias and fp8 products to itself)."""
        return (
            hidden.device.type == "cpu" and hidden.dtype == torch.float32 and self.pctx.tp_size == 1
        )

    def token_losses(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy [b, s] of the output layer on `hidden` [s, b, h]."""
        fused = self.config.kernels.linear_cross_entropy
        if fused is None:
            product = self.logits_buffer.linear if self._logits_into_buffer(hidden) else None
            logits = self.output_layer(hidden, self.output_weight(), plain_product=product)
            losses = vocab_parallel_cross_entropy(
                logits, labels.t(), self.pctx, overwrite_logits=True
            ).t()
            self.logits_buffer.done(logits)
            return losses
        seq, batch, size = hidden.shape
        losses = fused(hidden.reshape(-1, size), self.output_weight(), labels.t().reshape(-1))
        return losses.view(seq, batch).t()


def build_model(
    cfg, pctx: ParallelContext, vocab_size: int | None = None, parts: LayerParts | None = None
) -> list[GPTModel]:
    """This rank's GPT chunks (one per virtual pipeline stage), initialised from
    cfg.training.seed identically to the tp = 1, pp = 1 model.

    `vocab_size` is the tokenizer's vocabulary (unpadded); see `resolve_vocab_size`.
    """

    mup.check_mup(cfg)
    config = TransformerConfig.from_config(cfg)
    parts = layer_parts_for_run(cfg, pctx, moe_layer_parts(cfg, parts))
    if config.multi_latent_attention and parts.self_attention is None:
        parts = dataclasses.replace(parts, self_attention=MLASelfAttention)

    def make_chunk(padded, pre_process, post_process, layers, rng):
        return GPTModel(config, pctx, padded, pre_process, post_process, layers, rng, parts=parts)

    return build_model_chunks(cfg, pctx, vocab_size, make_chunk)
