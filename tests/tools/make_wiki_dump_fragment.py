"""Build tests/data/wiki-dump-fragment/enwiki-fragment.xml.bz2: a small MediaWiki export dump.

The article text is real Wikipedia prose: the "Du Fu" and "Kiss You" articles of WikiText-2's test
split (tests/data/wikitext-2-wiki.test.tokens, detokenized), with wiki markup put back around it
the way Wikipedia writes it (an infobox template, references, internal and external links, bold
text, a table, a file, categories, a comment), plus a redirect page and a talk page that the
extractor must skip. Run from the repository root: python tests/tools/make_wiki_dump_fragment.py
"""

from __future__ import annotations

import bz2
import re
from pathlib import Path
from xml.sax.saxutils import escape

SOURCE = Path("tests/data/wikitext-2-wiki.test.tokens")
TARGET = Path("tests/data/wiki-dump-fragment/enwiki-fragment.xml.bz2")


def article(lines: list[str], title: str) -> list[str]:
    """The paragraphs of one WikiText-2 article, headings as wiki headings, detokenized."""
    start = lines.index(f" = {title} = \n")
    body = []
    for line in lines[start + 1 :]:
        if re.match(r"^ = [^=]", line):
            break
        text = line.strip()
        for token, plain in (("@-@", "-"), ("@,@", ","), ("@.@", "."), (" ,", ","), (" .", ".")):
            text = text.replace(f" {token} " if "@" in token else token, plain)
        if text:
            body.append(text)
    return body


def page(page_id: int, title: str, text: str, ns: int = 0, redirect: str | None = None) -> str:
    redirect_tag = f'    <redirect title="{escape(redirect)}" />\n' if redirect else ""
    return (
        f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n"
        f"    <id>{page_id}</id>\n{redirect_tag}    <revision>\n      <id>{page_id}0</id>\n"
        f'      <text bytes="{len(text)}" xml:space="preserve">{escape(text)}</text>\n'
        "    </revision>\n  </page>\n"
    )


def marked_up(paragraphs: list[str], subject: str) -> str:
    first, rest = paragraphs[0], paragraphs[1:]
    first = first.replace(subject, f"'''{subject}'''", 1)
    first = re.sub(r"\bChinese\b", "[[Chinese language|Chinese]]", first, count=1)
    first = re.sub(r"\bpoet\b", "[[poet]]", first, count=1)
    infobox = "{{Infobox person\n| name = " + subject + "\n| image = {{!}}x.jpg\n}}\n"
    out = [infobox + "<!-- lead -->" + first + "<ref name=a>{{cite book |title=Poems}}</ref>"]
    for paragraph in rest:
        if paragraph.startswith("= = "):
            heading = paragraph.strip("= ").strip()
            out.append(f"== {heading} ==")
        else:
            out.append(paragraph + '<ref>[http://example.org/p "Source"]</ref>')
    out.append('{| class="wikitable"\n|-\n! Year !! Work\n|-\n| 759 || Poems\n|}')
    out.append("[[File:Example.jpg|thumb|A [[portrait]] of the subject]]")
    out.append("See the [http://example.org/du-fu archive page] for more.")
    out.append("[[Category:Poets]]\n[[fr:" + subject + "]]")
    return "\n\n".join(out)


def main() -> None:
    lines = SOURCE.read_text(encoding="utf-8").splitlines(keepends=True)
    head = (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" '
        'xml:lang="en">\n  <siteinfo>\n    <sitename>Wikipedia</sitename>\n'
        "    <base>https://en.wikipedia.org/wiki/Main_Page</base>\n  </siteinfo>\n"
    )
    pages = [
        page(100, "Du Fu", marked_up(article(lines, "Du Fu"), "Du Fu")),
        page(101, "Tu Fu", "#REDIRECT [[Du Fu]]", redirect="Du Fu"),
        page(102, "Talk:Du Fu", "== Sources ==\nDiscussion.", ns=1),
        page(
            103,
            "Kiss You (One Direction song)",
            marked_up(article(lines, "Kiss You ( One Direction song )"), "Kiss You"),
        ),
    ]
    TARGET.write_bytes(bz2.compress((head + "".join(pages) + "</mediawiki>\n").encode("utf-8")))


if __name__ == "__main__":
    main()
