"""The offline sentence splitter, on hand-checked English sentences."""

from __future__ import annotations

import pytest

from gigatron.data.sentences import split_sentences

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
    ('"Stop!" he said. She didn\'t.', ['"Stop!" he said.', "She didn't."]),
    ("Wait... What happened? Nobody knows.", ["Wait...", "What happened?", "Nobody knows."]),
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
    ("Dr. Who? Yes, the doctor.", ["Dr. Who?", "Yes, the doctor."]),
    ("it ended. and then lower case", ["it ended. and then lower case"]),
    (
        "Title\n\nFirst line. Second line.\nThird line.",
        ["Title", "First line.", "Second line.", "Third line."],
    ),
    ("  Hello world  ", ["Hello world"]),
    ("", []),
    ("\n\n  \n", []),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_split(text, expected):
    assert split_sentences(text) == expected


def test_keep_newlines_attaches_line_breaks():
    text = "First. Second.\nThird.\n\nFourth"
    sentences = split_sentences(text, keep_newlines=True)
    assert sentences == ["First.", "Second.\n", "Third.\n\n", "Fourth"]
    # Joining with spaces where no newline was kept gives back the text.
    assert "First. " + "".join(sentences[1:]) == text
