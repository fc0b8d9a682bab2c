"""The Retro neighbour store: neighbour + continuation tokens per GPT sample, and its errors."""

from __future__ import annotations

import numpy as np
import pytest

from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.retro.project import ProjectDir
from gigatron.data.retro.query import QuerySettings, query_split
from gigatron.data.retro.samples import SampleChunks
from gigatron.data.retro.store import RetroNeighbourStore
from gigatron.errors import GigatronError
from retro_data_helpers import (
    bag_of_tokens,
    brute_force,
    gpt_config,
    gpt_tokenizer,
    tiny_database,
    write_corpus,
)

CHUNK, SEQ = 32, 128


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("retro")
    prefix, tokenizer, project, database, db_embeddings = tiny_database(
        root, SEQ, CHUNK, doc_block_size=7
    )
    train, _, _ = build_gpt_datasets(gpt_config(prefix, SEQ), tokenizer, (20, 2, 0))
    chunks = SampleChunks(train, [prefix], SEQ, CHUNK)
    identity = {"db_identity": database.identity, "dataset_description": train.description}
    query_split(
        project, "train", chunks, bag_of_tokens,
        lambda queries, k: brute_force(db_embeddings, queries, k),
        database, identity, QuerySettings(10, 3, block_size=9),
    )  # fmt: skip
    return project, prefix, tokenizer, train, database


def test_database_chunks_cover_documents_without_eod(project):
    _, prefix, tokenizer, _, database = project
    chunks = np.asarray(database.chunks)
    assert (chunks[:, 3] - chunks[:, 2] <= CHUNK).all() and (chunks[:, 3] > chunks[:, 2]).all()
    from gigatron.data.indexed import IndexedDataset

    dataset = IndexedDataset(prefix)
    for doc in (0, 5, 39):
        rows = chunks[chunks[:, 1] == doc]
        tokens = dataset.get(doc)
        assert tokens[-1] == tokenizer.eod
        np.testing.assert_array_equal(rows[:, 2], np.arange(0, len(tokens) - 1, CHUNK))
        assert rows[-1, 3] == len(tokens) - 1  # the eod is not in the database


def test_neighbour_tokens_are_neighbour_and_continuation(project):
    root, _, tokenizer, train, database = project
    store = RetroNeighbourStore.open(root.root, "train")
    assert (store.chunk_length, store.num_neighbors, store.num_retrieved_chunks) == (CHUNK, 2, 2)
    assert store.eod == tokenizer.eod
    assert len(store) == len(train)
    store.check_dataset(train)
    for sample in (0, 7, len(store) - 1):
        tokens = store.neighbour_tokens(sample)
        assert tokens.shape == (SEQ // CHUNK, 2, 2 * CHUNK) and tokens.dtype == np.int64
        ids = store.neighbor_chunk_ids(sample)
        for c in range(SEQ // CHUNK):
            for k in range(2):
                first = int(ids[c, k])
                assert first >= 0
                expected = np.concatenate(
                    [database.tokens(first), database.tokens((first + 1) % len(database))]
                )
                np.testing.assert_array_equal(tokens[c, k], expected)
    # a short (last) chunk of a document is padded with eod
    short = int(np.flatnonzero(np.asarray(database.chunks)[:, 3] % CHUNK)[0])
    length = int(database.chunks[short, 3] - database.chunks[short, 2])
    assert (database.tokens(short)[length:] == tokenizer.eod).all()


def test_no_neighbour_from_the_samples_own_documents(project):
    root, prefix, _, train, database = project
    store = RetroNeighbourStore.open(root.root, "train", num_neighbors=3)
    chunks = SampleChunks(train, [prefix], SEQ, CHUNK)
    owners = np.asarray(database.chunks)[:, 1]
    for sample in range(len(store)):
        _, _, documents = chunks.sample(sample)
        ids = store.neighbor_chunk_ids(sample)
        assert not np.isin(owners[ids[ids >= 0]], documents).any()


def test_store_errors_name_file_and_fix(project, tmp_path):
    root, _, _, train, _ = project
    with pytest.raises(GigatronError, match=r"query/valid/meta.json: not found; run `gigatron"):
        RetroNeighbourStore.open(root.root, "valid")
    with pytest.raises(GigatronError, match=r"config.json: not found"):
        RetroNeighbourStore.open(tmp_path, "train")
    with pytest.raises(GigatronError, match="--retro-num-neighbors 4: .* holds 3"):
        RetroNeighbourStore.open(root.root, "train", num_neighbors=4)
    with pytest.raises(
        GigatronError, match="--seq-length 256: .*meta.json holds neighbours for seq length 128"
    ):
        RetroNeighbourStore.open(root.root, "train", seq_length=256)
    with pytest.raises(GigatronError, match="--retro-gpt-chunk-length 64: .* chunk length 32"):
        RetroNeighbourStore.open(root.root, "train", seq_length=SEQ, chunk_length=64)
    store = RetroNeighbourStore.open(root.root, "train", seq_length=SEQ, chunk_length=CHUNK)
    _, valid, _ = build_gpt_datasets(gpt_config(train.path, SEQ), gpt_tokenizer(), (20, 2, 0))
    with pytest.raises(GigatronError, match="another GPT dataset"):
        store.check_dataset(valid)


def test_store_refuses_neighbours_of_another_database(project, tmp_path):
    import shutil

    root, _, _, _, _ = project
    copy = ProjectDir(tmp_path / "copy")
    shutil.copytree(root.root, copy.root)
    meta = copy.db_meta.read_text().replace('"identity": "', '"identity": "0')
    copy.db_meta.write_text(meta)
    before = copy.neighbors("train").read_bytes()
    with pytest.raises(GigatronError, match="another chunk database"):
        RetroNeighbourStore.open(copy.root, "train")
    assert copy.neighbors("train").read_bytes() == before
    copy.db_meta.write_text(meta.replace('"fingerprint": "', '"fingerprint": "0'))
    with pytest.raises(GigatronError, match="wiki_text_document: changed since the Retro database"):
        RetroNeighbourStore.open(copy.root, "train")


def test_chunk_length_must_divide_seq_length(project):
    _, prefix, _, train, _ = project
    with pytest.raises(GigatronError, match="--seq-length 128: not a multiple of .* 48"):
        SampleChunks(train, [prefix], SEQ, 48)


def test_blocks_resume_after_a_kill_and_are_dealt_to_ranks(tmp_path):
    from gigatron.data.retro.blocks import read_blocks, run_blocks

    computed = []

    def compute(a, b):
        if len(computed) == 2 and not (tmp_path / "killed").exists():
            (tmp_path / "killed").touch()
            raise KeyboardInterrupt  # the run is killed while computing its third block
        computed.append((a, b))
        return np.arange(a, b) * 10

    with pytest.raises(KeyboardInterrupt):
        run_blocks(tmp_path / "blocks", 23, 5, compute)
    assert run_blocks(tmp_path / "blocks", 23, 5, compute) == 3  # only the missing blocks
    assert computed == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    np.testing.assert_array_equal(
        np.concatenate(read_blocks(tmp_path / "blocks", 23, 5)), np.arange(23) * 10
    )
    assert not list((tmp_path / "blocks").glob(".*"))  # no half-written file left
    ranks = [run_blocks(tmp_path / f"r{r}", 23, 5, lambda a, b: np.zeros(1), r, 2) for r in (0, 1)]
    assert ranks == [3, 2]


def test_blend_samples_name_their_dataset_and_documents(tmp_path):
    """A blended split: each sample's chunks are the blend's tokens, its documents are
    (the member's database dataset, that member's sequences)."""
    from gigatron.data.indexed import IndexedDataset

    tokenizer = gpt_tokenizer()
    first, second = write_corpus(tmp_path, 15, "a"), write_corpus(tmp_path, 15, "b", skip=15)
    cfg = gpt_config(first, SEQ)
    cfg.data.data_path = ["0.3", first, "0.7", second]
    train, _, _ = build_gpt_datasets(cfg, tokenizer, (30, 2, 0))
    chunks = SampleChunks(train, [second, first], SEQ, CHUNK)  # database order: b, a
    datasets = {0: IndexedDataset(second), 1: IndexedDataset(first)}
    seen = set()
    for sample in range(len(train)):
        tokens, dataset_id, documents = chunks.sample(sample)
        np.testing.assert_array_equal(tokens, train[sample]["tokens"])
        member = train.datasets[int(train.dataset_index[sample])]
        assert dataset_id == (0 if member.path == second else 1)
        stream = np.concatenate([datasets[dataset_id].get(int(d)) for d in documents])
        assert np.isin(tokens, stream).all()  # the sample's tokens come from those documents
        seen.add(dataset_id)
    assert seen == {0, 1}
    assert (
        np.concatenate(chunks.tokens(0, 8)).tolist()
        == np.concatenate([train[0]["tokens"], train[1]["tokens"]]).tolist()
    )


def test_filter_keeps_the_first_allowed_and_pads_with_minus_one(project):
    from gigatron.data.retro.query import filter_neighbors

    _, _, tokenizer, _, database = project
    owners = np.array([[0, 3], [0, 3], [0, 4], [0, 5], [0, 6]])  # chunk -> (dataset, document)
    found = np.array([[0, 2, 1, 3, -1], [1, 0, -1, -1, -1]])
    banned = [{(0, 3), (0, 5)}, {(0, 3)}]
    np.testing.assert_array_equal(
        filter_neighbors(found, banned, owners, 3), [[2, -1, -1], [-1, -1, -1]]
    )
    np.testing.assert_array_equal(filter_neighbors(found[:1], [set()], owners, 2), [[0, 2]])
    assert (database.tokens(-1) == tokenizer.eod).all() and len(database.tokens(-1)) == CHUNK
