"""Dataset options (what to read, how to split and shape it)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from gigatron.config.fields import flag_field, off_switch
from gigatron.config.rules import Section, fraction_problem
from gigatron.errors import GigatronError


@dataclass
class DataConfig(Section):
    data_path: Optional[list[str]] = flag_field(None, "dataset prefix, or weighted prefixes '0.3 a 0.7 b'", nargs="*")
    split: Optional[str] = flag_field(None, "train,valid,test proportions, e.g. 969,30,1")
    train_data_path: Optional[list[str]] = flag_field(None, "training prefixes", nargs="*")
    valid_data_path: Optional[list[str]] = flag_field(None, "validation prefixes", nargs="*")
    test_data_path: Optional[list[str]] = flag_field(None, "test prefixes", nargs="*")
    mock_data: bool = flag_field(False, "synthetic tokens instead of files")
    sft: bool = flag_field(
        False,
        "supervised fine-tuning (GPT): --data-path names JSON-lines files of prompt/response "
        "pairs or messages; the loss counts the response tokens only",
    )
    sft_pack_sequences: bool = flag_field(
        False,
        "with --sft: several conversations per sample (first-fit-decreasing), each with its own "
        "position ids and attention (docs/sft.md)",
    )
    sft_tokenizer_prompt_format: Optional[str] = flag_field(
        None,
        "with --sft: the chat template conversations are rendered with: nemotron-h-aligned, "
        "nemotron-nano-v2, tokenizer (the tokenizer_config.json's chat_template), or a file (a "
        "tokenizer_config.json or a Jinja template); loss on assistant turns (docs/sft.md)",
        default_help="none: the messages' texts joined, no template",
    )
    data_cache_path: Optional[str] = flag_field(None, "where dataset indices are cached")
    mid_level_dataset_surplus: float = flag_field(0.005, "extra samples asked of blended members")
    mask_prob: float = flag_field(0.15, "BERT: share of the tokens masked for the masked-LM loss")
    short_seq_prob: float = flag_field(0.1, "BERT: probability that a sample is given a random shorter target length")
    num_workers: int = flag_field(2, "data-loader worker processes")
    mmap_bin_files: bool = off_switch("read .bin files without memory-mapping")
    eod_mask_loss: bool = flag_field(False, "no loss on end-of-document tokens")
    reset_position_ids: bool = flag_field(False, "restart position ids after each end of document")
    reset_attention_mask: bool = flag_field(False, "no attention across end of document")
    create_attention_mask_in_dataloader: bool = off_switch(
        "build no attention mask in the data loader: the model applies its causal mask (gigatron "
        "builds one only for --reset-attention-mask)"
    )

    def problems(self) -> list[str]:
        """Masking probabilities, the split and the attention mask."""
        found = fraction_problem(self.mask_prob, "--mask-prob", True, True)
        found += fraction_problem(self.short_seq_prob, "--short-seq-prob", False, False)
        if self.split is not None:
            try:
                parse_split(self.split)
            except GigatronError as error:
                found.append(str(error))
        if self.sft_pack_sequences and not self.sft:
            found.append("--sft-pack-sequences: packs --sft conversations; add --sft")
        if self.sft_tokenizer_prompt_format is not None and not self.sft:
            found.append(
                f"--sft-tokenizer-prompt-format {self.sft_tokenizer_prompt_format}: formats "
                "--sft conversations; add --sft"
            )
        if self.sft_pack_sequences and not self.create_attention_mask_in_dataloader:
            found.append(
                "--sft-pack-sequences needs the mask the data loader builds (it keeps each "
                "conversation to itself); drop --no-create-attention-mask-in-dataloader"
            )
        if self.reset_attention_mask and not self.create_attention_mask_in_dataloader:
            found.append(
                "--reset-attention-mask needs the mask the data loader builds; drop "
                "--no-create-attention-mask-in-dataloader"
            )
        return found


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> [0.969, 0.03, 0.001]: up to three numbers separated by ',' (or '/'),
    right-padded with 0 to three, normalised. Anything else is refused (Megatron-Core would
    read '90,x,10' as 90,10 and silently give the test share to validation)."""
    pieces = [piece.strip() for piece in re.split(r"[,/]", split)]
    values = []
    for piece in pieces:
        try:
            value = float(piece)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value < 0:
            raise GigatronError(
                f"--split {split!r}: {piece!r} is not a non-negative number; give up to three "
                "proportions separated by commas, e.g. --split 969,30,1"
            )
        values.append(value)
    if len(values) > 3 or sum(values) <= 0:
        raise GigatronError(
            f"--split {split!r}: give up to three non-negative proportions with a positive sum, e.g. --split 969,30,1"
        )
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [x / total for x in values]
