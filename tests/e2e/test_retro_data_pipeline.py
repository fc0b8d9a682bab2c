"""`gigatron retro-preprocess` on WikiText-2 paragraphs with a tiny random BERT: the chunk
database, a flat and an IVF index and the neighbours, checked against brute force; the document
filter; reuse, resumption, two data-parallel ranks; bad input refused with nothing overwritten."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.retro.embeddings import embeddings_dir, load_embeddings
from gigatron.data.retro.project import ProjectDir, read_json
from gigatron.data.retro.samples import SampleChunks
from gigatron.data.retro.store import ChunkDatabase, RetroNeighbourStore
from gigatron.errors import GigatronError
from gigatron.parallel.context import ParallelContext
from gigatron.tasks.retro_embedder import load_bert_embedder
from gigatron.tasks.retro_preprocess import main as retro_preprocess
from helpers import BERT_VOCAB, gigatron
from retro_data_helpers import GPT_FILES, brute_force, gpt_config, gpt_tokenizer, write_corpus

SEQ, CHUNK, SAVE, BLOCK = 128, 64, 4, 100


def make_bert(root: Path) -> Path:
    """A randomly initialised 2-layer BERT checkpoint (one step at learning rate 0)."""
    save = root / "bert"
    gigatron("pretrain", "bert", "--mock-data", "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", BERT_VOCAB, "--num-layers", "2", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "128",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
             "--lr", "1e-4", "--eval-iters", "0", "--save", save)  # fmt: skip
    return save


def flags(project: Path, prefix: str, bert: Path, *extra: str) -> list[str]:
    return [
        "--retro-project-dir", str(project), "--retro-bert-load", str(bert),
        "--retro-bert-max-chunk-length", "128", "--retro-index-ntrain", "150",
        "--retro-block-size", str(BLOCK), "--retro-doc-block-size", "40",
        "--retro-query-num-neighbors-query", "60", "--retro-query-num-neighbors-save", str(SAVE),
        "--data-path", prefix, "--split", "90,10,0", "--seq-length", str(SEQ),
        "--retro-gpt-chunk-length", str(CHUNK), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", GPT_FILES[0], "--merge-file", GPT_FILES[1], "--train-samples", "32",
        "--global-batch-size", "4", "--eval-iters", "1", "--eval-interval", "4",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("retro")
    prefix, bert = write_corpus(root, 90), make_bert(root)
    project = root / "project"
    retro_preprocess(flags(project, prefix, bert, "--retro-index-str", "Flat"))
    flat = {s: np.load(ProjectDir(project).neighbors(s)) for s in ("train", "valid")}
    return root, prefix, bert, ProjectDir(project), flat


@pytest.fixture(scope="module")
def embedder(built):
    return load_bert_embedder(str(built[2]), ParallelContext.single(), gpt_tokenizer(), 128, 64, {})


def exact_neighbours(project: ProjectDir, prefix: str, embedder, split: int) -> np.ndarray:
    """Brute-force neighbours of every chunk of a split, minus the sample's own documents."""
    database = ChunkDatabase(project)
    key = read_json(project.embeddings / "current.json", "")["key"]
    keys = load_embeddings(embeddings_dir(project, key), len(database), BLOCK)
    datasets = build_gpt_datasets(gpt_config(prefix, SEQ), gpt_tokenizer(), (32, 12, None))
    chunks = SampleChunks(datasets[split], [prefix], SEQ, CHUNK)
    found = brute_force(keys, embedder(chunks.tokens(0, len(chunks))), len(database))
    owners = np.asarray(database.chunks[:, 1])
    out = np.full((len(chunks), SAVE), -1)
    for row, ids in enumerate(found):
        own = chunks.sample(row // chunks.chunks_per_sample)[2]
        kept = ids[~np.isin(owners[ids], own)][:SAVE]
        out[row, : len(kept)] = kept
    return out.reshape(-1, SEQ // CHUNK, SAVE)


def test_flat_neighbours_are_brute_force_minus_own_documents(built, embedder):
    root, prefix, bert, project, flat = built
    for split, name in ((0, "train"), (1, "valid")):
        np.testing.assert_array_equal(
            flat[name], exact_neighbours(project, prefix, embedder, split)
        )


def test_embedding_is_the_mean_between_cls_and_sep(built, embedder):
    _, _, bert, project, _ = built
    database = ChunkDatabase(project)
    key = read_json(project.embeddings / "current.json", "")["key"]
    saved = load_embeddings(embeddings_dir(project, key), len(database), BLOCK, [0, 5, 190])
    for row, chunk in zip(saved, (0, 5, 190)):
        ids = embedder.token_ids(database.real_tokens(chunk))
        assert ids[0] == embedder.bert.cls and ids[-1] == embedder.bert.sep
        tokens = torch.tensor([ids])
        with torch.no_grad():
            hidden = embedder.model.encode(tokens, torch.arange(len(ids))[None], None,
                                           torch.zeros_like(tokens))  # fmt: skip
        np.testing.assert_allclose(row, hidden[1:-1, 0].mean(0).numpy(), rtol=1e-4, atol=1e-5)


def test_ivf_recall_and_no_own_document(built):
    _, prefix, bert, project, flat = built
    extra = ["--retro-tasks", "index-build,query-neighbors", "--retro-index-str", "IVF16,Flat",
             "--retro-query-nprobe", "4"]  # fmt: skip
    retro_preprocess(flags(project.root, prefix, bert, *extra))
    ivf = np.load(project.neighbors("train"))
    hits = [
        len(set(a) & set(b)) for a, b in zip(ivf.reshape(-1, SAVE), flat["train"].reshape(-1, SAVE))
    ]
    recall = sum(hits) / flat["train"].size
    assert recall >= 0.9, recall
    added = read_json(project.index_dir("IVF16_Flat") / "added.json", "")
    assert added["ntotal"] == len(ChunkDatabase(project))
    assert not np.array_equal(ivf, flat["train"])  # the IVF search really ran
    store = RetroNeighbourStore.open(project.root, "train")
    datasets = build_gpt_datasets(gpt_config(prefix, SEQ), gpt_tokenizer(), (32, 12, None))
    store.check_dataset(datasets[0])
    chunks = SampleChunks(datasets[0], [prefix], SEQ, CHUNK)
    owners = np.asarray(store.database.chunks[:, 1])
    for sample in range(len(store)):
        ids = store.neighbor_chunk_ids(sample)
        assert (ids >= 0).all() and not np.isin(owners[ids], chunks.sample(sample)[2]).any()
    assert store.neighbour_tokens(3).shape == (SEQ // CHUNK, 2, 2 * CHUNK)


def test_bad_input_is_refused_and_nothing_is_overwritten(built, tmp_path):
    root, prefix, bert, project, _ = built
    fresh = tmp_path / "fresh"
    with pytest.raises(GigatronError, match="--seq-length 96: not a multiple of .* 64"):
        retro_preprocess(
            flags(fresh, prefix, bert, "--seq-length", "96", "--retro-tasks", "db-build")
        )
    with pytest.raises(GigatronError, match="--num-layers: not used by retro-preprocess"):
        retro_preprocess(
            flags(fresh, prefix, bert, "--num-layers", "2", "--retro-tasks", "db-build")
        )
    with pytest.raises(GigatronError, match="--retro-tasks db-bild: unknown task 'db-bild'"):
        retro_preprocess(flags(fresh, prefix, bert, "--retro-tasks", "db-bild"))
    with pytest.raises(GigatronError, match=r"missing\.bin and .*missing\.idx: not found"):
        retro_preprocess(flags(fresh, str(tmp_path / "missing"), bert, "--retro-tasks", "db-build"))
    assert not fresh.exists()
    other = write_corpus(tmp_path, 12, name="other", skip=200)
    before = {p: p.read_bytes() for p in (project.config, project.chunks, project.db_meta)}
    with pytest.raises(
        GigatronError, match="config.json: this project was built for other datasets"
    ):
        retro_preprocess(flags(project.root, other, bert, "--retro-tasks", "db-build"))
    assert before == {p: p.read_bytes() for p in before}
    # an index of another database (copied in) is refused by query-neighbors
    second = ProjectDir(tmp_path / "second")
    retro_preprocess(flags(second.root, other, bert, "--retro-tasks", "db-build",
                           "--retro-block-size", "7"))  # fmt: skip
    shutil.copytree(project.index_dir("Flat"), second.index_dir("Flat"))
    with pytest.raises(GigatronError, match="added.faissindex: built for another chunk database"):
        retro_preprocess(flags(second.root, other, bert, "--retro-tasks", "query-neighbors",
                               "--retro-index-str", "Flat"))  # fmt: skip
    assert not second.query_dir("train").exists()
    # half the database added, block by block (7 chunks each), to an HNSW index
    retro_preprocess(flags(second.root, other, bert, "--retro-tasks", "index-build",
                           "--retro-index-str", "HNSW8", "--retro-index-ntrain", "10",
                           "--retro-index-add-load-fraction", "0.5"))  # fmt: skip
    added = read_json(second.index_dir("HNSW8") / "added.json", "")
    assert added["ntotal"] == len(ChunkDatabase(second)) // 2 > 7


def test_db_build_resumes_and_query_is_reused(built, capsys):
    _, prefix, bert, project, _ = built
    key = read_json(project.embeddings / "current.json", "")["key"]
    blocks = sorted(embeddings_dir(project, key).glob("*.npy"))
    saved = {p: p.read_bytes() for p in [*blocks, project.chunks]}
    blocks[1].unlink()  # as if killed while embedding the second block
    project.chunks.unlink()
    retro_preprocess(flags(project.root, prefix, bert, "--retro-tasks", "db-build"))
    assert saved == {p: p.read_bytes() for p in saved}
    capsys.readouterr()
    args = ["--retro-tasks", "query-neighbors", "--retro-index-str", "IVF16,Flat",
            "--retro-query-nprobe", "4"]  # fmt: skip
    before = project.neighbors("train").stat().st_mtime_ns
    retro_preprocess(flags(project.root, prefix, bert, *args))
    assert "train neighbours reused" in capsys.readouterr().out
    assert project.neighbors("train").stat().st_mtime_ns == before


def test_two_data_parallel_ranks_give_the_one_process_project(built):
    root, prefix, bert, project, flat = built
    dp2 = ProjectDir(root / "dp2")
    gigatron("retro-preprocess", *flags(dp2.root, prefix, bert, "--retro-index-str", "Flat"),
             nproc=2)  # fmt: skip
    np.testing.assert_array_equal(np.load(dp2.chunks), np.load(project.chunks))
    for split in ("train", "valid"):
        np.testing.assert_array_equal(np.load(dp2.neighbors(split)), flat[split])


def test_hugging_face_bert_through_convert_embeds_as_transformers(built, tmp_path, capsys):
    """A Hugging Face BERT converted with `gigatron convert` embeds each chunk as the mean of
    transformers' last hidden state between [CLS] and [SEP]."""
    import transformers

    from gigatron.cli import main as gigatron_main

    _, _, _, project, _ = built
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BertModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert gigatron_main(["convert", "--from", "hf", "--to", "gigatron", "--load",
                          str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0  # fmt: skip
    capsys.readouterr()
    load = (str(tmp_path / "ckpt"), ParallelContext.single(), gpt_tokenizer(), 128, 4)
    with pytest.raises(GigatronError, match="names no tokenizer; give --retro-bert-tokenizer-type"):
        load_bert_embedder(*load, {})
    flags = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": str(BERT_VOCAB)}
    embedder = load_bert_embedder(*load, flags)
    database = ChunkDatabase(project)
    chunks = [database.real_tokens(i) for i in (0, 7, 42, 100, 150)]
    got = embedder(chunks)
    with torch.no_grad():
        for row, chunk in zip(got, chunks):
            ids = torch.tensor([embedder.token_ids(chunk)])
            expected = hf(ids).last_hidden_state[0, 1:-1].mean(0).numpy()
            np.testing.assert_allclose(row, expected, rtol=1e-4, atol=1e-5)
