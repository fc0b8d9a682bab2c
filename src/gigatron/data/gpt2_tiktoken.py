"""GPT-2 byte-level BPE run by `tiktoken`, used only where its ids provably equal the reference.

The reference is HF `tokenizers`: the ByteLevel pre-tokenizer (one regex splits the text into
pieces) and merge-based BPE (repeatedly apply the listed merge of lowest index, leftmost first).
`tiktoken` splits with a regex too, then runs rank-based BPE on each piece: repeatedly join the
adjacent pair whose concatenation has the lowest rank, leftmost first, and return a piece found
whole in the table as one token without merging. We give it the same pattern, and as ranks the
vocabulary ids of the 256 byte tokens and of every merge result. Then the two agree on every text
when these hold, and `build_tiktoken_bpe` checks each of them and returns None otherwise:

1. Splitting. The pattern depends on a character only through its identity and its membership of
   \\p{L}, \\p{N} and \\s; both engines have the same leftmost-first, greedy, look-ahead semantics.
   Membership is compared for every Unicode scalar value (`unicode_classes_agree`).
2. Ranks follow merges: the ids of the merge results increase with the merge index (so both BPEs
   order the listed merges alike, and no two merges make the same token).
3. Every table token t is its own reference encoding: merge-BPE(bytes of t) = [t].
Proof that 2 and 3 make the BPEs equal on a piece: run both in lockstep from the same bytes. The
merge-based candidates are the adjacent listed pairs; the rank-based ones are the adjacent pairs
(x, y) whose concatenation t is in the table. Suppose such an (x, y) is not t's merge while the
state is one merge-BPE reaches. The merges made so far inside the span x·y were each the lowest
(leftmost) listed pair inside it, i.e. exactly the merges merge-BPE makes on the bytes of t alone;
so merge-BPE(t) reaches [x, y]. (x, y) is not listed (by 2 only t's own merge makes t), so it
stops there and returns [x, y], against 3. Hence both see the same candidates in the same order
(2), pick the same pair, and end together. A piece that is a whole table token t: tiktoken
returns [t], merge-BPE too (3).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

# The GPT-2 split pattern as HF `tokenizers`' ByteLevel pre-tokenizer spells it.
GPT2_SPLIT_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# The Unicode classes the pattern reads; both engines must agree on each.
SPLIT_CLASSES = (r"\p{L}", r"\p{N}", r"\s")


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, mapped back to the byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


@functools.lru_cache(maxsize=1)
def unicode_classes_agree() -> bool:
    """Whether tiktoken's and HF tokenizers' regex engines put every Unicode scalar value in
    the same \\p{L} / \\p{N} / \\s classes (a property of the installed libraries)."""
    return all(same_class_members(pattern, pattern) for pattern in SPLIT_CLASSES)


def same_class_members(tiktoken_class: str, hf_class: str) -> bool:
    """Whether the character class `tiktoken_class` in tiktoken's engine has exactly the
    members of `hf_class` in HF tokenizers' engine, over every Unicode scalar value."""
    # why: optional fast tokenizer libraries, loaded when used
    import tiktoken
    from tokenizers import Regex, normalizers

    # tiktoken encodes only the text its pattern matches: the members, as bytes.
    probe = tiktoken.Encoding(
        name="class-probe",
        pat_str=tiktoken_class,
        mergeable_ranks={bytes([b]): b for b in range(256)},
        special_tokens={},
    )
    # HF keeps the members by deleting every run of non-members.
    keep = normalizers.Replace(Regex(f"[^{hf_class}]+"), "")
    # Plane by plane (surrogates are not scalar values), to keep memory small.
    for start in range(0, 0x110000, 0x10000):
        codes = np.arange(start, start + 0x10000, dtype="<u4")
        if start == 0:
            codes = codes[(codes < 0xD800) | (codes >= 0xE000)]
        block = codes.tobytes().decode("utf-32-le")
        if bytes(probe.encode_ordinary(block)).decode("utf-8") != keep.normalize_str(block):
            return False
    return True


def build_tiktoken_bpe(hf_tokenizer: Any, name: str = "gpt2-bpe") -> tuple[Any | None, str]:
    """A tiktoken Encoding whose `encode_ordinary` equals `hf_tokenizer.encode(text,
    add_special_tokens=False).ids` on every text, or (None, the reason it cannot be proven)."""
    # why: optional fast tokenizer libraries, loaded when used
    import tiktoken

    spec = json.loads(hf_tokenizer.to_str())
    model = spec["model"]
    reason = _unsupported_layout(spec)
    if reason:
        return None, reason
    vocab: dict[str, int] = model["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    decoder = byte_decoder()
    missing = [c for c in decoder if c not in vocab]
    if missing:
        return None, f"{len(missing)} of the 256 byte tokens are missing from the vocabulary"

    table = {c: vocab[c] for c in decoder}
    previous = -1
    for left, right in merges:
        merged = left + right
        token_id = vocab.get(merged)
        if token_id is None or token_id <= previous or merged in table:
            return None, f"merge {left} {right}: ids do not increase with the merge order"
        table[merged] = previous = token_id

    bpe = hf_tokenizer.model
    for token, token_id in table.items():
        encoded = bpe.tokenize(token)
        if len(encoded) != 1 or encoded[0].id != token_id:
            return None, f"token {token!r} does not encode to itself"
    if not unicode_classes_agree():
        return None, "tiktoken and tokenizers disagree on Unicode classes"

    # Each stand-in character to the Latin-1 character of its byte, then to that byte.
    to_latin1 = str.maketrans({c: chr(b) for c, b in decoder.items()})
    ranks = {token.translate(to_latin1).encode("latin-1"): i for token, i in table.items()}
    encoding = tiktoken.Encoding(
        name=name, pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    return encoding, ""


def _unsupported_layout(spec: dict) -> str:
    """Why the HF pipeline is not plain GPT-2 byte-level BPE, or '' when it is."""
    model = spec["model"]
    if model.get("type") != "BPE":
        return "not a BPE model"
    for option in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(option):
            return f"BPE option {option} is set"
    if model.get("byte_fallback") or model.get("ignore_merges"):
        return "BPE byte_fallback / ignore_merges is set"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex"):
        return "the pre-tokenizer is not ByteLevel(add_prefix_space=False, use_regex=True)"
    if spec.get("normalizer") is not None or spec.get("added_tokens"):
        return "a normalizer or added tokens are set"
    return ""
