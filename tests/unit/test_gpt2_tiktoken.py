"""The tiktoken path of GPT2BPETokenizer against the reference path (HF `tokenizers`): the same
ids on edge cases, every vocabulary token, random text and real corpora; the proof's checks
refuse merge tables where rank-based BPE would differ."""

from __future__ import annotations

import json
import random

import pytest
import tiktoken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from gigatron.data.gpt2_tiktoken import (
    GPT2_SPLIT_PATTERN,
    build_tiktoken_bpe,
    byte_decoder,
    same_class_members,
    unicode_classes_agree,
)
from gigatron.data.tokenizers import GPT2BPETokenizer

EDGE_CASES = [
    "",
    " ",
    "a",
    "<|endoftext|>",
    "one<|endoftext|>two",
    "end of a document.<|endoftext|>\n\n<|endoftext|><|endoftext|>start",
    "<|endoftext",
    "   leading",
    "trailing   ",
    "two  spaces   three    four",
    " " * 1000 + "x" + " " * 1000,
    "\n",
    "\n\n\n\nparagraph\n\n\n",
    "line\r\nwindows\rmac\n",
    "\ttab\t\tseparated\t",
    " \t \n \t\n",
    "no\u00a0break\u2003em\u3000ideographic\u2028line\u2029para\u0085nel",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "I'm you're he's we'll they've she'd it's 'S 'LL 'Re o'clock rock'n'roll '' '",
    "don't DON'T Don\u2019t",
    "12345 1,000,000.50 3.14159 0x1F 1e-9 \u0661\u0662\u0663 \u00bd \u2163",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002\u4e2d\u6587\u6587\u672c\uff0c\ud55c\uad6d\uc5b4",
    "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 \u2764\ufe0f",
    "e\u0301 a\u0308 Z\u0324\u0354\u0367\u0311\u0313a\u0356\u032d\u0308\u0307l\u036e\u0312g\u030co",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u05e2\u05d1\u05e8\u05d9\u05ea \u0939\u093f\u0928\u094d\u0926\u0940",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f",
    "\ue000\U000f0000\U0010ffff\U0003134a\U0002ebf0",
    "a" * 20000,
    "x" + "\U0001f642" * 3000,
    "9" * 5000,
    "!" * 5000 + "?",
    "supercalifragilisticexpialidocious" * 300,
    'http://example.com/a_b-c?d=e&f=g#h <html><body class="x">text</body></html>',
    "def f(x):\n    return x ** 2  # comment\n\n\tpass\n",
]


@pytest.fixture(scope="module")
def tokenizers(shared_data):
    vocab, merges = str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    fast = GPT2BPETokenizer(vocab, merges)
    reference = GPT2BPETokenizer(vocab, merges, backend="hf")
    assert fast.backend == "tiktoken", fast.backend_reason
    assert reference.backend == "hf"
    return fast, reference


def test_unicode_classes_agree_on_every_code_point():
    assert unicode_classes_agree()
    # The probe sees a difference of a single class member.
    assert same_class_members(r"[\p{N}x]", r"[\p{N}x]")
    assert not same_class_members(r"[\p{N}x]", r"\p{N}")
    assert not same_class_members(r"\p{L}", r"\p{Ll}")


def test_edge_cases(tokenizers):
    fast, reference = tokenizers
    for text in EDGE_CASES:
        assert fast.tokenize(text) == reference.tokenize(text), text[:40]
    assert fast.tokenize_batch(EDGE_CASES) == reference.tokenize_batch(EDGE_CASES)
    # The text spelling of the end-of-document token is plain text, never the eod id.
    assert fast.eod not in fast.tokenize("<|endoftext|>")


def test_every_token_and_random_token_sequences(tokenizers):
    fast, reference = tokenizers
    texts = [reference.detokenize([i]) for i in range(reference.vocab_size)]
    rng = random.Random(0)
    ids = list(range(reference.vocab_size))
    texts += [reference.detokenize(rng.choices(ids, k=rng.randint(2, 6))) for _ in range(30000)]
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)


def test_random_text(tokenizers):
    fast, reference = tokenizers
    rng = random.Random(1)
    alphabet = (
        "aeiouxyzAEZ0123456789 '\"\t\n\r.,;:!?-_()[]{}#@$%&*/\\|~`^"
        "\u00e9\u00df\u00f1\u03bb\u0436\u65e5\u672c\u00a0\u3000\u0301\u200d\U0001f600\U0001f3fd"
    )
    pieces = ["'s", "'ll", "'ve", "'re", "'d", "'m", "'t", "<|endoftext|>", "  ", "\n\n"]
    texts = [
        "".join(
            rng.choice(pieces) if rng.random() < 0.1 else rng.choice(alphabet)
            for _ in range(rng.randint(0, 200))
        )
        for _ in range(5000)
    ]
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)


def test_real_corpora(tokenizers, shared_data):
    fast, reference = tokenizers
    wiki = (shared_data / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8")
    lambada = [
        json.loads(line)["text"]
        for line in (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    texts = wiki.splitlines(keepends=True) + lambada
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)
    whole = fast.tokenize(wiki)
    assert whole == reference.tokenize(wiki)
    assert len(whole) > 280_000


def test_lone_surrogates_refused_like_the_reference(tokenizers):
    fast, reference = tokenizers
    for tokenizer in (fast, reference):
        with pytest.raises(TypeError):
            tokenizer.tokenize("a\ud800b")


def _toy_files(tmp_path, merges: list[tuple[str, str]], reorder: bool = False):
    """A byte-level vocabulary: the 256 byte tokens, then one token per merge (optionally
    with the merge ids reversed), then <|endoftext|>."""
    alphabet = list(byte_decoder())
    results = [a + b for a, b in merges]
    if reorder:
        results = results[::-1]
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({t: 256 + i for i, t in enumerate(results)})
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    )
    return str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")


def test_unprovable_tables_fall_back_to_the_reference(tmp_path):
    # "abc" is made from ("ab", "c"), but merge-BPE on "abc" makes "bc" first and stops at
    # [a, bc]; rank-based BPE would then join a+bc into "abc" because that token exists.
    vocab, merges = _toy_files(tmp_path, [("b", "c"), ("a", "b"), ("ab", "c")])
    tokenizer = GPT2BPETokenizer(vocab, merges)
    assert tokenizer.backend == "hf"
    assert "does not encode to itself" in tokenizer.backend_reason
    reference_ids = tokenizer.tokenize("abc")
    assert reference_ids == [tokenizer.vocab["a"], tokenizer.vocab["bc"]]
    model = HFTokenizer(models.BPE.from_file(vocab, merges))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    unchecked = tiktoken.Encoding(
        name="unchecked",
        pat_str=GPT2_SPLIT_PATTERN,
        mergeable_ranks={
            t.encode(): i
            for t, i in tokenizer.vocab.items()
            if t != "<|endoftext|>" and t.isascii()
        }
        | {bytes([b]): tokenizer.vocab[c] for c, b in byte_decoder().items()},
        special_tokens={},
    )
    assert unchecked.encode_ordinary("abc") == [tokenizer.vocab["abc"]] != reference_ids

    # Ids that run against the merge order: rank order would not be merge order.
    vocab, merges = _toy_files(tmp_path, [("a", "b"), ("c", "d")], reorder=True)
    tokenizer = GPT2BPETokenizer(vocab, merges)
    assert tokenizer.backend == "hf"
    assert "increase" in tokenizer.backend_reason


def test_consistent_toy_table_takes_tiktoken(tmp_path):
    vocab, merges = _toy_files(tmp_path, [("a", "b"), ("ab", "c"), ("Ġ", "abc"), ("c", "c")])
    fast = GPT2BPETokenizer(vocab, merges)
    reference = GPT2BPETokenizer(vocab, merges, backend="hf")
    assert fast.backend == "tiktoken"
    texts = ["abc abcc cccc ab abab", " abcabc", "", "cabcab"]
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)
    assert fast.tokenize(" abc") == [fast.vocab["Ġabc"]]


def test_build_reports_other_layouts(shared_data):
    model = models.BPE.from_file(
        str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    )
    tokenizer = HFTokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    encoding, reason = build_tiktoken_bpe(tokenizer)
    assert encoding is None and "add_prefix_space" in reason


def test_a_trained_vocabulary_takes_tiktoken_and_matches(tmp_path, shared_data):
    """`gigatron train-tokenizer` output (HF's BPE trainer) passes the checks: same ids."""
    from gigatron.data.train_tokenizer import main as train_tokenizer

    lines = (shared_data / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    out = tmp_path / "tok"
    argv = ["--input", str(corpus), "--tokenizer-type", "GPT2BPETokenizer"]
    assert train_tokenizer([*argv, "--vocab-size", "1500", "--output-dir", str(out)]) == 0
    files = str(out / "vocab.json"), str(out / "merges.txt")
    fast, reference = GPT2BPETokenizer(*files), GPT2BPETokenizer(*files, backend="hf")
    assert fast.backend == "tiktoken", fast.backend_reason
    texts = [json.loads(line)["text"] for line in lines] + EDGE_CASES
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)
