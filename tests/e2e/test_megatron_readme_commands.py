"""The commands of Megatron-LM's README, run with gigatron: the same flags, the program name
replaced (`tools/preprocess_data.py` -> `gigatron preprocess`, `tasks/main.py` -> `gigatron
evaluate` / `gigatron finetune`, `tools/run_text_generation_server.py` -> `gigatron serve`,
`tools/text_generation_cli.py` -> `gigatron text-generation-cli`, `tools/checkpoint/convert.py`
-> `gigatron convert-checkpoint`) and the sizes shrunk (2 layers, hidden 64). One tiny GPT and
one tiny BERT checkpoint are pretrained once for the module from the preprocessed corpus."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from inference_helpers import env, free_port, stop_server

from forked_cli import run_forked_cli
from gigatron.data.indexed import IndexedDataset

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data"
GPT_VOCAB, GPT_MERGES = DATA / "gpt2-vocab.json", DATA / "gpt2-merges.txt"
BERT_VOCAB = DATA / "bert-base-uncased-vocab.txt"
RACE, MNLI = DATA / "race-sample" / "RACE", DATA / "glue-mnli-sample"
# Megatron's COMMON_TASK_ARGS, the sizes shrunk.
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64"]  # fmt: skip
TIMEOUT_S = 300


def gigatron(*args: str, cwd: Path, ok: bool = True, stdin: str = "", timeout=TIMEOUT_S):
    result = run_forked_cli(list(map(str, args)), env(), timeout, cwd=cwd, stdin=stdin)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A JSON-lines corpus (WikiText paragraphs), preprocessed with the README's two commands."""
    work = tmp_path_factory.mktemp("readme")
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").split("\n")
    documents = [line.strip() for line in lines if len(line.strip()) > 200][:60]
    with open(work / "my-corpus.json", "w", encoding="utf-8") as handle:
        for text in documents:
            handle.write(json.dumps({"text": text}) + "\n")
    gigatron("preprocess", "--input", "my-corpus.json", "--output-prefix", "my-bert",
             "--vocab-file", BERT_VOCAB, "--tokenizer-type", "BertWordPieceLowerCase",
             "--split-sentences", "--workers", "1", cwd=work)  # fmt: skip
    gigatron("preprocess", "--input", "my-corpus.json", "--output-prefix", "my-gpt2",
             "--vocab-file", GPT_VOCAB, "--tokenizer-type", "GPT2BPETokenizer",
             "--merge-file", GPT_MERGES, "--append-eod", "--workers", "1", cwd=work)  # fmt: skip
    (work / "wiki.tokens").write_text("\n".join(lines[:16]), encoding="utf-8")  # WikiText's format
    (work / "wiki-small.tokens").write_text("\n".join(lines[:8]), encoding="utf-8")
    lambada = (DATA / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()[:16]
    (work / "lambada.jsonl").write_text("\n".join(lambada) + "\n", encoding="utf-8")
    return work


# The pretraining run that makes the checkpoints (its flags again for --ckpt-convert-format).
TRAINING = [*SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
            "--train-iters", "2", "--lr-decay-style", "constant", "--split", "98,2,0",
            "--eval-iters", "0", "--save-interval", "2", "--ckpt-format", "torch",
            "--seed", "7"]  # fmt: skip
GPT_DATA = ["--data-path", "my-gpt2_text_document", "--vocab-file", GPT_VOCAB,
            "--merge-file", GPT_MERGES, "--tokenizer-type", "GPT2BPETokenizer"]  # fmt: skip


@pytest.fixture(scope="module")
def gpt(work) -> Path:
    gigatron("pretrain", "gpt", *TRAINING, *GPT_DATA, "--save", "gpt_345m", cwd=work)
    return work / "gpt_345m"


@pytest.fixture(scope="module")
def bert(work) -> Path:
    gigatron("pretrain", "bert", *TRAINING, "--data-path", "my-bert_text_sentence",
             "--vocab-file", BERT_VOCAB, "--tokenizer-type", "BertWordPieceLowerCase",
             "--save", "bert_345m", cwd=work)  # fmt: skip
    return work / "bert_345m"


def test_preprocess_for_bert_and_gpt(work):
    gpt = IndexedDataset(work / "my-gpt2_text_document")
    bert = IndexedDataset(work / "my-bert_text_sentence")
    assert len(gpt) == 60 and len(gpt.document_indices) == 61
    assert len(bert.document_indices) == 61 and len(bert) > 60  # one sequence per sentence
    assert int(gpt[0][-1]) == 50256  # --append-eod: GPT-2's <|endoftext|>


def _zero_shot(work: Path, load: Path, task: str, data: str, *extra: str) -> dict:
    results = work / f"{task}-{load.name}-{Path(data).stem}-{len(extra)}.json"
    if results.is_file():  # the same run, made by an earlier test
        return json.loads(results.read_text())
    gigatron("evaluate", "--task", task, *extra, "--valid-data", data,
             "--load", load, "--results-file", results, "--device", "cpu", cwd=work)  # fmt: skip
    return json.loads(results.read_text())


def _megatron_task_args(task: str) -> list[str]:
    """tasks/main.py's flags in the README (COMMON_TASK_ARGS + the task's own)."""
    flags = [*SHAPE, "--fp16", "--vocab-file", GPT_VOCAB, "--tokenizer-type", "GPT2BPETokenizer"]
    flags += ["--strict-lambada"] if task == "LAMBADA" else []
    return [*flags, "--merge-file", GPT_MERGES, "--micro-batch-size", "8", "--log-interval", "10",
            "--no-load-optim", "--no-load-rng"]  # fmt: skip


def test_wikitext_perplexity_with_megatrons_flags(work, gpt):
    """The README's WikiText command; --fp16 runs the model in fp16: close to the fp32 result,
    not identical."""
    megatron = _zero_shot(work, gpt, "WIKITEXT103", "wiki.tokens", *_megatron_task_args("W"))
    plain = _zero_shot(work, gpt, "WIKITEXT103", "wiki.tokens")
    assert math.isfinite(megatron["avg_loss"]) and megatron["avg_loss"] > 5
    assert megatron["num_original_tokens"] == plain["num_original_tokens"]
    assert abs(megatron["avg_loss"] - plain["avg_loss"]) < 2e-2 * plain["avg_loss"]
    assert megatron["avg_loss"] != plain["avg_loss"]


def test_lambada_accuracy_with_megatrons_flags(work, gpt):
    result = _zero_shot(work, gpt, "LAMBADA", "lambada.jsonl", *_megatron_task_args("LAMBADA"))
    assert result["strict_lambada"] is True and result["num_examples"] == 16
    assert 0 <= result["num_correct"] <= 16


def test_a_flag_that_differs_from_the_checkpoint_is_named(work, gpt):
    result = gigatron("evaluate", "--task", "LAMBADA", "--valid-data", "lambada.jsonl",
                      "--load", gpt, "--num-layers", "3", "--hidden-size", "64", cwd=work,
                      ok=False)  # fmt: skip
    assert result.returncode == 2
    assert "--num-layers 3 (checkpoint: 2)" in result.stderr
    assert "--hidden-size" not in result.stderr  # equal: fine


def test_evaluate_on_a_bert_checkpoint_says_what_evaluate_supports(work, bert):
    result = gigatron("evaluate", "--task", "LAMBADA", "--valid-data", "lambada.jsonl",
                      "--load", bert, cwd=work, ok=False)  # fmt: skip
    assert result.returncode == 2 and "gigatron finetune" in result.stderr, result.stderr


def test_text_generation_server_curl_and_cli(work, gpt):
    """examples/inference/run_text_generation_server_345M.sh's flags under torchrun, then the
    README's curl request and tools/text_generation_cli.py."""
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                "--nnodes", "1", "--node_rank", "0", "--master_addr", "localhost",
                "--master_port", str(free_port())]  # fmt: skip
    flags = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
             "--num-layers", "2", "--hidden-size", "64", "--load", str(gpt),
             "--num-attention-heads", "4", "--max-position-embeddings", "64",
             "--tokenizer-type", "GPT2BPETokenizer", "--fp16", "--micro-batch-size", "1",
             "--seq-length", "64", "--vocab-file", str(GPT_VOCAB),
             "--merge-file", str(GPT_MERGES), "--seed", "42", "--port", str(port)]  # fmt: skip
    process = subprocess.Popen(
        [*launcher, "-m", "gigatron.cli", "serve", *flags], cwd=work, env=env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://localhost:{port}"
    try:
        _wait_for(process, url + "/health", timeout_s=240)
        request = urllib.request.Request(
            url + "/api", method="PUT",
            data=json.dumps({"prompts": ["Hello world"], "tokens_to_generate": 1}).encode(),
            headers={"Content-Type": "application/json; charset=UTF-8"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["tokens"][0][:2] == [15496, 995]  # "Hello", " world"
        assert len(answer["tokens"][0]) == 3 and answer["text"][0].startswith("Hello world")
        cli = gigatron("text-generation-cli", f"localhost:{port}", cwd=work,
                       stdin="Hello world\n3\n", timeout=120)  # fmt: skip
        assert "Megatron Response" in cli.stdout and "Hello world" in cli.stdout, cli.stdout
    finally:
        output = stop_server(process)
    assert "127.0.0.1" in output  # serve listens on this machine unless --host says otherwise


def _wait_for(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited {process.returncode}:\n{process.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if json.loads(response.read())["ready"]:
                    return
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise AssertionError("the server did not answer /health in time")


def _finetune(work: Path, bert: Path, task: str, train: list, valid: list, *own: str):
    """tasks/main.py's fine-tuning flags in the README (COMMON_TASK_ARGS and _EXT)."""
    save = work / f"bert_345m_{task.lower()}"
    common = [*SHAPE, "--fp16", "--vocab-file", BERT_VOCAB]
    ext = ["--train-data", *train, "--valid-data", *valid, "--pretrained-checkpoint", bert,
           "--save-interval", "2", "--save", save, "--log-interval", "1",
           "--eval-interval", "2", "--eval-iters", "1", "--weight-decay", "1.0e-1"]  # fmt: skip
    result = gigatron("finetune", "--task", task, *common, *ext,
                      "--tokenizer-type", "BertWordPieceLowerCase", *own, cwd=work)  # fmt: skip
    return result.stdout + result.stderr, save


def test_race_finetuning_with_megatrons_flags(work, bert):
    valid = [RACE / "dev" / "middle", RACE / "dev" / "high"]
    output, save = _finetune(work, bert, "RACE", [RACE / "train" / "middle"], valid,
                             "--epochs", "1", "--micro-batch-size", "4", "--lr", "1.0e-5",
                             "--lr-warmup-fraction", "0.06")  # fmt: skip
    assert "valid loss at iteration 2" in output  # --eval-interval 2, --eval-iters 1
    assert f"metrics for {valid[1]}: correct / total = " in output
    assert (save / "latest_checkpointed_iteration.txt").is_file()


def test_mnli_finetuning_with_megatrons_flags(work, bert):
    valid = [MNLI / "dev_matched.tsv", MNLI / "dev_mismatched.tsv"]
    output, save = _finetune(work, bert, "MNLI", [MNLI / "dev_matched.tsv"], valid,
                             "--epochs", "1", "--micro-batch-size", "2", "--lr", "5.0e-5",
                             "--lr-warmup-fraction", "0.065")  # fmt: skip
    assert f"metrics for {valid[0]}: correct / total = " in output
    assert (save / "latest_checkpointed_iteration.txt").is_file()


def test_finetune_model_flags_are_checked_against_the_pretrained_checkpoint(work, bert):
    result = gigatron("finetune", "--task", "MNLI", "--num-layers", "2", "--hidden-size", "128",
                      "--num-attention-heads", "4", "--seq-length", "32",
                      "--max-position-embeddings", "64", "--vocab-file", BERT_VOCAB,
                      "--tokenizer-type", "BertWordPieceLowerCase", "--pretrained-checkpoint",
                      bert, "--train-data", MNLI / "dev_matched.tsv", "--valid-data",
                      MNLI / "dev_matched.tsv", "--epochs", "1", "--micro-batch-size", "2",
                      "--lr", "1e-4", "--hidden-dropout", "0", cwd=work, ok=False)  # fmt: skip
    assert result.returncode == 2
    assert "--hidden-size 128 (checkpoint: 64)" in result.stderr, result.stderr
    # the sequence length and dropout may change for fine-tuning; equal shapes are fine
    assert "--seq-length" not in result.stderr and "--num-layers" not in result.stderr


def test_checkpoint_format_conversion_with_pretrain_flags(work, gpt):
    """`pretrain ... --ckpt-convert-format torch_dist --ckpt-convert-save DIR`: the converted
    checkpoint scores WikiText like the original."""
    gigatron("pretrain", "gpt", *TRAINING, *GPT_DATA, "--load", gpt,
             "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save", "gpt_dist",
             cwd=work)  # fmt: skip
    converted = _zero_shot(work, work / "gpt_dist", "WIKITEXT103", "wiki-small.tokens")
    original = _zero_shot(work, gpt, "WIKITEXT103", "wiki-small.tokens")
    assert converted["avg_loss"] == pytest.approx(original["avg_loss"], rel=1e-6)


def test_model_conversion_with_megatrons_converter_flags(work, gpt):
    """tools/checkpoint/convert.py's flags -> gigatron convert-checkpoint."""
    gigatron("convert-checkpoint", "--model-type", "GPT", "--loader", "core", "--saver", "core",
             "--load-dir", gpt, "--save-dir", "gpt_converted",
             "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1",
             cwd=work)  # fmt: skip
    converted = _zero_shot(work, work / "gpt_converted", "WIKITEXT103", "wiki-small.tokens")
    original = _zero_shot(work, gpt, "WIKITEXT103", "wiki-small.tokens")
    assert converted["avg_loss"] == pytest.approx(original["avg_loss"], rel=1e-6)
