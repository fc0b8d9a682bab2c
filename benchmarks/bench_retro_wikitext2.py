"""Retro against the same-size GPT on WikiText-2 (CPU): validation perplexity.

    python benchmarks/bench_retro_wikitext2.py [--work DIR] [--train-iters 300] [--seed 1234]
        [--families gpt,retro,retro-shuffled] [--documents article|paragraph]
        [--retriever random|trained [--bert-iters 150] [--bert-hidden 64]]

The pipeline of docs/retro.md end to end, all through the `gigatron` commands:
1. the corpus: WikiText-2's test file (tests/data; the train file is not in the repository), one
   document per article (64 articles) or per paragraph (`--documents paragraph`), GPT-2 tokens;
   the first round(90%) of the articles are the train split, the others the validation split,
   which no model trains on;
2. a BERT embeds the chunks: a random 2-layer one (`pretrain bert`, one step at learning rate 0:
   a random projection of each chunk's tokens), or one trained by `pretrain bert` on the train
   articles (`--retriever trained`);
3. `retro-preprocess` (chunk database, an exact Flat index, the neighbours of every train and
   validation chunk, excluding the sample's own documents);
4. `pretrain gpt` and `pretrain retro` with the same shape, data, seed and schedule, and the
   control `retro-shuffled`: `pretrain retro` reading a copy of the project whose neighbour rows
   are permuted across samples (a fixed permutation drawn with --seed), so each sample gets
   another sample's neighbours (none from its own documents). The validation loss at the end of
   each gives the perplexity (BENCHMARKS.md records them). `--families gpt` and `--families retro`
   in two processes on one `--work` train them side by side once the project is built;
   `--families none` prints the retrieval figures only.

The retrieval figure: of the validation tokens new to their sample (those of chunk j + 1 that
occur nowhere before them in it), the share found in chunk j's neighbours, against the share
found in the control's neighbours and in those of sample i + n/2 (chance).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse

from gigatron.config import GigatronConfig
from gigatron.data.gpt_dataset import build_gpt_datasets
from gigatron.data.indexed import write_dataset
from gigatron.data.retro.project import ProjectDir
from gigatron.data.retro.samples import member_sample, sample_documents
from gigatron.data.retro.store import ChunkDatabase, RetroNeighbourStore
from gigatron.data.tokenizers import GPT2BPETokenizer

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(DATA / "gpt2-vocab.json"),
        "--merge-file", str(DATA / "gpt2-merges.txt")]  # fmt: skip
SEQ, CHUNK = 128, 32
BATCH, EVAL_ITERS = 8, 20
# The validation samples a run asks for: EVAL_ITERS batches at each of (train_iters //
# eval_interval + 1) = 2 evaluations (Megatron's count; --eval-interval is --train-iters).
VALID_SAMPLES = EVAL_ITERS * BATCH * 2


def gigatron(*args: str) -> str:
    """Run `gigatron <args>`; its standard output (a failure raises with the output)."""
    command = [sys.executable, "-m", "gigatron.cli", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def articles(lines: list[str]) -> list[list[str]]:
    """WikiText-2's articles (a ` = Title = ` line starts one), each a list of its paragraphs;
    headings of sections (` = = ... = = `) are dropped."""
    found: list[list[str]] = []
    for line in lines:
        if line.startswith(" = ") and not line.startswith(" = = "):
            found.append([])
        elif line.strip() and not line.startswith(" =") and found:
            found[-1].append(line.strip())
    return [paragraphs for paragraphs in found if paragraphs]


def corpus_documents(found: list[list[str]], by: str) -> tuple[list[str], str]:
    """(documents, --split): one per article, or one per paragraph (the Retro paper's setting:
    the database then holds the other paragraphs of a sample's article). Either way the first
    round(90%) of the articles are the train split and the rest the validation split."""
    if by == "article":
        return ["\n".join(paragraphs) for paragraphs in found], "90,10,0"
    train = int(round(0.9 * len(found)))
    documents = [paragraph for paragraphs in found for paragraph in paragraphs]
    in_train = sum(len(paragraphs) for paragraphs in found[:train])
    return documents, f"{in_train},{len(documents) - in_train},0"  # paragraph counts as weights


def write_corpus(work: Path, texts: list[str], by: str) -> str:
    """The documents, each ending with eod, in the file's order."""
    name = "wikitext2" if by == "article" else f"wikitext2_{by}s"
    prefix = str(work / f"{name}_text_document")
    if not Path(f"{prefix}.idx").is_file():  # (a --work run before wrote it; a run may read it)
        tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
        docs = [[tokenizer.tokenize(text) + [tokenizer.eod]] for text in texts]
        write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


def common_flags(prefix: str, split: str, work: Path, train_iters: int, seed: int) -> list[str]:
    """Data and schedule shared by preprocessing and both models (the sample counts agree)."""
    return [
        "--data-path", prefix, "--split", split, "--seq-length", str(SEQ), *GPT2,
        "--data-cache-path", str(work / "cache"), "--micro-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH), "--train-iters", str(train_iters), "--eval-iters", str(EVAL_ITERS),
        "--eval-interval", str(train_iters), "--seed", str(seed),
    ]  # fmt: skip


BERT = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
        str(DATA / "bert-base-uncased-vocab.txt")]  # fmt: skip
# (this checkout's vocabulary, whichever checkout saved the BERT)
RETRO_BERT = ["--retro-bert-tokenizer-type", BERT[1], "--retro-bert-vocab-file", BERT[3]]
BERT_SHAPE = ["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "128", "--eval-iters", "0", "--num-workers", "0"]  # fmt: skip


def make_random_bert(work: Path) -> Path:
    """A random 2-layer BERT (one step at learning rate 0)."""
    save = work / "bert"
    if (save / "latest_checkpointed_iteration.txt").is_file():  # a --work run before made it
        return save
    gigatron("pretrain", "bert", "--mock-data", *BERT, *BERT_SHAPE, "--hidden-size", "64",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
             "--lr", "0", "--save", save)  # fmt: skip
    return save


def make_trained_bert(work: Path, texts: list[str], tag: str, iters: int, hidden: int) -> Path:
    """A 2-layer BERT trained (masked LM + sentence order, `iters` steps of 16) on the articles
    of the GPT train split only (the first 90%, rounded down), split into sentences."""
    save = work / f"bert-trained{tag}"
    if (save / "latest_checkpointed_iteration.txt").is_file():
        return save
    corpus = work / "bert-train.jsonl"
    train = texts[: math.floor(0.9 * len(texts))]
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in train))
    prefix = work / "bert_wikitext2"
    gigatron("preprocess", "--input", corpus, "--output-prefix", prefix, "--split-sentences",
             *BERT, "--workers", "1")  # fmt: skip
    gigatron("pretrain", "bert", "--data-path", f"{prefix}_text_sentence", "--split", "100,0,0",
             *BERT, *BERT_SHAPE, "--hidden-size", hidden, "--micro-batch-size", "16",
             "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "10", "--train-iters", iters,
             "--data-cache-path", work / "bert-cache", "--log-interval", "50",
             "--save", save)  # fmt: skip
    return save


def validation_loss(metrics: Path) -> float | None:
    """The last validation loss of a run's metrics file (None before the run evaluated)."""
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in rows if r["type"] == "eval" and r.get("split") == "valid"]
    return float(valid[-1]["lm_loss"]) if valid else None


def novel_tokens_retrieved(text: np.ndarray, neighbours: np.ndarray) -> tuple[int, int]:
    """(novel, found): the tokens a sample's chunk groups predict (chunk j + 1, from chunk j's
    neighbours) that occur nowhere before them in the sample, and how many of those occur in
    chunk j's neighbours."""
    novel = found = 0
    for j in range(len(neighbours) - 1):
        retrieved = set(neighbours[j].ravel().tolist())
        for q in range((j + 1) * CHUNK, (j + 2) * CHUNK):
            if text[q] not in text[:q]:
                novel += 1
                found += int(text[q] in retrieved)
    return novel, found


def split_datasets(prefix: str, split: str, work: Path, seed: int, train_iters: int) -> tuple:
    """The (train, valid) GPT datasets that `pretrain` reads with the bench's flags."""
    cfg = GigatronConfig()
    cfg.model.seq_length, cfg.training.seed = SEQ, seed
    cfg.data.data_path, cfg.data.split = [prefix], split
    cfg.data.data_cache_path = str(work / "cache")
    tokenizer = GPT2BPETokenizer(str(DATA / "gpt2-vocab.json"), str(DATA / "gpt2-merges.txt"))
    train, valid, _ = build_gpt_datasets(cfg, tokenizer, (train_iters * BATCH, VALID_SAMPLES, None))
    return train, valid


def other_samples_neighbours(
    neighbors: np.ndarray, own: list[set[int]], chunk_documents: np.ndarray, seed: int
) -> np.ndarray:
    """The neighbour rows under a fixed permutation of the samples (the control): sample i gets
    the neighbours of another sample, none of them, nor their continuations, from one of sample
    i's own documents (the query's filter, kept so that the control leaks no text of sample i;
    a swap repairs each draw that would)."""
    rng = np.random.default_rng(seed)
    total = len(chunk_documents)  # a neighbour's documents: its own and its continuation's
    rows = [row[row >= 0] for row in neighbors.reshape(len(neighbors), -1)]
    donors = [set(chunk_documents[np.concatenate([r, (r + 1) % total])].tolist()) for r in rows]

    def allowed(i: int, j: int) -> bool:
        return i != j and not donors[j] & own[i]

    perm = rng.permutation(len(neighbors))
    for i in range(len(perm)):
        if allowed(i, perm[i]):
            continue
        for k in rng.permutation(len(perm)):  # a swap that leaves sample k allowed too
            if allowed(i, perm[k]) and allowed(k, perm[i]):
                perm[i], perm[k] = perm[k], perm[i]
                break
        else:
            raise SystemExit(f"no other sample's neighbours fit sample {i}")
    return neighbors[perm]


def derived_project(
    project: Path,
    name: str,
    datasets: dict[str, Any],
    rows: Callable[[np.ndarray, Any], np.ndarray],
) -> Path:
    """A copy of `project` (database and index linked) whose neighbours of each split are
    `rows(neighbours, split dataset)`: `pretrain retro` reads it as any project."""
    derived = project.with_name(name)
    if (derived / "query" / "valid" / "neighbors.npy").is_file():
        return derived
    for split, dataset in datasets.items():
        (derived / "query" / split).mkdir(parents=True, exist_ok=True)
        neighbors = np.load(project / "query" / split / "neighbors.npy")
        np.save(derived / "query" / split / "neighbors.npy", rows(neighbors, dataset))
        shutil.copy(project / "query" / split / "meta.json", derived / "query" / split)
    for link in ("config.json", "db", "index"):
        (derived / link).unlink(missing_ok=True)
        (derived / link).symlink_to((project / link).resolve())
    return derived


def shuffled_project(project: Path, datasets: dict[str, Any], seed: int) -> Path:
    """The control: each sample gets another sample's neighbours (other_samples_neighbours)."""
    chunk_documents = np.load(project / "db" / "chunks.npy")[:, 1]

    def rows(neighbors: np.ndarray, dataset: Any) -> np.ndarray:
        own = [
            set(sample_documents(*member_sample(dataset, i)).tolist())
            for i in range(len(neighbors))
        ]
        return other_samples_neighbours(neighbors, own, chunk_documents, seed)

    return derived_project(project, f"{project.name}-shuffled", datasets, rows)


def hit_rate(valid: Any, neighbours: Callable[[int], np.ndarray]) -> float:
    """Of the validation tokens that are new to their sample, the share found in
    `neighbours(i)` (sample i's neighbour tokens [chunks, k, r])."""
    totals = np.zeros(2)
    for i in range(len(valid)):
        sample = valid[i]
        text = np.concatenate([sample["tokens"], sample["labels"][-1:]])
        totals += novel_tokens_retrieved(text, neighbours(i))
    return totals[1] / totals[0]


def valid_store(project: Path, valid: Any) -> RetroNeighbourStore:
    store = RetroNeighbourStore.open(project, "valid", 2, 2, SEQ, CHUNK)
    store.check_dataset(valid)
    return store


class LexicalRetriever:
    """A yardstick, not Retro's retriever: the 2 database chunks nearest to a chunk by the
    cosine of TF-IDF vectors of GPT tokens, the sample's own documents excluded."""

    def __init__(self, database: ChunkDatabase) -> None:
        self.database = database
        self.documents = database.chunks[:, 1]
        counts = self.counts([database.real_tokens(c) for c in range(len(database))])
        seen = np.asarray((counts > 0).sum(0)).ravel()
        self.idf = np.log((len(database) + 1) / (seen + 1))
        self.vectors = self.normalised(counts)

    @staticmethod
    def counts(chunks: list[np.ndarray]) -> sparse.csr_matrix:
        rows = np.repeat(np.arange(len(chunks)), [len(c) for c in chunks])
        cols = np.concatenate(chunks).astype(np.int64)
        return sparse.csr_matrix((np.ones(len(cols)), (rows, cols)), shape=(len(chunks), 1 << 16))

    def normalised(self, counts: sparse.csr_matrix) -> sparse.csr_matrix:
        weighted = sparse.csr_matrix(counts.multiply(self.idf[None, :]))
        norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(1)).ravel()) + 1e-12
        return sparse.csr_matrix(sparse.diags(1 / norms) @ weighted)

    def neighbour_tokens(self, dataset: Any, i: int) -> np.ndarray:
        return np.stack(
            [
                [self.database.retrieved_tokens(int(f), 2) for f in row]
                for row in self.nearest(dataset, i)
            ]
        )

    def nearest(self, dataset: Any, i: int) -> np.ndarray:
        """int64 [chunks, 2]: the database chunks nearest to each chunk of sample i."""
        text = dataset[i]["tokens"][:SEQ]
        member, j = member_sample(dataset, i)
        chunks = [text[c : c + CHUNK] for c in range(0, SEQ, CHUNK)]
        scores = (self.normalised(self.counts(chunks)) @ self.vectors.T).toarray()
        own = np.isin(self.documents, sample_documents(member, j))
        # (as the query, no chunk of the sample's documents; nor one whose continuation, the
        # next database chunk, is one: it would hand the model the sample's own text)
        scores[:, own | np.roll(own, -1)] = -np.inf
        return np.argsort(-scores, axis=1, kind="stable")[:, :2]

    def project(self, project: Path, datasets: dict[str, Any]) -> Path:
        """A copy of `project` whose neighbours are these (the bench's yardstick retriever)."""

        def rows(neighbors: np.ndarray, dataset: Any) -> np.ndarray:
            return np.stack([self.nearest(dataset, i) for i in range(len(neighbors))])

        return derived_project(
            project, project.name.replace("project", "project-tfidf"), datasets, rows
        )


def print_hit_rates(project: Path, shuffled: Path, valid: Any) -> None:
    """The retrieval figures of the module's docstring."""
    own, control = valid_store(project, valid), valid_store(shuffled, valid)
    lexical = LexicalRetriever(own.database)
    rates = [
        hit_rate(valid, own.neighbour_tokens),
        hit_rate(valid, control.neighbour_tokens),
        hit_rate(valid, lambda i: own.neighbour_tokens((i + len(own) // 2) % len(own))),
        hit_rate(valid, lambda i: lexical.neighbour_tokens(valid, i)),
    ]
    print(
        "validation tokens new to their sample found in its neighbours: {:.1%} (in the control's "
        "neighbours: {:.1%}; in those of sample i + n/2: {:.1%}; in the TF-IDF nearest chunks' "
        "(a yardstick): {:.1%})".format(*rates)
    )


def bench_flags() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--families",
        default="gpt,retro",
        help="the models to train, of gpt, retro, retro-shuffled (Retro given another sample's "
        "neighbours: the control); 'none' trains none (retrieval figures only)",
    )
    parser.add_argument(
        "--retriever",
        choices=("random", "trained", "tfidf"),
        default="random",
        help="the BERT that embeds the chunks: random, or trained on the train articles; tfidf: "
        "the random BERT's project with its neighbours replaced by the TF-IDF nearest chunks "
        "(the yardstick retriever, not gigatron's)",
    )
    parser.add_argument("--bert-iters", type=int, default=150, help="steps of the trained BERT")
    parser.add_argument(
        "--bert-hidden", type=int, default=64, help="hidden size of the trained BERT"
    )
    parser.add_argument(
        "--documents",
        choices=("article", "paragraph"),
        default="article",
        help="one document per article, or per paragraph (other paragraphs of a sample's "
        "article are then in its database)",
    )
    return parser.parse_args()


MODEL = ["--num-layers", "6", "--hidden-size", "128", "--num-attention-heads", "4",
         "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--clip-grad", "1.0",
         "--log-interval", "50", "--num-workers", "0"]  # fmt: skip


def main() -> None:
    args = bench_flags()
    work = Path(args.work or tempfile.mkdtemp(prefix="retro-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    found = articles(lines)
    texts, split = corpus_documents(found, args.documents)
    prefix = write_corpus(work, texts, args.documents)
    common = common_flags(prefix, split, work, args.train_iters, args.seed)
    trained = args.retriever == "trained"
    docs_tag = "" if args.documents == "article" else f"-{args.documents}"
    shape = (args.bert_iters, args.bert_hidden)
    bert_tag = "" if shape == (150, 64) else "{}h{}".format(*shape)
    tag = (f"-trained{bert_tag}" if trained else "") + docs_tag
    project = work / f"project{tag}"
    started = time.perf_counter()
    articles_text = ["\n".join(paragraphs) for paragraphs in found]
    bert = (
        make_trained_bert(work, articles_text, bert_tag, *shape)
        if trained
        else make_random_bert(work)
    )
    gigatron("retro-preprocess", "--retro-project-dir", project, "--retro-bert-load",
             bert, "--retro-gpt-chunk-length", CHUNK, "--retro-index-str", "Flat",
             "--retro-bert-max-chunk-length", "96", "--retro-query-num-neighbors-query", "50",
             "--retro-query-num-neighbors-save", "2", "--retro-index-ntrain", "2000",
             *RETRO_BERT, *common)  # fmt: skip
    train, valid = split_datasets(prefix, split, work, args.seed, args.train_iters)
    datasets = {"train": train, "valid": valid}
    if args.retriever == "tfidf":
        project, tag = (
            LexicalRetriever(ChunkDatabase(ProjectDir(project))).project(project, datasets),
            f"-tfidf{tag}",
        )
    shuffled = shuffled_project(project, datasets, args.seed)
    preprocess_s = time.perf_counter() - started
    retro = ["--retro-gpt-chunk-length", str(CHUNK), "--retro-project-dir"]
    results = {}
    for family, extra in (
        ("gpt", []),
        ("retro", [*retro, str(project)]),
        ("retro-shuffled", [*retro, str(shuffled)]),
    ):
        if family not in args.families.split(","):
            continue
        metrics = work / f"{family}{docs_tag if family == 'gpt' else tag}.jsonl"
        started = time.perf_counter()
        if validation_loss(metrics) is None:  # (a --work run before may have trained it)
            metrics.unlink(missing_ok=True)
            model = family.split("-")[0]
            gigatron("pretrain", model, *common, *MODEL, *extra, "--metrics-file", metrics)
        loss = validation_loss(metrics)
        results[family] = (loss, math.exp(loss), time.perf_counter() - started)
    print(f"preprocessing: {preprocess_s:.0f} s")
    print_hit_rates(project, shuffled, valid)
    for family, (loss, ppl, seconds) in results.items():
        print(f"{family}: validation loss {loss:.4f}, perplexity {ppl:.1f} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
