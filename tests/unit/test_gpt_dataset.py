"""GPTDataset: split bookends, sample contents, flags, caching, mock data, build_gpt_datasets."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from gigatron.config import GigatronConfig
from gigatron.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetOptions,
    build_gpt_datasets,
    default_cache_dir,
    make_sample,
    parse_blend,
    parse_split,
    split_indices,
    split_matrix,
)
from gigatron.data.indexed import IndexedDataset, write_dataset
from gigatron.data.tokenizers import NullTokenizer
from gigatron.errors import GigatronError

EOD = 999


def make_documents(num_docs: int, seed: int = 0) -> list[np.ndarray]:
    """Documents whose tokens say where they come from: doc i holds i*10 + 0, 1, ... then EOD."""
    rng = np.random.RandomState(seed)
    docs = []
    for i in range(num_docs):
        length = int(rng.randint(1, 12))
        tokens = (np.arange(length) % 10 + i * 10) % EOD
        docs.append(np.append(tokens, EOD).astype(np.int64))
    return docs


@pytest.fixture
def corpus(tmp_path):
    docs = make_documents(200)
    prefix = str(tmp_path / "corpus_text_document")
    write_dataset(prefix, [[d] for d in docs], dtype=np.uint16)
    return prefix, docs


def config(prefix=None, seq=16, seed=1234, **data):
    cfg = GigatronConfig()
    cfg.model.seq_length = seq
    cfg.training.seed = seed
    cfg.data.data_path = [prefix] if prefix else None
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


TOKENIZER = NullTokenizer(vocab_size=EOD + 1)


def test_split_bookends_megatron():
    proportions = parse_split("969,30,1")
    assert proportions == pytest.approx([0.969, 0.03, 0.001])
    matrix = split_matrix(proportions)
    assert matrix[0][0] == 0 and isinstance(matrix[0][0], int)
    train, valid, test = (split_indices(1000, b) for b in matrix)
    assert (train[0], train[-1], len(train)) == (0, 968, 969)
    assert (valid[0], valid[-1], len(valid)) == (969, 998, 30)
    assert test.tolist() == [999]
    assert parse_split("90,10") == pytest.approx([0.9, 0.1, 0.0])
    assert split_matrix(parse_split("90,10"))[2] is None
    assert parse_split("1, 1, 1") == pytest.approx([1 / 3] * 3)
    with pytest.raises(GigatronError, match="--split"):
        parse_split("0,0,0")


def test_parse_blend_forms():
    assert parse_blend(["a"], "--data-path") == (["a"], None)
    assert parse_blend(["0.3", "a", "0.7", "b"], "--data-path") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["0.3 a 0.7 b"], "--data-path") == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b", "c"], "--data-path") == (["a", "b", "c"], None)
    with pytest.raises(GigatronError, match="--data-path"):
        parse_blend(["0.3", "a", "b"], "--data-path")


def reference_concatenation(dataset: GPTDataset, docs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([docs[int(d)] for d in dataset.document_index])


def test_samples_are_windows_of_shuffled_documents(corpus):
    prefix, docs = corpus
    train, valid, test = build_gpt_datasets(config(prefix, split="90,5,5"), TOKENIZER, (300, 5, 5))
    seq = 16
    for dataset, lo, hi in ((train, 0, 180), (valid, 180, 190)):
        assert set(np.unique(dataset.document_index).tolist()) == set(range(lo, hi))
        stream = reference_concatenation(dataset, docs)
        assert len(dataset) == (len(stream) - 1) // seq
        for k in range(len(dataset)):
            j = int(dataset.shuffle_index[k])
            window = stream[j * seq : j * seq + seq + 1]
            sample = dataset[k]
            np.testing.assert_array_equal(sample["tokens"], window[:-1])
            np.testing.assert_array_equal(sample["labels"], window[1:])
            assert sample["tokens"].dtype == np.int64 and sample["labels"].dtype == np.int64
            assert sample["loss_mask"].dtype == np.float32 and sample["loss_mask"].all()
            np.testing.assert_array_equal(sample["position_ids"], np.arange(seq))
            assert "attention_mask" not in sample
    assert len(train) >= 300  # several epochs were built to serve 300 samples
    assert sorted(np.asarray(train.shuffle_index).tolist()) == list(range(len(train)))


def test_determinism_and_seed(corpus, tmp_path):
    prefix, _ = corpus
    first = build_gpt_datasets(config(prefix, split="1,0,0"), TOKENIZER, (50, 0, 0))[0]
    again = build_gpt_datasets(config(prefix, split="1,0,0"), TOKENIZER, (50, 0, 0))[0]
    other = build_gpt_datasets(config(prefix, split="1,0,0", seed=7), TOKENIZER, (50, 0, 0))[0]
    same = [np.array_equal(first[k]["tokens"], again[k]["tokens"]) for k in range(50)]
    differ = [np.array_equal(first[k]["tokens"], other[k]["tokens"]) for k in range(50)]
    assert all(same)
    assert not all(differ)
    assert first.unique_description_hash != other.unique_description_hash


def test_cache_files_reuse_and_keys(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    cfg = config(prefix, split="969,30,1", data_cache_path=cache)
    train = build_gpt_datasets(cfg, TOKENIZER, (40, 2, 0))[0]
    assert not train.loaded_from_cache
    files = train.cache_files(cache)
    assert all(os.path.isfile(p) for p in files.values())
    assert os.path.basename(files["sample_index.npy"]).startswith(
        f"{train.unique_description_hash}-GPTDataset-train-"
    )
    # The key is the md5 of the stored description, a JSON of everything the indices depend on.
    with open(files["description.txt"]) as handle:
        text = handle.read()
    assert hashlib.md5(text.encode()).hexdigest() == train.unique_description_hash
    described = json.loads(text)
    assert list(described) == [
        "class", "dataset_path", "num_samples", "index_split", "random_seed",
        "sequence_length", "split", "split_matrix", "tokenizer",
    ]  # fmt: skip
    assert described["split_matrix"][0][0] == 0 and described["num_samples"] == 40
    # No temporary files are left behind.
    assert not [name for name in os.listdir(cache) if "tmp" in name]

    again = build_gpt_datasets(cfg, TOKENIZER, (40, 2, 0))[0]
    assert again.loaded_from_cache
    np.testing.assert_array_equal(again.sample_index, train.sample_index)
    np.testing.assert_array_equal(again[3]["tokens"], train[3]["tokens"])

    for changed in (
        config(prefix, seq=8, split="969,30,1", data_cache_path=cache),
        config(prefix, seed=5, split="969,30,1", data_cache_path=cache),
    ):
        other = build_gpt_datasets(changed, TOKENIZER, (40, 2, 0))[0]
        assert not other.loaded_from_cache
        assert other.unique_description_hash != train.unique_description_hash


def test_default_cache_dir_next_to_the_data(corpus):
    prefix, _ = corpus
    train = build_gpt_datasets(config(prefix, split="1,0,0"), TOKENIZER, (10, 0, 0))[0]
    directory = os.path.join(os.path.dirname(prefix), "cache", "GPTDataset_indices")
    assert default_cache_dir(prefix) == directory
    assert os.path.isfile(train.cache_files(directory)["shuffle_index.npy"])


def test_default_split_warns(corpus):
    prefix, _ = corpus
    with pytest.warns(UserWarning, match="969, 30, 1"):
        train, valid, test = build_gpt_datasets(config(prefix), TOKENIZER, (10, 1, 0))
    assert train.options.split == "969, 30, 1"
    # 200 sequences: train [0, 194), valid [194, 200), test [round(199.8), 200) = empty
    assert set(np.unique(valid.document_index).tolist()) == set(range(194, 200))
    assert test is None


def test_empty_split_with_requested_samples_is_an_error(tmp_path):
    prefix = str(tmp_path / "small")
    write_dataset(prefix, [[d] for d in make_documents(10)], dtype=np.uint16)
    # 10 sequences at 969,30,1: valid = [round(9.69), round(9.99)) = [10, 10), empty.
    with pytest.raises(GigatronError, match=r"valid split.*--split"):
        build_gpt_datasets(config(prefix, split="969,30,1"), TOKENIZER, (5, 3, 0))
    # Asked for nothing, an empty split is simply absent.
    train, valid, test = build_gpt_datasets(config(prefix, split="969,30,1"), TOKENIZER, (5, 0, 0))
    assert valid is None and train is not None


def test_missing_files_and_seq_length(tmp_path):
    with pytest.raises(GigatronError, match="not found"):
        build_gpt_datasets(config(str(tmp_path / "nope"), split="1"), TOKENIZER, (1, 0, 0))
    cfg = config(str(tmp_path / "nope"), split="1")
    cfg.model.seq_length = None
    with pytest.raises(GigatronError, match="--seq-length"):
        build_gpt_datasets(cfg, TOKENIZER, (1, 0, 0))
    with pytest.raises(GigatronError, match="--mock-data"):
        build_gpt_datasets(config(None), TOKENIZER, (1, 0, 0))


def test_per_split_paths(corpus, tmp_path):
    prefix, docs = corpus
    other = str(tmp_path / "other")
    write_dataset(other, [[d] for d in docs[:20]], dtype=np.uint16)
    cfg = config(None, train_data_path=[prefix], valid_data_path=[other])
    train, valid, test = build_gpt_datasets(cfg, TOKENIZER, (20, 4, 0))
    assert test is None
    assert set(np.unique(train.document_index).tolist()) == set(range(200))
    assert set(np.unique(valid.document_index).tolist()) == set(range(20))
    assert valid.index_split == "valid"
    cfg.data.data_path = [prefix]
    with pytest.raises(GigatronError, match="both"):
        build_gpt_datasets(cfg, TOKENIZER, (20, 4, 0))


def test_weighted_blend_from_data_path(corpus, tmp_path):
    prefix, docs = corpus
    other = str(tmp_path / "other")
    write_dataset(other, [[d] for d in docs[:50]], dtype=np.uint16)
    cfg = config(None, split="1,0,0", data_cache_path=str(tmp_path / "c"))
    cfg.data.data_path = ["0.25", prefix, "0.75", other]
    train, valid, test = build_gpt_datasets(cfg, TOKENIZER, (400, 0, 0))
    assert valid is None and test is None
    assert len(train) == 400
    ids = np.array([int(train[k]["dataset_id"]) for k in range(400)])
    assert (ids == 0).sum() == 100 and (ids == 1).sum() == 300
    # member requests: ceil(ceil(400 * w) * 1.005)
    assert train.datasets[0].num_samples == 101 and train.datasets[1].num_samples == 302
    # A blended sample is the member's sample.
    k = int(np.flatnonzero(ids == 1)[5])
    member = train.datasets[1][int(train.dataset_sample_index[k])]
    np.testing.assert_array_equal(train[k]["tokens"], member["tokens"])


def test_unweighted_blend_uses_sizes(corpus, tmp_path):
    prefix, docs = corpus
    other = str(tmp_path / "other")
    write_dataset(other, [[d] for d in docs[:50]], dtype=np.uint16)
    cfg = config(None, split="1,0,0")
    cfg.data.data_path = [prefix, other]
    train = build_gpt_datasets(cfg, TOKENIZER, (10, 0, 0))[0]
    sizes = [len(m) for m in train.datasets]
    assert sizes == [84, 21] and [m.num_samples for m in train.datasets] == [None, None]
    # Megatron-Core: each member read once; the blend holds min(requested, sum of sizes)
    # samples, weighted by the sizes (84 : 21 = 0.8 : 0.2).
    assert len(train) == 10
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [8, 2]


def test_make_sample_flags_hand_computed():
    # text of S + 1 = 9 tokens; eod = 9 at positions 2 and 5.
    text = np.array([1, 2, 9, 3, 4, 9, 5, 6, 7], dtype=np.int64)
    options = GPTDatasetOptions(
        seq_length=8, eod=9, eod_mask_loss=True, reset_position_ids=True,
        reset_attention_mask=True,
    )  # fmt: skip
    sample = make_sample(text, 9, options)
    np.testing.assert_array_equal(sample["tokens"], [1, 2, 9, 3, 4, 9, 5, 6])
    np.testing.assert_array_equal(sample["labels"], [2, 9, 3, 4, 9, 5, 6, 7])
    np.testing.assert_array_equal(sample["loss_mask"], [1, 1, 0, 1, 1, 0, 1, 1])
    np.testing.assert_array_equal(sample["position_ids"], [0, 1, 2, 0, 1, 2, 0, 1])
    mask = sample["attention_mask"]
    assert mask.shape == (1, 8, 8) and mask.dtype == bool
    allowed = ~mask[0]
    # query 4 (second document) sees keys 3..4 only; query 7 sees keys 6..7.
    assert np.flatnonzero(allowed[4]).tolist() == [3, 4]
    assert np.flatnonzero(allowed[7]).tolist() == [6, 7]
    assert np.flatnonzero(allowed[2]).tolist() == [0, 1, 2]

    plain = make_sample(text, 9, GPTDatasetOptions(seq_length=8, eod=9))
    assert plain["loss_mask"].all() and "attention_mask" not in plain
    np.testing.assert_array_equal(plain["position_ids"], np.arange(8))


def test_make_sample_padding_masked_by_position():
    # 5 real tokens of 9; pad id = eod = 9 must not mask the real eod's loss.
    text = np.array([1, 2, 3, 9, 4, 9, 9, 9, 9], dtype=np.int64)
    sample = make_sample(text, 5, GPTDatasetOptions(seq_length=8, eod=9, pad=9))
    np.testing.assert_array_equal(sample["loss_mask"], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(sample["tokens"], [1, 2, 3, 9, 4, 0, 0, 0])
    np.testing.assert_array_equal(sample["labels"], [2, 3, 9, 4, 0, 0, 0, 0])


def test_mock_data():
    cfg = config(None, seq=32, mock_data=True)
    train, valid, test = build_gpt_datasets(cfg, NullTokenizer(vocab_size=100), (64, 8, 8))
    assert min(len(train), len(valid), len(test)) >= 64
    assert train.options.split == "1,1,1"
    first = [train[k]["tokens"] for k in range(8)]
    again = build_gpt_datasets(cfg, NullTokenizer(vocab_size=100), (64, 8, 8))[0]
    for k in range(8):
        np.testing.assert_array_equal(first[k], again[k]["tokens"])
        assert first[k].shape == (32,) and first[k].min() >= 0 and first[k].max() <= 99
    stream = np.concatenate([train[k]["tokens"] for k in range(64)])
    assert (stream == 99).any()  # documents end with eod


def test_indexed_low_level_interface(corpus):
    prefix, docs = corpus
    low = IndexedDataset(prefix)
    options = GPTDatasetOptions(seq_length=4, eod=EOD)
    dataset = GPTDataset(low, prefix, np.arange(10, dtype=np.int32), None, "train", options)
    stream = np.concatenate([docs[int(d)] for d in dataset.document_index])
    assert len(dataset) == (len(stream) - 1) // 4  # one epoch when num_samples is None


class FakeRanks:
    """Stands in for a ParallelContext of two ranks; the barrier has nothing to wait for here."""

    def __init__(self, rank):
        self.rank, self.world_size, self.barriers = rank, 2, 0

    def barrier(self):
        self.barriers += 1


def test_rank_zero_builds_and_other_ranks_load(corpus, tmp_path):
    prefix, _ = corpus
    cfg = config(prefix, split="1,0,0", data_cache_path=str(tmp_path / "ranks"))
    zero, one = FakeRanks(0), FakeRanks(1)
    built = build_gpt_datasets(cfg, TOKENIZER, (30, 0, 0), zero)[0]
    loaded = build_gpt_datasets(cfg, TOKENIZER, (30, 0, 0), one)[0]
    assert zero.barriers == one.barriers == 1
    assert not built.loaded_from_cache and loaded.loaded_from_cache
    np.testing.assert_array_equal(built.shuffle_index, loaded.shuffle_index)


def test_empty_member_of_a_blend_is_an_error(corpus, tmp_path):
    prefix, docs = corpus
    small = str(tmp_path / "small")
    write_dataset(small, [[d] for d in docs[:10]], dtype=np.uint16)
    cfg = config(None, split="969,30,1")
    cfg.data.data_path = [prefix, small]
    with pytest.raises(GigatronError, match=r"valid split of .*small.*--split"):
        build_gpt_datasets(cfg, TOKENIZER, (20, 3, 0))
    cfg.data.data_path = ["0.5", prefix, "0.5", small]
    with pytest.raises(GigatronError, match=r"valid split of .*small.*--split"):
        build_gpt_datasets(cfg, TOKENIZER, (20, 3, 0))


def test_real_text_with_gpt2_tokenizer(shared_data, tmp_path):
    from gigatron.data.tokenizers import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(
        str(shared_data / "gpt2-vocab.json"), str(shared_data / "gpt2-merges.txt")
    )
    lines = (shared_data / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    texts = [line for line in lines if line.strip()][:150]
    docs = [np.array(tokenizer.tokenize(t) + [tokenizer.eod], dtype=np.int64) for t in texts]
    prefix = str(tmp_path / "wiki_text_document")
    write_dataset(prefix, [[d] for d in docs], dtype=np.uint16)
    cfg = config(prefix, seq=64, split="98,2,0", eod_mask_loss=True)
    train, valid, test = build_gpt_datasets(cfg, tokenizer, (100, 4, 0))
    stream = reference_concatenation(train, docs)
    for k in range(0, 100, 7):
        j = int(train.shuffle_index[k])
        sample = train[k]
        np.testing.assert_array_equal(sample["tokens"], stream[j * 64 : j * 64 + 64])
        np.testing.assert_array_equal(sample["loss_mask"] == 0, sample["tokens"] == tokenizer.eod)
    text = tokenizer.detokenize(train[0]["tokens"].tolist())
    assert text in tokenizer.detokenize(stream.tolist())
    described = json.loads(train.description)
    assert described["tokenizer"]["class"] == "GPT2BPETokenizer"


def test_unwritable_cache_warns_and_continues(corpus, tmp_path):
    prefix, _ = corpus
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = config(prefix, split="1,0,0", data_cache_path=str(blocker / "cache"))
    with pytest.warns(UserWarning, match="--data-cache-path"):
        train = build_gpt_datasets(cfg, TOKENIZER, (10, 0, 0))[0]
    assert len(train) >= 10 and train[0]["tokens"].shape == (16,)


def test_a_blend_weight_that_is_not_a_number_is_named(corpus):
    prefix, _ = corpus
    with pytest.raises(GigatronError, match="blend weight 'abc' is not a number"):
        parse_blend(["abc", prefix], "--data-path")
    # Prefixes only (no weights) are still fine when each one is a dataset.
    assert parse_blend([prefix, prefix], "--data-path") == ([prefix, prefix], None)


def test_the_missing_file_of_a_dataset_is_named(corpus):
    prefix, _ = corpus
    os.remove(prefix + ".bin")
    with pytest.raises(GigatronError) as error:
        build_gpt_datasets(config(prefix, split="1"), TOKENIZER, (1, 0, 0))
    assert f"{prefix}.bin not found" in str(error.value)
    assert ".idx" not in str(error.value)  # the index is there
