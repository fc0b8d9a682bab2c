"""The lm-evaluation-harness model `gigatron`: its loglikelihoods are gigatron's own per-token
losses, its rolling loglikelihood covers every token once, and the harness's LAMBADA (a local
copy of lambada_openai over tests/data) agrees with `gigatron evaluate --strict-lambada`."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing may be downloaded
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from task_helpers import lambada_texts, memorise, save, tiny_model  # noqa: E402

from gigatron.integrations.lm_eval import GigatronLM  # noqa: E402
from gigatron.tasks.evaluate import evaluate  # noqa: E402
from helpers import env, gigatron  # noqa: E402

SEQ = 32
TASK_YAML = """task: gigatron_lambada_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _same_split(text: str) -> bool:
    """The harness splits the last word off at a space, Megatron at any whitespace."""
    last = text.split()[-1]
    return " ".join(text.split(" ")[:-1]) == text[: text.rfind(last)].strip()


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm_eval")
    cfg, tokenizer, chunk = tiny_model(SEQ)
    texts = [t for t in lambada_texts(60) if _same_split(t)]
    memorise(chunk, tokenizer, texts[:4], SEQ)
    save(directory / "ckpt", cfg, chunk)
    data = directory / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:24]))
    model = GigatronLM(load=str(directory / "ckpt"), device="cpu", batch_size=4)
    return directory, tokenizer, chunk, data, model


def _request(kind, args, index=0):
    return Instance(request_type=kind, doc={}, arguments=args, idx=index)


def _token_losses(chunk, ids):
    tokens = torch.tensor(ids)
    with torch.no_grad():
        logits = chunk(tokens[None, :-1], None)[0].float()
    return F.cross_entropy(logits, tokens[1:], reduction="none"), logits.argmax(-1)


def test_loglikelihood_is_minus_the_summed_token_losses(memorised):
    _, tokenizer, chunk, _, model = memorised
    pairs = [("The cat sat on the", " mat"), ("", "Hello world"), ("One two", " three four five")]
    results = model.loglikelihood([_request("loglikelihood", p, i) for i, p in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, results):
        ctx = tokenizer.tokenize(context) if context else [tokenizer.eod]
        cont = tokenizer.tokenize(continuation)
        losses, predicted = _token_losses(chunk, ctx + cont)
        n = len(cont)
        assert logprob == pytest.approx(-losses[-n:].sum().item(), rel=1e-5)
        assert greedy == bool((predicted[-n:] == torch.tensor(cont)).all())


def test_rolling_loglikelihood_scores_every_token_once(memorised):
    _, tokenizer, chunk, _, model = memorised
    text = " ".join(lambada_texts(1, skip=300))  # longer than the model's 32-token window
    ids = tokenizer.tokenize(text)
    assert len(ids) > 2 * SEQ
    (total,) = model.loglikelihood_rolling([_request("loglikelihood_rolling", (text,))])
    # By hand: the first window starts at end-of-document; each later one scores the next
    # SEQ tokens with the longest context that fits.
    full = [tokenizer.eod, *ids]
    scored = 0.0
    done = 0  # tokens of `ids` scored so far
    while done < len(ids):
        end = min(done + SEQ, len(ids))  # score ids[done:end]
        window = full[max(0, end - SEQ) : end + 1]
        losses, _ = _token_losses(chunk, window)
        scored += losses[-(end - done) :].sum().item()
        done = end
    assert total == pytest.approx(-scored, rel=1e-5)


def test_generate_until_stops_at_the_stop_string(memorised):
    _, tokenizer, _, _, model = memorised
    (text,) = model.generate_until(
        [_request("generate_until", ("The", {"until": ["\n"], "max_gen_toks": 6}))]
    )
    assert "\n" not in text
    assert len(tokenizer.tokenize(text)) <= 6


def _task_dir(tmp_path: Path, data: Path) -> Path:
    """A folder holding the local LAMBADA task's YAML over `data`."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lambada_local.yaml").write_text(TASK_YAML.format(path=data))
    return tasks


def test_harness_lambada_agrees_with_gigatron_evaluate(memorised, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    directory, _, _, data, model = memorised
    tasks = _task_dir(tmp_path, data)
    output = simple_evaluate(
        model=model,
        tasks=["gigatron_lambada_local"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    )
    harness = output["results"]["gigatron_lambada_local"]["acc,none"]
    ours = evaluate(["--load", str(directory / "ckpt"), "--device", "cpu", "--task", "LAMBADA",
                     "--strict-lambada", "--valid-data", str(data), "--no-progress-bar"])  # fmt: skip
    assert ours["num_examples"] == 24
    assert ours["num_correct"] >= 4  # the memorised passages
    assert harness == pytest.approx(ours["accuracy"])


def test_gigatron_lm_eval_command_runs_the_harness(memorised, tmp_path):
    directory, _, _, data, _ = memorised
    tasks = _task_dir(tmp_path, data)
    result = gigatron(
        "lm-eval", "--model", "gigatron", "--model_args", f"load={directory / 'ckpt'},device=cpu",
        "--tasks", "gigatron_lambada_local", "--include_path", str(tasks),
        environment=env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    ours = evaluate(["--load", str(directory / "ckpt"), "--device", "cpu", "--task", "LAMBADA",
                     "--strict-lambada", "--valid-data", str(data), "--no-progress-bar"])  # fmt: skip
    (row,) = [line for line in result.stdout.splitlines() if "|gigatron_lambada_local|" in line]
    value = float(row.split("|")[7])
    assert value == pytest.approx(ours["accuracy"], abs=5e-5)
