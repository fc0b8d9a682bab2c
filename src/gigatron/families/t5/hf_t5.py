"""Weight map between gigatron T5 state dicts (full tensors, as at tp = 1, the Hugging Face
variant: relative positions, RMSNorm, no biases, gated GeLU) and Hugging Face
`T5ForConditionalGeneration` state dicts, both directions.

Besides renaming:
- Hugging Face T5 does not divide the attention scores by sqrt(d_kv) (its initialisation
  accounts for it); gigatron does, so the query weights are multiplied by sqrt(d_kv) on import
  and divided on export.
- q, k, v are fused per head ([q_h; k_h; v_h]); cross-attention keys and values per head
  ([k_h; v_h]); the gated MLP's wi_0 and wi_1 are fused as [gate; up].
- The relative position bias of each stack is its first layer's in Hugging Face.
- Original T5 (`scale_decoder_outputs`) multiplies the decoder output by d_model**-0.5 before
  the tied output layer: folded into the decoder's final norm weight.
- The word embedding is padded to the padded vocabulary on import and cut back on export; a
  tied gigatron model's output bias (Megatron's T5 head has one) is zero on import and must be
  zero to export.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from gigatron.errors import GigatronError
from gigatron.families.hf_mapping import fuse_qkv, pad_rows, split_qkv

StateDict = dict[str, torch.Tensor]


def _count_blocks(hf: StateDict, stack: str) -> int:
    pattern = re.compile(rf"^{stack}\.block\.(\d+)\.")
    found = {int(m.group(1)) for key in hf if (m := pattern.match(key))}
    return max(found) + 1 if found else 0


def _layer_count(sd: StateDict, stack: str) -> int:
    pattern = re.compile(rf"^{stack}\.layers\.(\d+)\.")
    found = {int(m.group(1)) for key in sd if (m := pattern.match(key))}
    return max(found) + 1 if found else 0


class T5HFAdapter:
    """The T5 family's Hugging Face adapter (`T5ForConditionalGeneration`, gated-gelu)."""

    hf_class_name = "T5ForConditionalGeneration"
    auto_class = "AutoModelForSeq2SeqLM"
    model_types = ("t5",)

    def config_from_hf(self, hf_config: Any) -> dict[str, Any]:
        """gigatron ModelConfig values (plus `vocab_size`) for a Hugging Face T5Config."""
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        projection = c.get("feed_forward_proj", "relu")
        if projection != "gated-gelu":
            raise GigatronError(
                f"feed_forward_proj {projection!r}: gigatron's T5 uses the gated GeLU MLP of "
                "T5 v1.1 (feed_forward_proj 'gated-gelu'); convert a v1.1 model"
            )
        return {
            "encoder_num_layers": c["num_layers"],
            "decoder_num_layers": c.get("num_decoder_layers") or c["num_layers"],
            "num_layers": c["num_layers"],
            "hidden_size": c["d_model"],
            "num_attention_heads": c["num_heads"],
            "kv_channels": c["d_kv"],
            "ffn_hidden_size": c["d_ff"],
            "position_embedding_type": "relative",
            "relative_attention_num_buckets": c["relative_attention_num_buckets"],
            "relative_attention_max_distance": c.get("relative_attention_max_distance", 128),
            "normalization": "RMSNorm",
            "layernorm_epsilon": c.get("layer_norm_epsilon", 1e-6),
            "add_bias_linear": False,
            "geglu": True,
            "openai_gelu": True,
            "untie_embeddings_and_output_weights": False,
            # Relative positions set no length limit: Megatron's T5 lengths, flags override them.
            "seq_length": 512,
            "encoder_seq_length": 512,
            "decoder_seq_length": 128,
            "vocab_size": c["vocab_size"],
        }

    def from_hf(
        self,
        hf: StateDict,
        num_layers: int | None,
        num_heads: int,
        padded_vocab: int,
        scale_decoder_outputs: bool = False,
        hf_config: Any = None,
    ) -> StateDict:
        """T5ForConditionalGeneration state dict -> gigatron T5 state dict (tied output layer
        with a zero bias; untied when `lm_head.weight` differs from the embedding).
        `num_layers` is unused (each stack's count is read from the state dict);
        `scale_decoder_outputs`: the Hugging Face config's (original T5, not v1.1), read from
        `hf_config` when given."""
        tied = None
        if hf_config is not None:
            scale_decoder_outputs, tied = _tying(hf_config)
        shared = hf["shared.weight"]
        sd: StateDict = {"embedding.word_embeddings.weight": pad_rows(shared, padded_vocab)}
        head = hf.get("lm_head.weight")
        if tied is None:
            tied = head is None or torch.equal(head, shared)
        if tied:
            sd["output_layer.bias"] = shared.new_zeros(padded_vocab)
        else:
            sd["output_layer.weight"] = pad_rows(head, padded_vocab)
        kv = hf["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // num_heads
        q_scale = math.sqrt(kv)
        for stack in ("encoder", "decoder"):
            src_bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            sd[f"{stack}_relative_pos_emb.relative_attention_bias.weight"] = hf[src_bias]
            final = hf[f"{stack}.final_layer_norm.weight"]
            if stack == "decoder" and scale_decoder_outputs:
                final = final * shared.shape[1] ** -0.5
            sd[f"{stack}.final_layernorm.weight"] = final
            mlp_index = 1 if stack == "encoder" else 2
            for i in range(_count_blocks(hf, stack)):
                src, dst = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
                att = f"{src}0.SelfAttention."
                q, k, v = (hf[f"{att}{n}.weight"] for n in "qkv")
                sd[f"{dst}self_attention.linear_qkv.weight"] = fuse_qkv(
                    q * q_scale, k, v, num_heads
                )
                sd[f"{dst}self_attention.linear_proj.weight"] = hf[f"{att}o.weight"]
                sd[f"{dst}input_layernorm.weight"] = hf[f"{src}0.layer_norm.weight"]
                if stack == "decoder":
                    cross = f"{src}1.EncDecAttention."
                    sd[f"{dst}pre_cross_attn_layernorm.weight"] = hf[f"{src}1.layer_norm.weight"]
                    sd[f"{dst}cross_attention.linear_q.weight"] = hf[f"{cross}q.weight"] * q_scale
                    k, v = hf[f"{cross}k.weight"], hf[f"{cross}v.weight"]
                    sd[f"{dst}cross_attention.linear_kv.weight"] = _fuse_kv(k, v, num_heads)
                    sd[f"{dst}cross_attention.linear_proj.weight"] = hf[f"{cross}o.weight"]
                mlp = f"{src}{mlp_index}."
                sd[f"{dst}pre_mlp_layernorm.weight"] = hf[f"{mlp}layer_norm.weight"]
                sd[f"{dst}mlp.linear_fc1.weight"] = torch.cat(
                    [hf[f"{mlp}DenseReluDense.wi_0.weight"], hf[f"{mlp}DenseReluDense.wi_1.weight"]]
                )
                sd[f"{dst}mlp.linear_fc2.weight"] = hf[f"{mlp}DenseReluDense.wo.weight"]
        return sd

    def to_hf(
        self,
        sd: StateDict,
        num_layers: int | None,
        num_heads: int,
        vocab_size: int,
        scale_decoder_outputs: bool = False,
        hf_config: Any = None,
    ) -> StateDict:
        """gigatron T5 state dict (Hugging Face variant) -> T5ForConditionalGeneration's state
        dict (with the tied aliases; `to_hf_files` gives what save_pretrained writes)."""
        if hf_config is not None:
            scale_decoder_outputs, _ = _tying(hf_config)
        word = sd["embedding.word_embeddings.weight"][:vocab_size]
        bias = sd.get("output_layer.bias")
        if bias is not None and bool(bias.any()):
            raise GigatronError(
                "output_layer.bias: the T5 output layer has a non-zero bias, which Hugging Face "
                "T5 has no place for; export a model trained with "
                "--untie-embeddings-and-output-weights, or one imported from Hugging Face"
            )
        hf: StateDict = {
            "shared.weight": word,
            "encoder.embed_tokens.weight": word,
            "decoder.embed_tokens.weight": word,
            "lm_head.weight": sd["output_layer.weight"][:vocab_size]
            if "output_layer.weight" in sd
            else word,
        }
        hidden = word.shape[1]
        kv = sd["encoder.layers.0.self_attention.linear_qkv.weight"].shape[0] // (3 * num_heads)
        q_scale = math.sqrt(kv)
        for stack in ("encoder", "decoder"):
            bias_name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            hf[bias_name] = sd[f"{stack}_relative_pos_emb.relative_attention_bias.weight"]
            final = sd[f"{stack}.final_layernorm.weight"]
            if stack == "decoder" and scale_decoder_outputs:
                final = final * hidden**0.5
            hf[f"{stack}.final_layer_norm.weight"] = final
            mlp_index = 1 if stack == "encoder" else 2
            for i in range(_layer_count(sd, stack)):
                src, dst = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
                att = f"{dst}0.SelfAttention."
                q, k, v = split_qkv(
                    sd[f"{src}self_attention.linear_qkv.weight"], num_heads, num_heads, kv
                )
                hf[f"{att}q.weight"], hf[f"{att}k.weight"], hf[f"{att}v.weight"] = (
                    q / q_scale,
                    k,
                    v,
                )
                hf[f"{att}o.weight"] = sd[f"{src}self_attention.linear_proj.weight"]
                hf[f"{dst}0.layer_norm.weight"] = sd[f"{src}input_layernorm.weight"]
                if stack == "decoder":
                    cross = f"{dst}1.EncDecAttention."
                    hf[f"{dst}1.layer_norm.weight"] = sd[f"{src}pre_cross_attn_layernorm.weight"]
                    hf[f"{cross}q.weight"] = sd[f"{src}cross_attention.linear_q.weight"] / q_scale
                    k, v = _split_kv(sd[f"{src}cross_attention.linear_kv.weight"], num_heads)
                    hf[f"{cross}k.weight"], hf[f"{cross}v.weight"] = k, v
                    hf[f"{cross}o.weight"] = sd[f"{src}cross_attention.linear_proj.weight"]
                mlp = f"{dst}{mlp_index}."
                hf[f"{mlp}layer_norm.weight"] = sd[f"{src}pre_mlp_layernorm.weight"]
                gate, up = sd[f"{src}mlp.linear_fc1.weight"].chunk(2, dim=0)
                hf[f"{mlp}DenseReluDense.wi_0.weight"] = gate.clone()
                hf[f"{mlp}DenseReluDense.wi_1.weight"] = up.clone()
                hf[f"{mlp}DenseReluDense.wo.weight"] = sd[f"{src}mlp.linear_fc2.weight"]
        return hf

    def to_hf_files(self, hf_state: StateDict, hf_config: Any) -> StateDict:
        """The tensors `save_pretrained` writes: the tied aliases of `shared.weight` left out."""
        _, tied = _tying(hf_config)
        aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
        if tied:
            aliases.add("lm_head.weight")
        return {name: tensor for name, tensor in hf_state.items() if name not in aliases}


def _tying(hf_config: Any) -> tuple[bool, bool]:
    """(scale_decoder_outputs, tied) of a Hugging Face T5 config: transformers 5 writes
    `scale_decoder_outputs`; older configs say it with `tie_word_embeddings` (original T5 ties
    and scales, v1.1 does neither)."""
    c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    tied = c.get("tie_word_embeddings", True) is not False
    return bool(c.get("scale_decoder_outputs", tied)), tied


def _fuse_kv(k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[ng*hn, h] twice -> gigatron's linear_kv rows [k_g; v_g] per group."""
    rest = k.shape[1:]
    return torch.cat([k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)], dim=1).reshape(
        -1, *rest
    )


def _split_kv(kv: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    rest = kv.shape[1:]
    k, v = kv.reshape(groups, 2, -1, *rest).unbind(1)
    return k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()
