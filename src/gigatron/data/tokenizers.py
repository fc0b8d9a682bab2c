"""Tokenizers selected by `--tokenizer-type`, with Megatron-LM's ids and special tokens.

Every tokenizer wraps a maintained library (HF `tokenizers`, `sentencepiece`, `tiktoken`) and
reads only local files: nothing is downloaded. `build_tokenizer(cfg)` is the one entry point.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from gigatron.config.tokenizer import TokenizerConfig
from gigatron.data.gpt2_tiktoken import build_tiktoken_bpe
from gigatron.errors import GigatronError


class Tokenizer:
    """The interface every tokenizer serves; ids that a vocabulary lacks are None."""

    vocab_size: int
    eod: int | None = None
    pad: int | None = None
    bos: int | None = None
    eos: int | None = None
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    unk: int | None = None

    def __init__(self, identifiers: dict[str, Any]) -> None:
        self._identifiers = {"class": type(self).__name__, **identifiers}
        self.additional_special_tokens_ids: list[int] = []

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        """Class name, files and options: what makes two tokenizers produce the same ids."""
        return dict(self._identifiers)

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Tokenize many texts at once (the library's batch path where it has one)."""
        return [self.tokenize(text) for text in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


def _require_file(value: str | None, flag: str, tokenizer_type: str, what: str) -> str:
    if not value:
        raise GigatronError(f"{flag} is required with --tokenizer-type {tokenizer_type}: {what}")
    if not os.path.isfile(value):
        raise GigatronError(f"{flag} {value}: file not found; give the path to {what}")
    return os.path.abspath(value)


def _ids(values: Sequence[int]) -> list[int]:
    # Callers pass numpy arrays or tensors too; the libraries want plain ints.
    return [int(v) for v in values]


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from vocab.json + merges.txt.

    Like Megatron's original GPT-2 tokenizer, `<|endoftext|>` in the text is not treated as a
    special token: only `eod` is that id. HF `tokenizers` is the reference; encoding runs on
    `tiktoken` when `gpt2_tiktoken.build_tiktoken_bpe` proves its ids equal (for GPT-2's own
    files it does), else on HF. `backend` is "auto" (that choice) or "hf" (the reference only);
    the chosen one is in `.backend`.
    """

    def __init__(self, vocab_file: str, merge_file: str, backend: str = "auto") -> None:
        # why: tokenizer libraries load only for the tokenizer type chosen
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        if backend not in ("auto", "hf"):
            raise ValueError(f"backend {backend!r}: expected 'auto' or 'hf'")
        super().__init__({"vocab_file": vocab_file, "merge_file": merge_file})
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:
            raise GigatronError(
                f"--vocab-file {vocab_file} / --merge-file {merge_file}: not a GPT-2 BPE "
                f"vocabulary and merges pair ({error})"
            ) from None
        self._tokenizer = HFTokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        self.vocab = self._tokenizer.get_vocab()
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = len(self.vocab)
        if "<|endoftext|>" not in self.vocab:
            raise GigatronError(
                f"--vocab-file {vocab_file}: has no <|endoftext|> token, which GPT-2 uses as the "
                "end-of-document id; use a GPT-2 style vocabulary"
            )
        self.eod = self.vocab["<|endoftext|>"]
        self._fast = None
        self.backend, self.backend_reason = "hf", "requested"
        if backend == "auto":
            self._fast, self.backend_reason = build_tiktoken_bpe(self._tokenizer)
            if self._fast is not None:
                self.backend = "tiktoken"

    def tokenize(self, text: str) -> list[int]:
        # tiktoken would replace lone surrogates; HF refuses them: keep the reference's answer.
        if self._fast is not None and (text.isascii() or not _SURROGATE.search(text)):
            return self._fast.encode_ordinary(text)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            # One call per text: tiktoken's batch call adds a thread pool and is slower here.
            return [self.tokenize(text) for text in texts]
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(_ids(ids), skip_special_tokens=False)


_SURROGATE = re.compile("[\ud800-\udfff]")


class BertWordPieceTokenizer(Tokenizer):
    """BERT WordPiece from vocab.txt (HF `tokenizers`); `tokenize` adds no [CLS]/[SEP].

    As in Megatron, [BOS] and [EOS] (and `--vocab-extra-ids` `<extra_id_i>` tokens) are appended
    to the vocabulary when it lacks them; the end-of-document id is [SEP].
    """

    def __init__(self, vocab_file: str, lower_case: bool, vocab_extra_ids: int = 0) -> None:
        # why: tokenizer libraries load only for the tokenizer type chosen
        from tokenizers.implementations import BertWordPieceTokenizer as HFBert

        super().__init__(
            {"vocab_file": vocab_file, "lower_case": lower_case, "vocab_extra_ids": vocab_extra_ids}
        )
        try:
            self._tokenizer = HFBert(
                vocab_file,
                lowercase=lower_case,
                strip_accents=None if lower_case else False,
            )
        except Exception as error:
            raise GigatronError(
                f"--vocab-file {vocab_file}: not a WordPiece vocab.txt ({error})"
            ) from None
        self.vocab = dict(self._tokenizer.get_vocab())
        missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]") if t not in self.vocab]
        if missing:
            raise GigatronError(
                f"--vocab-file {vocab_file}: lacks the BERT special tokens {missing}; a BERT "
                "vocab.txt must define [PAD] [UNK] [CLS] [SEP] [MASK]"
            )
        self._base_size = len(self.vocab)
        self._added: dict[int, str] = {}
        self.bos = self._add_token("[BOS]")
        self.eos = self._add_token("[EOS]")
        self.additional_special_tokens_ids = [
            self._add_token(f"<extra_id_{i}>") for i in range(vocab_extra_ids)
        ]
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = len(self.vocab)
        self.cls = self.vocab["[CLS]"]
        self.sep = self.vocab["[SEP]"]
        self.pad = self.vocab["[PAD]"]
        self.mask = self.vocab["[MASK]"]
        self.unk = self.vocab["[UNK]"]
        self.eod = self.sep

    def _add_token(self, token: str) -> int:
        # Appended to the id space only; text that spells "[BOS]" still tokenizes as words,
        # as it did in Megatron's original BERT tokenizer.
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
            self._added[self.vocab[token]] = token
        return self.vocab[token]

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for token_id in _ids(ids):
            if token_id in self._added:
                if run:
                    pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self._added[token_id])
            else:
                run.append(token_id)
        if run:
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=False))
        # The WordPiece decoder's clean-up leaves "l ' eure"; BERT references read "l'eure".
        return " ".join(pieces).replace(" ' ", "'")


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece with Megatron's extra specials <CLS> <SEP> <EOD> <MASK> (and <PAD>, <BOS>,
    <EOS> when the model has none), appended after the model's pieces; `eod` is <EOD>.

    The text spelling of a special token maps to its id, as in Megatron.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__({"tokenizer_model": model_file, "vocab_extra_ids": vocab_extra_ids})
        self._processor = _load_sentencepiece(model_file)
        self.vocab = {self._processor.id_to_piece(i): i for i in range(len(self._processor))}
        self._special: dict[str, int] = {}
        self.cls = self._add_special("<CLS>")
        self.sep = self._add_special("<SEP>")
        self.eod = self._add_special("<EOD>")
        self.mask = self._add_special("<MASK>")
        self.pad = self._add_special(self._piece_or(self._processor.pad_id(), "<PAD>"))
        self.bos = self._add_special(self._piece_or(self._processor.bos_id(), "<BOS>"))
        self.eos = self._add_special(self._piece_or(self._processor.eos_id(), "<EOS>"))
        self.additional_special_tokens_ids = [
            self._add_special(f"<extra_id_{i}>") for i in range(vocab_extra_ids)
        ]
        unk = self._processor.unk_id()
        self.unk = unk if unk >= 0 else None
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self._inv_special = {i: t for t, i in self._special.items()}
        self.vocab_size = len(self.vocab)
        # Longest first so that a special token that prefixes another never wins by accident.
        alternatives = sorted(self._special, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(t) for t in alternatives))

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        if 0 <= piece_id < len(self._processor):
            return self._processor.id_to_piece(piece_id)
        return fallback

    def _add_special(self, token: str) -> int:
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
        self._special[token] = self.vocab[token]
        return self.vocab[token]

    def tokenize(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(self._processor.encode(text[start : match.start()]))
            ids.append(self._special[match.group()])
            start = match.end()
        ids.extend(self._processor.encode(text[start:]))
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        plain = [i for i, text in enumerate(texts) if not self._special_pattern.search(text)]
        results: list[list[int]] = [[] for _ in texts]
        if plain:
            encoded = self._processor.encode([texts[i] for i in plain], num_threads=1)
            for i, ids in zip(plain, encoded):
                results[i] = ids
        plain_set = set(plain)
        for i, text in enumerate(texts):
            if i not in plain_set:
                results[i] = self.tokenize(text)
        return results

    def detokenize(self, ids: Sequence[int]) -> str:
        text = ""
        run: list[int] = []
        for token_id in _ids(ids):
            if token_id in self._inv_special:
                text += self._processor.decode(run) + " " + self._inv_special[token_id] + " "
                run = []
            else:
                run.append(token_id)
        return text + self._processor.decode(run)


class GPTSentencePieceTokenizer(Tokenizer):
    """SentencePiece as-is (no added tokens); `eod` is the model's </s>."""

    def __init__(self, model_file: str) -> None:
        super().__init__({"tokenizer_model": model_file})
        self._processor = _load_sentencepiece(model_file)
        self.vocab_size = len(self._processor)
        self.pad = _or_none(self._processor.pad_id())
        self.bos = _or_none(self._processor.bos_id())
        self.eos = _or_none(self._processor.eos_id())
        self.unk = _or_none(self._processor.unk_id())
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._processor.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._processor.decode(_ids(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2 SentencePiece: `tokenize` puts <s> first, as Megatron's Llama2Tokenizer does."""

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text, add_bos=self.bos is not None)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._processor.encode(list(texts), add_bos=self.bos is not None, num_threads=1)


def _or_none(value: int) -> int | None:
    return value if value >= 0 else None


def _load_sentencepiece(model_file: str) -> Any:
    # why: tokenizer libraries load only for the tokenizer type chosen
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except Exception as error:
        raise GigatronError(
            f"--tokenizer-model {model_file}: not a SentencePiece model ({error})"
        ) from None


class HuggingFaceTokenizer(Tokenizer):
    """A local Hugging Face fast tokenizer: a directory holding tokenizer.json (and optionally
    tokenizer_config.json / special_tokens_map.json), or the tokenizer.json file itself.

    `tokenize` adds the tokenizer's own special tokens (e.g. a leading BOS), like Megatron's
    `HuggingFaceTokenizer` calling `tokenizer(text).input_ids`.
    """

    def __init__(self, path: str, include_special_tokens: bool = True) -> None:
        # why: tokenizer libraries load only for the tokenizer type chosen
        from tokenizers import Tokenizer as HFTokenizer

        if os.path.isdir(path):
            directory, json_path = path, os.path.join(path, "tokenizer.json")
        else:
            directory, json_path = os.path.dirname(path), path
        if not os.path.isfile(json_path):
            raise GigatronError(
                f"--tokenizer-model {path}: no tokenizer.json there; gigatron reads Hugging Face "
                "tokenizers from local files only (download the model's tokenizer.json, e.g. "
                "with `huggingface-cli download MODEL tokenizer.json tokenizer_config.json`, "
                "and pass its directory)"
            )
        super().__init__(
            {"tokenizer_model": os.path.abspath(json_path), "special": include_special_tokens}
        )
        try:
            self._tokenizer = HFTokenizer.from_file(json_path)
        except Exception as error:
            raise GigatronError(
                f"--tokenizer-model {json_path}: not a Hugging Face tokenizer.json ({error})"
            ) from None
        self._add_special = include_special_tokens
        self.vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        names = _special_token_names(directory)
        for attribute in ("bos", "eos", "pad", "unk", "cls", "sep", "mask"):
            token = names.get(f"{attribute}_token")
            setattr(self, attribute, self.vocab.get(token) if token else None)
        if self.eos is None:
            # No tokenizer_config.json: fall back on the end token names in common use.
            for token in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"):
                if token in self.vocab:
                    self.eos = self.vocab[token]
                    break
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=self._add_special)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(_ids(ids), skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` without the tokenizer's own special tokens (a chat template writes
        them) and each one's [start, end) characters."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


def _special_token_names(directory: str) -> dict[str, str]:
    """Special token strings from tokenizer_config.json / special_tokens_map.json, if present."""
    names: dict[str, str] = {}
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, filename)
        if not directory or not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as stream:
                config = json.load(stream)
        except (OSError, json.JSONDecodeError) as error:
            raise GigatronError(f"{path}: unreadable JSON ({error})") from None
        for key, value in config.items():
            if not key.endswith("_token"):
                continue
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                names[key] = value
    return names


TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
TIKTOKEN_REQUIRED_SPECIALS = ["<unk>", "<s>", "</s>"]


class TikTokenizer(Tokenizer):
    """A byte-level BPE run by `tiktoken`, laid out as Megatron's TikTokenizer: ids below
    `--tiktoken-num-special-tokens` are special tokens (<unk>=0, <s>=1, </s>=2, then
    <SPECIAL_i> fillers), the ranked byte sequences follow. `eod` is </s>.

    `--tokenizer-model` is a `.tiktoken` file (base64 token and rank per line) or Megatron's JSON
    list of {"rank", "token_bytes", "token_str"}.
    """

    def __init__(
        self,
        path: str,
        pattern: str,
        vocab_size: int | None,
        num_special_tokens: int,
    ) -> None:
        # why: tokenizer libraries load only for the tokenizer type chosen
        import tiktoken

        super().__init__(
            {
                "tokenizer_model": path,
                "pattern": pattern,
                "vocab_size": vocab_size,
                "num_special_tokens": num_special_tokens,
            }
        )
        if num_special_tokens < len(TIKTOKEN_REQUIRED_SPECIALS):
            raise GigatronError(
                f"--tiktoken-num-special-tokens {num_special_tokens}: must be at least "
                f"{len(TIKTOKEN_REQUIRED_SPECIALS)} (for {' '.join(TIKTOKEN_REQUIRED_SPECIALS)})"
            )
        ranks = _load_tiktoken_ranks(path)
        if vocab_size is not None:
            if vocab_size <= num_special_tokens:
                raise GigatronError(
                    f"--vocab-size {vocab_size}: must exceed --tiktoken-num-special-tokens "
                    f"{num_special_tokens}"
                )
            ranks = {t: r for t, r in ranks.items() if r < vocab_size - num_special_tokens}
        specials = TIKTOKEN_REQUIRED_SPECIALS + [
            f"<SPECIAL_{i}>" for i in range(len(TIKTOKEN_REQUIRED_SPECIALS), num_special_tokens)
        ]
        special_ids = {token: i for i, token in enumerate(specials)}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(path),
            pat_str=TIKTOKEN_PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens=special_ids,
        )
        self.vocab_size = vocab_size if vocab_size is not None else num_special_tokens + len(ranks)
        self.unk, self.bos, self.eos = 0, 1, 2
        self.eod = self.eos

    def tokenize(self, text: str) -> list[int]:
        return self._encoding.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._encoding.encode_ordinary_batch(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(_ids(ids))


def _load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as stream:
                entries = json.load(stream)
            for entry in entries:
                ranks[base64.b64decode(entry["token_bytes"])] = int(entry["rank"])
        else:
            with open(path, "rb") as stream:
                for line in stream:
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise GigatronError(
            f"--tokenizer-model {path}: not a tiktoken rank file (one 'base64-token rank' per "
            f"line, or Megatron's JSON list) ({error})"
        ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise GigatronError(f"--tokenizer-model {path}: ranks must be 0..N-1 without gaps")
    return ranks


class NullTokenizer(Tokenizer):
    """No vocabulary: the text is space-separated integer ids (for benchmarks and tests)."""

    def __init__(self, vocab_size: int, eod_id: int | None = None) -> None:
        super().__init__({"vocab_size": vocab_size, "eod_id": eod_id})
        self.vocab_size = vocab_size
        self.eod = eod_id if eod_id is not None else vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(piece) for piece in text.split()]
        except ValueError:
            raise ValueError(
                f"NullTokenizer text must be space-separated integers, got {text[:60]!r}"
            ) from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer `--tokenizer-type` names, from its local files."""
    kind = cfg.tokenizer_type
    if kind is None:
        raise GigatronError("--tokenizer-type is required (e.g. GPT2BPETokenizer)")
    if kind == "GPT2BPETokenizer":
        vocab = _require_file(cfg.vocab_file, "--vocab-file", kind, "GPT-2 vocab.json")
        merges = _require_file(cfg.merge_file, "--merge-file", kind, "GPT-2 merges.txt")
        return GPT2BPETokenizer(vocab, merges)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _require_file(cfg.vocab_file, "--vocab-file", kind, "BERT vocab.txt")
        return BertWordPieceTokenizer(
            vocab, lower_case=kind == "BertWordPieceLowerCase", vocab_extra_ids=_extra_ids(cfg)
        )
    if kind == "SentencePieceTokenizer":
        model = _require_file(cfg.tokenizer_model, "--tokenizer-model", kind, "a .model file")
        return SentencePieceTokenizer(model, vocab_extra_ids=_extra_ids(cfg))
    if kind == "GPTSentencePieceTokenizer":
        model = _require_file(cfg.tokenizer_model, "--tokenizer-model", kind, "a .model file")
        return GPTSentencePieceTokenizer(model)
    if kind == "Llama2Tokenizer":
        model = _require_file(cfg.tokenizer_model, "--tokenizer-model", kind, "a .model file")
        return Llama2Tokenizer(model)
    if kind == "HuggingFaceTokenizer":
        if not cfg.tokenizer_model:
            raise GigatronError(
                f"--tokenizer-model is required with --tokenizer-type {kind}: a local directory "
                "holding tokenizer.json, or the tokenizer.json file"
            )
        include = not getattr(cfg, "tokenizer_hf_no_include_special_tokens", False)
        return HuggingFaceTokenizer(cfg.tokenizer_model, include_special_tokens=include)
    if kind == "TikTokenizer":
        path = _require_file(
            cfg.tokenizer_model, "--tokenizer-model", kind, "a .tiktoken or Megatron JSON file"
        )
        return TikTokenizer(
            path,
            pattern=cfg.tiktoken_pattern or "v2",
            vocab_size=cfg.vocab_size,
            num_special_tokens=cfg.tiktoken_num_special_tokens,
        )
    if kind == "NullTokenizer":
        if cfg.vocab_size is None or cfg.vocab_size < 1:
            raise GigatronError(
                "--vocab-size is required with --tokenizer-type NullTokenizer (a positive integer)"
            )
        return NullTokenizer(cfg.vocab_size, cfg.null_tokenizer_eod_id)
    raise GigatronError(f"--tokenizer-type {kind}: unknown tokenizer type")


def _extra_ids(cfg: TokenizerConfig) -> int:
    return int(getattr(cfg, "vocab_extra_ids", 0) or 0)


def build_run_tokenizer(cfg: Any) -> Any:
    """The tokenizer of a run (a GigatronConfig); --mock-data with --vocab-size needs no files
    (NullTokenizer)."""
    tok = cfg.tokenizer
    if tok.tokenizer_type is None:
        if cfg.data.mock_data and tok.vocab_size is not None:
            tok = dataclasses.replace(tok, tokenizer_type="NullTokenizer")  # cfg is frozen
        else:
            raise GigatronError(
                "--tokenizer-type is required (e.g. GPT2BPETokenizer with --vocab-file and "
                "--merge-file), or use --mock-data --vocab-size N"
            )
    return build_tokenizer(tok)
