"""`gigatron finetune`: the GLUE and RACE readers against hand-built samples, the pretrained
weights loaded under a new head, end-to-end runs on the real MNLI, QQP and RACE samples, and
a synthetic separable task that is learned from its labels (and not from shuffled ones)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from finetune_helpers import MNLI, QQP, RACE, finetune_flags, model_flags, save_pretrained

from gigatron.checkpoint.pipeline import Target, convert
from gigatron.data.tokenizers import build_tokenizer
from gigatron.errors import GigatronError
from gigatron.models.lora import is_adapter_name
from gigatron.parallel.context import ParallelContext
from gigatron.tasks import finetune as ft
from gigatron.tasks.glue import clean_text, glue_samples, pair_ids, read_mnli, read_qqp
from gigatron.tasks.race import article_samples, join_question, race_samples
from gigatron.torch_files import safe_load
from helpers import gigatron, gigatron_runs, records, train_values

CLS, SEP, PAD = 101, 102, 0


@pytest.fixture(scope="module")
def tokenizer():
    cfg, _ = ft.parse_finetune_args(
        model_flags() + ["--task", "MNLI", "--epochs", "0", "--valid-data", "x",
                         "--micro-batch-size", "1", "--lr", "1e-3"],
        world_size=1,
    )  # fmt: skip
    return build_tokenizer(cfg.tokenizer)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("bert-pretrained")
    save_pretrained(directory)
    return directory


def _records(directory: Path) -> list[dict]:
    return records(directory)


def _run_cli(flags: list[str]) -> subprocess.CompletedProcess:
    return gigatron("finetune", *flags, timeout=600)


# ---- readers ------------------------------------------------------------------------------------
def test_pair_layout_truncation_and_padding():
    assert pair_ids([5, 6], [7], 8, CLS, SEP, PAD) == (
        [CLS, 5, 6, SEP, 7, SEP, PAD, PAD], [0, 0, 0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0],
    )  # fmt: skip
    # Too long: the first seq-1 tokens, then [SEP] (Megatron's rule).
    assert pair_ids([5, 6, 7], [8, 9, 10], 6, CLS, SEP, PAD) == (
        [CLS, 5, 6, 7, SEP, SEP], [0, 0, 0, 0, 0, 1], [1] * 6,
    )  # fmt: skip
    assert clean_text("a  b\nc . d") == "a b c. d"


def test_mnli_and_qqp_rows():
    pairs = read_mnli(str(MNLI / "dev_matched.tsv"))
    assert pairs == [
        ("The new rights are nice enough", "Everyone really likes the newest benefits", 2),
        (
            "This site includes a list of all award winners and a searchable database of "
            "Government Executive articles.",
            "The Government Executive articles housed on the website are not able to be searched.",
            0,
        ),
    ]
    qqp = read_qqp(str(QQP))
    # The row with an empty question is skipped; white space is cleaned.
    assert [label for _, _, label in qqp] == [1, 0, 1, 0]
    assert qqp[2][:2] == ("Why is the sky blue?", "What makes the sky look blue?")


def test_glue_sample_tokens(tokenizer):
    (first, _) = glue_samples("MNLI", str(MNLI / "dev_matched.tsv"), tokenizer, 32)
    a = tokenizer.tokenize("The new rights are nice enough")
    b = tokenizer.tokenize("Everyone really likes the newest benefits")
    n = len(a) + len(b) + 3
    assert first["tokens"][:n].tolist() == [CLS, *a, SEP, *b, SEP]
    assert first["token_types"][:n].tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    assert first["padding_mask"].tolist() == [1] * n + [0] * (32 - n)
    assert int(first["label"]) == 2


def test_race_question_and_option_joining(tokenizer):
    assert join_question("The _ is red.", "apple") == "The apple is red."
    assert join_question("What is red?", "the apple") == "What is red? the apple"
    article = {
        "article": "An apple is red .\nA pear is green.",
        "questions": ["The _ is green."],
        "options": [["apple", "pear", "sky", "sea"]],
        "answers": ["B"],
    }
    (sample,) = article_samples(article, tokenizer, 24, "case")
    assert sample["tokens"].shape == (4, 24) and int(sample["label"]) == 1
    context = tokenizer.tokenize("An apple is red. A pear is green.")
    for row, option in zip(sample["tokens"], ["apple", "pear", "sky", "sea"]):
        qa = tokenizer.tokenize(f"The {option} is green.")
        assert row[: len(qa) + len(context) + 3].tolist() == [CLS, *qa, SEP, *context, SEP]


def test_race_directory_counts_every_question(tokenizer):
    files = sorted((RACE / "dev").rglob("*.txt"))
    questions = sum(len(json.loads(f.read_text())["questions"]) for f in files)
    samples = race_samples(str(RACE / "dev"), tokenizer, 32)
    assert len(samples) == questions > 0
    with pytest.raises(GigatronError, match="not a directory"):
        race_samples(str(QQP), tokenizer, 32)


def test_multiple_choice_accuracy_scores_each_choice():
    """A stand-in model scores a sequence by whether it holds token 7: the chosen option is the
    one with the highest score, compared with the label."""

    class Scorer(torch.nn.Module):
        def forward(self, tokens, positions, mask, tokentype_ids=None):
            return (tokens == 7).any(-1, keepdim=True).float()

    def question(answer: int, label: int) -> dict:
        rows = [pair_ids([7 if c == answer else 8], [9], 8, CLS, SEP, PAD) for c in range(4)]
        from gigatron.tasks.glue import make_sample

        return make_sample(rows, label)

    samples = [question(2, 2), question(0, 0), question(3, 1)]
    assert ft.accuracy(Scorer(), samples, 2, ParallelContext.single()) == (2, 3)


# ---- model --------------------------------------------------------------------------------------
def test_pretrained_weights_are_loaded_and_the_head_is_new(pretrained, tmp_path):
    from gigatron.checkpoint.torch_format import safe_load

    cfg, task = ft.parse_finetune_args(
        finetune_flags("RACE", pretrained, tmp_path, epochs="0", valid_data=str(RACE / "dev")),
        world_size=1,
    )
    model = ft.build_classifier(cfg, ParallelContext.single(), 30522, task)
    (saved,) = pretrained.glob("iter_*/mp_rank_00/model_optim_rng.pt")
    weights = safe_load(saved)["model"]
    state = model.state_dict()
    for name, value in weights.items():
        assert torch.equal(state[f"bert.{name}"], value), name
    assert state["multichoice_head.weight"].shape == (1, 64)
    assert state["multichoice_head.weight"].abs().sum() > 0
    with pytest.raises(GigatronError, match="no such directory"):
        bad = ft.parse_finetune_args(
            finetune_flags("RACE", tmp_path / "none", tmp_path, epochs="0", valid_data="x"),
            world_size=1,
        )
        ft.build_classifier(*bad[:1], ParallelContext.single(), 30522, bad[1])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data-path", "x"], "--data-path: not a gigatron finetune flag"),
        (["--train-iters", "5"], "--train-iters: not a gigatron finetune flag"),
        (["--num-workers", "0"], "--num-workers: not a gigatron finetune flag"),
        (["--sft"], "--sft: not a gigatron finetune flag"),
        (
            ["--no-create-attention-mask-in-dataloader"],
            "--no-create-attention-mask-in-dataloader: not a gigatron finetune flag",
        ),
        (["--eval-iters", "3"], "--eval-iters 3: the validation loss is measured every"),
        (["--async-save"], "--async-save: not a gigatron finetune flag"),
        (["--save-hf", "x"], "--save-hf: not a gigatron finetune flag"),
        (["--pipeline-model-parallel-size", "2"], "tensor and data parallelism only"),
        (["--use-torch-fsdp2"], "--use-torch-fsdp2/--use-megatron-fsdp: gigatron finetune"),
    ],
)
def test_refused_flags(extra, message, tmp_path):
    flags = finetune_flags("MNLI", None, tmp_path, epochs="1", train_data="a", valid_data="b")
    with pytest.raises(GigatronError, match=message):
        ft.parse_finetune_args(flags + extra, world_size=2)


# ---- end to end ---------------------------------------------------------------------------------
def test_mnli_end_to_end_keeps_the_best_checkpoint(pretrained, tmp_path):
    save = tmp_path / "mnli"
    files = f"{MNLI / 'dev_matched.tsv'} {MNLI / 'dev_mismatched.tsv'}"
    result = _run_cli(
        finetune_flags("MNLI", pretrained, save, 32, train_data=files, valid_data=files,
                       epochs="2")
    )  # fmt: skip
    assert "metrics for" in result.stdout and "saved the best checkpoint" in result.stdout
    records = _records(save)
    evals = [r for r in records if r["type"] == "eval"]
    assert [(r["epoch"], Path(r["valid_data"]).name, r["total"]) for r in evals] == [
        (1, "dev_matched.tsv", 2), (1, "dev_mismatched.tsv", 2),
        (2, "dev_matched.tsv", 2), (2, "dev_mismatched.tsv", 2),
    ]  # fmt: skip
    assert all(r["accuracy"] == r["correct"] / 2 for r in evals)
    assert [r["iteration"] for r in records if r["type"] == "train"] == [1, 2, 3, 4]
    means = [(evals[i]["accuracy"] + evals[i + 1]["accuracy"]) / 2 for i in (0, 2)]
    best_iteration = 2 if means[0] >= means[1] else 4
    kept = sorted(p.name for p in save.glob("iter_*"))
    assert kept == [f"iter_{best_iteration:07d}"]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(best_iteration)


def test_race_and_qqp_end_to_end(pretrained, tmp_path):
    save = tmp_path / "race"
    _run_cli(
        finetune_flags("RACE", pretrained, save, 32, train_data=str(RACE / "train" / "middle"),
                       valid_data=str(RACE / "dev" / "middle"), epochs="1", keep_last="")
    )  # fmt: skip
    (record,) = [r for r in _records(save) if r["type"] == "eval"]
    files = sorted((RACE / "dev" / "middle").glob("*.txt"))
    assert record["total"] == sum(len(json.loads(f.read_text())["questions"]) for f in files)
    assert list(save.glob("iter_*"))
    # QQP, evaluation only (--epochs 0): every pair is scored, nothing is saved.
    save = tmp_path / "qqp"
    result = _run_cli(finetune_flags("QQP", pretrained, save, 32, valid_data=str(QQP), epochs="0"))
    (record,) = [r for r in _records(save) if r["type"] == "eval"]
    assert record["total"] == 4 and "correct / total" in result.stdout
    assert not list(save.glob("iter_*"))


# ---- learning -----------------------------------------------------------------------------------
COLOURS = {"red": "entailment", "blue": "contradiction", "green": "neutral"}
NOUNS = "car house tree dog cat boat chair table book lamp door road bird fish cup shoe".split()


def _synthetic_mnli(path: Path, rows: list[tuple[str, str]]) -> None:
    """An MNLI-format file whose label is given by the colour word of sentence1."""
    header = ["index", "promptID", "pairID", "genre", "b1", "b2", "p1", "p2", "sentence1",
              "sentence2", "label1", "gold_label"]  # fmt: skip
    lines = ["\t".join(header)]
    for index, (sentence, label) in enumerate(rows):
        lines.append("\t".join([str(index), "0", "0", "x", "", "", "", "", sentence,
                                "it is there", label, label]))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")


def _final_accuracy(task_name, tmp_path, seq, train, valid, epochs, seed=None) -> float:
    """Fine-tune a fresh model on tmp_path/train, the mean accuracy of the last epoch."""
    flags = finetune_flags(
        task_name, None, tmp_path / "out", seq, train_data=str(tmp_path / train),
        valid_data=str(tmp_path / valid), epochs=epochs, micro_batch_size="4",
        global_batch_size="4",
    )  # fmt: skip
    flags += ["--lr", "2e-3", "--metrics-file", str(tmp_path / "m.jsonl")]
    cfg, task = ft.parse_finetune_args(flags, world_size=1)
    if seed is not None:
        torch.manual_seed(seed)
    with open(tmp_path / "log.txt", "w") as log:
        result = ft.finetune(cfg, task, stream=log)
    return result["epochs"][-1]["mean_accuracy"]


def _separable_run(tmp_path: Path, shuffle_labels: bool) -> float:
    rng = random.Random(0)
    pairs = [(colour, noun) for colour in COLOURS for noun in NOUNS]
    rng.shuffle(pairs)
    rows = [(f"the {noun} is {colour}", COLOURS[colour]) for colour, noun in pairs]
    train, valid = rows[:36], rows[36:]
    if shuffle_labels:
        labels = [label for _, label in train]
        rng.shuffle(labels)
        train = [(sentence, label) for (sentence, _), label in zip(train, labels)]
    tmp_path.mkdir()
    _synthetic_mnli(tmp_path / "train.tsv", train)
    _synthetic_mnli(tmp_path / "valid.tsv", valid)
    return _final_accuracy("MNLI", tmp_path, 12, "train.tsv", "valid.tsv", "8", seed=0)


def test_a_separable_task_is_learned_from_its_labels(tmp_path):
    torch.set_num_threads(1)
    np.random.seed(0)
    assert _separable_run(tmp_path / "real", shuffle_labels=False) >= 0.9
    # The same sentences with the training labels shuffled: nothing to learn.
    assert _separable_run(tmp_path / "shuffled", shuffle_labels=True) <= 0.6


def test_a_checkpoint_without_pooler_gets_a_new_one(tmp_path):
    save_pretrained(tmp_path / "no-pooler", "--bert-no-binary-head")
    cfg, task = ft.parse_finetune_args(
        finetune_flags("QQP", tmp_path / "no-pooler", tmp_path / "out", epochs="0",
                       valid_data=str(QQP)) + ["--bert-no-binary-head"],
        world_size=1,
    )  # fmt: skip
    model = ft.build_classifier(cfg, ParallelContext.single(), 30522, task)
    names = set(model.state_dict())
    assert {"pooler.weight", "classification_head.weight"} <= names
    assert not any(name.startswith("bert.pooler") for name in names)
    assert model.classification_head.weight.shape == (2, 64)
    logits = ft.classify(
        model,
        ft.collate(ft.read_samples("QQP", str(QQP), build_tokenizer(cfg.tokenizer), 64), [0, 1]),
    )
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def _synthetic_race(directory: Path, questions: list[tuple[list[str], int]]) -> None:
    """RACE articles of 4 questions each; the options and the answer letter are given."""
    directory.mkdir(parents=True)
    for number in range(0, len(questions), 4):
        part = questions[number : number + 4]
        article = {
            "article": "a short story about things .",
            "questions": ["which one is right ?"] * len(part),
            "options": [options for options, _ in part],
            "answers": ["ABCD"[answer] for _, answer in part],
            "id": f"{number}.txt",
        }
        (directory / f"{number}.txt").write_text(json.dumps(article))


def _separable_race_run(tmp_path: Path, shuffle_labels: bool) -> float:
    """The right option says 'yes', the others 'no': learnable from the labels only."""
    rng = random.Random(1)
    questions = []
    for _ in range(52):
        answer = rng.randrange(4)
        nouns = rng.sample(NOUNS, 4)
        options = [("yes " if c == answer else "no ") + nouns[c] for c in range(4)]
        questions.append((options, answer))
    train, valid = questions[:40], questions[40:]
    if shuffle_labels:
        train = [(options, rng.randrange(4)) for options, _ in train]
    _synthetic_race(tmp_path / "train", train)
    _synthetic_race(tmp_path / "dev", valid)
    return _final_accuracy("RACE", tmp_path, 16, "train", "dev", "6")


def test_a_separable_multiple_choice_task_is_learned_from_its_labels(tmp_path):
    torch.set_num_threads(1)
    assert _separable_race_run(tmp_path / "real", shuffle_labels=False) >= 0.9
    assert _separable_race_run(tmp_path / "shuffled", shuffle_labels=True) <= 0.6


# ---- LoRA ---------------------------------------------------------------------------------------
LORA = ["--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        "--lora-rank", "4", "--lora-alpha", "8"]  # fmt: skip


def test_lora_fine_tune_at_tp2_equals_tp1(pretrained, tmp_path):
    """LoRA through `gigatron finetune`: the encoder frozen with adapters, the new head trained
    whole; tp 2 trains the losses of one process; the best checkpoint holds the adapters and
    the head only."""
    files = f"{MNLI / 'dev_matched.tsv'} {MNLI / 'dev_mismatched.tsv'}"
    convert("gigatron", pretrained, "gigatron", tmp_path / "base_tp2", Target(tp=2), log=print)
    runs = {}
    for name, processes, base, extra in (
        ("tp2", 2, tmp_path / "base_tp2", ["--tensor-model-parallel-size", "2"]),
        ("tp1", 1, pretrained, []),
    ):
        flags = finetune_flags("MNLI", base, tmp_path / name, 32, train_data=files,
                               valid_data=files, epochs="2")  # fmt: skip
        runs[name] = (processes, ["finetune", *flags, *LORA, *extra, "--lr", "1e-2"])
    gigatron_runs(tmp_path, runs)
    tp2, tp1 = (train_values(tmp_path / name) for name in ("tp2", "tp1"))
    assert sorted(tp1) == [1, 2, 3, 4] and tp1[4] != pytest.approx(tp1[2], rel=1e-3)
    for iteration, loss in tp2.items():
        assert loss == pytest.approx(tp1[iteration], rel=1e-5), iteration
    # Per layer: A [4, in] and B [out, 4] of qkv 64 -> 192, proj 64 -> 64, fc1 64 -> 256 and
    # fc2 256 -> 64; the head [3, 64] with its bias.
    adapters = 2 * 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    (startup,) = records(tmp_path / "tp1", "startup")
    assert startup["trainable_parameters"] == adapters + 3 * 64 + 3
    (saved,) = (tmp_path / "tp1").glob("iter_*/mp_rank_00/model_optim_rng.pt")
    names = sorted(safe_load(saved)["model"])
    assert names[:2] == ["bert.encoder.layers.0.mlp.linear_fc1.adapter.linear_in.weight",
                         "bert.encoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"]  # fmt: skip
    assert sum(is_adapter_name(n) for n in names) == 2 * 4 * 2
    assert [n for n in names if not is_adapter_name(n)] == [
        "classification_head.bias", "classification_head.weight",
    ]  # fmt: skip
