"""Fine-tuning heads on a BERT encoder (Megatron's classification and multiple-choice models):
the pooled [CLS] output (tanh of the pooler, loaded from the pretrained checkpoint when it has
one), dropout, then a linear layer: to the classes, or to one score per choice (the scores of a
question's choices are compared by a softmax in the loss)."""

from __future__ import annotations

import torch
from torch import nn

from gigatron.models.bert import BertModel, replicated_linear
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.parallel.tensor_parallel import initialize_parameters


class BertClassifier(PipelineStage):
    """`forward(tokens, position_ids, attention_mask, tokentype_ids) -> [b, outputs]` logits,
    `outputs` = the classes, or 1 (a choice's score) for multiple choice. Parameter names:
    `bert.*` (the pretrained chunk), `pooler.*` when the checkpoint had none, and Megatron's
    `classification_head.*` / `multichoice_head.*`. One chunk (no pipeline parallelism)."""

    def __init__(self, bert: BertModel, num_outputs: int, dropout: float, seed: int) -> None:
        super().__init__()
        config, pctx = bert.config, bert.pctx
        self.bert = bert
        self.config, self.rng = config, bert.rng
        self.vocab_size, self.layer_numbers = bert.vocab_size, bert.layer_numbers
        self.pre_process = self.post_process = True
        self.multiple_choice = num_outputs == 1
        new = nn.Module()
        if not hasattr(bert, "pooler"):
            self.pooler = replicated_linear(config.hidden_size, config.hidden_size, config, pctx)
            new.pooler = self.pooler
        self.head_dropout = nn.Dropout(dropout)
        head = replicated_linear(config.hidden_size, num_outputs, config, pctx)
        if self.multiple_choice:
            self.multichoice_head = head
        else:
            self.classification_head = head
        new.head = head
        # Only the new layers: the pretrained weights stay as loaded.
        initialize_parameters(new, seed, pctx.tp_rank, pctx.tp_size)

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        pooler = self.bert.pooler if hasattr(self.bert, "pooler") else self.pooler
        return torch.tanh(pooler(self.bert.first_token(hidden)))

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.bert.encode(tokens, position_ids, attention_mask, tokentype_ids)
        head = self.multichoice_head if self.multiple_choice else self.classification_head
        return head(self.head_dropout(self.pooled(hidden)))

    def set_input_tensor(self, input_tensor) -> None:
        self.bert.set_input_tensor(input_tensor)
