"""Wiki markup -> plain text: templates, tables, references, files and categories removed,
links replaced by their text, formatting and HTML tags dropped, headings kept as lines."""

from __future__ import annotations

import html
import re

_COMMENT = re.compile(r"<!--.*?-->", re.S)
# Elements whose content is not prose: dropped whole.
_DROPPED_ELEMENTS = ("ref", "math", "gallery", "timeline", "score", "syntaxhighlight", "chem")
_DROPPED = re.compile(
    r"<({})\b[^>]*?(?:/>|>.*?</\1\s*>)".format("|".join(_DROPPED_ELEMENTS)), re.S | re.I
)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.S)
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL = re.compile(r"\[(?:https?:)?//[^\s\]]+(?:\s+([^\]]*))?\]")
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$", re.M)
_LIST_MARK = re.compile(r"^[*#:;]+\s*", re.M)
_MAGIC = re.compile(r"__[A-Z]+__")
_BLANK_LINES = re.compile(r"\n{3,}")
# Link namespaces that are not running text (their whole link is removed).
NON_TEXT_NAMESPACES = frozenset({"file", "image", "category", "media"})


def _link_text(match: re.Match) -> str:
    body = match.group(1)
    target, _, label = body.partition("|")
    namespace = target.split(":", 1)[0].strip().lower() if ":" in target else ""
    if namespace in NON_TEXT_NAMESPACES:
        return ""
    if target.startswith(":") or (namespace and len(namespace) <= 3):
        # [[:fr:Paris]] or an interlanguage link [[fr:Paris]]: text only when labelled
        return label.rsplit("|", 1)[-1] if label else ""
    return label.rsplit("|", 1)[-1] if label else target


def _remove_nested(pattern: re.Pattern, text: str, replacement="") -> str:
    """Apply `pattern` (an innermost construct) until no match is left."""
    while True:
        text, count = pattern.subn(replacement, text)
        if count == 0:
            return text


def strip_markup(wikitext: str) -> str:
    """Plain text of an article's wikitext."""
    text = _COMMENT.sub("", wikitext)
    text = _DROPPED.sub("", text)
    text = _remove_nested(_TEMPLATE, text)
    text = _remove_nested(_TABLE, text)
    text = _remove_nested(_LINK, text, _link_text)
    text = _EXTERNAL.sub(lambda m: m.group(1) or "", text)
    text = _TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _HEADING.sub(lambda m: m.group(2), text)
    text = _LIST_MARK.sub("", text)
    text = _MAGIC.sub("", html.unescape(text))
    lines = [" ".join(line.split()) for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
