"""Supervised fine-tuning data (`--sft`): JSON-lines conversations for GPT, with the loss on the
response tokens only.

Each line is `{"prompt": ..., "response": ...}` or `{"messages": [{"role": ..., "content": ...},
...]}` (Megatron's SFT field). By default the messages are tokenized one by one and concatenated
with no chat template (put any role markers in the text); the response (the `assistant` messages)
and the end-of-document token that closes the conversation are the targets. With
`--sft-tokenizer-prompt-format` a chat template renders the conversation instead
(data/chat_template.py: the assistant turns are the targets; end-of-document is added unless the
template wrote it). One line is one sample of `--seq-length` tokens: a longer conversation is cut on
the right, a shorter one is padded (the padding is never a target). With `--sft-pack-sequences` one
sample holds several conversations instead (data/packing.py: first-fit-decreasing over the split's
conversations, position ids restarting and attention kept inside each conversation; the fill ratio
is printed). Items are GPTDataset's: `tokens`, `labels`, `loss_mask`, `position_ids` (and
`attention_mask` when packed). A dataset class of `data.builder` (its `open_low_level` reads the
file)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gigatron.data.builder import Bookend, build_datasets
from gigatron.data.chat_template import (
    ChatTemplate,
    TemplateFailure,
    chat_tokens,
    load_chat_template,
)
from gigatron.data.json_lines import json_lines
from gigatron.data.packing import (
    first_fit_decreasing,
    packed_sample,
    packing_stats,
    padded_length,
)
from gigatron.errors import GigatronError


@dataclass
class Conversation:
    tokens: np.ndarray  # int64 [n]
    targets: np.ndarray  # bool [n]: the token is part of a response


def record_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The messages of one JSON line (a prompt/response pair is a user and an assistant turn)."""
    messages = None
    if isinstance(record, dict) and "messages" in record:
        try:
            messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        except (KeyError, TypeError):
            messages = None
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    if not messages or not all(
        isinstance(m["content"], str) and isinstance(m["role"], str) for m in messages
    ):
        raise GigatronError(
            f'{where}: not an SFT record; give {{"prompt": ..., "response": ...}} or '
            '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}'
        )
    return messages


def conversation_from_json(
    record: Any, tokenizer: Any, where: str, template: ChatTemplate | None = None
) -> Conversation:
    """The tokens of one JSON line and which of them are response tokens: the messages'
    texts joined, or rendered by a chat template; then end-of-document unless already there."""
    messages = record_messages(record, where)
    tokens: list[int] = []
    targets: list[bool] = []
    if template is None:
        for message in messages:
            ids = list(tokenizer.tokenize(message["content"]))
            tokens += ids
            targets += [message["role"] == "assistant"] * len(ids)
    else:
        try:
            tokens, targets = chat_tokens(template, messages, tokenizer)
        except TemplateFailure as error:
            raise GigatronError(f"{where}: the chat template failed ({error})") from None
    if template is None or not tokens or tokens[-1] != tokenizer.eod:
        tokens.append(tokenizer.eod)
        # The closing token is learned after a response.
        targets.append(messages[-1]["role"] == "assistant")
    return Conversation(np.asarray(tokens, dtype=np.int64), np.asarray(targets, dtype=bool))


class SFTConversations:
    """Every conversation of one JSON-lines file, tokenized (held in memory)."""

    def __init__(self, path: str, tokenizer: Any, template: ChatTemplate | None = None) -> None:
        self.path = path
        self.conversations: list[Conversation] = []
        try:
            handle = open(path, encoding="utf-8")  # noqa: SIM115
        except OSError as error:
            raise GigatronError(
                f"--data-path {path}: cannot be read ({error.strerror}); with --sft the data are "
                "JSON-lines files"
            ) from None
        with handle:
            for number, record in json_lines(handle, path):
                where = f"{path}: line {number}"
                conversation = conversation_from_json(record, tokenizer, where, template)
                self.conversations.append(conversation)

    def __len__(self) -> int:
        return len(self.conversations)


@dataclass
class SFTDatasetOptions:
    seq_length: int
    seed: int
    pad: int
    pack: bool = False
    # Packed under context parallelism: documents padded to multiples of 2 cp (the split per
    # document cuts each into 2 cp chunks).
    pack_multiple: int = 1
    prompt_format: str | None = None
    split: str | None = None
    split_matrix: list[Bookend] = field(default_factory=list)
    tokenizer_identifiers: dict[str, Any] = field(default_factory=dict)


class SFTDataset:
    """One split of one conversation file: `num_samples` samples (None: one pass), the split's
    conversations in a new order each pass (a permutation seeded by the seed and the pass)."""

    cache_name = "SFTDataset"

    def __init__(
        self,
        low_level: SFTConversations,
        dataset_path: str | None,
        indices: np.ndarray,
        num_samples: int | None,
        index_split: str,
        options: SFTDatasetOptions,
        cache_dir: str | None = None,
    ) -> None:
        self.dataset, self.path, self.indices = low_level, dataset_path, indices
        self.options = options
        # Packed: a sample is a bin of conversations (positions into `indices`), else one.
        self.bins = None
        if options.pack:
            lengths = [len(low_level.conversations[i].tokens) for i in indices]
            seq, multiple = options.seq_length, options.pack_multiple
            sizes = [padded_length(n, seq, multiple) for n in lengths]
            self.bins = first_fit_decreasing(sizes, seq)
            self.packing = packing_stats(lengths, self.bins, options.seq_length)
        units = len(indices) if self.bins is None else len(self.bins)
        self.num_samples = units if num_samples is None else num_samples
        if self.num_samples and not len(indices):
            raise GigatronError(
                f"--data-path {dataset_path}: the {index_split} split holds no conversations; "
                "change --split"
            )
        digest = hashlib.md5(json.dumps(options.tokenizer_identifiers, sort_keys=True).encode())
        self.unique_identifiers = {
            "class": self.cache_name, "path": dataset_path, "split": index_split,
            "num_samples": self.num_samples, "seed": options.seed,
            "seq_length": options.seq_length, "tokenizer": digest.hexdigest(),
            "pack": options.pack, "pack_multiple": options.pack_multiple,
            "prompt_format": options.prompt_format,
        }  # fmt: skip
        self._orders: dict[int, np.ndarray] = {}

    @staticmethod
    def open_low_level(path: str, flag: str, cfg: Any, tokenizer: Any) -> SFTConversations:
        spec = cfg.data.sft_tokenizer_prompt_format
        template = None if spec is None else load_chat_template(spec, tokenizer)
        return SFTConversations(path, tokenizer, template)

    @staticmethod
    def options_from_config(cfg: Any, tokenizer: Any) -> SFTDatasetOptions:
        if getattr(tokenizer, "eod", None) is None:
            raise GigatronError("--sft: the tokenizer has no end-of-document token")
        if cfg.data.mock_data:
            raise GigatronError("--sft with --mock-data: give JSON-lines files as --data-path")
        # Conversations are whole samples, or packed with positions and attention kept to each:
        # the document-boundary options have nothing to act on.
        for name in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
            if getattr(cfg.data, name):
                flag = "--" + name.replace("_", "-")
                raise GigatronError(
                    f"{flag}: not used with --sft (one conversation per sample; "
                    "--sft-pack-sequences packs them, each with its own positions and attention)"
                )
        identifiers = getattr(tokenizer, "unique_identifiers", {})
        cp = cfg.parallel.context_parallel_size
        pad = tokenizer.pad if getattr(tokenizer, "pad", None) is not None else tokenizer.eod
        return SFTDatasetOptions(
            seq_length=cfg.model.seq_length,
            seed=cfg.training.seed,
            pad=pad,
            pack=cfg.data.sft_pack_sequences,
            pack_multiple=1 if cp == 1 else 2 * cp,
            prompt_format=cfg.data.sft_tokenizer_prompt_format,
            tokenizer_identifiers=dict(identifiers() if callable(identifiers) else identifiers),
        )

    @staticmethod
    def numel_low_level_dataset(low_level: SFTConversations) -> int:
        return len(low_level)

    @staticmethod
    def holds_data(low_level: SFTConversations, indices: np.ndarray) -> bool:
        return len(indices) > 0

    @staticmethod
    def build_mock_low_level(cfg: Any, tokenizer: Any) -> SFTConversations:
        raise GigatronError("--sft with --mock-data: give JSON-lines files as --data-path")

    def __len__(self) -> int:
        return self.num_samples

    def unit_index(self, index: int) -> int:
        """The conversation (or bin, when packed) of sample `index`: a new order each pass."""
        units = len(self.indices) if self.bins is None else len(self.bins)
        epoch, position = divmod(index, units)
        if epoch not in self._orders:
            rng = np.random.RandomState((self.options.seed + epoch) % 2**32)
            self._orders[epoch] = rng.permutation(units)
        return int(self._orders[epoch][position])

    def conversation_index(self, index: int) -> int:
        return int(self.indices[self.unit_index(index)])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        options = self.options
        if self.bins is None:
            conversation = self.dataset.conversations[self.conversation_index(index)]
            return sft_sample(conversation, options.seq_length, options.pad)
        chosen = [
            self.dataset.conversations[self.indices[i]] for i in self.bins[self.unit_index(index)]
        ]
        documents = [(c.tokens, c.targets) for c in chosen]
        return packed_sample(documents, options.seq_length, options.pad, options.pack_multiple)


def sft_sample(conversation: Conversation, seq_length: int, pad: int) -> dict[str, np.ndarray]:
    """seq_length + 1 tokens (cut or padded): inputs, next-token labels, and the loss mask that
    is 1 where the label is a response token."""
    tokens = np.full(seq_length + 1, pad, dtype=np.int64)
    targets = np.zeros(seq_length + 1, dtype=bool)
    n = min(len(conversation.tokens), seq_length + 1)
    tokens[:n] = conversation.tokens[:n]
    targets[:n] = conversation.targets[:n]
    return {
        "tokens": tokens[:-1],
        "labels": tokens[1:],
        "loss_mask": targets[1:].astype(np.float32),
        "position_ids": np.arange(seq_length, dtype=np.int64),
    }


def build_sft_datasets(cfg: Any, tokenizer: Any, num_samples, pctx: Any = None):
    """(train, valid, test) SFT datasets of the configuration (`--data-path` JSON-lines files);
    when packed, rank 0 prints each split's fill ratio."""
    splits = build_datasets(SFTDataset, cfg, tokenizer, num_samples, pctx)
    if cfg.data.sft_pack_sequences and (pctx is None or pctx.rank == 0):
        for name, dataset in zip(("train", "valid", "test"), splits):
            # A blend of several files: each member's packing.
            for member in getattr(dataset, "datasets", [dataset]):
                if isinstance(member, SFTDataset):
                    where = name if member is dataset else f"{name}, {member.path}"
                    print(member.packing.line(where), flush=True)
    return splits
