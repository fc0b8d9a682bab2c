"""Tokenizer options, shared by preprocessing, training and generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field
from gigatron.config.rules import Section

TOKENIZER_TYPES = [
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
]


@dataclass
class TokenizerConfig(Section):
    tokenizer_type: Optional[str] = flag_field(None, "tokenizer kind", choices=TOKENIZER_TYPES)
    vocab_file: Optional[str] = flag_field(None, "vocabulary file (GPT-2 vocab.json or BERT vocab.txt)")
    merge_file: Optional[str] = flag_field(None, "BPE merges file (GPT-2 merges.txt)")
    tokenizer_model: Optional[str] = flag_field(
        None, "SentencePiece .model, Hugging Face directory/tokenizer.json, or .tiktoken file"
    )
    vocab_size: Optional[int] = flag_field(None, "vocabulary size of the NullTokenizer")
    null_tokenizer_eod_id: Optional[int] = flag_field(None, "end-of-document id of the NullTokenizer")
    tiktoken_pattern: Optional[str] = flag_field(
        None, "TikTokenizer split pattern", choices=["v1", "v2"], default_help="v2"
    )
    tiktoken_num_special_tokens: int = flag_field(1000, "special tokens reserved by TikTokenizer")
    vocab_extra_ids: int = flag_field(
        0, "extra <extra_id_i> tokens appended to BERT / SentencePiece vocabularies (T5 sentinels)"
    )
    tokenizer_hf_no_include_special_tokens: bool = flag_field(
        False, "HuggingFaceTokenizer: do not add the tokenizer's own special tokens (e.g. BOS)"
    )
