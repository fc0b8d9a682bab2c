"""`gigatron data <tool>`: each corpus tool on real text, against hand-computed results, and on
bad input (a one-line error, no partial output)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gigatron.cli import main
from gigatron.data.corpus import decontaminate as decon
from gigatron.data.corpus.wikitext_markup import strip_markup
from helpers import DATA

DUMP = DATA / "wiki-dump-fragment" / "enwiki-fragment.xml.bz2"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def paragraphs(count: int, min_words: int = 40) -> list[str]:
    """Real English paragraphs of WikiText-2 (distinct, at least `min_words` words)."""
    lines = (DATA / "wikitext-2-wiki.test.tokens").read_text(encoding="utf-8").splitlines()
    found = [line.strip() for line in lines if len(line.split()) >= min_words]
    return list(dict.fromkeys(found))[:count]


def test_strip_markup_by_hand():
    wikitext = (
        "{{Infobox|name={{nested}}}}'''Ada''' was a [[mathematician]] and [[Writer|author]]."
        "<ref>{{cite|x}}</ref> See [http://example.org the site].<!-- note -->\n"
        "== Life ==\n* She [[File:A.jpg|thumb|a [[portrait]]]]wrote &amp; read.\n"
        '{| class="wikitable"\n| a || b\n|}\n[[Category:People]]'
    )
    assert strip_markup(wikitext) == (
        "Ada was a mathematician and author. See the site.\nLife\nShe wrote & read."
    )


def test_wikipedia_dump_to_articles(tmp_path, capsys):
    output, report = tmp_path / "wiki.jsonl", tmp_path / "report.json"
    assert main(["data", "wikipedia", "--input", str(DUMP), "--output", str(output),
                 "--report", str(report), "--workers", "2"]) == 0  # fmt: skip
    articles = read_jsonl(output)
    # the redirect (101) and the talk page (102) are skipped
    assert [a["id"] for a in articles] == ["100", "103"]
    assert articles[0]["url"] == "https://en.wikipedia.org/wiki?curid=100"
    assert articles[1]["title"] == "Kiss You (One Direction song)"
    text = articles[0]["text"]
    assert text.startswith("Du Fu ( Wade")
    assert "was a prominent Chinese poet of the Tang dynasty" in text
    for markup in ("{{", "}}", "[[", "]]", "<ref", "'''", "{|", "Category", "http", "<!--"):
        assert markup not in text
    assert "\nLife\n" in text and "See the archive page for more." in text
    assert json.loads(report.read_text())["counts"] == {"kept": 2}


def test_clean_repairs_standardises_and_filters(tmp_path, capsys):
    english = paragraphs(3)
    records = [
        {"text": english[0] + " It was \u201cfine\u201d \u2026", "url": "a"},
        {"text": "La ville est tr\u00c3\u00a8s belle et les habitants sont tr\u00c3\u00a8s "
                 "gentils avec les visiteurs qui viennent de loin pour la voir." * 3},
        {"text": "Too short."},
        {"text": english[1].replace(" ", "   ")},
        {"text": "   "},
    ]  # fmt: skip
    source, output = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    report = tmp_path / "report.json"
    assert main(["data", "clean", "--input", str(source), "--output", str(output),
                 "--min-tokens", "20", "--report", str(report)]) == 0  # fmt: skip
    kept = read_jsonl(output)
    assert [r.get("url") for r in kept] == ["a", None]
    assert kept[0]["text"].endswith('It was "fine"...')
    assert kept[1]["text"] == " ".join(english[1].split()).replace(" ,", ",").replace(" .", ".")
    counts = json.loads(report.read_text())["counts"]
    assert counts == {"kept": 2, "language": 1, "too_short": 1, "empty": 1}


def test_clean_repairs_mojibake():
    from gigatron.data.corpus.clean import CleanRules, clean_document

    text, reason = clean_document(
        "The caf\u00c3\u00a9 was open.", CleanRules(None, 1), lambda t: len(t.split())
    )
    assert (text, reason) == ("The caf\u00e9 was open.", "kept")


def _planted_corpus(rng: random.Random) -> tuple[list[dict], set[int]]:
    """Real paragraphs plus near-duplicates (a few words changed) and exact copies; the
    indices of the planted copies."""
    base = paragraphs(220)
    docs = [{"text": t, "url": f"u{i}"} for i, t in enumerate(base)]
    planted = set()
    for source in rng.sample(range(len(base)), 60):
        words = base[source].split()
        for position in rng.sample(range(len(words)), max(1, len(words) // 60)):
            words[position] = "changed"
        planted.add(len(docs))
        docs.append({"text": " ".join(words), "url": f"near{source}"})
    for source in rng.sample(range(len(base)), 20):
        planted.add(len(docs))
        docs.append({"text": base[source], "url": f"copy{source}"})
    return docs, planted


def test_dedup_finds_planted_duplicates(tmp_path, capsys):
    docs, planted = _planted_corpus(random.Random(0))
    source, output = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out.jsonl"
    groups = tmp_path / "groups.jsonl"
    assert main(["data", "dedup", "--input", str(source), "--output", str(output),
                 "--id-key", "url", "--groups-output", str(groups), "--workers", "2"]) == 0  # fmt: skip
    kept = {r["url"] for r in read_jsonl(output)}
    removed = {i for i, doc in enumerate(docs) if doc["url"] not in kept}
    true_positives = len(removed & planted)
    assert true_positives / len(removed) >= 0.95  # precision
    assert true_positives / len(planted) >= 0.95  # recall
    for group in read_jsonl(groups):
        assert group["kept"].startswith("u")  # the first occurrence is kept
    assert "exact_duplicate 20" in capsys.readouterr().err


def test_dedup_exact_only_keeps_near_duplicates(tmp_path, capsys):
    text = paragraphs(1)[0]
    docs = [{"text": text}, {"text": "  " + text.upper()}, {"text": text + " extra"}]
    source, output = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out.jsonl"
    assert main(["data", "dedup", "--input", str(source), "--output", str(output),
                 "--exact-only"]) == 0  # fmt: skip
    assert [r["text"] for r in read_jsonl(output)] == [text, text + " extra"]


def test_decontaminate_hand_computed_example():
    rules = decon.NgramRules(remove_char_each_side=20, min_piece_chars=10)
    evaluation = "The quick brown fox jumps over the lazy dog near the old river bank."
    ngrams = decon.evaluation_ngrams([evaluation], rules)
    assert len(ngrams) == 2  # 14 words: two 13-word windows
    text = (
        "Alpha beta gamma delta. Epsilon zeta eta theta. Then: the QUICK brown fox jumps over "
        "the lazy dog near the old river, said Ann. Iota kappa lambda mu. Nu xi omicron pi rho!"
    )
    # The match spans "the QUICK ... river" (characters 54-116). 20 characters before it falls
    # inside "Epsilon ... theta.", so the first piece ends at the period before (character 22);
    # 20 characters after it falls inside "Iota ... mu.", so the rest starts after that period.
    assert decon.decontaminate(text, ngrams, rules) == (
        ["Alpha beta gamma delta.", " Nu xi omicron pi rho!"],
        1,
    )
    assert decon.decontaminate("Nothing to see here.", ngrams, rules) == (
        ["Nothing to see here."],
        0,
    )


def test_decontaminate_command_against_lambada(tmp_path, capsys):
    lambada = [json.loads(line) for line in (DATA / "lambada_test.jsonl").open()][:50]
    clean_text = " ".join(paragraphs(3))
    leaked = clean_text + " " + lambada[7]["text"] + " " + clean_text
    docs = [{"text": clean_text}, {"text": leaked}]
    source, output = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "out.jsonl"
    evaluation = write_jsonl(tmp_path / "lambada.jsonl", lambada)
    assert main(["data", "decontaminate", "--input", str(source), "--output", str(output),
                 "--eval-data", str(evaluation)]) == 0  # fmt: skip
    out = read_jsonl(output)
    assert out[0] == {"text": clean_text}
    pieces = out[1:]
    assert [p["split_id"] for p in pieces] == ["2-0", "2-1"]
    leak = decon.evaluation_ngrams([lambada[7]["text"]], decon.NgramRules())
    for piece in pieces:
        assert decon.first_match(decon.words_and_spans(piece["text"])[0], leak, [13]) is None
    assert pieces[0]["text"] in leaked and pieces[1]["text"] in leaked
    assert "matches 1" in capsys.readouterr().err


def test_blacklist_urls(tmp_path, capsys):
    domains = tmp_path / "domains.txt"
    domains.write_text("# bad sites\nspam.example\n")
    records = [
        {"url": "https://news.example.org/story", "text": "a"},
        {"url": "https://www.spam.example/x", "text": "b"},
        {"url": "http://site.example/photo.JPG", "text": "c"},
        {"url": "http://x", "text": "d"},
        {"url": "not a url at all", "text": "e"},
        {"url": "https://news.example.org/story", "text": "f"},
    ]
    source, output = write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out.jsonl"
    assert main(["data", "blacklist", "--input", str(source), "--output", str(output),
                 "--domains", str(domains)]) == 0  # fmt: skip
    assert [r["text"] for r in read_jsonl(output)] == ["a"]
    err = capsys.readouterr().err
    for reason in ("domain 1", "extension 1", "short_url 1", "malformed_url 1", "duplicate_url 1"):
        assert reason in err


TOOL_FLAGS = {
    "clean": ["--lang", "any", "--min-tokens", "1"],
    "dedup": [],
    "decontaminate": ["--eval-data", str(DATA / "lambada_test.jsonl")],
    "blacklist": [],
}


@pytest.mark.parametrize("tool", sorted(TOOL_FLAGS))
@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "holds no records"),
        (b'{"text": "a", "url": "http://example.org/a"}\n{"text": oops}\n', "line 2 is not JSON"),
        (b'{"text": "caf\xe9", "url": "http://example.org/a"}\n', "line 1 is not UTF-8"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, tool, content, message):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(content)
    status = main(
        ["data", tool, "--input", str(source), "--output", str(output), *TOOL_FLAGS[tool]]
    )
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    if tool == "blacklist" and content == b"":
        message = "holds no"
    assert message in err, err
    assert list(tmp_path.iterdir()) == [source]


@pytest.mark.parametrize(
    "content",
    [b"<mediawiki><page><title>x</title>", b"", b"<mediawiki><page><title>caf\xe9</title>"],
    ids=["truncated", "empty", "not-utf8"],
)
def test_bad_dump_is_one_line_and_leaves_nothing(tmp_path, capsys, content):
    broken = tmp_path / "dump.xml"
    broken.write_bytes(content)
    status = main(["data", "wikipedia", "--input", str(broken), "--output", str(tmp_path / "o")])
    assert status == 2 and "not a readable MediaWiki XML dump" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump.xml"]


def test_bad_flags(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    assert main(["data", "dedup", "--input", str(source), "--output", str(source)]) == 2
    assert "is also an input" in capsys.readouterr().err
    assert main(["data", "dedup", "--input", str(source), "--output", str(tmp_path / "o"),
                 "--bands", "7"]) == 2  # fmt: skip
    assert "must divide --num-perm" in capsys.readouterr().err
    assert main(["data", "sort"]) == 2
    assert "data sort: unknown step" in capsys.readouterr().err


def test_common_ngrams_are_not_contamination(tmp_path, capsys):
    # An evaluation n-gram found in 10 or more training documents (--key-threshold) is common
    # language and stays; below the threshold it is cut.
    phrase = "one two three four five six seven eight nine ten eleven twelve thirteen"
    filler = " ".join(paragraphs(2)) + " "
    docs = [{"text": filler + phrase + ". " + filler} for _ in range(3)]
    source, evaluation = write_jsonl(tmp_path / "in.jsonl", docs), tmp_path / "eval.txt"
    evaluation.write_text(phrase + "\n")
    for threshold, unchanged in ((3, True), (4, False)):
        output = tmp_path / f"out{threshold}.jsonl"
        assert main(["data", "decontaminate", "--input", str(source), "--output", str(output),
                     "--eval-data", str(evaluation), "--key-threshold", str(threshold)]) == 0  # fmt: skip
        assert (read_jsonl(output) == docs) is unchanged


@pytest.mark.parametrize("tool", ["wikipedia", "clean", "dedup", "decontaminate", "blacklist"])
def test_every_tool_help(capsys, tool):
    with pytest.raises(SystemExit) as stop:
        main(["data", tool, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert f"gigatron data {tool}" in out and "--output" in out and "default" in out
