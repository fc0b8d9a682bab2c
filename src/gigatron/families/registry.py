"""The model-family record and the registry `gigatron pretrain <family>` looks families up in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from gigatron.errors import GigatronError
from gigatron.families.hf_adapter import HFAdapter

# forward_step(data_iterator, chunk) -> (output, loss_fn); loss_fn(output) -> (loss, num_tokens,
# {name: tensor [sum, count]}) (the schedule contract, parallel/schedules.py).
ForwardStep = Callable[[Iterator | None, nn.Module], tuple[Any, Callable]]


@dataclass(frozen=True)
class ModelFamily:
    """Everything the generic machinery needs to know about one family of models.

    - `build_model(cfg, pctx, vocab_size) -> list[nn.Module]`: this rank's pipeline chunks, each a
      `parallel.pipeline_stage.PipelineStage` (the schedules' contract).
    - `make_forward_step(cfg, pctx) -> ForwardStep`: batch -> outputs -> named loss reports.
    - `loss_names(cfg) -> tuple[str, ...]`: every report name the forward step may produce (the
      loop reduces them across ranks in this order); the first is the main loss.
    - `build_datasets(cfg, tokenizer, num_samples, pctx) -> (train, valid, test)`.
    - `flops_per_iteration(cfg, global_batch_size, padded_vocab_size) -> float` (for MFU).
    - `validate(cfg)`: the family's own configuration rules (raise GigatronError).
    - `accepted_fields`: the configuration fields this family uses beyond the common core (a
      field name, or `name=value` for a family-specific value); a field any family declares is
      refused in the others when set (config/family_fields.py, `families.accepted`).
    - `hf_adapter`: maps full (tp = 1) state dicts to and from Hugging Face names (the
      protocol: families/hf_adapter.py), or None.
    - `iteration_reports(cfg, pctx, model_chunks) -> {name: tensor [sum, count]}`: reports of a
      whole training iteration, not of one micro-batch (MoE auxiliary losses and routing
      statistics), also the place for per-iteration model updates (MoE expert biases); called
      by every rank after the gradients are final; names among `loss_names`. Or None.
    - `pipeline_stage_shapes(cfg, pctx) -> stage_shapes | None`: for families whose pipeline
      stages exchange several tensors (T5), `stage_shapes(pp_rank)` -> the shapes of what that
      stage sends forward (the schedule's `ScheduleConfig.stage_shapes`). None (or a None
      result): one hidden-state tensor between stages.
    - `generation`: the chunks take `inference_cache` (`gigatron generate` / `serve` load them).
    - `default_tokenizer_type`: the --tokenizer-type used when a run gives a --vocab-file but no
      type (Megatron's entry points set it: pretrain_gpt.py GPT2BPETokenizer, pretrain_bert.py
      BertWordPieceLowerCase), or None.
    """

    name: str
    description: str
    build_model: Callable[..., list[nn.Module]]
    make_forward_step: Callable[..., ForwardStep]
    loss_names: Callable[[Any], tuple[str, ...]]
    build_datasets: Callable[..., tuple[Any, Any, Any]]
    flops_per_iteration: Callable[[Any, int, int], float]
    validate: Callable[[Any], None] | None = None
    hf_adapter: HFAdapter | None = None
    iteration_reports: Callable[..., dict[str, Any]] | None = None
    pipeline_stage_shapes: Callable[..., Any] | None = None
    generation: bool = False
    default_tokenizer_type: str | None = None
    accepted_fields: frozenset[str] = frozenset()

    @classmethod
    def from_namespace(cls, namespace: dict[str, Any], **fields: Any) -> ModelFamily:
        """The family a family module declares by its own names: `ModelFamily.from_namespace(
        globals(), description=...)`. A function field is the module's function of that name
        (`build_model`, `make_forward_step`, ..., `validate`), any other field the upper-case
        constant (`ACCEPTED_FIELDS`, `HF_ADAPTER`, ...); the name is the module's (families/<name>).
        `fields` gives the rest and overrides."""
        found: dict[str, Any] = {"name": namespace["__name__"].rsplit(".", 1)[-1]}
        for name in cls.__dataclass_fields__:
            if callable(namespace.get(name)):
                found[name] = namespace[name]
            elif name.upper() in namespace:
                found[name] = namespace[name.upper()]
        return cls(**{**found, **fields})


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make `family` available to `gigatron pretrain <name>` and every other command."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise GigatronError(f"model family {family.name!r} is already registered")
    _FAMILIES[family.name] = family
    return family


def family_names() -> list[str]:
    return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The registered family called `name` (an error lists the known ones)."""
    if name not in _FAMILIES:
        raise GigatronError(
            f"{name}: unknown model family; choose one of {', '.join(family_names())} "
            f"(e.g. gigatron pretrain gpt --help)"
        )
    return _FAMILIES[name]
