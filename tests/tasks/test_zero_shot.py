"""`gigatron evaluate`: WikiText perplexity equal to a hand computation on a tiny model, Megatron's
adjusted-perplexity formula and detokenizer, and LAMBADA accuracy on passages a model memorised."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from task_helpers import LAMBADA, SEQ, WIKITEXT, lambada_texts, memorise, save, tiny_model

from gigatron.errors import GigatronError
from gigatron.tasks.evaluate import evaluate
from gigatron.tasks.lambada import split_passage
from gigatron.tasks.wikitext import perplexities, wikitext_detokenize, window_samples


# ---- WikiText ------------------------------------------------------------------------------
def test_detokenizer_follows_the_wiki_rules():
    text = (
        ' = = Early life = = \n The 1 @,@ 000 @-@ year old man \'s dog ( a " big " one ) ran '
        "3 @.@ 5 km ; then it stopped . \n"
    )
    assert wikitext_detokenize(text) == (
        ' == Early life ==\nThe 1,000-year old man\'s dog (a "big" one) ran 3.5 km; '
        "then it stopped.\n"
    )


@pytest.mark.parametrize("stride", [1, 5, 16, 32])
def test_windows_score_every_target_once(stride):
    tokens = list(range(100))
    seen = []
    for sample in window_samples(tokens, 32, stride):
        targets = sample.tokens[1:]
        seen += [int(t) for t, m in zip(targets, sample.loss_mask) if m]
    assert seen == tokens[1:]


def test_adjusted_perplexity_is_megatrons_formula():
    # 1001 tokenized tokens (1000 targets), 801 original words (800 gaps): ratio 1.25.
    result = perplexities(total_loss=2000.0, num_tokenized_tokens=1001, num_original_tokens=801)
    assert result["avg_loss"] == 2.0
    assert result["token_ratio"] == 1.25
    assert result["ppl"] == pytest.approx(math.exp(2.0))
    assert result["adjusted_ppl"] == pytest.approx(math.exp(2.5))
    capped = perplexities(total_loss=1e6, num_tokenized_tokens=1001, num_original_tokens=801)
    assert capped["ppl"] == capped["adjusted_ppl"] == pytest.approx(math.exp(20.0))


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("untrained")
    cfg, tokenizer, chunk = tiny_model()
    save(directory / "ckpt", cfg, chunk)
    wiki = directory / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:12]))
    return directory, tokenizer, chunk.eval(), wiki


def _run(directory, *flags):
    out = directory / "result.json"
    result = evaluate(["--load", str(directory / "ckpt"), "--device", "cpu", "--results-file",
                       str(out), "--no-progress-bar", *flags])  # fmt: skip
    assert json.loads(out.read_text()) == result
    return result


def test_wikitext_perplexity_equals_a_hand_computation(untrained):
    directory, tokenizer, chunk, wiki = untrained
    text = wiki.read_text(encoding="utf-8")
    tokens = torch.tensor(tokenizer.tokenize(wikitext_detokenize(text)))
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, SEQ):
            window = tokens[start : start + SEQ + 1]
            logits = chunk(window[None, :-1], None)[0].float()
            total += F.cross_entropy(logits, window[1:], reduction="sum").item()
    words = len(text.strip().split(" "))
    flags = ["--task", "WIKITEXT103", "--valid-data", str(wiki), "--micro-batch-size", "3"]
    result = _run(directory, *flags, "--overlapping-eval", str(SEQ))
    assert result["num_tokenized_tokens"] == len(tokens)
    assert result["num_original_tokens"] == words
    assert result["scored_tokens"] == len(tokens) - 1
    mean = total / (len(tokens) - 1)
    assert result["avg_loss"] == pytest.approx(mean, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(mean), rel=1e-4)
    ratio = (len(tokens) - 1) / (words - 1)
    assert result["adjusted_ppl"] == pytest.approx(math.exp(mean * ratio), rel=1e-4)
    # A sliding window scores the same targets with more context: a different total.
    sliding = _run(directory, *flags, "--overlapping-eval", "16")
    assert sliding["scored_tokens"] == len(tokens) - 1
    assert sliding["windows"] > result["windows"]
    assert sliding["avg_loss"] != pytest.approx(result["avg_loss"], rel=1e-6)


# ---- LAMBADA -------------------------------------------------------------------------------
LSEQ = 32  # the LAMBADA model's context: passages keep their last 32 tokens


def _greedy_correct(chunk, tokenizer, text, strict):
    context, target = split_passage(text, tokenizer, strict)
    tokens = torch.tensor((context + target)[-(LSEQ + 1) :])
    with torch.no_grad():
        logits = chunk(tokens[None, :-1], None)[0]
    predicted = logits.argmax(-1)[-len(target) :]
    loss = torch.nn.functional.cross_entropy(
        logits[-len(target) :], tokens[-len(target) :], reduction="sum"
    )
    return bool((predicted == tokens[-len(target) :]).all()), float(loss), len(target)


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    directory = tmp_path_factory.mktemp("memorised")
    cfg, tokenizer, chunk = tiny_model(LSEQ)
    short = lambada_texts(40)
    # Three passages, and one whose last word is several tokens (the strict target differs).
    long_word = [t for t in short if len(split_passage(t, tokenizer, True)[1]) > 1]
    texts = [t for t in short if t not in long_word[:1]][:3] + long_word[:1]
    memorise(chunk, tokenizer, texts, LSEQ)
    save(directory / "ckpt", cfg, chunk)
    return directory, tokenizer, chunk, texts


def _write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_lambada_is_right_on_every_memorised_passage(memorised):
    directory, tokenizer, _, texts = memorised
    data = _write_jsonl(directory / "memorised.jsonl", texts)
    # The strict target is a whole word of several tokens for at least one passage.
    assert any(len(split_passage(t, tokenizer, True)[1]) > 1 for t in texts)
    for strict in ([], ["--strict-lambada"]):
        result = _run(directory, "--task", "LAMBADA", "--valid-data", str(data), *strict)
        assert (result["num_correct"], result["num_examples"]) == (4, 4)
        assert result["accuracy"] == 1.0


def test_lambada_counts_match_greedy_predictions_on_real_passages(memorised):
    directory, tokenizer, chunk, texts = memorised
    others = lambada_texts(30, skip=100)
    data = _write_jsonl(directory / "mixed.jsonl", texts + others)
    for strict in (False, True):
        scored = [_greedy_correct(chunk, tokenizer, t, strict) for t in texts + others]
        expected = sum(right for right, _, _ in scored)
        nll, count = sum(loss for _, loss, _ in scored), sum(n for _, _, n in scored)
        flags = ["--strict-lambada"] if strict else []
        result = _run(directory, "--task", "LAMBADA", "--valid-data", str(data),
                      "--micro-batch-size", "4", *flags)  # fmt: skip
        assert result["num_examples"] == 34
        assert result["num_correct"] == expected
        assert 4 <= expected < 34
        assert result["target_ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_lambada_file_errors_name_the_line(memorised, tmp_path):
    directory = memorised[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one two"}\n{"txt": "x"}\n')
    with pytest.raises(GigatronError, match="line 2 is not a JSON object with 'text'"):
        _run(directory, "--task", "LAMBADA", "--valid-data", str(bad))
    with pytest.raises(GigatronError, match="--valid-data .*missing.jsonl: no such file"):
        _run(directory, "--task", "LAMBADA", "--valid-data", str(tmp_path / "missing.jsonl"))


def test_the_real_lambada_file_reads(memorised):
    from gigatron.tasks.lambada import read_lambada

    samples = read_lambada(str(LAMBADA), memorised[1], LSEQ, strict=True)
    assert len(samples) == 5153
    assert all(len(s.tokens) == LSEQ + 1 and s.loss_mask[-1] == 1 for s in samples)
