"""The model-family registry: a family registered from a test file trains through `pretrain`
with no change to the loop; named losses reach metrics.jsonl."""

from __future__ import annotations

import io
import json
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gigatron.errors import GigatronError
from gigatron.families import ModelFamily, family_names, get_family, register_family
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.training.pretrain import parse_pretrain_config, pretrain

VOCAB, SEQ = 32, 8


class Bigram(PipelineStage):
    """A one-matrix language model: logits of the next token from the current one."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, VOCAB)
        self.pre_process = self.post_process = True

    def set_input_tensor(self, tensor) -> None:
        raise AssertionError("a one-stage model gets no pipeline input")

    def forward(self, tokens):
        return self.table(tokens)


class ShiftDataset:
    """Samples whose next token is always token + 1: learnable by a bigram."""

    def __init__(self, size: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, VOCAB, size)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int):
        text = (self.starts[index] + np.arange(SEQ + 1)) % VOCAB
        return {"tokens": text[:-1].astype(np.int64), "labels": text[1:].astype(np.int64)}


def _loss(labels, logits):
    losses = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    first = losses[:, 0]
    report = {
        "toy_loss": torch.stack([losses.sum().detach(), torch.tensor(float(losses.numel()))]),
        "first_token_loss": torch.stack([first.sum().detach(), torch.tensor(float(first.numel()))]),
    }
    return losses.sum(), torch.tensor(float(losses.numel())), report


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    return model(batch["tokens"]), partial(_loss, batch["labels"])


TOY = ModelFamily(
    name="toy-bigram",
    description="a bigram table (test family)",
    build_model=lambda cfg, pctx, vocab_size=None: [Bigram()],
    make_forward_step=lambda cfg, pctx: _forward_step,
    loss_names=lambda cfg: ("toy_loss", "first_token_loss"),
    build_datasets=lambda cfg, tok, counts, pctx=None: tuple(
        ShiftDataset(n, seed) if n else None for n, seed in zip(counts, (1, 2, 3))
    ),
    flops_per_iteration=lambda cfg, batch, vocab: 2.0 * 3 * batch * SEQ * VOCAB * VOCAB,
)


def test_a_registered_toy_family_trains_through_pretrain(tmp_path):
    register_family(TOY)
    assert "toy-bigram" in family_names() and get_family("toy-bigram") is TOY
    cfg = parse_pretrain_config(
        ["--mock-data", "--vocab-size", str(VOCAB), "--num-layers", "1", "--hidden-size", "8",
         "--num-attention-heads", "1", "--seq-length", str(SEQ), "--micro-batch-size", "4",
         "--global-batch-size", "8", "--lr", "0.5", "--train-iters", "30", "--log-interval", "5",
         "--eval-interval", "15", "--eval-iters", "2", "--save", str(tmp_path)],
        world_size=1, family="toy-bigram",
    )  # fmt: skip
    result, _ = pretrain(cfg, stream=io.StringIO(), family="toy-bigram")
    losses = result.train_losses
    assert losses[30] < 0.5 * losses[1]  # the bigram is learnt
    assert set(result.train_reports[1]) == {"toy_loss", "first_token_loss"}
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert all("toy_loss" in r and "first_token_loss" in r for r in train)
    assert all("toy_loss_ppl" in r and "first_token_loss_ppl" in r for r in evals)
    saved = torch.load(
        tmp_path / "iter_0000030" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True
    )
    assert saved["gigatron_family"] == "toy-bigram"


def test_registering_another_family_under_a_taken_name_is_refused():
    register_family(TOY)
    other = ModelFamily(**{**TOY.__dict__, "description": "another"})
    with pytest.raises(GigatronError, match="already registered"):
        register_family(other)


# ---- which family uses which flags ---------------------------------------------------------------
_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "1",
          "--mock-data", "--vocab-size", "128"]  # fmt: skip
_T5 = ["--decoder-seq-length", "16"]


@pytest.mark.parametrize(
    "family, flags, shown, owners",
    [
        ("gpt", ["--encoder-num-layers", "2"], "--encoder-num-layers", "t5 does"),
        ("gpt", ["--hybrid-layer-pattern", "M*"], "--hybrid-layer-pattern", "mamba does"),
        ("gpt", ["--bert-no-binary-head"], "--bert-no-binary-head", "bert does"),
        ("t5", [*_T5, "--multi-latent-attention"], "--multi-latent-attention", "gpt does"),
        ("t5", [*_T5, "--num-experts", "4"], "--num-experts", "gpt does"),
        ("bert", ["--num-experts", "4"], "--num-experts", "gpt does"),
        ("bert", ["--sft"], "--sft", "gpt and mamba do"),
        ("mamba", ["--mtp-num-layers", "1"], "--mtp-num-layers", "gpt does"),
        ("mamba", ["--mask-prob", "0.2"], "--mask-prob", "bert and t5 do"),
        (
            "bert",
            ["--calculate-per-token-loss"],
            "--calculate-per-token-loss",
            "gpt, mamba and t5 do",
        ),
        (
            "bert",
            ["--position-embedding-type", "relative"],
            "--position-embedding-type relative",
            "t5 does",
        ),
    ],
)
def test_a_flag_of_another_family_is_refused_naming_flag_and_family(family, flags, shown, owners):
    with pytest.raises(GigatronError) as error:
        parse_pretrain_config([*_SHAPE, *flags], world_size=1, family=family)
    first = owners.split()[0].rstrip(",")
    expected = (
        f"{shown}: the {family} family does not use it (only {owners}); remove it, or use "
        f"`gigatron pretrain {first}`"
    )
    builtin = {"gpt", "bert", "t5", "mamba"}
    others = [n for n in family_names() if n not in builtin and get_family(n).accepted_fields]
    if not others:
        assert str(error.value) == expected
    else:  # a test family registered in this process may use the flag too
        assert str(error.value).startswith(f"{shown}: the {family} family does not use it (only ")


def test_each_family_accepts_its_own_flags_and_the_core():
    cfg = parse_pretrain_config([*_SHAPE, "--num-experts", "4", "--mtp-num-layers", "1"],
                                world_size=1, family="gpt")  # fmt: skip
    assert cfg.moe.num_experts == 4 and cfg.model.mtp_num_layers == 1
    cfg = parse_pretrain_config([*_SHAPE, *_T5, "--encoder-num-layers", "2",
                                 "--position-embedding-type", "relative"],
                                world_size=1, family="t5")  # fmt: skip
    assert cfg.model.position_embedding_type == "relative"
    # Other values of a field only one value of which is family-specific stay core.
    cfg = parse_pretrain_config([*_SHAPE, "--position-embedding-type", "rope"],
                                world_size=1, family="bert")  # fmt: skip
    assert cfg.model.position_embedding_type == "rope"
    # A family that declares nothing accepts only the core (the toy family above does).
    cfg = parse_pretrain_config(_SHAPE, world_size=1, family=TOY)
    assert cfg.model.hidden_size == 64


def test_a_new_family_declares_its_flags_and_no_other_family_changes():
    """The refusal is derived from the declarations: a new family's fields are refused in every
    other family without an edit there."""
    from gigatron.config import parse_config
    from gigatron.config.family_fields import claims, foreign_settings

    declared = {"gpt": set(), "newfam": {"mask_prob", "position_embedding_type=relative"}}
    claimed = claims(declared)
    assert claimed == {"mask_prob": ["newfam"], "position_embedding_type=relative": ["newfam"]}
    cfg = parse_config(["--mask-prob", "0.25", "--position-embedding-type", "relative"])
    assert foreign_settings(cfg, "newfam", declared["newfam"], claimed) == []
    assert foreign_settings(cfg, "gpt", declared["gpt"], claimed) == [
        "--mask-prob: the gpt family does not use it (only newfam does); remove it, or use "
        "`gigatron pretrain newfam`",
        "--position-embedding-type relative: the gpt family does not use it (only newfam does); "
        "remove it, or use `gigatron pretrain newfam`",
    ]
    assert foreign_settings(parse_config([]), "gpt", (), claimed) == []  # defaults are fine
    with pytest.raises(KeyError):
        claims({"newfam": {"no_such_field"}})


def test_the_config_is_frozen_at_the_edge_and_building_models_never_changes_it():
    import copy
    import dataclasses

    from gigatron.config import GigatronConfig
    from gigatron.models.transformer_config import TransformerConfig
    from gigatron.parallel.context import ParallelContext

    cfg = parse_pretrain_config(_SHAPE, world_size=1, family="gpt")
    with pytest.raises(dataclasses.FrozenInstanceError, match="ModelConfig.hidden_size: the"):
        cfg.model.hidden_size = 32
    # Every family's model builds from the frozen configuration (nothing writes into it).
    mamba = ["--mamba-num-groups", "1", "--mamba-head-dim", "16"]
    for family, extra in (("gpt", []), ("bert", []), ("t5", _T5), ("mamba", mamba)):
        frozen = parse_pretrain_config([*_SHAPE, *extra], world_size=1, family=family)
        chunks = get_family(family).build_model(frozen, ParallelContext.single(), 128)
        assert sum(p.numel() for chunk in chunks for p in chunk.parameters()) > 0
    thawed = copy.deepcopy(cfg)  # a copy is free to change (the converters derive layouts so)
    thawed.model.hidden_size = 32
    assert (thawed.model.hidden_size, cfg.model.hidden_size) == (32, 64)
    # An unfinalized config stays as it was: TransformerConfig finalizes a copy.
    raw = GigatronConfig()
    raw.model.num_layers, raw.model.hidden_size, raw.model.num_attention_heads = 2, 64, 4
    before = copy.deepcopy(raw)
    assert TransformerConfig.from_config(raw).ffn_hidden_size == 256
    assert raw == before and raw.model.ffn_hidden_size is None
