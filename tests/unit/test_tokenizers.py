"""Tokenizers against reference encodings (GPT-2, BERT), the SentencePiece library, hand-built
tiktoken files and Hugging Face `transformers`."""

from __future__ import annotations

import base64
import json

import pytest
import sentencepiece

from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError

TEXTS = [
    "Hello world, it's a test.",
    "The quick brown fox jumps over the lazy dog!",
    "",
    "  leading spaces and\nnewlines\n",
    "Ünïcödé façade — 東京",
]


def test_gpt2_reproduces_reference(shared_data, gpt2_tokenizer):
    reference = json.loads(
        (shared_data / "tokenizer-reference/gpt2_encoded_tokens.json").read_text()
    )
    tokenizer = gpt2_tokenizer
    assert tokenizer.tokenize(reference["text"]) == reference["token_ids"]
    assert tokenizer.detokenize(reference["token_ids"]) == reference["decoded_text"]
    assert tokenizer.vocab_size == 50257
    assert tokenizer.eod == 50256
    assert tokenizer.pad is None and tokenizer.cls is None
    assert tokenizer.tokenize_batch([reference["text"], "Hello"]) == [
        reference["token_ids"],
        [15496],
    ]
    # Byte-level BPE round-trips any text.
    for text in TEXTS:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(t) for t in TEXTS]


def test_gpt2_identifiers(gpt2_tokenizer):
    ids = gpt2_tokenizer.unique_identifiers
    assert ids["class"] == "GPT2BPETokenizer"
    assert ids["vocab_file"].endswith("gpt2-vocab.json")
    assert ids["merge_file"].endswith("gpt2-merges.txt")


def test_bert_lowercase_reproduces_reference(shared_data):
    reference = json.loads(
        (shared_data / "tokenizer-reference/bert_uncased_encoded.json").read_text()
    )
    tokenizer = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="BertWordPieceLowerCase",
            vocab_file=str(shared_data / "bert-base-uncased-vocab.txt"),
        )
    )
    ids = tokenizer.tokenize(reference["text"])
    # The reference includes [CLS] ... [SEP]; tokenize adds no special tokens (datasets do).
    assert [tokenizer.cls, *ids, tokenizer.sep] == reference["token_ids"]
    assert tokenizer.detokenize(reference["token_ids"]) == reference["decoded_text"]
    assert (tokenizer.pad, tokenizer.unk, tokenizer.cls, tokenizer.sep, tokenizer.mask) == (
        0,
        100,
        101,
        102,
        103,
    )
    # Megatron appends [BOS] and [EOS] after the 30522 entries of vocab.txt.
    assert (tokenizer.bos, tokenizer.eos, tokenizer.vocab_size) == (30522, 30523, 30524)
    assert tokenizer.eod == tokenizer.sep
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(t) for t in TEXTS]


def test_bert_case_keeps_case_and_extra_ids(shared_data):
    lower = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="BertWordPieceLowerCase",
            vocab_file=str(shared_data / "bert-base-uncased-vocab.txt"),
        )
    )
    cased = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="BertWordPieceCase",
            vocab_file=str(shared_data / "bert-base-uncased-vocab.txt"),
            vocab_extra_ids=3,
        )
    )
    # The uncased vocabulary has no "Hello", so the cased tokenizer falls back to [UNK].
    assert lower.tokenize("Hello") == [7592]
    assert cased.tokenize("Hello") == [100]
    assert cased.additional_special_tokens_ids == [30524, 30525, 30526]
    assert cased.vocab_size == 30527
    assert cased.detokenize([7592, 30524]) == "hello <extra_id_0>"


def test_sentencepiece_types(shared_data):
    model = str(shared_data / "spm-botchan-unigram-1000.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "I am a cat. As yet I have no name."
    expected = processor.encode(text)

    plain = build_tokenizer(
        TokenizerConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=model)
    )
    assert plain.tokenize(text) == expected
    assert plain.detokenize(expected) == text
    assert (plain.vocab_size, plain.bos, plain.eos, plain.eod, plain.unk, plain.pad) == (
        1000,
        1,
        2,
        2,
        0,
        None,
    )
    assert plain.tokenize_batch([text, "cat"]) == [expected, processor.encode("cat")]

    llama = build_tokenizer(
        TokenizerConfig(tokenizer_type="Llama2Tokenizer", tokenizer_model=model)
    )
    assert llama.tokenize(text) == [1, *expected]
    assert llama.tokenize_batch([text]) == [[1, *expected]]
    assert llama.eod == 2

    megatron = build_tokenizer(
        TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=model)
    )
    # <CLS> <SEP> <EOD> <MASK> <PAD> are appended; <s> and </s> exist in the model.
    assert (megatron.cls, megatron.sep, megatron.eod, megatron.mask, megatron.pad) == (
        1000,
        1001,
        1002,
        1003,
        1004,
    )
    assert (megatron.bos, megatron.eos, megatron.vocab_size) == (1, 2, 1005)
    with_special = text + "<EOD>" + "cat"
    assert megatron.tokenize(with_special) == [*expected, 1002, *processor.encode("cat")]
    assert megatron.tokenize_batch([with_special, text]) == [
        megatron.tokenize(with_special),
        expected,
    ]
    assert megatron.detokenize([*expected, 1002]) == text + " <EOD> "


def write_tiny_tiktoken(path, merges=(b"th", b"the", b" the", b"ca", b"cat")) -> None:
    with open(path, "wb") as stream:
        for i in range(256):
            stream.write(base64.b64encode(bytes([i])) + b" %d\n" % i)
        for j, merge in enumerate(merges):
            stream.write(base64.b64encode(merge) + b" %d\n" % (256 + j))


def test_tiktoken_file(tmp_path):
    write_tiny_tiktoken(tmp_path / "tiny.tiktoken")
    tokenizer = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="TikTokenizer",
            tokenizer_model=str(tmp_path / "tiny.tiktoken"),
            tiktoken_num_special_tokens=10,
        )
    )
    # "the" is merge rank 257, " " is byte 32, "cat" is rank 260; all shifted by 10 specials.
    assert tokenizer.tokenize("the cat") == [267, 42, 270]
    assert tokenizer.tokenize_batch(["the cat", "a"]) == [[267, 42, 270], [ord("a") + 10]]
    assert tokenizer.detokenize([267, 42, 270]) == "the cat"
    assert (tokenizer.unk, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (0, 1, 2, 2)
    assert tokenizer.vocab_size == 10 + 261


def test_tiktoken_megatron_json_and_vocab_cut(tmp_path):
    entries = [
        {"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": ""}
        for i in range(256)
    ] + [{"rank": 256, "token_bytes": base64.b64encode(b"ab").decode(), "token_str": "ab"}]
    (tmp_path / "vocab.json").write_text(json.dumps(entries))
    config = TokenizerConfig(
        tokenizer_type="TikTokenizer",
        tokenizer_model=str(tmp_path / "vocab.json"),
        tiktoken_num_special_tokens=5,
        tiktoken_pattern="v1",
    )
    assert build_tokenizer(config).tokenize("ab") == [261]
    config.vocab_size = 5 + 256  # cuts the "ab" merge
    assert build_tokenizer(config).tokenize("ab") == [ord("a") + 5, ord("b") + 5]


def test_huggingface_local_directory(tmp_path, shared_data):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    hf = Tokenizer(
        models.BPE.from_file(
            str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
        )
    )
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 50256)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": {"content": "<|endoftext|>"}})
    )
    tokenizer = build_tokenizer(
        TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    )
    reference = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        assert tokenizer.tokenize(text) == reference(text).input_ids
    assert tokenizer.tokenize("Hello") == [50256, 15496]
    assert tokenizer.tokenize_batch(["Hello"]) == [[50256, 15496]]
    assert (tokenizer.eod, tokenizer.bos, tokenizer.vocab_size) == (50256, 50256, 50257)
    assert tokenizer.detokenize([15496]) == "Hello"
    # The tokenizer.json path works too, and special tokens can be left out.
    bare = build_tokenizer(
        TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer",
            tokenizer_model=str(tmp_path / "tokenizer.json"),
            tokenizer_hf_no_include_special_tokens=True,
        )
    )
    assert bare.tokenize("Hello") == [15496]


def test_null_tokenizer():
    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tokenizer.tokenize("1 2  30") == [1, 2, 30]
    assert tokenizer.detokenize([4, 5]) == "4 5"
    assert (tokenizer.vocab_size, tokenizer.eod) == (100, 99)
    custom = build_tokenizer(
        TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=100, null_tokenizer_eod_id=0)
    )
    assert custom.eod == 0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (TokenizerConfig(tokenizer_type="GPT2BPETokenizer"), "--vocab-file is required"),
        (
            TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="/nonexistent/v.json"),
            "--vocab-file /nonexistent/v.json: file not found",
        ),
        (TokenizerConfig(tokenizer_type="BertWordPieceCase"), "--vocab-file is required"),
        (TokenizerConfig(tokenizer_type="Llama2Tokenizer"), "--tokenizer-model is required"),
        (
            TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="gpt2"),
            "--tokenizer-model gpt2: no tokenizer.json",
        ),
        (TokenizerConfig(tokenizer_type="NullTokenizer"), "--vocab-size is required"),
        (TokenizerConfig(), "--tokenizer-type is required"),
    ],
)
def test_missing_inputs_name_the_flag(config, message):
    with pytest.raises(GigatronError, match=message):
        build_tokenizer(config)


def test_gpt2_missing_merge_file(shared_data):
    config = TokenizerConfig(
        tokenizer_type="GPT2BPETokenizer", vocab_file=str(shared_data / "gpt2-vocab.json")
    )
    with pytest.raises(GigatronError, match="--merge-file is required"):
        build_tokenizer(config)


def test_not_a_sentencepiece_model(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"not a model")
    config = TokenizerConfig(
        tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "bad.model")
    )
    with pytest.raises(GigatronError, match="not a SentencePiece model"):
        build_tokenizer(config)
