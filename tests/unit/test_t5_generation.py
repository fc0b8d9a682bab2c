"""T5 generation (inference/t5_generation.py) against Hugging Face's greedy
`T5ForConditionalGeneration.generate` on a converted random model: prompts of different lengths,
rows ending at an end token at different steps. (Hugging Face runs without its cache: its
cache assumes as many decoder layers as encoder layers, and this model has 2 and 3.)"""

from __future__ import annotations

import json

import pytest
import torch
from tests.unit.test_t5_model import HEADS, VOCAB, hf_t5_model, t5_config

from gigatron.errors import GigatronError
from gigatron.families.t5.hf_t5 import T5HFAdapter
from gigatron.inference.sampling import RowSampling
from gigatron.inference.speculative import distributions
from gigatron.inference.t5_generation import T5DecoderCache, t5_generate
from gigatron.models.t5 import build_t5_model
from gigatron.parallel.context import ParallelContext

NEW = 10


def _hf_greedy(hf, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    out = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_beams=1,
        eos_token_id=eos, pad_token_id=0, decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    rows = []
    for row in out.tolist():
        tokens = row[1:]  # the decoder start
        rows.append(tokens[: tokens.index(eos)] if eos in tokens else tokens)
    return rows


def test_greedy_equals_hugging_face_t5():
    hf = hf_t5_model(scale_outputs=False)
    adapter = T5HFAdapter()
    values = adapter.config_from_hf(hf.config)
    pctx = ParallelContext.single()
    (model,) = build_t5_model(t5_config(values), pctx, vocab_size=VOCAB)
    model.load_state_dict(adapter.from_hf(hf.state_dict(), None, HEADS, model.vocab_size, False))
    model.eval()
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (9, 4, 13)]
    free = _hf_greedy(hf, prompts, eos=None)
    assert all(len(row) == NEW for row in free)
    # an end token that row 0 reaches mid-way: its row stops there, the others may not
    eos = free[0][4]
    expected = _hf_greedy(hf, prompts, eos=eos)
    completions = t5_generate(model, pctx, prompts, NEW, 0, eos, VOCAB)
    assert [c.output_ids for c in completions] == expected
    assert completions[0].finish_reason == "stop" and len(expected[0]) <= 4
    assert [c.finish_reason for c in completions] == [
        "stop" if len(row) < NEW else "length" for row in expected
    ]
    assert [c.output_ids for c in t5_generate(model, pctx, prompts, NEW, 0, None, VOCAB)] == free


def test_sampling_follows_the_models_distribution():
    # the first decoder token of one prompt drawn with 1500 seeds against softmax(logits / T)
    # among the top k (a chi-square test), and top-p keeping only the nucleus
    hf = hf_t5_model(scale_outputs=False)
    adapter = T5HFAdapter()
    pctx = ParallelContext.single()
    (model,) = build_t5_model(t5_config(adapter.config_from_hf(hf.config)), pctx, vocab_size=VOCAB)
    model.load_state_dict(adapter.from_hf(hf.state_dict(), None, HEADS, model.vocab_size, False))
    model.eval()
    prompt, draws, temperature, top_k = [5, 17, 42, 8], 1500, 4.0, 6
    with torch.no_grad():
        ids = torch.tensor([prompt])
        cache = T5DecoderCache(model.encode(ids, torch.ones_like(ids)))
        start = torch.zeros(1, 1, dtype=torch.long)
        logits = model.decode(start, 0, cache.memory, torch.ones_like(ids), cache)
    exact = distributions(logits[:, -1], VOCAB, temperature, top_k)[0]
    rows = [RowSampling(temperature, top_k, seed=seed) for seed in range(draws)]
    completions = t5_generate(model, pctx, [prompt] * draws, 1, 0, None, VOCAB, rows)
    counts = torch.bincount(torch.tensor([c.output_ids[0] for c in completions]), minlength=VOCAB)
    assert counts[exact == 0].sum() == 0  # nothing outside the top k
    kept = exact > 0
    chi2 = float(((counts[kept] - draws * exact[kept]) ** 2 / (draws * exact[kept])).sum())
    assert chi2 < 22.5, (chi2, counts[kept], exact[kept])  # chi-square, 5 df, p = 0.0002
    assert (counts[kept] > 0).sum() > 1, exact[kept]  # really sampled
    probs = torch.softmax(logits[0, -1, :VOCAB].float() / temperature, -1)
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.9).sum()) + 1].tolist()
    rows = [RowSampling(temperature, top_p=0.9, seed=seed) for seed in range(200)]
    completions = t5_generate(model, pctx, [prompt] * 200, 1, 0, None, VOCAB, rows)
    assert {c.output_ids[0] for c in completions} <= set(nucleus)


def test_generate_cli_on_a_converted_t5_checkpoint(tmp_path, capsys):
    from gigatron.checkpoint.hf_convert import hf_to_gigatron
    from gigatron.inference.generate import main

    hf = hf_t5_model(scale_outputs=False)
    hf.save_pretrained(tmp_path / "hf")
    hf_to_gigatron(tmp_path / "hf", tmp_path / "ckpt", log=lambda _: None)
    prompts = [[5, 17, 42, 8, 9], [70, 3]]
    expected = _hf_greedy(hf, prompts, eos=1)
    base = ["--load", str(tmp_path / "ckpt"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB), "--max-tokens", str(NEW)]  # fmt: skip
    prompt_flags = [f for p in prompts for f in ("--prompt", " ".join(map(str, p)))]
    out = tmp_path / "out.jsonl"
    assert main([*base, *prompt_flags, "--greedy", "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in records] == expected
    assert [r["prompt_tokens"] for r in records] == prompts
    with pytest.raises(GigatronError, match="--stop, --logprobs / --prompt-logprobs / --top-lo"):
        main([*base, *prompt_flags, "--stop", "x", "--logprobs"])
    # sampling: a seed repeats, top-k 1 is greedy
    sampled = [*base, *prompt_flags, "--temperature", "0.7", "--top-k", "8", "--sampling-seed", "3"]
    runs = []
    for name in ("a", "b"):
        assert main([*sampled, "--output", str(tmp_path / name)]) == 0
        runs.append(
            [json.loads(line)["tokens"] for line in (tmp_path / name).read_text().splitlines()]
        )
    assert runs[0] == runs[1]
    assert main([*base, *prompt_flags, "--top-k", "1", "--output", str(out)]) == 0
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == expected
