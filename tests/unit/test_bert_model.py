"""BERT against Hugging Face `BertForPreTraining` (random init from a small config, nothing
downloaded): same masked-LM and sentence-order logits, and a round trip of the weight map."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from gigatron.config import parse_config
from gigatron.families import get_family
from gigatron.families.bert import bert_loss
from gigatron.models.bert import build_bert_model
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ, LAYERS, HIDDEN, HEADS = 99, 16, 2, 64, 4


def _hf_model() -> BertForPreTraining:
    torch.manual_seed(3)
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, type_vocab_size=2,
    )  # fmt: skip
    model = BertForPreTraining(config).eval()
    with torch.no_grad():  # random biases and norms, so the map of every tensor is tested
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.normal_(0.0, 0.1)
    return model


def _config(*flags: str):
    adapter = get_family("bert").hf_adapter
    values = adapter.config_from_hf(_hf_model().config)
    argv = [
        "--num-layers", str(values["num_layers"]), "--hidden-size", str(values["hidden_size"]),
        "--num-attention-heads", str(values["num_attention_heads"]),
        "--ffn-hidden-size", str(values["ffn_hidden_size"]), "--seq-length", str(SEQ),
        "--norm-epsilon", str(values["layernorm_epsilon"]), "--post-layernorm",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "8", *flags,
    ]  # fmt: skip
    return parse_config(argv)


def _inputs():
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=generator)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(3, SEQ)
    valid = torch.ones(3, SEQ, dtype=torch.long)
    valid[1, 11:] = 0  # a padded sample
    return tokens, types, valid


def _relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_same_logits_as_hugging_face_and_the_map_round_trips():
    hf = _hf_model()
    cfg = _config()
    (model,) = build_bert_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    assert model.vocab_size == 104  # padded to a multiple of 8
    adapter = get_family("bert").hf_adapter
    state = adapter.from_hf(hf.state_dict(), LAYERS, HEADS, model.vocab_size)
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    model.eval()
    tokens, types, valid = _inputs()
    with torch.no_grad():
        expected = hf(input_ids=tokens, token_type_ids=types, attention_mask=valid)
        positions = torch.arange(SEQ).expand(3, SEQ)
        mask = (valid == 0)[:, None, None, :]
        lm_logits, sop_logits = model(tokens, positions, mask, tokentype_ids=types)
    assert lm_logits.shape == (3, SEQ, 104)
    real = valid.bool()
    assert _relative_error(lm_logits[..., :VOCAB][real], expected.prediction_logits[real]) < 1e-4
    assert _relative_error(sop_logits, expected.seq_relationship_logits) < 1e-4

    back = adapter.to_hf(model.state_dict(), LAYERS, HEADS, VOCAB)
    for name, tensor in hf.state_dict().items():
        if name in back:
            assert torch.equal(back[name], tensor), name
    hf_names = {n for n in hf.state_dict() if not n.endswith("position_ids")}
    assert hf_names <= set(back) | {"cls.predictions.decoder.bias"}


def test_pre_norm_bert_has_no_embedding_norm_and_a_final_norm():
    cfg = _config()
    cfg.model.post_layernorm = False
    (model,) = build_bert_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    names = set(dict(model.named_parameters()))
    assert "encoder.final_layernorm.weight" in names
    assert "encoder.layers.0.input_layernorm.weight" in names
    assert not any("embedding_norm" in n or "post_attention" in n for n in names)


def test_bidirectional_attention_sees_later_tokens():
    cfg = _config()
    (model,) = build_bert_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.eval()
    tokens, types, _ = _inputs()
    positions = torch.arange(SEQ).expand(3, SEQ)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    with torch.no_grad():
        a, _ = model(tokens, positions, None, tokentype_ids=types)
        b, _ = model(changed, positions, None, tokentype_ids=types)
    assert not torch.allclose(a[:, 0], b[:, 0])  # the first token sees the last


def test_loss_is_masked_mean_plus_sentence_order_mean():
    cfg = _config()
    (model,) = build_bert_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    tokens, types, valid = _inputs()
    labels = torch.randint(0, VOCAB, tokens.shape, generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(tokens.shape)
    loss_mask[:, 2] = loss_mask[0, 5] = 1.0
    batch = {"labels": labels, "loss_mask": loss_mask, "is_random": torch.tensor([0, 1, 1])}
    positions = torch.arange(SEQ).expand(3, SEQ)
    output = model(tokens, positions, (valid == 0)[:, None, None, :], tokentype_ids=types)
    loss, count, reports = bert_loss(batch, ParallelContext.single(), output)
    lm_logits, sop_logits = output
    ce = torch.nn.functional.cross_entropy
    picked = loss_mask.bool()
    mlm = ce(lm_logits[picked], labels[picked])
    sop = ce(sop_logits, batch["is_random"])
    assert loss.item() == pytest.approx((mlm + sop).item(), rel=1e-5)
    assert count.item() == 1.0
    assert reports["mlm_loss"][1].item() == 4.0
    assert reports["sop_loss"][1].item() == 3.0
    assert (reports["mlm_loss"][0] / 4).item() == pytest.approx(mlm.item(), rel=1e-5)
