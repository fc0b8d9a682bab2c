"""Speculative decoding with MTP heads (inference/speculative.py): greedy tokens equal the
engine's non-speculative ones; the rejection rule keeps the target distribution (tiny
vocabulary, empirical frequencies against the exact probabilities)."""

from __future__ import annotations

import json

import pytest
import torch

from gigatron.config.root import GigatronConfig
from gigatron.config.validate import finalize_config
from gigatron.errors import GigatronError
from gigatron.inference import SamplingParams
from gigatron.inference.load import build_engine
from gigatron.inference.speculative import MTPSpeculator, distributions, verify
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

VOCAB, NEW = 50, 10


def _mtp_model(depths: int, positions: str = "rope"):
    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length = 2, 64, 4, 64
    m.attention_dropout = m.hidden_dropout = 0.0
    m.mtp_num_layers, m.position_embedding_type = depths, positions
    finalize_config(cfg)
    (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    return model.eval()


def test_greedy_speculation_gives_the_non_speculative_tokens():
    model = _mtp_model(depths=3)
    engine = build_engine([model], ParallelContext.single(), max_batch_size=1, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (1, 9)]
    expected = engine.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0))
    for k in (1, 3):
        speculator = MTPSpeculator(model, k, VOCAB)
        for prompt, completion in zip(prompts, expected):
            result = speculator.generate(prompt, NEW)
            assert result.output_ids == completion.output_ids
            assert result.rounds < NEW and result.drafted == k * result.rounds
    # an end token the sequence reaches: cut there, not included
    eos = expected[1].output_ids[6]
    result = MTPSpeculator(model, 2, VOCAB).generate(prompts[1], NEW, eos_id=eos)
    cut = expected[1].output_ids
    assert result.output_ids == cut[: cut.index(eos)] and result.finish_reason == "stop"
    with pytest.raises(GigatronError, match="--num-speculative-tokens 4: the model has 3"):
        MTPSpeculator(model, 4, VOCAB)


def test_drafts_a_model_agrees_with_are_all_accepted():
    # zero final norms: every logit is 0, the main model and every head choose token 0
    model = _mtp_model(depths=2)
    with torch.no_grad():
        model.decoder.final_layernorm.weight.zero_()
        for layer in model.mtp.layers:
            layer.final_layernorm.weight.zero_()
    result = MTPSpeculator(model, 2, VOCAB).generate([3, 4, 5], NEW)
    assert result.output_ids == [0] * NEW
    assert result.accepted == result.drafted == 2 * result.rounds
    assert result.rounds == 3  # 1 token from the prompt's forward, then 3 per round


def test_the_rejection_rule_keeps_the_target_distribution():
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    draft = torch.tensor([[0.1, 0.6, 0.1, 0.2]])
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    first = torch.zeros(4)
    second_after_accept = torch.zeros(4)
    accepted_count = 0
    for _ in range(draws):
        drafted = int(torch.multinomial(draft[0], 1, generator=generator))
        accepted, token = verify(target, draft, [drafted], generator)
        first[drafted if accepted else token] += 1
        if accepted:
            second_after_accept[token] += 1
            accepted_count += 1
    # exact: the first token follows target[0]; accepted drafts are followed by target[1]
    sigma = (target[0] * (1 - target[0]) / draws).sqrt()
    assert ((first / draws - target[0]).abs() <= 4 * sigma + 1e-3).all(), first / draws
    # acceptance probability sum_x min(q(x), p(x)) = 0.1 + 0.3 + 0.1 + 0.05 = 0.55
    assert abs(accepted_count / draws - 0.55) < 0.015
    share = second_after_accept / accepted_count
    assert (share - target[1]).abs().max() < 0.02, share


def test_distributions_are_one_hot_at_temperature_zero_and_cut_by_top_k():
    logits = torch.tensor([[1.0, 3.0, 2.0, 9.0, -1.0]])  # the last entry is vocabulary padding
    assert distributions(logits, 4, 0.0, 0).tolist() == [[0.0, 0.0, 0.0, 1.0]]
    probs = distributions(logits, 4, 1.0, 2)
    e = torch.exp(torch.tensor([3.0 - 9.0]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, e / (1 + e), 0.0, 1 / (1 + e)]]))


def test_generate_cli_speculates_with_the_checkpoints_mtp_heads(tmp_path):
    from gigatron.checkpoint.formats import save_checkpoint
    from gigatron.inference.generate import main
    from gigatron.training.pretrain import parse_pretrain_config

    cfg = parse_pretrain_config(
        ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--mock-data",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-3", "--mtp-num-layers", "2",
         "--position-embedding-type", "rope"],
        world_size=1,
    )  # fmt: skip
    pctx = ParallelContext.single()
    chunks = build_model(cfg, pctx, vocab_size=VOCAB)
    save_checkpoint(tmp_path / "ckpt", 1, chunks, None, None, pctx, cfg,
                    extra={"gigatron_family": "gpt"})  # fmt: skip
    base = ["--load", str(tmp_path / "ckpt"), "--prompt", "3 1 4 1 5", "--prompt", "9",
            "--greedy", "--max-tokens", "8", "--ignore-eos"]  # fmt: skip
    outputs = {}
    for name, extra in (("plain", []), ("speculative", ["--num-speculative-tokens", "2"])):
        out = tmp_path / f"{name}.jsonl"
        assert main([*base, *extra, "--output", str(out)]) == 0
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["tokens"] for r in outputs["speculative"]] == [r["tokens"] for r in outputs["plain"]]
    assert all(r["speculative"]["drafted"] > 0 for r in outputs["speculative"])
    with pytest.raises(GigatronError, match="--top-p, --max-sequence-length: not available"):
        main([*base, "--num-speculative-tokens", "2", "--top-p", "0.5",
              "--max-sequence-length", "20"])  # fmt: skip
    with pytest.raises(GigatronError, match="--num-speculative-tokens 3: the model has 2"):
        main([*base, "--num-speculative-tokens", "3"])


def test_learned_positions_bound_the_request():
    model = _mtp_model(depths=2, positions="learned_absolute")  # 64 positions
    with pytest.raises(GigatronError, match="= 66 positions, past the model's 64"):
        MTPSpeculator(model, 2, VOCAB).generate([1] * 54, 10)
