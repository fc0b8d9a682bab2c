"""Hugging Face checkpoints as people publish them, seen in the names the adapters read.

The families' adapters read the names of the models with a head (`BertForPreTraining`,
`LlamaForCausalLM`, ...). Published checkpoints are often the base model alone (`BertModel`,
`LlamaModel`, `Qwen2Model`, `GPT2Model`: no `bert.` / `model.` / `transformer.` prefix, no head),
sometimes inside a sentence-transformers folder. This module

- finds the model folder of a sentence-transformers folder (`model_folder`: `modules.json` names
  the Transformer module's subfolder, `0_Transformer/` in older versions, "" in newer ones);
- presents a folder's tensors under the adapters' names (`LayoutSource`): the base model's names
  get the prefix the layout's marker tensor shows missing, and the heads gigatron's model has but
  the checkpoint lacks (BERT's pooler, MLM head and sentence-order head; an untied `lm_head`) are
  initialised as `transformers` does (normal with the config's `initializer_range`, zero biases,
  unit norms), named in one warning.
"""

from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gigatron.checkpoint.hf_adapter import TensorSource
from gigatron.errors import GigatronError

MODULES_FILE = "modules.json"
_TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"


@dataclass(frozen=True)
class Head:
    """A tensor a base checkpoint may lack: its name, shape (from hidden size h and vocabulary
    v) and initialisation ('normal', 'zeros' or 'ones')."""

    name: str
    shape: Callable[[int, int], tuple[int, ...]]
    init: str
    needed: Callable[[dict[str, Any]], bool] = lambda config: True


@dataclass(frozen=True)
class Layout:
    """The adapter's names of one kind of model: the prefix base models lack, the first parts
    of the names that get it, a tensor every checkpoint holds (without the prefix), the word
    embedding (for shapes), the heads."""

    prefix: str
    roots: tuple[str, ...]
    marker: str
    embedding: str
    heads: tuple[Head, ...] = ()


def _square(h: int, v: int) -> tuple[int, ...]:
    return (h, h)


def _hidden(h: int, v: int) -> tuple[int, ...]:
    return (h,)


_BERT = Layout(
    "bert.",
    ("embeddings", "encoder", "pooler"),
    "embeddings.word_embeddings.weight",
    "bert.embeddings.word_embeddings.weight",
    (
        Head("bert.pooler.dense.weight", _square, "normal"),
        Head("bert.pooler.dense.bias", _hidden, "zeros"),
        Head("cls.predictions.transform.dense.weight", _square, "normal"),
        Head("cls.predictions.transform.dense.bias", _hidden, "zeros"),
        Head("cls.predictions.transform.LayerNorm.weight", _hidden, "ones"),
        Head("cls.predictions.transform.LayerNorm.bias", _hidden, "zeros"),
        Head("cls.predictions.bias", lambda h, v: (v,), "zeros"),
        Head("cls.seq_relationship.weight", lambda h, v: (2, h), "normal"),
        Head("cls.seq_relationship.bias", lambda h, v: (2,), "zeros"),
    ),
)
_LLAMA = Layout(
    "model.",
    ("embed_tokens", "layers", "norm"),
    "embed_tokens.weight",
    "model.embed_tokens.weight",
    (
        Head(
            "lm_head.weight",
            lambda h, v: (v, h),
            "normal",
            needed=lambda config: not config.get("tie_word_embeddings", False),
        ),
    ),
)
LAYOUTS = {
    "bert": _BERT,
    "gpt2": Layout(
        "transformer.", ("wte", "wpe", "h", "ln_f"), "wte.weight", "transformer.wte.weight"
    ),
    **dict.fromkeys(("llama", "mistral", "qwen2", "mixtral", "qwen2_moe"), _LLAMA),
}


def model_folder(load: Path) -> Path:
    """The folder holding `config.json` and the weights: `load`, or the Transformer module's
    folder of a sentence-transformers folder whose `modules.json` names one."""
    modules_file = load / MODULES_FILE
    if (load / "config.json").is_file() or not modules_file.is_file():
        return load
    try:
        modules = json.loads(modules_file.read_text())
        path = next(m.get("path", "") for m in modules if m.get("type") == _TRANSFORMER_MODULE)
    except (ValueError, TypeError, AttributeError, StopIteration):
        raise GigatronError(
            f"{modules_file}: names no {_TRANSFORMER_MODULE} module; give the folder that holds "
            "the model's config.json"
        ) from None
    folder = (load / str(path)).resolve()
    if not folder.is_relative_to(load.resolve()):
        raise GigatronError(f"{modules_file}: module path {path!r} leaves {load}; refused")
    return folder


def _initial(head: Head, shape: tuple[int, ...], dtype: torch.dtype, std: float) -> torch.Tensor:
    if head.init == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if head.init == "ones":
        return torch.ones(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(zlib.crc32(head.name.encode()))
    return torch.normal(0.0, std, shape, generator=generator).to(dtype)


class LayoutSource:
    """The tensors of `stored` under the adapter's names (`renamed`: adapter name -> stored
    name), and the initialised `heads` (name -> (meta tensor, function giving the tensor))."""

    def __init__(
        self,
        stored: TensorSource,
        renamed: dict[str, str],
        heads: dict[str, tuple[torch.Tensor, Callable[[], torch.Tensor]]],
    ) -> None:
        self.stored, self.renamed, self.heads = stored, renamed, heads

    def names(self) -> list[str]:
        return [*self.renamed, *self.heads]

    def __contains__(self, name: object) -> bool:
        return name in self.heads or name in self.renamed

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.heads:
            return self.heads[name][1]()
        return self.stored.tensor(self.renamed[name])

    def meta(self, name: str) -> torch.Tensor:
        if name in self.heads:
            return self.heads[name][0]
        return self.stored.meta(self.renamed[name])


def _renamed(layout: Layout, names: list[str]) -> dict[str, str]:
    """Adapter name -> stored name: a base model's names (those under the layout's roots, when
    its marker shows the prefix missing) get the prefix, others keep theirs."""
    base = layout.marker in names and not any(n.startswith(layout.prefix) for n in names)
    roots = layout.roots if base else ()
    return {(layout.prefix + n if n.split(".")[0] in roots else n): n for n in names}


def canonical_source(stored: TensorSource, hf_config: dict[str, Any], where: Path) -> TensorSource:
    """`stored` under the names the family's adapter reads (module docstring); the heads it
    initialises are named in one warning."""
    layout = LAYOUTS.get(str(hf_config.get("model_type")))
    if layout is None:
        return stored
    renamed = _renamed(layout, stored.names())
    if layout.embedding not in renamed:
        return stored  # not a layout this module knows: the adapter names what it misses
    meta = stored.meta(renamed[layout.embedding])
    if meta.dim() != 2:
        return stored  # the adapter or the layout check names the wrong shape
    (vocab, hidden), dtype = meta.shape, meta.dtype
    std = hf_config.get("initializer_range", 0.02)
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not std > 0:
        std = 0.02  # transformers' default, where the config has no usable one
    missing = [head for head in layout.heads if head.needed(hf_config) and head.name not in renamed]
    heads = {}
    for head in missing:
        shape = head.shape(hidden, vocab)
        empty = torch.empty(shape, dtype=dtype, device="meta")
        heads[head.name] = (empty, lambda h=head, s=shape: _initial(h, s, dtype, std))
    if missing:
        kind = ", ".join(hf_config.get("architectures") or []) or "this checkpoint"
        warnings.warn(
            f"--load {where} ({kind}): has no {', '.join(h.name for h in missing)}; "
            f"initialised (normal std {std}, zero biases, unit norms): fine-tune before using "
            "what they compute",
            stacklevel=2,
        )
    return LayoutSource(stored, renamed, heads)
