"""Weight map between gigatron BERT state dicts (full tensors, as at tp = 1, post-norm layout)
and Hugging Face `BertForPreTraining` state dicts, both directions.

Besides renaming: q, k, v are fused per head (BERT has no grouped-query attention, so each head
is its own group: [q_h; k_h; v_h]); the word embedding and the output bias are padded to the
padded vocabulary on import and cut back on export; the decoder weight is the tied embedding.
"""

from __future__ import annotations

from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import fuse_qkv, pad_rows, sizes_from_hf, split_qkv

StateDict = dict[str, torch.Tensor]

# gigatron name (per layer, after "encoder.layers.{i}.") -> Hugging Face name (after
# "bert.encoder.layer.{i}.")
_LAYER_NAMES = {
    "self_attention.linear_proj.weight": "attention.output.dense.weight",
    "self_attention.linear_proj.bias": "attention.output.dense.bias",
    "post_attention_layernorm.weight": "attention.output.LayerNorm.weight",
    "post_attention_layernorm.bias": "attention.output.LayerNorm.bias",
    "mlp.linear_fc1.weight": "intermediate.dense.weight",
    "mlp.linear_fc1.bias": "intermediate.dense.bias",
    "mlp.linear_fc2.weight": "output.dense.weight",
    "mlp.linear_fc2.bias": "output.dense.bias",
    "post_mlp_layernorm.weight": "output.LayerNorm.weight",
    "post_mlp_layernorm.bias": "output.LayerNorm.bias",
}
_OTHER_NAMES = {
    "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "embedding.embedding_norm.weight": "bert.embeddings.LayerNorm.weight",
    "embedding.embedding_norm.bias": "bert.embeddings.LayerNorm.bias",
    "lm_head.dense.weight": "cls.predictions.transform.dense.weight",
    "lm_head.dense.bias": "cls.predictions.transform.dense.bias",
    "lm_head.layer_norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "lm_head.layer_norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "pooler.weight": "bert.pooler.dense.weight",
    "pooler.bias": "bert.pooler.dense.bias",
    "binary_head.weight": "cls.seq_relationship.weight",
    "binary_head.bias": "cls.seq_relationship.bias",
}
_QKV = ("query", "key", "value")


class BertHFAdapter:
    """The BERT family's Hugging Face adapter (`BertForPreTraining`)."""

    hf_class_name = "BertForPreTraining"
    model_types = ("bert",)
    auto_class = "AutoModelForPreTraining"

    def config_from_hf(self, hf_config: Any) -> dict[str, Any]:
        """gigatron ModelConfig values (plus `vocab_size`) for a Hugging Face BertConfig."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        return {
            **sizes_from_hf(c),
            "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm",
            "layernorm_epsilon": c.get("layer_norm_eps", 1e-12),
            "openai_gelu": c.get("hidden_act", "gelu") in ("gelu_new", "gelu_pytorch_tanh"),
            "post_layernorm": True,
            "vocab_size": c["vocab_size"],
        }

    def config_to_hf(self, cfg: Any, vocab_size: int) -> dict[str, Any]:
        """A `config.json` (BertForPreTraining) for a gigatron BERT with the original layout."""
        m = cfg.model
        if not m.post_layernorm or not m.bert_binary_head:
            raise GigatronError(
                "BertForPreTraining has the original post-norm layout and the sentence-order "
                "head: export a --post-layernorm BERT without --bert-no-binary-head"
            )
        return {
            "model_type": "bert",
            "architectures": ["BertForPreTraining"],
            "vocab_size": vocab_size,
            "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "intermediate_size": m.ffn_hidden_size,
            "max_position_embeddings": m.max_position_embeddings,
            "layer_norm_eps": m.layernorm_epsilon,
            "hidden_act": "gelu_new" if m.openai_gelu else "gelu",
            "type_vocab_size": 2,
        }

    def from_hf(self, hf: StateDict, num_layers: int, num_heads: int, padded_vocab: int):
        """BertForPreTraining state dict -> gigatron BERT state dict."""
        sd: StateDict = {
            "embedding.word_embeddings.weight": pad_rows(
                hf["bert.embeddings.word_embeddings.weight"], padded_vocab
            ),
            "output_layer.bias": pad_rows(hf["cls.predictions.bias"], padded_vocab),
        }
        for ours, theirs in _OTHER_NAMES.items():
            if theirs in hf:
                sd[ours] = hf[theirs]
        for i in range(num_layers):
            src, dst = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
            for kind in ("weight", "bias"):
                q, k, v = (hf[f"{src}attention.self.{n}.{kind}"] for n in _QKV)
                sd[f"{dst}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, num_heads)
            for ours, theirs in _LAYER_NAMES.items():
                sd[dst + ours] = hf[src + theirs]
        return sd

    def to_hf(self, sd: StateDict, num_layers: int, num_heads: int, vocab_size: int):
        """gigatron BERT state dict (post-norm layout) -> BertForPreTraining state dict."""
        word = sd["embedding.word_embeddings.weight"][:vocab_size]
        hf: StateDict = {
            "bert.embeddings.word_embeddings.weight": word,
            "cls.predictions.decoder.weight": word,
            "cls.predictions.bias": sd["output_layer.bias"][:vocab_size],
        }
        for ours, theirs in _OTHER_NAMES.items():
            if ours in sd:
                hf[theirs] = sd[ours]
        hidden = word.shape[1]
        for i in range(num_layers):
            src, dst = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
            for kind in ("weight", "bias"):
                parts = split_qkv(
                    sd[f"{src}self_attention.linear_qkv.{kind}"],
                    num_heads,
                    num_heads,
                    hidden // num_heads,
                )
                for name, tensor in zip(_QKV, parts):
                    hf[f"{dst}attention.self.{name}.{kind}"] = tensor
            for ours, theirs in _LAYER_NAMES.items():
                hf[dst + theirs] = sd[src + ours]
        return hf
