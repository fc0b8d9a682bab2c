"""Input embeddings shared by the families (word, learned position, token type) and the padded
vocabulary size (computed here, once)."""

from __future__ import annotations

import torch
from torch import nn

from gigatron.errors import GigatronError
from gigatron.models.dropout import dropout
from gigatron.models.transformer import Norm
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.collectives import scatter_to_sequence_parallel_region
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    VocabParallelEmbedding,
    padded_vocab_size,
    set_tensor_parallel_attributes,
)


def resolve_vocab_size(cfg, tp_size: int, vocab_size: int | None = None) -> int:
    """The padded vocabulary: --padded-vocab-size if given, else the tokenizer's size (argument
    or --vocab-size) padded to a multiple of --make-vocab-size-divisible-by x tp."""
    m = cfg.model
    size = vocab_size if vocab_size is not None else cfg.tokenizer.vocab_size
    if m.padded_vocab_size is not None:
        if m.padded_vocab_size % tp_size:
            raise GigatronError(
                f"--padded-vocab-size {m.padded_vocab_size} is not divisible by the "
                f"tensor-parallel size {tp_size}; pick a multiple of it"
            )
        if size is not None and m.padded_vocab_size < size:
            raise GigatronError(
                f"--padded-vocab-size {m.padded_vocab_size} is smaller than the "
                f"tokenizer's {size} tokens; raise it or leave it out"
            )
        return m.padded_vocab_size
    if size is None:
        raise GigatronError(
            "the vocabulary size is unknown: pass the tokenizer's vocab_size to build_model, "
            "or give --vocab-size or --padded-vocab-size"
        )
    return padded_vocab_size(size, m.make_vocab_size_divisible_by, tp_size)


def _replicated_embedding(rows: int, config: TransformerConfig, pctx: ParallelContext):
    table = nn.Embedding(rows, config.hidden_size, dtype=config.params_dtype, device=pctx.device)
    set_tensor_parallel_attributes(
        table.weight, False, init="normal", init_std=config.init_method_std
    )
    return table


class LanguageModelEmbedding(nn.Module):
    """Word (+ learned position) (+ token type) embeddings -> [seq(/tp with SP), batch, hidden],
    then (with `norm`, BERT's post-norm layout) a norm, then dropout."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        vocab_size: int,
        rng: ModelParallelRNG,
        num_tokentypes: int = 0,
        norm: bool = False,
    ) -> None:
        super().__init__()
        self.pctx = pctx
        self.sequence_parallel = config.sequence_parallel
        self.dropout = config.hidden_dropout
        self.rng = rng
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            pctx,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            dtype=config.params_dtype,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            if not config.max_position_embeddings:
                raise GigatronError(
                    "--max-position-embeddings (or --seq-length) is needed for learned absolute "
                    "position embeddings"
                )
            self.position_embeddings = _replicated_embedding(
                config.max_position_embeddings, config, pctx
            )
        self.tokentype_embeddings = (
            _replicated_embedding(num_tokentypes, config, pctx) if num_tokentypes else None
        )
        self.embedding_norm = Norm(config, pctx) if norm else None

    def _replicated(self, table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        rows = table(ids.t())
        if self.sequence_parallel:
            # Replicated table: each rank adds the rows of its own slice of the sequence.
            rows = scatter_to_sequence_parallel_region(rows, self.pctx)
        return rows

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Look up in [seq, batch] order so the result is already in the block's layout.
        x = self.word_embeddings(tokens.t())
        if self.position_embeddings is not None:
            if position_ids is None:
                raise GigatronError("learned absolute position embeddings need position_ids")
            x = x + self._replicated(self.position_embeddings, position_ids)
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise GigatronError("this model has token-type embeddings: pass tokentype_ids")
            x = x + self._replicated(self.tokentype_embeddings, tokentype_ids)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        if self.sequence_parallel:
            with self.rng.fork():
                return dropout(x, self.dropout, self.training)
        return dropout(x, self.dropout, self.training)
