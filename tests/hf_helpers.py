"""Shared by the Hugging Face parity tests (importable as `hf_helpers`, beside tests/helpers.py): a
small decoder's config values, random weights, a gigatron model built from the values an adapter
reads, and the comparisons (logits, state dicts, greedy generation); a checkpoint's model as
`generate` loads it and a transformers folder's logits."""

from __future__ import annotations

from argparse import Namespace

import torch

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config, validate_config
from gigatron.inference import InferenceEngine, ModelRunner, SamplingParams
from gigatron.inference.load import load_for_inference
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext


def hf_decoder(**values) -> dict:
    """Keyword arguments of a small Hugging Face decoder config (2 layers, hidden 64, 4 heads in
    2 key-value groups, 64 positions); `values` add to or override them."""
    return {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, **values,
    }  # fmt: skip


def llama_gqa_config(vocab_size: int):
    """A small Llama config with grouped-query attention (8 heads in 2 groups), a RoPE base of
    500 and untied output weights."""
    from transformers import LlamaConfig  # why: transformers is slow to import

    return LlamaConfig(
        **hf_decoder(num_attention_heads=8), vocab_size=vocab_size, intermediate_size=96,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip


def randomise(hf_model: torch.nn.Module, std: float, norm_mean: float | None = None) -> None:
    """Draw every weight from N(0, std) (Hugging Face initialises some to zeros); norm weights
    from N(norm_mean, std), or left as they are when norm_mean is None."""
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, std)
            elif norm_mean is not None:
                param.normal_(norm_mean, std)


def gigatron_model(
    model_values: dict, moe_values: dict | None = None, finalize: bool = True, **overrides
) -> torch.nn.Module:
    """A one-process gigatron model in eval mode without dropout, from the config values an
    adapter read (`vocab_size` among the model values); `overrides` change model values."""
    values = dict(model_values)
    vocab = values.pop("vocab_size")
    cfg = GigatronConfig()
    for key, value in {**values, **overrides}.items():
        setattr(cfg.model, key, value)
    for key, value in (moe_values or {}).items():
        setattr(cfg.moe, key, value)
    cfg.model.attention_dropout = cfg.model.hidden_dropout = 0.0
    if finalize:
        finalize_config(cfg)
        validate_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    return model.eval()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def assert_same_state(got: dict, expected: dict) -> None:
    """The same names and, bit for bit, the same tensors."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


def assert_greedy_generation_matches(model: torch.nn.Module, hf_model, vocab: int) -> None:
    """The engine (KV cache, continuous batching over mixed prompt lengths) picks Hugging Face's
    greedy tokens, 12 of them after each of three prompts."""
    runner = ModelRunner([model], ParallelContext.single(), vocab, 2, 48)
    engine = InferenceEngine(runner, None)
    prompts = [[5, 17, 42, 8, 99, 3, 61], [7], [11, 12, 13]]
    completions = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, completion in zip(prompts, completions, strict=True):
        hf_out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        assert completion.output_ids == hf_out[0, len(prompt) :].tolist()


def checkpoint_model(load, step: int | None = None, lora=None) -> torch.nn.Module:
    """The one-process model of a checkpoint as `generate` loads it (with a LoRA run's adapters
    when `lora` is given)."""
    args = Namespace(
        load=str(load), ckpt_step=step, device="cpu", tokenizer_model=None, vocab_file=None,
        merge_file=None, lora_checkpoint=str(lora) if lora else None,
    )  # fmt: skip
    (model,) = load_for_inference(args).chunks
    return model


def transformers_logits(folder, tokens: torch.Tensor, peft=None) -> torch.Tensor:
    """float32 logits of a transformers folder (with a PEFT adapter folder when given)."""
    from transformers import AutoModelForCausalLM  # why: transformers is slow to import

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if peft is not None:
        from peft import PeftModel  # why: slow to import, only the PEFT test needs it

        model = PeftModel.from_pretrained(model, peft)
    with torch.no_grad():
        return model.eval()(tokens).logits.float()
