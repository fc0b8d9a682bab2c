"""BERT: embeddings (word, position, token type) -> bidirectional encoder -> masked-LM head and,
optionally, the pooler and the binary sentence-order head; split into pipeline chunks.

The encoder is the shared `TransformerBlock` with `causal_attention=False`; the layer layout is
pre-norm (Megatron's default) or, with `--post-layernorm`, BERT's original post-norm layout
(norms after each residual addition and on the embeddings), which Hugging Face BERT weights need.
The model returns logits; the losses are the family's (families/bert/).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.models import mup
from gigatron.models.build import build_model_chunks, layer_parts_for_run
from gigatron.models.embedding import LanguageModelEmbedding
from gigatron.models.language_model import LanguageModelStage
from gigatron.models.transformer import LayerParts, Norm, TransformerBlock
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.collectives import gather_from_sequence_parallel_region
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import set_tensor_parallel_attributes

NUM_TOKENTYPES = 2


def replicated_linear(
    in_features: int,
    out_features: int,
    config: TransformerConfig,
    pctx: ParallelContext,
    sees_sequence_slice: bool = False,
) -> nn.Linear:
    """A linear layer held whole on every tensor-parallel rank. `sees_sequence_slice`: under
    sequence parallelism it sees only this rank's tokens, so its gradients are partial sums."""
    layer = nn.Linear(in_features, out_features, dtype=config.params_dtype, device=pctx.device)
    set_tensor_parallel_attributes(
        layer.weight, False, init="normal", init_std=config.init_method_std
    )
    set_tensor_parallel_attributes(layer.bias, False, init="zeros")
    for param in layer.parameters():
        param.sequence_parallel = sees_sequence_slice and config.sequence_parallel
    return layer


class BertLMHead(nn.Module):
    """dense -> GeLU -> norm, before the (tied) output layer."""

    def __init__(self, config: TransformerConfig, pctx: ParallelContext) -> None:
        super().__init__()
        self.dense = replicated_linear(
            config.hidden_size, config.hidden_size, config, pctx, sees_sequence_slice=True
        )
        self.layer_norm = Norm(config, pctx)
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(hidden), approximate=self.gelu_approximate))


class BertModel(LanguageModelStage):
    """One pipeline chunk of a BERT (see the module docstring and docs/architecture.md)."""

    def __init__(
        self, *stage: Any, parts: LayerParts | None = None, add_binary_head: bool = True, **stage_kw
    ) -> None:
        """`stage`, `stage_kw`: `LanguageModelStage`'s arguments."""
        super().__init__(*stage, **stage_kw)
        config, pctx = self.config, self.pctx
        pre_process, post_process = self.pre_process, self.post_process
        parts = parts or LayerParts()
        self.add_binary_head = add_binary_head

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, pctx, self.vocab_size, self.rng, NUM_TOKENTYPES, norm=parts.post_norm
            )
        self.encoder = TransformerBlock(
            config, pctx, self.layer_numbers, post_process and not parts.post_norm, self.rng, parts
        )
        if post_process:
            self.lm_head = BertLMHead(config, pctx)
            # BERT always ties the output layer to the word embedding; the bias is its own.
            self.add_output_layer(True, True, pre_process)
            if add_binary_head:
                self.pooler = replicated_linear(
                    config.hidden_size, config.hidden_size, config, pctx
                )
                self.binary_head = replicated_linear(
                    config.hidden_size, NUM_TOKENTYPES, config, pctx
                )
        if pre_process and pctx.pp_size > 1:
            self.embedding.word_embeddings.weight.shared_embedding = True

    def forward(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ):
        """`attention_mask`: bool, True = masked, `[b, 1, 1, s]` (padded keys) or `[b, 1, s, s]`.
        Last stage: (masked-LM logits [b, s, vocab/tp] (a transposed view), sentence-order
        logits [b, 2] or None); other stages: hidden states [s(/tp with SP), b, h]."""
        hidden = self.encode(tokens, position_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return hidden
        logits = self.output_layer(self.lm_head(hidden), self.output_weight())
        binary_logits = None
        if self.add_binary_head:
            pooled = torch.tanh(self.pooler(self.first_token(hidden)))
            binary_logits = self.binary_head(pooled)
        return logits.transpose(0, 1), binary_logits

    def encode(
        self,
        tokens: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The encoder's output [s(/tp with SP), b, h] (after the final norm on the last
        stage); the heads read it (fine-tuning heads too, tasks/heads.py)."""
        if self.pre_process:
            hidden = self.embedding(tokens, position_ids, tokentype_ids)
        else:
            hidden = self.stage_input()
        return self.encoder(hidden, attention_mask)

    def first_token(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, h]: the first ([CLS]) position of `encode`'s output. Under sequence parallelism it
        lives on tp rank 0, so the sequence is gathered (every rank then computes the same)."""
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.pctx, reduce_grads=False)
        return hidden[0]


def build_bert_model(
    cfg, pctx: ParallelContext, vocab_size: int | None = None, parts: LayerParts | None = None
) -> list[BertModel]:
    """This rank's BERT chunks, initialised identically to the one-process model."""
    mup.check_mup(cfg, "BERT")
    config = TransformerConfig.from_config(cfg, causal_attention=False)
    if parts is None:
        parts = LayerParts(post_norm=cfg.model.post_layernorm)
    parts = layer_parts_for_run(cfg, pctx, parts)

    def make_chunk(padded, pre_process, post_process, layers, rng):
        return BertModel(
            config, pctx, padded, pre_process, post_process, layers, rng, parts=parts,
            add_binary_head=cfg.model.bert_binary_head,
        )  # fmt: skip

    return build_model_chunks(cfg, pctx, vocab_size, make_chunk)
