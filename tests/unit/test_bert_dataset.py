"""BertDataset on a hand-built sentence corpus with the real BERT vocabulary: segments, token
types, sentence order, masking, padding, determinism, splits, blends and the cache."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from gigatron.config import GigatronConfig
from gigatron.data.bert_dataset import BertDataset, build_bert_datasets
from gigatron.data.blend import BlendedDataset
from gigatron.data.indexed import write_dataset
from gigatron.data.loader import build_data_iterator
from gigatron.data.tokenizers import BertWordPieceTokenizer, NullTokenizer
from gigatron.errors import GigatronError
from helpers import WORDS


@pytest.fixture(scope="module")
def tokenizer(shared_data):
    return BertWordPieceTokenizer(str(shared_data / "bert-base-uncased-vocab.txt"), lower_case=True)


def make_documents(tokenizer, num_docs, seed=0, min_sentences=2):
    """Documents of 2-6 sentences of 3-12 words: lists of token-id lists."""
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(num_docs):
        sentences = []
        for _ in range(rng.randint(min_sentences, 7)):
            words = [WORDS[i] for i in rng.randint(0, len(WORDS), size=rng.randint(3, 13))]
            sentences.append(tokenizer.tokenize(" ".join(words) + "."))
        docs.append(sentences)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("bert")
    docs = make_documents(tokenizer, 120)
    prefix = str(directory / "corpus_text_sentence")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix, docs


def config(prefix=None, seq=64, seed=1234, binary_head=True, **data):
    cfg = GigatronConfig()
    cfg.model.seq_length = seq
    cfg.model.bert_binary_head = binary_head
    cfg.training.seed = seed
    cfg.data.data_path = [prefix] if prefix else None
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def sentences_of(dataset, k):
    first, end, target = (int(x) for x in dataset.sample_index[k])
    return [dataset.dataset.get(i).tolist() for i in range(first, end)], target


def unmasked(sample):
    tokens = sample["tokens"].copy()
    masked = sample["loss_mask"] == 1
    tokens[masked] = sample["labels"][masked]
    return tokens


def test_segments_token_types_and_padding(corpus, tokenizer):
    prefix, _ = corpus
    # seq 200 and no short samples: nothing is trimmed, so A and B are whole sentences.
    cfg = config(prefix, seq=200, split="1,0,0", short_seq_prob=0.0)
    train = build_bert_datasets(cfg, tokenizer, (100, 0, 0))[0]
    assert isinstance(train, BertDataset) and len(train) >= 100
    swapped = 0
    for k in range(len(train)):
        sample = train[k]
        assert set(sample) == {
            "tokens", "token_types", "labels", "loss_mask", "padding_mask", "is_random",
        }  # fmt: skip
        assert sample["tokens"].shape == (200,) and sample["tokens"].dtype == np.int64
        assert sample["loss_mask"].dtype == np.float32 and sample["is_random"].shape == ()
        sentences, _ = sentences_of(train, k)
        tokens = unmasked(sample)
        real = int(sample["padding_mask"].sum())
        assert sample["padding_mask"][:real].all() and not sample["padding_mask"][real:].any()
        assert (sample["tokens"][real:] == tokenizer.pad).all()
        seps = np.flatnonzero(tokens[:real] == tokenizer.sep)
        assert tokens[0] == tokenizer.cls and len(seps) == 2 and seps[1] == real - 1
        a, b = tokens[1 : seps[0]].tolist(), tokens[seps[0] + 1 : seps[1]].tolist()
        types = sample["token_types"]
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1 : real] == 1).all()
        assert not types[real:].any()
        # A then B is the sample's sentences cut at a sentence boundary; swapped when is_random.
        first, second = (b, a) if sample["is_random"] else (a, b)
        boundaries = np.cumsum([len(s) for s in sentences]).tolist()
        assert first + second == [t for s in sentences for t in s]
        assert len(first) in boundaries[:-1]
        swapped += int(sample["is_random"])
    # Sentence-order labels are balanced: within four standard deviations of a fair coin.
    assert abs(swapped / len(train) - 0.5) < 4 * np.sqrt(0.25 / len(train))


def test_masking_of_dataset_samples(corpus, tokenizer):
    prefix, _ = corpus
    train = build_bert_datasets(config(prefix, split="1,0,0"), tokenizer, (400, 0, 0))[0]
    masked = real = replaced = 0
    for k in range(400):
        sample = train[k]
        positions = np.flatnonzero(sample["loss_mask"])
        tokens, labels = sample["tokens"], sample["labels"]
        assert not labels[sample["loss_mask"] == 0].any()  # 0 where nothing is predicted
        original = unmasked(sample)
        specials = np.isin(original, [tokenizer.cls, tokenizer.sep]) | (sample["padding_mask"] == 0)
        assert not (specials & (sample["loss_mask"] == 1)).any()  # never [CLS], [SEP], [PAD]
        masked += len(positions)
        real += int(sample["padding_mask"].sum())
        replaced += int((tokens[positions] == tokenizer.mask).sum())
    assert 0.13 < masked / real <= 0.15
    assert abs(replaced / masked - 0.8) < 4 * np.sqrt(0.16 / masked)


def test_trimmed_samples_fit_their_target(corpus, tokenizer):
    prefix, _ = corpus
    train = build_bert_datasets(
        config(prefix, seq=24, split="1,0,0", short_seq_prob=0.5), tokenizer, (300, 0, 0)
    )[0]
    targets = np.asarray(train.sample_index)[:, 2]
    assert targets.max() == 21 and (targets < 21).mean() > 0.3  # seq - 3; short ones drawn
    for k in range(300):
        sample = train[k]
        _, target = sentences_of(train, k)
        real = int(sample["padding_mask"].sum())
        assert real <= target + 3
        tokens = unmasked(sample)
        seps = np.flatnonzero(tokens[:real] == tokenizer.sep)
        # Trimming takes from the longer segment, so neither is emptied.
        assert len(seps) == 2 and seps[0] > 1 and seps[1] > seps[0] + 1


def test_without_binary_head(corpus, tokenizer):
    prefix, _ = corpus
    cfg = config(prefix, seq=200, split="1,0,0", short_seq_prob=0.0, binary_head=False)
    train = build_bert_datasets(cfg, tokenizer, (50, 0, 0))[0]
    for k in range(50):
        sample = train[k]
        sentences, _ = sentences_of(train, k)
        real = int(sample["padding_mask"].sum())
        tokens = unmasked(sample)
        assert int(sample["is_random"]) == 0 and not sample["token_types"].any()
        assert tokens[0] == tokenizer.cls and tokens[real - 1] == tokenizer.sep
        assert tokens[1 : real - 1].tolist() == [t for s in sentences for t in s]
    assert json.loads(train.description)["classification_head"] is False


def test_determinism_and_per_sample_seeds(corpus, tokenizer, tmp_path):
    prefix, _ = corpus
    cfg = config(prefix, split="1,0,0", data_cache_path=str(tmp_path / "c"))
    first = build_bert_datasets(cfg, tokenizer, (60, 0, 0))[0]
    reversed_reads = {k: first[k] for k in reversed(range(60))}
    again = build_bert_datasets(cfg, tokenizer, (60, 0, 0))[0]
    assert again.loaded_from_cache and not first.loaded_from_cache
    for k in range(60):
        for key, value in first[k].items():
            np.testing.assert_array_equal(value, again[k][key])
            np.testing.assert_array_equal(value, reversed_reads[k][key])
    other = build_bert_datasets(config(prefix, split="1,0,0", seed=99), tokenizer, (60, 0, 0))[0]
    assert any(not np.array_equal(first[k]["tokens"], other[k]["tokens"]) for k in range(60))


def test_splits_divide_documents_and_cache_entries(corpus, tokenizer, tmp_path):
    prefix, docs = corpus
    cache = str(tmp_path / "cache")
    cfg = config(prefix, split="8,1,1", data_cache_path=cache)
    train, valid, test = build_bert_datasets(cfg, tokenizer, (50, 10, 5))
    # 120 documents: train [0, 96), valid [96, 108), test [108, 120)
    starts = np.cumsum([0] + [len(d) for d in docs])
    for dataset, lo, hi in ((train, 0, 96), (valid, 96, 108), (test, 108, 120)):
        rows = np.asarray(dataset.sample_index)
        assert rows[:, 0].min() >= starts[lo] and rows[:, 1].max() <= starts[hi]
        assert len(dataset) >= dataset.num_samples
    names = sorted(os.listdir(cache))
    assert len(names) == 6 and all("-BERTMaskedWordPieceDataset-" in n for n in names)
    described = json.loads(
        open(
            os.path.join(
                cache, f"{valid.unique_description_hash}-BERTMaskedWordPieceDataset-description.txt"
            )
        ).read()
    )
    assert list(described) == [
        "class", "dataset_path", "num_samples", "index_split", "random_seed", "sequence_length",
        "split", "split_matrix", "tokenizer", "masking_probability", "short_sequence_probability",
        "masking_max_ngram", "masking_do_full_word", "masking_do_permutation",
        "masking_use_longer_ngrams", "masking_use_geometric_distribution", "classification_head",
    ]  # fmt: skip
    assert described["index_split"] == "valid" and described["masking_max_ngram"] == 3
    changed = build_bert_datasets(config(prefix, split="8,1,1", data_cache_path=cache,
                                         mask_prob=0.2), tokenizer, (50, 10, 5))[0]  # fmt: skip
    assert not changed.loaded_from_cache
    assert changed.unique_description_hash != train.unique_description_hash


def test_blends(corpus, tokenizer, tmp_path):
    prefix, _ = corpus
    other = str(tmp_path / "other_text_sentence")
    write_dataset(other, make_documents(tokenizer, 40, seed=1), dtype=np.uint16)
    cfg = config(None, split="1,0,0", data_cache_path=str(tmp_path / "c"))
    cfg.data.data_path = ["0.25", prefix, "0.75", other]
    train = build_bert_datasets(cfg, tokenizer, (100, 0, 0))[0]
    assert isinstance(train, BlendedDataset) and len(train) == 100
    assert [m.num_samples for m in train.datasets] == [26, 76]  # ceil(ceil(100 w) * 1.005)
    ids = np.array([int(train[k]["dataset_id"]) for k in range(100)])
    assert (ids == 0).sum() == 25
    k = int(np.flatnonzero(ids == 1)[3])
    member = train.datasets[1][int(train.dataset_sample_index[k])]
    np.testing.assert_array_equal(train[k]["tokens"], member["tokens"])
    # Unweighted: each member once, the blend capped at the request.
    cfg.data.data_path = [prefix, other]
    unweighted = build_bert_datasets(cfg, tokenizer, (30, 0, 0))[0]
    assert [m.num_samples for m in unweighted.datasets] == [None, None]
    assert len(unweighted) == 30


def test_batches_from_the_loader(corpus, tokenizer):
    prefix, _ = corpus
    train = build_bert_datasets(config(prefix, seq=32, split="1,0,0"), tokenizer, (16, 0, 0))[0]
    batch = next(build_data_iterator(train, 4, 0, None))
    assert batch["tokens"].shape == (4, 32) and batch["is_random"].shape == (4,)
    assert batch["loss_mask"].dtype.is_floating_point
    np.testing.assert_array_equal(batch["token_types"][1].numpy(), train[1]["token_types"])


def test_mock_data(tokenizer):
    cfg = config(None, seq=48, mock_data=True)
    train, valid, test = build_bert_datasets(cfg, tokenizer, (40, 8, 8))
    assert min(len(train), len(valid), len(test)) >= 8
    again = build_bert_datasets(cfg, tokenizer, (40, 8, 8))[0]
    for k in range(10):
        np.testing.assert_array_equal(train[k]["tokens"], again[k]["tokens"])
        assert train[k]["tokens"][0] == tokenizer.cls and train[k]["loss_mask"].sum() > 0


def test_errors(corpus, tokenizer, tmp_path):
    prefix, _ = corpus
    with pytest.raises(GigatronError, match="BertWordPieceLowerCase"):
        build_bert_datasets(config(prefix, split="1,0,0"), NullTokenizer(100), (10, 0, 0))
    with pytest.raises(GigatronError, match="--seq-length 4"):
        build_bert_datasets(config(prefix, seq=4, split="1,0,0"), tokenizer, (10, 0, 0))
    single = str(tmp_path / "single_text_document")
    write_dataset(single, [[s for s in d[:1]] for d in make_documents(tokenizer, 20)])
    with pytest.raises(GigatronError, match="--split-sentences, or train with --bert-no-binary"):
        build_bert_datasets(config(single, split="1,0,0"), tokenizer, (10, 0, 0))
    # One sentence a document is fine without the binary head.
    cfg = config(single, split="1,0,0", binary_head=False)
    assert len(build_bert_datasets(cfg, tokenizer, (10, 0, 0))[0]) >= 10
    with pytest.raises(GigatronError, match="valid split of .* holds no documents"):
        build_bert_datasets(config(prefix, split="1000,1,0"), tokenizer, (10, 3, 0))
