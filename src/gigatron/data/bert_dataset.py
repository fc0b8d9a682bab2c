"""BERT pre-training samples from sentence datasets, as Megatron-Core's BERTMaskedWordPieceDataset.

The data are `gigatron preprocess --split-sentences` output: each document is several sequences,
one per sentence. `--split` divides documents. A sample is consecutive sentences of one document
(data.sentence_samples: at most seq_length - 3 tokens, shorter with --short-seq-prob), then:

- with the binary head (default): the sentences are cut in two segments A and B at a random
  sentence boundary, and swapped with probability 0.5 (`is_random` = 1, sentence-order
  prediction); without it (`--bert-no-binary-head`) all sentences form A;
- A and B are trimmed to the sample's target length, one token at a time from the longer
  segment, at its front or back with probability 0.5 each;
- tokens are `[CLS] A [SEP] B [SEP]` (`[CLS] A [SEP]` without B); token types 0 up to the first
  [SEP], 1 after it;
- masking (data.masking): whole-word n-grams, --mask-prob of the tokens, 80% [MASK] /
  10% random id / 10% unchanged; [CLS] and [SEP] are never masked;
- padded with [PAD] to --seq-length.

Sample k draws all its random numbers from `numpy.random.RandomState((seed + k) % 2**32)`, in
Megatron's order, so a sample does not depend on which other samples were read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gigatron.data import builder
from gigatron.data.builder import Bookend
from gigatron.data.indexed import DocumentTable
from gigatron.data.masking import MaskingOptions, create_masked_lm_predictions
from gigatron.data.sentence_samples import build_sentence_sample_index
from gigatron.errors import GigatronError

INDEX_NAMES = ("sample_index.npy",)
# Megatron-Core's fixed masking recipe for BERT (pretrain_bert.py).
MASKING_MAX_NGRAM = 3
MASKING_DO_FULL_WORD = True


@dataclass
class BertDatasetOptions:
    """Everything a BertDataset needs besides its documents."""

    seq_length: int
    masking: MaskingOptions
    cls: int
    sep: int
    pad: int
    seed: int = 1234
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    binary_head: bool = True
    split: str | None = None
    split_matrix: list[Bookend] = field(default_factory=list)
    tokenizer_identifiers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, seq_length: int, **kwargs: Any) -> BertDatasetOptions:
        """Options for a WordPiece tokenizer with [CLS] [SEP] [MASK] [PAD] and `inv_vocab`."""
        ids = {name: getattr(tokenizer, name, None) for name in ("cls", "sep", "mask", "pad")}
        inv_vocab = getattr(tokenizer, "inv_vocab", None)
        if None in ids.values() or not inv_vocab:
            missing = [f"[{name.upper()}]" for name, value in ids.items() if value is None]
            raise GigatronError(
                f"--tokenizer-type {type(tokenizer).__name__}: BERT samples need a WordPiece "
                f"vocabulary with [CLS] [SEP] [MASK] [PAD] (missing: {missing or 'the vocab'}); "
                "use --tokenizer-type BertWordPieceLowerCase or BertWordPieceCase"
            )
        vocab_ids = np.array(sorted(inv_vocab), dtype=np.int64)
        is_continuation = np.zeros(int(vocab_ids.max()) + 1, dtype=bool)
        for token_id, piece in inv_vocab.items():
            is_continuation[token_id] = str(piece).startswith("##")
        masking = MaskingOptions(
            probability=float(kwargs.get("mask_prob", 0.15)),
            mask_id=int(ids["mask"]),
            special_ids=frozenset((int(ids["cls"]), int(ids["sep"]))),
            is_continuation=is_continuation,
            vocab_ids=vocab_ids,
            max_ngram=MASKING_MAX_NGRAM,
            whole_word=MASKING_DO_FULL_WORD,
        )
        return cls(
            seq_length=seq_length,
            masking=masking,
            cls=int(ids["cls"]),
            sep=int(ids["sep"]),
            pad=int(ids["pad"]),
            tokenizer_identifiers=dict(getattr(tokenizer, "unique_identifiers", {})),
            **kwargs,
        )


class BertDataset(builder.SplitDataset):
    """One split of one sentence dataset, as `len(self)` BERT samples (whole epochs).

    Items: `tokens`, `token_types`, `labels` (the original id at masked positions, 0 elsewhere),
    `padding_mask` (1 for real tokens) int64 [S]; `loss_mask` float32 [S] (1 at masked
    positions); `is_random` int64 scalar (1 when A and B were swapped).
    """

    # Megatron-Core's class name: cache entries have its name and description.
    cache_name = "BERTMaskedWordPieceDataset"

    def build_indices(self, where: str, cache_dir: str | None) -> None:
        if len(self.indices) == 0:
            raise GigatronError(
                f"--split {self.options.split}: {where} holds no documents (of "
                f"{self.numel_low_level_dataset(self.dataset)}) but samples are asked of it; "
                f"change --split to give {self.index_split} a larger share, or give "
                f"--{self.index_split}-data-path"
            )
        self.unique_identifiers = self._identifiers()
        # Megatron-Core's BERT file names carry no split name (the description has it).
        loaded = self.load_indices(
            cache_dir, self.cache_name, INDEX_NAMES, lambda: [self._build_sample_index(where)]
        )
        (self.sample_index,) = loaded

    def _identifiers(self) -> dict[str, Any]:
        """What the cached indices depend on (Megatron-Core's description of the dataset)."""
        options = self.options
        return {
            **self.identifiers(self.cache_name),
            "masking_probability": options.mask_prob,
            "short_sequence_probability": options.short_seq_prob,
            "masking_max_ngram": MASKING_MAX_NGRAM,
            "masking_do_full_word": MASKING_DO_FULL_WORD,
            "masking_do_permutation": False,
            "masking_use_longer_ngrams": False,
            "masking_use_geometric_distribution": False,
            "classification_head": options.binary_head,
        }

    def _build_sample_index(self, where: str) -> np.ndarray:
        bounds = np.asarray(self.dataset.document_indices)[
            np.append(self.indices, self.indices[-1] + 1)
        ]
        min_sentences = 2 if self.options.binary_head else 1
        try:
            return build_sentence_sample_index(
                bounds,
                self.dataset.sequence_lengths,
                self.num_samples,
                self.seq_length - 3,  # room for [CLS] and two [SEP]
                self.options.short_seq_prob,
                self.options.seed,
                min_sentences,
            )
        except GigatronError as error:
            hint = (
                "preprocess the text with --split-sentences, or train with --bert-no-binary-head"
                if self.options.binary_head
                else "check the data"
            )
            raise GigatronError(f"{where}: {error}; {hint}") from None

    # The interface of data.builder.
    @staticmethod
    def options_from_config(cfg: Any, tokenizer: Any) -> BertDatasetOptions:
        seq_length = cfg.model.seq_length
        if seq_length is None or seq_length < 5:
            raise GigatronError(
                f"--seq-length {seq_length}: BERT samples need at least 5 positions "
                "([CLS], two [SEP] and two tokens); give a larger --seq-length"
            )
        return BertDatasetOptions.from_tokenizer(
            tokenizer,
            seq_length=int(seq_length),
            seed=int(cfg.training.seed),
            mask_prob=float(cfg.data.mask_prob),
            short_seq_prob=float(cfg.data.short_seq_prob),
            binary_head=bool(cfg.model.bert_binary_head),
        )

    @staticmethod
    def numel_low_level_dataset(low_level: Any) -> int:
        """--split divides documents (each one several sentences)."""
        return len(low_level.document_indices) - 1

    @staticmethod
    def holds_data(low_level: Any, indices: np.ndarray) -> bool:
        if len(indices) == 0:
            return False
        bounds = np.asarray(low_level.document_indices)
        first, end = int(bounds[indices[0]]), int(bounds[indices[-1] + 1])
        return bool(np.asarray(low_level.sequence_lengths)[first:end].any())

    @staticmethod
    def build_mock_low_level(cfg: Any, tokenizer: Any) -> MockSentenceDataset:
        inv_vocab = getattr(tokenizer, "inv_vocab", None) or {}
        words = [i for i, piece in inv_vocab.items() if not str(piece).startswith("[")]
        if not words:
            raise GigatronError(
                "--mock-data with BERT needs a WordPiece tokenizer (--tokenizer-type "
                "BertWordPieceLowerCase and --vocab-file)"
            )
        return MockSentenceDataset(np.array(sorted(words), dtype=np.int64))

    def __len__(self) -> int:
        return int(self.sample_index.shape[0])

    @staticmethod
    def make_sample(
        sentences: list[list[int]], target: int, rng: np.random.RandomState, options: Any
    ) -> dict[str, Any]:
        """The sample of `sentences` cut to `target` tokens (T5Dataset makes T5 samples)."""
        return make_bert_sample(sentences, target, rng, options)

    def __getitem__(self, index: int) -> dict[str, Any]:
        index = self.position(index)
        first, end, target = (int(x) for x in self.sample_index[index])
        sentences = [self.dataset.get(i).tolist() for i in range(first, end)]
        rng = np.random.RandomState((self.options.seed + index) % 2**32)
        return self.make_sample(sentences, target, rng, self.options)


def make_bert_sample(
    sentences: list[list[int]], target: int, rng: np.random.RandomState, options: BertDatasetOptions
) -> dict[str, Any]:
    """The BERT sample of `sentences` (token ids) trimmed to `target` tokens, drawn from `rng`."""
    pivot, is_random = len(sentences), False
    if options.binary_head:
        if len(sentences) < 2:
            raise ValueError("a sample for the binary head needs at least two sentences")
        pivot = 1 if len(sentences) < 3 else int(rng.randint(low=1, high=len(sentences)))
        is_random = bool(rng.random_sample() < 0.5)
    a = [t for sentence in sentences[:pivot] for t in sentence]
    b = [t for sentence in sentences[pivot:] for t in sentence]
    if is_random:
        a, b = b, a
    a, b = _trim(a, b, target, rng)

    tokens = [options.cls, *a, options.sep]
    types = [0] * len(tokens)
    if b:
        tokens += [*b, options.sep]
        types += [1] * (len(b) + 1)
    tokens, positions, originals = create_masked_lm_predictions(
        tokens, target, rng, options.masking
    )

    seq, real = options.seq_length, len(tokens)
    if real > seq:
        raise ValueError(f"sample of {real} tokens exceeds --seq-length {seq}")
    sample_tokens = np.full(seq, options.pad, dtype=np.int64)
    sample_tokens[:real] = tokens
    token_types = np.zeros(seq, dtype=np.int64)
    token_types[:real] = types
    labels = np.zeros(seq, dtype=np.int64)
    labels[positions] = originals
    loss_mask = np.zeros(seq, dtype=np.float32)
    loss_mask[positions] = 1.0
    padding_mask = np.zeros(seq, dtype=np.int64)
    padding_mask[:real] = 1
    return {
        "tokens": sample_tokens,
        "token_types": token_types,
        "labels": labels,
        "loss_mask": loss_mask,
        "padding_mask": padding_mask,
        "is_random": np.int64(is_random),
    }


def _trim(
    a: list[int], b: list[int], target: int, rng: np.random.RandomState
) -> tuple[list[int], list[int]]:
    """Drop tokens from the longer segment (B on ties), front or back at random, to `target`."""
    a_lo, a_hi, b_lo, b_hi = 0, len(a), 0, len(b)
    while (a_hi - a_lo) + (b_hi - b_lo) > target:
        front = rng.random_sample() < 0.5
        if a_hi - a_lo > b_hi - b_lo:
            a_lo, a_hi = (a_lo + 1, a_hi) if front else (a_lo, a_hi - 1)
        else:
            b_lo, b_hi = (b_lo + 1, b_hi) if front else (b_lo, b_hi - 1)
    return a[a_lo:a_hi], b[b_lo:b_hi]


# ----------------------------------------------------------------------------------------------
# Synthetic sentences for --mock-data


class MockSentenceDataset(DocumentTable):
    """Documents of 2 to 8 sentences of 4 to 40 random word ids, from a fixed seed (--mock-data).

    Serves the part of IndexedDataset's interface that BertDataset uses.
    """

    def __init__(self, words: np.ndarray, num_documents: int = 2_000) -> None:
        self.path = None
        rng = np.random.RandomState(0)
        per_document = rng.randint(2, 9, size=num_documents)
        self._document_indices = np.concatenate(([0], np.cumsum(per_document))).astype(np.int64)
        self._sequence_lengths = rng.randint(4, 41, size=int(per_document.sum())).astype(np.int32)
        starts = np.concatenate(([0], np.cumsum(self._sequence_lengths)))
        self._starts = starts
        self._tokens = words[rng.randint(0, len(words), size=int(starts[-1]))]

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self._starts[index]) + offset
        end = int(self._starts[index + 1]) if length is None else start + length
        return self._tokens[start:end]


# (train, valid, test) BERT datasets of a configuration; None for a split that is absent.
build_bert_datasets = BertDataset.build_splits
