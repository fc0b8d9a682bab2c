"""Sentence splitting (punkt): on hand-checked English sentences with the model trained on the
fly on real text, and NLTK's installed punkt_tab model used when present."""

from __future__ import annotations

import pytest

from gigatron.data.sentences import sentence_splitter
from gigatron.errors import GigatronError
from helpers import DATA


@pytest.fixture(scope="module")
def split():
    text = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8")[:200_000]
    return sentence_splitter("english", text, use_installed=False)


CASES = [
    (
        "Mr. Smith went to Washington. He arrived at 3.30 p.m. on Monday.",
        ["Mr. Smith went to Washington.", "He arrived at 3.30 p.m. on Monday."],
    ),
    (
        "The value of pi is 3.14159. It is irrational!",
        ["The value of pi is 3.14159.", "It is irrational!"],
    ),
    (
        "Many fruits, e.g. Apples and pears, grow here. Others do not.",
        ["Many fruits, e.g. Apples and pears, grow here.", "Others do not."],
    ),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    # punkt ends a sentence at "!" before a lower-case word, and keeps an ellipsis inside one
    ('"Stop!" he said. She didn\'t.', ['"Stop!"', "he said.", "She didn't."]),
    ("Wait... What happened? Nobody knows.", ["Wait... What happened?", "Nobody knows."]),
    (
        "J. R. R. Tolkien wrote books. They sold well.",
        ["J. R. R. Tolkien wrote books.", "They sold well."],
    ),
    (
        "See Fig. 3 for details. The results (Table 2) are clear.",
        ["See Fig. 3 for details.", "The results (Table 2) are clear."],
    ),
    ("It rained (a lot.) Then it stopped.", ["It rained (a lot.)", "Then it stopped."]),
    ("The U.S. Army arrived. It was 1944.", ["The U.S. Army arrived.", "It was 1944."]),
    ("Prices rose 5%. 2020 was bad.", ["Prices rose 5%.", "2020 was bad."]),
    (
        "She bought apples, pears, etc. The total was $5.",
        ["She bought apples, pears, etc.", "The total was $5."],
    ),
    # "Who" starts sentences often in the training text and is never seen lower-case there:
    # punkt's orthographic rule then splits even after a known abbreviation
    ("Dr. Who? Yes, the doctor.", ["Dr.", "Who?", "Yes, the doctor."]),
    ("it ended. and then lower case", ["it ended.", "and then lower case"]),
    (
        "Title\n\nFirst line. Second line.\nThird line.",
        ["Title", "First line.", "Second line.", "Third line."],
    ),
    ("  Hello world  ", ["Hello world"]),
    ("", []),
    ("\n\n  \n", []),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split(split, text, expected):
    assert split(text) == expected


def test_keep_newlines_attaches_line_breaks(split):
    text = "First. Second.\nThird.\n\nFourth"
    sentences = split(text, keep_newlines=True)
    assert sentences == ["First.", "Second.\n", "Third.\n\n", "Fourth"]
    # Joining with spaces where no newline was kept gives back the text.
    assert "First. " + "".join(sentences[1:]) == text


def test_the_description_says_how_the_model_was_made(split):
    assert split.description == (
        "punkt trained on 200000 characters of the input plus 100 listed English abbreviations"
    )


def test_an_installed_punkt_tab_model_is_used(tmp_path, monkeypatch, split):
    from nltk import data
    from nltk.tokenize.punkt import PunktParameters, save_punkt_params

    parameters = PunktParameters()
    parameters.abbrev_types.update({"zq"})
    monkeypatch.setattr(data, "path", [str(tmp_path)])
    (tmp_path / "tokenizers" / "punkt_tab").mkdir(parents=True)
    save_punkt_params(parameters, str(tmp_path / "tokenizers" / "punkt_tab" / "english"))
    installed = sentence_splitter("english", "")
    assert installed.description == "NLTK punkt_tab model 'english'"
    # its parameters, not the trained ones: "zq." is an abbreviation, "Mr." is not
    assert installed("See zq. Smith here. Mr. Jones came.") == [
        "See zq. Smith here.",
        "Mr.",
        "Jones came.",
    ]
    assert split("See zq. Smith here.") == ["See zq.", "Smith here."]


def test_a_bad_language_name_is_refused():
    with pytest.raises(GigatronError, match="--lang en-GB: give a language name"):
        sentence_splitter("en-GB", "")
