"""RETRO-QA's parts on hand-computed examples: SQuAD normalisation, exact match, token F1,
Megatron's answer clean-up, the QA file reader, Megatron's prompt (cut to fit) and the
evaluate flags each task refuses."""

from __future__ import annotations

import json

import pytest

from gigatron.cli import main as cli
from gigatron.errors import GigatronError
from gigatron.tasks.qa_metrics import (
    clean_prediction,
    exact_match,
    f1,
    normalize_answer,
    token_f1,
)
from gigatron.tasks.retro_qa import QAExample, qa_prompt, read_qa_file
from helpers import DATA

SAMPLE = DATA / "retro-qa-wikitext2.jsonl"


def test_normalisation_and_exact_match():
    assert normalize_answer("The  Royal Court, Theatre!") == "royal court theatre"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Li Po's poems") == "li pos poems"  # punctuation removed, not spaced
    assert normalize_answer("Chang 'an") == "chang"  # "an" left alone is an article
    assert exact_match("the Royal Court Theatre.", ["Royal Court Theatre"]) == 1.0
    assert exact_match("Royal Court", ["Royal Court Theatre", "the Bill"]) == 0.0
    assert exact_match("an apple", ["pear", "Apple"]) == 1.0


def test_token_f1_by_hand():
    # 2 shared tokens: precision 2/2, recall 2/3 -> F1 = 2 * 1 * (2/3) / (5/3) = 0.8
    assert token_f1("Royal Court", "the Royal Court Theatre") == pytest.approx(0.8)
    # against "746": precision 1/3, recall 1 -> 0.5; against "AD 746 in China": 3 shared of
    # 3 predicted and 4 gold -> 2 * 1 * 0.75 / 1.75 = 6/7; the best answer counts
    assert token_f1("in 746 AD", "746") == pytest.approx(0.5)
    assert f1("in 746 AD", ["746", "AD 746 in China"]) == pytest.approx(6 / 7)
    # repeated tokens count as often as both sides hold them: 1 shared "la" of 3 and of 1
    assert token_f1("la la la", "la") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("Paris", "London") == 0.0
    assert token_f1("the", "a") == 1.0  # both empty after normalisation
    assert token_f1("", "Tang") == 0.0


def test_megatron_answer_clean_up():
    assert clean_prediction(" Answer: Simon Stephens.\nHe wrote<|endoftext|>junk") == (
        "Simon Stephens. He wrote"
    )
    assert clean_prediction("A: Tang", "") == "Tang"
    assert clean_prediction("  the Tang dynasty \n") == "the Tang dynasty"


def test_read_qa_file_jsonl_array_and_errors(tmp_path):
    examples = read_qa_file(str(SAMPLE))
    assert len(examples) == 5
    assert examples[1] == QAExample("Who wrote the play Herons?", ["Simon Stephens"], [])
    assert examples[2].contexts[1] == (
        "title: Du Fu, source: Along with Li Po, he is frequently called the greatest of the "
        "Chinese poets."
    )
    array = tmp_path / "nq.json"  # Megatron's NQ files: a JSON array, "answer" accepted
    array.write_text(json.dumps([{"question": "q?", "answer": "x", "ctxs": [{"text": "t"}]}]))
    assert read_qa_file(str(array)) == [QAExample("q?", ["x"], ["title: , source: t"])]
    bad = tmp_path / "bad.jsonl"
    for line, message in (
        ('{"question": "q"}', "line 2: 'answers' must be a non-empty list of strings"),
        ('{"answers": ["a"]}', "line 2: not a JSON object with a string 'question'"),
        ("not json", "line 2: not JSON; write one JSON object per line"),
        ('{"question": "q", "answers": ["a"], "ctxs": [1]}', "line 2: 'ctxs' must be a list"),
    ):
        bad.write_text('{"question": "q", "answers": ["a"]}\n' + line + "\n")
        with pytest.raises(GigatronError, match=message):
            read_qa_file(str(bad))
    bad.write_text("\n")
    with pytest.raises(GigatronError, match="holds no questions"):
        read_qa_file(str(bad))


class Characters:
    """One token per character: prompt lengths by hand."""

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


SYSTEM = (
    "System: This is a chat between a user and an artificial intelligence assistant. The "
    "assistant gives helpful, detailed, and polite answers to the user's questions based on the "
    "context. The assistant should also indicate when the answer cannot be found in the "
    "context.\n\n"
)


def test_megatron_prompt_and_its_context_cut():
    chars = Characters()
    example = QAExample("Who?", ["x"], ["title: A, source: one", "title: B, source: two"])
    turn = "User: Answer the following question with a short span. Who?\n\nAssistant: The answer is"
    roomy = chars.detokenize(qa_prompt(example, 2, chars, 10_000, 64))
    assert roomy == SYSTEM + "title: A, source: one\n\ntitle: B, source: two\n\n" + turn
    # the context keeps what fits: max_length - answer - turn - system characters
    cut = chars.detokenize(qa_prompt(example, 2, chars, len(SYSTEM) + len(turn) + 64 + 12, 64))
    assert cut == SYSTEM + "title: A, so" + turn
    assert chars.detokenize(qa_prompt(example, 0, chars, 10_000, 64)) == SYSTEM + turn
    empty = QAExample("Who?", ["x"], [])  # Megatron's neighbour text when none is given
    assert chars.detokenize(qa_prompt(empty, 1, chars, 10_000, 64)) == (
        SYSTEM + "title: , source: \n\n" + turn
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--task", "LAMBADA", "--retro-project-dir", "p"], "--retro-project-dir: not a flag of "
         "--task RETRO-QA only"),
        (["--task", "WIKITEXT103", "--ft-neighbours", "2"], "--ft-neighbours: not a flag"),
        (["--task", "RETRO-QA", "--strict-lambada"], "--strict-lambada: not a flag of --task "
         "RETRO-QA"),
        (["--task", "RETRO-QA", "--out-seq-length", "0"], "--out-seq-length 0: must be at least 1"),
    ],
)  # fmt: skip
def test_evaluate_refuses_another_tasks_flags(flags, message, capsys):
    argv = ["evaluate", *flags, "--valid-data", str(SAMPLE), "--load", "nowhere"]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
