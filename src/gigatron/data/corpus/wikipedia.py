"""A MediaWiki XML dump (`pages-articles.xml[.bz2]`) -> loose JSON articles, streamed.

Pages are read one at a time with `iterparse` (the dump is never loaded whole); articles of the
main namespace that are not redirects become `{"id", "url", "title", "text"}` records, the URL
`<site base>?curid=<id>` as WikiExtractor's `--json` writes it. Markup is stripped in worker
processes (wikitext_markup.py).
"""

from __future__ import annotations

import bz2
import os
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from gigatron.data.corpus.wikitext_markup import strip_markup
from gigatron.errors import GigatronError


@dataclass(frozen=True)
class Page:
    id: str
    title: str
    wikitext: str


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def open_dump(path: str) -> IO[bytes]:
    if not os.path.isfile(path):
        raise GigatronError(f"{path}: no such dump file; give a pages-articles.xml[.bz2] path")
    return bz2.open(path, "rb") if path.endswith(".bz2") else open(path, "rb")


def _page(element: ElementTree.Element) -> Page | None:
    """The article in a <page> element, or None for other namespaces and redirects."""
    fields = {_local(child.tag): child for child in element}
    if fields.get("ns") is not None and (fields["ns"].text or "0").strip() != "0":
        return None
    if "redirect" in fields or "id" not in fields or "title" not in fields:
        return None
    text = ""
    revision = fields.get("revision")
    if revision is not None:
        for child in revision:
            if _local(child.tag) == "text":
                text = child.text or ""
    return Page(fields["id"].text.strip(), fields["title"].text or "", text)


def read_dump(path: str) -> Iterator[tuple[str, Page]]:
    """(the site's URL base, an article) for every article of the dump, streamed."""
    stream = open_dump(path)
    base = ""
    try:
        for _, element in ElementTree.iterparse(stream, events=("end",)):
            name = _local(element.tag)
            if name == "base" and not base:
                base = (element.text or "").rsplit("/", 1)[0]
            elif name == "page":
                page = _page(element)
                element.clear()
                if page is not None:
                    yield base, page
    except (ElementTree.ParseError, OSError, EOFError) as error:
        raise GigatronError(
            f"{path}: not a readable MediaWiki XML dump ({error}); give a "
            "pages-articles.xml or .xml.bz2 file as downloaded"
        ) from None
    finally:
        stream.close()


def article_record(item: tuple[str, Page]) -> dict[str, str]:
    """The loose-JSON record of one (URL base, article) (text without markup)."""
    base, page = item
    url = f"{base or 'https://en.wikipedia.org/wiki'}?curid={page.id}"
    return {"id": page.id, "url": url, "title": page.title, "text": strip_markup(page.wikitext)}
