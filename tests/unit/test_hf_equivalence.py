"""gigatron's GPT equals Hugging Face GPT-2 and Llama (GQA) given the same weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from gigatron.families.gpt import token_losses
from gigatron.families.hf_mapping import (
    gigatron_to_gpt2,
    gigatron_to_llama,
    gpt2_to_gigatron,
    llama_to_gigatron,
    model_config_from_hf,
)
from gigatron.parallel.context import ParallelContext
from hf_helpers import gigatron_model, llama_gqa_config

VOCAB = 100
SEQ = 16


def _lm_losses(logits, labels):
    """Per-token losses [b, s] of a GPT chunk's logits (the GPT family's loss)."""
    return token_losses(logits, labels, ParallelContext.single())


def _gigatron_model(hf_config):
    model = gigatron_model(model_config_from_hf(hf_config), finalize=False)
    return model, model.vocab_size


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_logits_and_loss(model, hf_model, vocab):
    torch.manual_seed(0)
    tokens = torch.randint(0, vocab, (2, SEQ))
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        expected = hf_model(tokens).logits
        logits = model(tokens, positions)
        loss = _lm_losses(model(tokens, positions), tokens)
    assert logits.shape == (2, SEQ, model.vocab_size)
    assert _relative_error(logits[..., :vocab], expected) < 1e-4
    # The loss is the cross entropy of the (padded) logits.
    reference = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1), reduction="none"
    )
    torch.testing.assert_close(loss, reference.view(2, SEQ), rtol=1e-5, atol=1e-5)


def test_gpt2_same_logits_as_hugging_face():
    torch.manual_seed(1)
    hf_config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf_model = GPT2LMHeadModel(hf_config).eval()
    model, padded = _gigatron_model(hf_config)
    assert padded == 128
    hf_sd = hf_model.state_dict()
    model.load_state_dict(gpt2_to_gigatron(hf_sd, 2, 4, padded), strict=True)
    _check_logits_and_loss(model, hf_model, VOCAB)

    back = gigatron_to_gpt2(model.state_dict(), 2, 4, VOCAB)
    for name, tensor in hf_model.state_dict().items():
        if name in back:
            torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)
    missing, unexpected = GPT2LMHeadModel(hf_config).load_state_dict(back, strict=False)
    assert not unexpected and all(".attn.bias" in m or "masked_bias" in m for m in missing)


def test_llama_gqa_same_logits_as_hugging_face():
    torch.manual_seed(2)
    hf_config = llama_gqa_config(VOCAB)
    hf_model = LlamaForCausalLM(hf_config).eval()
    model, padded = _gigatron_model(hf_config)
    spec = model.config
    assert (spec.num_query_groups, spec.kv_channels, spec.rotary_base) == (2, 8, 500)
    hf_sd = hf_model.state_dict()
    model.load_state_dict(llama_to_gigatron(hf_sd, 2, 8, 2, padded), strict=True)
    _check_logits_and_loss(model, hf_model, VOCAB)

    back = gigatron_to_llama(model.state_dict(), 2, 8, 2, 8, VOCAB)
    assert set(back) == set(hf_sd)
    for name, tensor in hf_sd.items():
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=0)
