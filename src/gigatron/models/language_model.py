"""`LanguageModelStage`: what the families' pipeline chunks (GPT and its hybrid and Mamba
stacks, BERT, T5) share: the `PipelineStage` contract, the chunk's place in the pipeline, and
the output layer tied to the word embedding.

A tied output layer is a `ColumnParallelLinear` without a weight of its own on a chunk that
holds the word embedding (`output_weight()` is then the embedding's); on a last stage without
the embedding it keeps a copy drawn like the embedding (`init_name`), whose gradient
`finalize_model_grads` sums with the first stage's (`shared_embedding`).
"""

from __future__ import annotations

import torch

from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import ColumnParallelLinear

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class LanguageModelStage(PipelineStage):
    """One pipeline chunk of a language model: `pre_process` (it embeds the tokens),
    `post_process` (it ends the model: final norm and output layer), `vocab_size` (padded),
    `layer_numbers` (the global numbers of its layers; default all)."""

    def __init__(
        self,
        config: TransformerConfig,
        pctx: ParallelContext,
        vocab_size: int,
        pre_process: bool,
        post_process: bool,
        layer_numbers: range | None,
        rng: ModelParallelRNG | None,
    ) -> None:
        super().__init__()
        self.config = config
        self.pctx = pctx
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_numbers = range(config.num_layers) if layer_numbers is None else layer_numbers
        self.rng = rng or ModelParallelRNG.for_rank(config.seed, pctx)

    def add_output_layer(self, bias: bool, tied: bool, holds_embedding: bool) -> None:
        """`output_layer` [hidden -> vocab/tp]; `tied`: its weight is the word embedding's
        (`holds_embedding`: this chunk has the embedding, else it keeps a shared copy)."""
        config = self.config
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            self.vocab_size,
            self.pctx,
            bias=bias,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            skip_weight=tied and holds_embedding,
            dtype=config.params_dtype,
        )
        if tied and not holds_embedding:
            # Drawn from the same generator as the word embedding, so both copies start equal
            # without any communication.
            self.output_layer.weight.init_name = WORD_EMBEDDING
            self.output_layer.weight.shared_embedding = True

    def output_weight(self) -> torch.Tensor:
        """The output layer's weight: its own, or the word embedding it is tied to."""
        if self.output_layer.weight is not None:
            return self.output_layer.weight
        return self.embedding.word_embeddings.weight
