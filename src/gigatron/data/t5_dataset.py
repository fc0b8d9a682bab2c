"""T5 span-corruption samples from sentence datasets, as Megatron-Core's T5MaskedWordPieceDataset.

The data are `gigatron preprocess --split-sentences` output with a WordPiece tokenizer and
`--vocab-extra-ids N` sentinel tokens `<extra_id_0>`.. . A sample is consecutive sentences of one
document (data.sentence_samples: at most encoder length - 2 tokens, shorter with
--short-seq-prob), then:

- the tokens are concatenated and cut to the sample's target length;
- spans are chosen by the masked-LM machinery (data.masking): whole words, span sizes
  min(Geometric(0.2), 10) words (mean about 3 words), --mask-prob of the tokens;
- each span, in order, is replaced in the encoder input by the next sentinel; the decoder input
  is [BOS] then, per span, its sentinel and its tokens; the labels are the decoder input shifted
  left (per span its sentinel and tokens, then [EOS]);
- encoder input and decoder input are padded with [PAD] (then set to id 0, as Megatron), labels
  with -1; `loss_mask` is 1 on the decoder's real positions; `enc_mask` / `dec_mask` are 1 on
  real tokens.

Sample k draws all its random numbers from `numpy.random.RandomState((seed + k) % 2**32)`, in
Megatron's order, so a sample does not depend on which other samples were read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from gigatron.data.bert_dataset import BertDataset, BertDatasetOptions
from gigatron.data.masking import create_masked_spans
from gigatron.data.sentence_samples import build_sentence_sample_index
from gigatron.errors import GigatronError

# Megatron-Core's fixed masking recipe for T5 (pretrain_t5.py).
MASKING_MAX_NGRAM = 10
MASKING_DO_FULL_WORD = True
MASKING_USE_GEOMETRIC_DISTRIBUTION = True


@dataclass
class T5DatasetOptions(BertDatasetOptions):
    """BERT's options (seq_length is the encoder's) plus the decoder length and the T5 tokens."""

    decoder_seq_length: int = 128
    bos: int = -1
    eos: int = -1
    sentinels: tuple[int, ...] = ()

    @classmethod
    def for_t5(
        cls, tokenizer: Any, seq_length: int, decoder_seq_length: int, **kwargs: Any
    ) -> T5DatasetOptions:
        """Options for a WordPiece tokenizer with [BOS] [EOS] and `<extra_id_i>` sentinels."""
        sentinels = tuple(getattr(tokenizer, "additional_special_tokens_ids", None) or ())
        bos, eos = getattr(tokenizer, "bos", None), getattr(tokenizer, "eos", None)
        if bos is None or eos is None:
            raise GigatronError(
                f"tokenizer {type(tokenizer).__name__}: T5 samples need [BOS] and [EOS]; use "
                "--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase"
            )
        if not sentinels:
            raise GigatronError(
                "--vocab-extra-ids 0: T5 samples need sentinel tokens <extra_id_i>, one per "
                "masked span; give --vocab-extra-ids 100 (Megatron's T5 setting)"
            )
        base = BertDatasetOptions.from_tokenizer(tokenizer, seq_length, binary_head=False, **kwargs)
        masking = dataclasses.replace(
            base.masking,
            max_ngram=MASKING_MAX_NGRAM,
            whole_word=MASKING_DO_FULL_WORD,
            geometric=MASKING_USE_GEOMETRIC_DISTRIBUTION,
            replacement="mask",
        )
        values = {f.name: getattr(base, f.name) for f in dataclasses.fields(BertDatasetOptions)}
        values.update(
            masking=masking,
            decoder_seq_length=decoder_seq_length,
            bos=int(bos),
            eos=int(eos),
            sentinels=tuple(int(s) for s in sentinels),
        )
        return cls(**values)


class T5Dataset(BertDataset):
    """One split of one sentence dataset, as `len(self)` T5 samples (whole epochs).

    Items (Megatron's names): `text_enc` [S_enc], `text_dec` [S_dec], `labels` [S_dec] (-1 on
    padding), `enc_mask` [S_enc], `dec_mask` [S_dec] (1 real, 0 pad) int64; `loss_mask` float32
    [S_dec]; `truncated` int64 scalar (1 when the sentences were cut to the target length).
    """

    cache_name = "T5MaskedWordPieceDataset"

    def _identifiers(self) -> dict[str, Any]:
        identifiers = super()._identifiers()
        del identifiers["classification_head"]
        identifiers.update(
            masking_max_ngram=MASKING_MAX_NGRAM,
            masking_do_full_word=MASKING_DO_FULL_WORD,
            masking_use_geometric_distribution=MASKING_USE_GEOMETRIC_DISTRIBUTION,
            sequence_length_decoder=self.options.decoder_seq_length,
        )
        return identifiers

    def _build_sample_index(self, where: str) -> np.ndarray:
        bounds = np.asarray(self.dataset.document_indices)[
            np.append(self.indices, self.indices[-1] + 1)
        ]
        try:
            return build_sentence_sample_index(
                bounds,
                self.dataset.sequence_lengths,
                self.num_samples,
                self.seq_length - 2,  # Megatron's room, as for [BOS] / [EOS]
                self.options.short_seq_prob,
                self.options.seed,
                1,
            )
        except GigatronError as error:
            raise GigatronError(f"{where}: {error}; check the data") from None

    @staticmethod
    def options_from_config(cfg: Any, tokenizer: Any) -> T5DatasetOptions:
        m = cfg.model
        encoder, decoder = m.encoder_seq_length or m.seq_length, m.decoder_seq_length
        if encoder is None or encoder < 3 or decoder is None or decoder < 2:
            raise GigatronError(
                f"--encoder-seq-length {encoder} / --decoder-seq-length {decoder}: T5 samples "
                "need both lengths (encoder >= 3, decoder >= 2), e.g. 512 and 128"
            )
        return T5DatasetOptions.for_t5(
            tokenizer,
            seq_length=int(encoder),
            decoder_seq_length=int(decoder),
            seed=int(cfg.training.seed),
            mask_prob=float(cfg.data.mask_prob),
            short_seq_prob=float(cfg.data.short_seq_prob),
        )

    @staticmethod
    def make_sample(
        sentences: list[list[int]], target: int, rng: np.random.RandomState, options: Any
    ) -> dict[str, Any]:
        return make_t5_sample(sentences, target, rng, options)


def make_t5_sample(
    sentences: list[list[int]], target: int, rng: np.random.RandomState, options: T5DatasetOptions
) -> dict[str, Any]:
    """The T5 sample of `sentences` (token ids) cut to `target` tokens, drawn from `rng`."""
    tokens = [token for sentence in sentences for token in sentence]
    truncated = len(tokens) > target
    tokens = tokens[:target]
    masked, _, _, spans = create_masked_spans(tokens, target, rng, options.masking)
    if len(spans) > len(options.sentinels):
        raise GigatronError(
            f"--vocab-extra-ids {len(options.sentinels)}: a sample has {len(spans)} masked spans "
            "and each needs its own sentinel; raise --vocab-extra-ids (Megatron uses 100)"
        )
    encoder, decoder_in, decoder_out = [], [options.bos], []
    start = 0
    for sentinel, span in zip(options.sentinels, spans):
        originals = [tokens[p] for p in span]
        encoder += masked[start : span[0]] + [sentinel]
        decoder_in += [sentinel, *originals]
        decoder_out += [sentinel, *originals]
        start = span[-1] + 1
    encoder += masked[start:]
    decoder_out.append(options.eos)

    enc_len, dec_len = options.seq_length, options.decoder_seq_length
    if len(encoder) > enc_len or len(decoder_in) > dec_len:
        raise GigatronError(
            f"a T5 sample has {len(encoder)} encoder and {len(decoder_in)} decoder tokens, more "
            f"than --encoder-seq-length {enc_len} / --decoder-seq-length {dec_len}; raise "
            "--decoder-seq-length (about 0.25 x the encoder length fits --mask-prob 0.15)"
        )
    text_enc = np.full(enc_len, options.pad, dtype=np.int64)
    text_enc[: len(encoder)] = encoder
    text_dec = np.full(dec_len, options.pad, dtype=np.int64)
    text_dec[: len(decoder_in)] = decoder_in
    enc_mask = (text_enc != options.pad).astype(np.int64)
    dec_mask = (text_dec != options.pad).astype(np.int64)
    labels = np.full(dec_len, -1, dtype=np.int64)
    labels[: len(decoder_out)] = decoder_out
    loss_mask = np.zeros(dec_len, dtype=np.float32)
    loss_mask[: len(decoder_in)] = 1.0
    # As Megatron: padding ids become 0 so that any embedding can look them up.
    for array in (text_enc, text_dec, labels):
        array[array == options.pad] = 0
    return {
        "text_enc": text_enc,
        "text_dec": text_dec,
        "labels": labels,
        "loss_mask": loss_mask,
        "enc_mask": enc_mask,
        "dec_mask": dec_mask,
        "truncated": np.int64(truncated),
    }


# (train, valid, test) T5 datasets of a configuration; None for a split that is absent.
build_t5_datasets = T5Dataset.build_splits
