"""Speculative decoding with a separate draft model (inference/draft_speculative.py): greedy
tokens equal the engine's non-speculative ones for a batch of prompts; sampled sequences follow
the target model's exact distribution (chi-square over many seeded draws); the CLI flag."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.inference import SamplingParams
from gigatron.inference.draft_speculative import DraftModelSpeculator
from gigatron.inference.load import build_engine
from gigatron.inference.speculative import distributions
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, NEW = 50, 10


def _model(layers: int, hidden: int, seed: int, vocab: int = VOCAB, sharpen: float = 1.0):
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = layers, hidden, 4, 64
    m.attention_dropout = m.hidden_dropout = 0.0
    m.position_embedding_type = "rope"
    cfg.training.seed = seed
    finalize_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=vocab)
    with torch.no_grad():  # a sharper, more distinct distribution: rejections happen
        model.decoder.final_layernorm.weight.mul_(sharpen)
    return model.eval()


def test_greedy_draft_speculation_gives_the_non_speculative_tokens():
    target, draft = _model(2, 64, seed=1), _model(1, 32, seed=2)
    engine = build_engine([target], ParallelContext.single(), max_batch_size=4, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 9, 4)]
    expected = [c.output_ids for c in engine.generate(prompts, SamplingParams(NEW, 0.0))]
    for k in (1, 3):
        results = DraftModelSpeculator(target, draft, k, VOCAB).generate(prompts, NEW)
        assert [r.output_ids for r in results] == expected
        assert all(r.drafted == k * r.rounds and r.accepted <= r.drafted for r in results)
    # the target as its own draft: every draft accepted, K + 1 tokens per round
    results = DraftModelSpeculator(target, target, 3, VOCAB).generate(prompts, NEW)
    assert [r.output_ids for r in results] == expected
    assert all(r.accepted == r.drafted and r.rounds == 3 for r in results)  # 1 + 3 x 4 >= 10
    # an end token the sequence reaches: cut there, not included
    eos = expected[1][6]
    results = DraftModelSpeculator(target, draft, 2, VOCAB).generate(prompts, NEW, eos_id=eos)
    for result, tokens in zip(results, expected):
        cut = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert result.output_ids == cut
        assert result.finish_reason == ("stop" if eos in tokens else "length")


def test_sampled_draft_speculation_follows_the_target_distribution():
    vocab, prompt, temperature, top_k = 6, [1, 4], 0.9, 4
    target = _model(2, 64, seed=3, vocab=vocab, sharpen=2.0)
    draft = _model(1, 32, seed=4, vocab=vocab, sharpen=2.0)
    # exact: p(t1) p(t2 | t1) p(t3 | t1 t2) from full forwards of the target, no cache
    triples = list(itertools.product(range(vocab), repeat=3))
    ids = torch.tensor([prompt + list(t) for t in triples])
    with torch.no_grad():
        logits = target(ids, torch.arange(ids.shape[1])[None, :].expand_as(ids))
    exact = torch.ones(len(triples))
    for step in range(3):
        p = distributions(logits[:, len(prompt) - 1 + step], vocab, temperature, top_k)
        exact *= p.gather(1, ids[:, len(prompt) + step, None])[:, 0]
    draws = 2000
    speculator = DraftModelSpeculator(target, draft, 2, vocab)
    results = speculator.generate([prompt] * draws, 3, temperature, top_k, seeds=list(range(draws)))
    counts = torch.zeros(len(triples))
    for result in results:
        counts[triples.index(tuple(result.output_ids))] += 1
    drafted = sum(r.drafted for r in results)
    accepted = sum(r.accepted for r in results)
    assert 0.2 < accepted / drafted < 0.9, accepted / drafted  # both paths of the rule ran
    expected = exact * draws
    big = expected >= 5  # cells expecting fewer than 5 pooled into one
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    df = observed.numel() - 1
    # the chi-square quantile at p = 0.001 (Wilson-Hilferty): a correct sampler fails 1 in 1000
    limit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, (chi2, limit, df)


def _save(path, layers: int, hidden: int, seed: int) -> None:
    from gigatron.checkpoint.formats import save_checkpoint
    from gigatron.training.pretrain import parse_pretrain_config

    cfg = parse_pretrain_config(
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--mock-data",
         "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-3", "--seed", str(seed),
         "--position-embedding-type", "rope"],
        world_size=1,
    )  # fmt: skip
    pctx = ParallelContext.single()
    chunks = build_model(cfg, pctx, vocab_size=VOCAB)
    save_checkpoint(path, 1, chunks, None, None, pctx, cfg, extra={"gigatron_family": "gpt"})


def test_generate_cli_speculates_with_a_draft_checkpoint(tmp_path):
    from gigatron.inference.generate import main

    _save(tmp_path / "target", 2, 64, seed=1)
    _save(tmp_path / "draft", 1, 32, seed=2)
    base = ["--load", str(tmp_path / "target"), "--prompt", "3 1 4 1 5", "--prompt", "9",
            "--prompt", "2 7", "--max-tokens", "8", "--ignore-eos", "--max-batch-size", "2"]  # fmt: skip
    draft = ["--speculative-draft-load", str(tmp_path / "draft"), "--num-speculative-tokens", "3"]
    outputs = {}
    for name, extra in (
        ("plain", ["--greedy"]),
        ("speculative", ["--greedy", *draft]),
        ("sampled", ["--temperature", "0.8", "--sampling-seed", "5", *draft]),
        ("sampled_again", ["--temperature", "0.8", "--sampling-seed", "5", *draft]),
    ):
        out = tmp_path / f"{name}.jsonl"
        assert main([*base, *extra, "--output", str(out)]) == 0
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    tokens = {name: [r["tokens"] for r in records] for name, records in outputs.items()}
    assert tokens["speculative"] == tokens["plain"]
    assert tokens["sampled"] == tokens["sampled_again"] != tokens["plain"]
    assert all(len(t) == 8 for t in tokens["sampled"])
    assert all(r["speculative"]["drafted"] > 0 for r in outputs["speculative"])
    with pytest.raises(GigatronError, match="--speculative-draft-load: give --num-speculative"):
        main([*base, "--speculative-draft-load", str(tmp_path / "draft")])
    with pytest.raises(GigatronError, match=f"--speculative-draft-load {tmp_path}: no checkpoint"):
        main([*base, "--speculative-draft-load", str(tmp_path), "--num-speculative-tokens", "2"])
