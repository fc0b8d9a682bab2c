"""Shared by the test folders (importable as `helpers`: tests/ is on sys.path through
tests/conftest.py): running `gigatron <command>` in a subprocess, alone or under torchrun, tiny
model flag sets, tiny datasets and reading metrics.jsonl."""

from __future__ import annotations

import enum
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from forked_cli import run_forked, run_forked_cli

DATA = Path(__file__).resolve().parent / "data"
LAMBADA = DATA / "lambada_test.jsonl"
BERT_VOCAB = DATA / "bert-base-uncased-vocab.txt"
TIMEOUT_S = 300  # a subprocess that has not ended by then has hung: fail instead of waiting


# ---- subprocesses ----
def env(**extra: str) -> dict[str, str]:
    """This process's environment with one thread per process (torchrun starts several on few
    cores; thread counts also change CPU reduction order) and unbuffered output."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def launcher(nproc: int = 1) -> list[str]:
    """This interpreter, or torchrun with `nproc` local processes when nproc > 1."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc)]  # fmt: skip


def gigatron_command(*args: str, nproc: int = 1) -> list[str]:
    """The command line of `gigatron <args>` (under torchrun when nproc > 1)."""
    return [*launcher(nproc), "-m", "gigatron.cli", *args]


def run(
    command: Sequence[str],
    *,
    check: bool = True,
    timeout: float = TIMEOUT_S,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `command` to its end; with `check`, a non-zero exit fails the test with the command,
    its exit status and both streams. Past `timeout` seconds the command and every process it
    started (torchrun's workers) are killed and the test fails with what they printed."""
    process = subprocess.Popen(
        list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env() if environment is None else environment, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the workers go too
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"timed out after {timeout} s: {' '.join(map(str, command))}\n"
            f"--- stdout\n{stdout}\n--- stderr\n{stderr}"
        ) from None
    return _checked(
        subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), check
    )


def gigatron(
    *args: str, nproc: int = 1, check: bool = True, timeout: float = TIMEOUT_S, **kw
) -> subprocess.CompletedProcess:
    """`gigatron <args>` to its end, as a subprocess would run it (see `run`), without a fresh
    interpreter's imports: one process is forked from a server that has torch imported
    (tests/forked_cli.py), `nproc` ranks are forked as gigatron_sequence forks them."""
    args = tuple(map(str, args))
    if nproc == 1:
        return _checked(run_forked_cli(args, kw.get("environment") or env(), timeout), check)
    with tempfile.TemporaryDirectory(prefix="gigatron-ranks-") as folder:
        out = Path(folder) / "stdout"
        result = _run_sequence([(out, args)], nproc, timeout, check=check, **kw)
        return subprocess.CompletedProcess(
            ["gigatron", *args], result.returncode, out.read_text(encoding="utf-8"), result.stderr
        )


def pretrain(family: str, *flags: str, nproc: int = 1, **kw) -> subprocess.CompletedProcess:
    """`gigatron pretrain <family> <flags>` in a subprocess; see `gigatron`."""
    return gigatron("pretrain", family, *flags, nproc=nproc, **kw)


def gigatron_sequence(
    runs: Sequence[tuple[Path, Sequence[str]]], nproc: int = 1, timeout: float = TIMEOUT_S
) -> list[str]:
    """Run each `gigatron <args>` in turn in one launch (one process, or `nproc` ranks forked
    from one process, with the environment torchrun gives its ranks) instead of one launch
    each; `runs` pairs a file for the command's standard output with its args. The outputs, in
    order; a failing command fails the test."""
    _run_sequence(runs, nproc, timeout)
    return [Path(out).read_text(encoding="utf-8") for out, _ in runs]


def _run_sequence(
    runs: Sequence[tuple[Path, Sequence[str]]],
    nproc: int,
    timeout: float,
    check: bool = True,
    environment: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """tests/gigatron_sequence.py over `runs` in a forked child (tests/forked_cli.py); with
    `check`, a non-zero exit fails the test with both streams."""
    spec = Path(runs[0][0]).parent / f"sequence-{os.getpid()}-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps([[str(out), [str(a) for a in args]] for out, args in runs]))
    environment = environment or env()
    result = run_forked("gigatron_sequence:main", [str(spec), str(nproc)], environment, timeout)
    return _checked(result, check)


def _checked(result: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    """`result`; with `check`, a non-zero exit fails the test with the command and both streams."""
    if check and result.returncode != 0:
        raise AssertionError(
            f"exit {result.returncode}: {' '.join(map(str, result.args))}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    return result


def gigatron_runs(
    root: Path, runs: dict[str, tuple[int, Sequence[str]]], timeout: float = 600
) -> dict[str, str]:
    """Run named `gigatron` commands (name -> (processes, args)) in one launch per process
    count (gigatron_sequence), the largest count first and, within one, in the given order;
    each command's standard output, by name (also in `root/<name>.out`)."""
    outputs: dict[str, str] = {}
    for nproc in sorted({n for n, _ in runs.values()}, reverse=True):
        names = [name for name, (n, _) in runs.items() if n == nproc]
        files = [(root / f"{name.replace('/', '_')}.out", runs[name][1]) for name in names]
        outputs.update(zip(names, gigatron_sequence(files, nproc=nproc, timeout=timeout)))
    return outputs


def wait_for_train_record(metrics: Path, process: subprocess.Popen, seconds: float) -> None:
    """Wait until `metrics` holds a train record; fail if `process` ends first or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if metrics.is_file() and '"type": "train"' in metrics.read_text():
            return
        if process.poll() is not None:
            raise AssertionError(f"the run ended early:\n{process.communicate()[0]}")
        time.sleep(0.2)
    raise AssertionError(f"no iteration logged within {seconds} s")


# ---- tiny models ----
def tiny_gpt_flags(
    *,
    vocab_size: int = 128,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    seq_length: int = 16,
    micro_batch_size: int = 2,
) -> list[str]:
    """Mock data and a small GPT (2 layers, hidden 64 unless told): add the batch and schedule."""
    return [
        "--mock-data", "--vocab-size", str(vocab_size), "--num-layers", str(num_layers),
        "--hidden-size", str(hidden_size), "--num-attention-heads", str(num_attention_heads),
        "--seq-length", str(seq_length), "--micro-batch-size", str(micro_batch_size),
    ]  # fmt: skip


# Multi-latent attention's sizes in the tiny models (with a query latent and latent norms).
TINY_MLA = dict(
    multi_latent_attention=True, qk_layernorm=True, q_lora_rank=24, kv_lora_rank=16,
    qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12,
)  # fmt: skip
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
WEIGHTS_ONLY = ["--no-load-optim", "--no-load-rng", "--skip-train"]


# ---- tiny datasets ----
# Common English words (all in the BERT WordPiece vocabulary) to make random sentences of.
WORDS = (
    "the cat sat on a mat while the dog ran around an old red barn and birds sang in tall "
    "green trees near a quiet river where children played games until evening came"
).split()


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    """One JSON object a line."""
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def lambada_lines(count: int, skip: int = 0) -> list[str]:
    """The first `count` lines (after `skip`) of tests/data/lambada_test.jsonl, as written."""
    return LAMBADA.read_text(encoding="utf-8").splitlines()[skip : skip + count]


def lambada_corpus(path: Path, count: int) -> Path:
    """A JSON-lines corpus of `count` LAMBADA passages ({"text": ...} a line)."""
    path.write_text("\n".join(lambada_lines(count)) + "\n", encoding="utf-8")
    return path


def wordpiece_sentences(directory: Path, count: int = 300) -> str:
    """`count` LAMBADA passages, sentence-split and WordPiece-tokenised by `gigatron preprocess`:
    the --data-path of a BERT or T5 run."""
    corpus = lambada_corpus(directory / "corpus.jsonl", count)
    gigatron("preprocess", "--input", corpus, "--output-prefix", directory / "wiki",
             "--split-sentences", "--tokenizer-type", "BertWordPieceLowerCase",
             "--vocab-file", BERT_VOCAB, "--workers", "1")  # fmt: skip
    return str(directory / "wiki_text_sentence")


# ---- metrics.jsonl ----
def records(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a metrics file (or of `<directory>/metrics.jsonl`), of one type if given."""
    if path.is_dir():
        path = path / "metrics.jsonl"
    every = [json.loads(line) for line in path.read_text().splitlines()]
    return every if kind is None else [r for r in every if r["type"] == kind]


def train_values(source: Path | list[dict], key: str = "lm_loss") -> dict[int, float]:
    """{iteration: value} of the train records (of a metrics path or already read records)."""
    rows = records(source) if isinstance(source, Path) else source
    return {r["iteration"]: r[key] for r in rows if r["type"] == "train"}


def eval_record(path: Path, split: str = "test") -> dict:
    """The one eval record of `split`."""
    (record,) = [r for r in records(path, "eval") if r["split"] == split]
    return record


def loss_on_test_split(path: Path, key: str = "lm_loss") -> float:
    """The test split's `key` of a metrics file (or of a run directory)."""
    return eval_record(path, "test")[key]


# ---- pickles ----
class GetattrOf:
    """Pickled by EnumsByGetattr as getattr(cls, name): a reach a safe reader must refuse."""

    def __init__(self, cls: type, name: str) -> None:
        self.cls, self.name = cls, name


class EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.4 do: getattr(their class, their name), and
    the global enums (signals) by their module's name (`signal.SIGTERM`)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, signal.Signals):
            return obj.name
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, GetattrOf):
            return getattr, (obj.cls, obj.name)
        return NotImplemented
