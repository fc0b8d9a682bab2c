"""The tokenizer of a `gigatron convert --to hf` export, as files `AutoTokenizer` loads.

Which tokenizer: the flags given to `convert` (`--tokenizer-type`, `--vocab-file`,
`--merge-file`, `--tokenizer-model`) over the run's recorded tokenizer configuration; with
none given, a checkpoint imported from Hugging Face keeps the tokenizer files copied next to it.
How it is written:
- GPT2BPETokenizer: `vocab.json` + `merges.txt` and a GPT-2 `tokenizer_config.json`;
- BertWordPieceLowerCase / BertWordPieceCase: `vocab.txt` and a BERT `tokenizer_config.json`;
- HuggingFaceTokenizer: its folder's tokenizer files (or its `tokenizer.json` alone, with a
  `tokenizer_config.json` naming the fast tokenizer class).
Other kinds (SentencePiece with Megatron's added tokens, TikTokenizer) and runs that record no
tokenizer (NullTokenizer) are refused with the fix, unless `--no-tokenizer` asks for the weights
alone: an export without tokenizer files would load a wrong one silently.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gigatron.config.tokenizer import TokenizerConfig
from gigatron.errors import GigatronError

# Files a Hugging Face folder keeps next to the weights that belong to the tokenizer.
TOKENIZER_FILES = re.compile(
    r"^(tokenizer.*|vocab\..*|merges\.txt|special_tokens_map\.json|added_tokens\.json|"
    r".*\.tiktoken|spiece\.model|sentencepiece.*\.model|generation_config\.json)$"
)
TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
_GPT2_END = "<|endoftext|>"
_GENERATION_CONFIG = "generation_config.json"
_FIX = (
    "give the tokenizer to write with --tokenizer-type and its files (--vocab-file, "
    "--merge-file, --tokenizer-model), or --no-tokenizer to export the weights alone"
)


@dataclass
class TokenizerFiles:
    """Files to copy into the export (name there -> source) and a tokenizer_config.json."""

    copies: dict[str, Path] = field(default_factory=dict)
    config: dict[str, Any] | None = None

    def write(self, folder: Path) -> list[str]:
        for name, source in self.copies.items():
            shutil.copy2(source, folder / name)
        if self.config is not None:
            text = json.dumps(self.config, indent=2) + "\n"
            (folder / "tokenizer_config.json").write_text(text)
        names = set(self.copies) | ({"tokenizer_config.json"} if self.config else set())
        return sorted(names)


def _file(value: str | None, flag: str, kind: str, where: str) -> Path:
    if not value:
        raise GigatronError(f"{where}: tokenizer {kind} records no {flag}; {_FIX}")
    path = Path(value)
    if not path.is_file():
        raise GigatronError(f"{where}: tokenizer {kind}'s {flag} {value} is not there; {_FIX}")
    return path


def _hugging_face(path_text: str | None, where: str) -> TokenizerFiles:
    kind = "HuggingFaceTokenizer"
    path = Path(path_text or "")
    if path_text and path.is_dir():
        copies = {f.name: f for f in sorted(path.iterdir()) if TOKENIZER_FILES.match(f.name)}
        if "tokenizer.json" not in copies:
            raise GigatronError(f"{where}: --tokenizer-model {path} has no tokenizer.json; {_FIX}")
        has_config = "tokenizer_config.json" in copies
        return TokenizerFiles(
            copies, None if has_config else {"tokenizer_class": "PreTrainedTokenizerFast"}
        )
    json_file = _file(path_text, "--tokenizer-model", kind, where)
    return TokenizerFiles(
        {"tokenizer.json": json_file}, {"tokenizer_class": "PreTrainedTokenizerFast"}
    )


def files_for(tokenizer: TokenizerConfig, where: str) -> TokenizerFiles:
    """The Hugging Face files of `tokenizer` (module docstring), or a GigatronError with the fix."""
    kind = tokenizer.tokenizer_type
    if kind == "GPT2BPETokenizer":
        vocab = _file(tokenizer.vocab_file, "--vocab-file", kind, where)
        merges = _file(tokenizer.merge_file, "--merge-file", kind, where)
        config = {
            "tokenizer_class": "GPT2Tokenizer",
            "add_prefix_space": False,
            **dict.fromkeys(("bos_token", "eos_token", "unk_token"), _GPT2_END),
        }
        return TokenizerFiles({"vocab.json": vocab, "merges.txt": merges}, config)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        vocab = _file(tokenizer.vocab_file, "--vocab-file", kind, where)
        lower = kind == "BertWordPieceLowerCase"
        config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower}
        return TokenizerFiles({"vocab.txt": vocab}, config)
    if kind == "HuggingFaceTokenizer":
        return _hugging_face(tokenizer.tokenizer_model, where)
    if kind in (None, "NullTokenizer"):
        raise GigatronError(f"{where}: records no tokenizer ({kind}); {_FIX}")
    raise GigatronError(
        f"{where}: tokenizer {kind} has no Hugging Face files gigatron writes (supported: "
        "GPT2BPETokenizer, BertWordPiece*, HuggingFaceTokenizer); give an equal Hugging Face "
        "tokenizer with --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR, or "
        "--no-tokenizer to export the weights alone"
    )


def plan_tokenizer_export(
    checkpoint: Path,
    recorded: TokenizerConfig | None,
    given: dict[str, str | None] | None,
    mode: str,
    where: str,
) -> TokenizerFiles:
    """What tokenizer files the export of `checkpoint` gets (checked before anything is
    written). `mode`: "required" (refused without a usable tokenizer), "if-any" (then none is
    written) or "none" (no tokenizer files)."""
    if mode not in ("required", "if-any", "none"):
        raise ValueError(f"tokenizer mode {mode!r}")
    kept = {f.name: f for f in sorted(checkpoint.iterdir()) if TOKENIZER_FILES.match(f.name)}
    generation = {n: f for n, f in kept.items() if n == _GENERATION_CONFIG}  # not a tokenizer's
    if mode == "none":
        return TokenizerFiles(generation)
    given = {name: value for name, value in (given or {}).items() if value is not None}
    unknown = set(given) - set(TOKENIZER_FLAGS)
    if unknown:
        raise ValueError(f"not tokenizer flags: {sorted(unknown)}")
    if not given and len(kept) > len(generation):  # copied there by the import from HF
        return TokenizerFiles(kept)
    tokenizer = dataclasses.replace(recorded or TokenizerConfig(), **given)
    try:
        files = files_for(tokenizer, where)
    except GigatronError:
        if mode == "required":
            raise
        return TokenizerFiles(generation)
    return TokenizerFiles({**generation, **files.copies}, files.config)
