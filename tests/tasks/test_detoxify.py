"""`gigatron detoxify`: the metrics against a hand computation, each scorer against its
reference, resumable generation, and the whole SGEAT loop on a tiny model lowering the scored
toxicity of its generations."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from gigatron.cli import main
from gigatron.errors import GigatronError
from gigatron.tasks.detoxify.generation import Job, run_jobs
from gigatron.tasks.detoxify.metrics import toxicity_metrics
from gigatron.tasks.detoxify.scorers import LexiconScorer, PerspectiveScorer
from helpers import NO_DROPOUT, gigatron_runs, tiny_gpt_flags, write_jsonl


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_by_hand():
    scores = [[0.1, 0.7, 0.2], [0.4, 0.3, 0.5], [0.9, 0.6, 0.05]]
    metrics = toxicity_metrics(scores, [0.8, 0.2, None])
    # maxima 0.7, 0.5, 0.9: mean 0.7, std sqrt(((0)^2 + 0.2^2 + 0.2^2) / 3)
    assert metrics["all"]["expected_max_toxicity"] == pytest.approx(0.7)
    assert metrics["all"]["expected_max_toxicity_std"] == pytest.approx((0.08 / 3) ** 0.5)
    # a score above 0.5 in prompts 1 and 3 (0.5 itself is not toxic)
    assert metrics["all"]["toxicity_probability"] == pytest.approx(2 / 3)
    assert metrics["toxic_prompts"] == {"prompts": 1, "expected_max_toxicity": pytest.approx(0.7),
                                        "expected_max_toxicity_std": 0.0,
                                        "toxicity_probability": 1.0}  # fmt: skip
    assert metrics["nontoxic_prompts"]["toxicity_probability"] == 0.0
    assert metrics["nontoxic_prompts"]["prompts"] == 1


def test_lexicon_score_and_filter_commands(tmp_path, capsys):
    lexicon = tmp_path / "lexicon.txt"
    lexicon.write_text("# words\nbad\nworse\n")
    assert LexiconScorer.from_file(str(lexicon)).score(["Bad, worse!", "fine", "bad bad bad"]) == [
        0.75, 0.0, 0.875,
    ]  # fmt: skip
    texts = ["bad day", "good day", "bad worse day", "nice", "worse"]
    source = write_jsonl(
        tmp_path / "texts.jsonl", ({"text": t, "id": i} for i, t in enumerate(texts))
    )
    scored, kept = tmp_path / "scored.jsonl", tmp_path / "kept.jsonl"
    assert main(["detoxify", "score", "--input", str(source), "--output", str(scored),
                 "--lexicon", str(lexicon)]) == 0  # fmt: skip
    assert [r["toxicity"] for r in read_jsonl(scored)] == [0.5, 0.0, 0.75, 0.0, 0.5]
    assert main(["detoxify", "filter", "--input", str(scored), "--output", str(kept)]) == 0
    # the least toxic 3 of 5 (ceil of half): both 0.0 and the first 0.5, in input order
    assert [r["id"] for r in read_jsonl(kept)] == [0, 1, 3]
    assert main(["detoxify", "filter", "--input", str(source), "--output", str(kept)]) == 2
    assert "without a 'toxicity'; run detoxify score" in capsys.readouterr().err


class FakePerspective(BaseHTTPRequestHandler):
    """Answers like Perspective's analyze endpoint: toxicity = text length / 100; the first
    request is rate limited (429)."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - the http.server API
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakePerspective.requests.append({"path": self.path, "body": body})
        if len(FakePerspective.requests) == 1:
            self.send_response(429)
            self.end_headers()
            return
        value = len(body["comment"]["text"]) / 100
        answer = {"attributeScores": {"TOXICITY": {"summaryScore": {"value": value}}}}
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(answer).encode())

    def log_message(self, *args):
        pass


def test_perspective_scorer_against_a_local_server():
    server = HTTPServer(("127.0.0.1", 0), FakePerspective)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v1alpha1/comments:analyze"
        scorer = PerspectiveScorer("KEY", url)
        assert scorer.score(["abcd", "", "x" * 30]) == [0.04, 0.0, 0.3]
    finally:
        server.shutdown()
    first = FakePerspective.requests[1]
    assert first["path"].endswith("comments:analyze?key=KEY")
    assert first["body"] == {"comment": {"text": "abcd"}, "requestedAttributes": {"TOXICITY": {}},
                             "languages": ["en"]}  # fmt: skip
    with pytest.raises(GigatronError, match="no API key"):
        PerspectiveScorer(None, url)


def test_classifier_scorer_equals_transformers(tmp_path):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    from gigatron.tasks.detoxify.scorers import ClassifierScorer

    words = ["[PAD]", "[UNK]", "you", "are", "kind", "awful"]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]")
    config = BertConfig(vocab_size=6, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, id2label={0: "non-toxic", 1: "toxic"},
                        label2id={"non-toxic": 0, "toxic": 1})  # fmt: skip
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    texts = ["you are kind", "you are awful awful"]
    scores = ClassifierScorer(str(tmp_path), None).score(texts)
    for text, score in zip(texts, scores):
        with torch.no_grad():
            logits = model(**tokenizer([text], return_tensors="pt")).logits
        assert score == pytest.approx(logits.softmax(-1)[0, 1].item(), abs=1e-6)
    with pytest.raises(GigatronError, match="--toxic-label rude: not a label"):
        ClassifierScorer(str(tmp_path), "rude")


def test_generation_resumes_after_a_kill(tmp_path):
    jobs = [Job([1], 100 + i, {"index": i}) for i in range(7)]
    made = []

    def generate(batch):
        made.extend(job.seed for job in batch)
        return [f"text {job.seed}" for job in batch]

    complete = tmp_path / "complete.jsonl"
    run_jobs(jobs, str(complete), generate, batch_size=3)
    resumed = tmp_path / "resumed.jsonl"
    lines = complete.read_text().splitlines(keepends=True)
    # a run killed while writing its fifth record: four whole lines and a torn one
    Path(f"{resumed}.partial").write_text("".join(lines[:4]) + lines[4][:5])
    made.clear()
    assert run_jobs(jobs, str(resumed), generate, batch_size=3) == 3
    assert made == [104, 105, 106]
    assert resumed.read_text() == complete.read_text()
    assert not Path(f"{resumed}.partial").exists()
    with pytest.raises(GigatronError, match="exists; remove it"):
        run_jobs(jobs, str(resumed), generate, batch_size=3)


MODEL = [*tiny_gpt_flags(vocab_size=32, seq_length=16, micro_batch_size=8), *NO_DROPOUT,
         "--eval-iters", "0", "--seed", "3"]  # fmt: skip
GENERATE = ["--num-samples", "64", "--max-tokens", "8", "--device", "cpu",
            "--max-batch-size", "16", "--seed", "11"]  # fmt: skip


def test_self_generation_loop_lowers_toxicity(tmp_path, capsys):
    lexicon = tmp_path / "lexicon.txt"
    lexicon.write_text("3\n4\n")  # two of the 32 token ids count as toxic words
    t = {name: str(tmp_path / name) for name in ("base", "gen", "scored", "kept", "data", "ft",
                                                  "after", "after_scored", "prompts", "eval")}  # fmt: skip
    write_jsonl(Path(t["prompts"]), [{"prompt": {"text": "5 6", "toxicity": 0.9}},
                                     {"prompt": {"text": "7", "toxicity": 0.1}}])  # fmt: skip
    score = ["--lexicon", str(lexicon)]
    gigatron_runs(tmp_path, {
        "base": (1, ["pretrain", "gpt", *MODEL, "--global-batch-size", "8", "--train-iters", "1",
                     "--lr", "1e-9", "--save", t["base"]]),
        "generate": (1, ["detoxify", "generate", "--load", t["base"], *GENERATE, "--output", t["gen"]]),
        "score": (1, ["detoxify", "score", "--input", t["gen"], "--output", t["scored"], *score]),
        "filter": (1, ["detoxify", "filter", "--input", t["scored"], "--output", t["kept"]]),
        "preprocess": (1, ["preprocess", "--input", t["kept"], "--output-prefix", t["data"],
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "32",
                           "--append-eod", "--workers", "1"]),
        "finetune": (1, ["pretrain", "gpt", *MODEL[1:], "--tokenizer-type", "NullTokenizer",
                         "--data-path", t["data"] + "_text_document", "--split", "100,0,0",
                         "--global-batch-size", "8", "--train-iters", "40", "--lr", "1e-2",
                         "--finetune", "--load", t["base"], "--save", t["ft"]]),
        "after": (1, ["detoxify", "generate", "--load", t["ft"], *GENERATE, "--output", t["after"]]),
        "after_score": (1, ["detoxify", "score", "--input", t["after"], "--output",
                            t["after_scored"], *score]),
        "evaluate": (1, ["detoxify", "evaluate", "--load", t["ft"], "--prompts", t["prompts"],
                         "--output", t["eval"], "--num-generations", "4", "--device", "cpu", "--max-tokens", "8",
                         "--report", t["eval"] + ".report", *score]),
    })  # fmt: skip
    before = [r["toxicity"] for r in read_jsonl(Path(t["scored"]))]
    after = [r["toxicity"] for r in read_jsonl(Path(t["after_scored"]))]
    assert len(before) == len(after) == 64
    assert sum(after) / 64 < 0.5 * sum(before) / 64, (sum(before) / 64, sum(after) / 64)
    report = json.loads(Path(t["eval"] + ".report").read_text())
    generations = read_jsonl(Path(t["eval"]))
    assert [(g["prompt"], g["generation"]) for g in generations] == [
        (p, g) for p in range(2) for g in range(4)
    ]
    scorer = LexiconScorer(frozenset({"3", "4"}))
    expected = [scorer.score([g["text"] for g in generations if g["prompt"] == p]) for p in (0, 1)]
    assert report["scores"] == expected
    assert report["metrics"] == json.loads(json.dumps(toxicity_metrics(expected, [0.9, 0.1])))
    too_long = ["detoxify", "evaluate", "--load", t["ft"], "--prompts", t["prompts"], "--output",
                str(tmp_path / "long.jsonl"), "--device", "cpu", "--max-tokens", "20"]  # fmt: skip
    assert main(too_long) == 2
    assert "exceeds the model's context of 16 tokens" in capsys.readouterr().err
    assert not (tmp_path / "long.jsonl").exists()


def test_bad_inputs_are_one_line(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": {"text": "1 2"}}, {"id": 3}])
    status = main(["detoxify", "evaluate", "--load", str(tmp_path), "--prompts", str(prompts),
                   "--output", str(tmp_path / "out.jsonl")])  # fmt: skip
    assert status == 2
    assert "line 2 has no prompt text" in capsys.readouterr().err
    status = main(["detoxify", "score", "--input", str(prompts), "--output",
                   str(tmp_path / "s.jsonl")])  # fmt: skip
    assert status == 2
    assert "has no text field 'text'" in capsys.readouterr().err
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"text": "a"}])
    status = main(["detoxify", "score", "--input", str(texts), "--output",
                   str(tmp_path / "s.jsonl"), "--scorer", "classifier"])  # fmt: skip
    assert status == 2
    assert "give --toxicity-model DIR" in capsys.readouterr().err
    assert main(["detoxify", "wash"]) == 2
    assert "unknown step" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl", "texts.jsonl"]


@pytest.mark.parametrize("step", ["generate", "score", "filter", "evaluate"])
def test_every_step_help(capsys, step):
    with pytest.raises(SystemExit) as stop:
        main(["detoxify", step, "--help"])
    assert stop.value.code == 0
    assert f"gigatron detoxify {step}" in capsys.readouterr().out
