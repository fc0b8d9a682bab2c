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


def _engine(target, draft=None, k: int = 0, slots: int = 4, vocab: int = VOCAB):
    return build_engine([target], ParallelContext.single(), max_batch_size=slots,
                        vocab_size=vocab, draft=draft, num_speculative_tokens=k)  # fmt: skip


def test_greedy_draft_speculation_gives_the_non_speculative_tokens():
    target, draft = _model(2, 64, seed=1), _model(1, 32, seed=2)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 9, 4, 6)]
    greedy = SamplingParams(NEW, 0.0)
    expected = [c.output_ids for c in _engine(target, slots=3).generate(prompts, greedy)]
    for k in (1, 3):
        engine = _engine(target, draft, k, slots=3)  # 4 prompts, 3 slots: one joins later
        completions = engine.generate(prompts, greedy)
        assert [c.output_ids for c in completions] == expected
        assert all(c.drafted % k == 0 and 0 < c.drafted < k * NEW for c in completions)
        assert engine.stats()["speculative_drafted"] == sum(c.drafted for c in completions)
    # the target as its own draft: every draft accepted, K + 1 tokens per round
    completions = _engine(target, target, 3).generate(prompts, greedy)
    assert [c.output_ids for c in completions] == expected
    assert all(c.accepted == c.drafted == 9 for c in completions)  # 1 + 4 + 4 + 4 >= 10
    # an end token mid-round cuts there; a request asking log-probs decodes without drafts
    eos = expected[1][6]
    params = [SamplingParams(NEW, 0.0, stop_token_ids=(eos,))] * 3 + [
        SamplingParams(NEW, 0.0, logprobs=True)
    ]
    completions = _engine(target, draft, 2).generate(prompts, params)
    for completion, tokens in zip(completions[:3], expected):
        cut = tokens[: tokens.index(eos)] if eos in tokens else tokens
        assert completion.output_ids == cut
        assert completion.finish_reason == ("stop" if eos in tokens else "length")
    assert completions[3].output_ids == expected[3] and len(completions[3].log_probs) == NEW
    assert completions[3].drafted == 0


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
    draws = 1000
    engine = _engine(target, draft, 2, slots=draws, vocab=vocab)
    params = [SamplingParams(3, temperature, top_k, seed=i) for i in range(draws)]
    completions = engine.generate([prompt] * draws, params)
    counts = torch.zeros(len(triples))
    for completion in completions:
        counts[triples.index(tuple(completion.output_ids))] += 1
    stats = engine.stats()
    rate = stats["speculative_accepted"] / stats["speculative_drafted"]
    assert 0.2 < rate < 0.9, rate  # both paths of the rejection rule ran
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
    with pytest.raises(GigatronError, match="give --num-speculative-tokens K >= 1"):
        main([*base, "--speculative-draft-load", str(tmp_path / "draft")])
    with pytest.raises(GigatronError, match=f"--speculative-draft-load {tmp_path}: no checkpoint"):
        main([*base, "--speculative-draft-load", str(tmp_path), "--num-speculative-tokens", "2"])


def test_models_with_mamba_layers_are_refused():
    from gigatron.config import parse_config
    from gigatron.models.hybrid import build_model as build_hybrid

    argv = ["--hybrid-layer-pattern", "M*", "--hidden-size", "64", "--num-attention-heads", "4",
            "--mamba-state-dim", "16", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
            "--position-embedding-type", "rope", "--seq-length", "64", "--vocab-size",
            str(VOCAB)]  # fmt: skip
    (hybrid,) = build_hybrid(parse_config(argv), ParallelContext.single(), vocab_size=VOCAB)
    with pytest.raises(GigatronError, match="the target has Mamba layers"):
        _engine(hybrid.eval(), _model(1, 32, seed=2), 2)
    with pytest.raises(GigatronError, match="the draft has Mamba layers"):
        _engine(_model(2, 64, seed=1), hybrid.eval(), 2)
