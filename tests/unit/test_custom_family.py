"""A model family added from outside the package: everything it needs lives in this file (what a
`families/<name>/` folder would hold) plus one `register_family` call, and then the generic
commands serve it: `gigatron pretrain tinylm` trains it, its own rules refuse flags it does not
take, `gigatron convert` moves its weights to and from Hugging Face through its adapter, and its
checkpoints load back to equal weights."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from gigatron.cli import main as gigatron
from gigatron.data.batch import get_batch
from gigatron.errors import GigatronError
from gigatron.families import ModelFamily, family_names, get_family, register_family
from gigatron.families.hf_adapter import HFAdapter
from gigatron.parallel.pipeline_stage import PipelineStage
from gigatron.torch_files import safe_load
from gigatron.training.pretrain import parse_pretrain_config, pretrain

VOCAB, SEQ, HIDDEN, LAYERS = 32, 8, 16, 2


# ---- what families/tinylm/ would hold ----------------------------------------------------------
class TinyLM(PipelineStage):
    """Embedding, `num_layers` tanh(Linear) layers, output projection: one pipeline stage."""

    def __init__(self, vocab: int, hidden: int, num_layers: int) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        self.output_layer = nn.Linear(hidden, vocab, bias=False)
        self.pre_process = self.post_process = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.output_layer(x)


def build_model(cfg, pctx, vocab_size=None) -> list[nn.Module]:
    torch.manual_seed(cfg.training.seed)
    model = TinyLM(vocab_size, cfg.model.hidden_size, cfg.model.num_layers)
    return [model.to(pctx.device)]


class ShiftDataset:
    """Samples whose next token is always token + 1 (learnable)."""

    def __init__(self, size: int, seed: int) -> None:
        self.starts = np.random.default_rng(seed).integers(0, VOCAB, size)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        text = (self.starts[index] + np.arange(SEQ + 1)) % VOCAB
        return {"tokens": text[:-1].astype(np.int64), "labels": text[1:].astype(np.int64)}


def build_datasets(cfg, tokenizer, counts, pctx=None):
    return tuple(ShiftDataset(n, seed) if n else None for n, seed in zip(counts, (1, 2, 3)))


def loss(labels: torch.Tensor, logits: torch.Tensor):
    losses = F.cross_entropy(logits.transpose(1, 2).float(), labels, reduction="none")
    tokens = torch.tensor(float(losses.numel()))
    return losses.sum(), tokens, {"lm_loss": torch.stack([losses.sum().detach(), tokens])}


def make_forward_step(cfg, pctx):
    def forward_step(data_iterator, model):
        batch = get_batch(data_iterator, pctx, ("tokens", "labels"))
        return model(batch["tokens"]), partial(loss, batch["labels"])

    return forward_step


def validate(cfg) -> None:
    """What this family does not take (a flag set away from its default is refused)."""
    if cfg.moe.num_experts:
        raise GigatronError(
            f"--num-experts {cfg.moe.num_experts}: the tinylm family has no MoE layers; drop it"
        )
    if not cfg.model.untie_embeddings_and_output_weights:
        raise GigatronError(
            "tinylm keeps its output layer apart from the embedding; pass "
            "--untie-embeddings-and-output-weights"
        )


class TinyHFAdapter:
    """Hugging Face names: `embed.weight`, `blocks.<i>.{weight,bias}`, `lm_head.weight`."""

    model_types = ("tinylm-hf",)

    def config_from_hf(self, hf_config) -> dict:
        c = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        return {
            "num_layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"],
            "num_attention_heads": 1,
            "seq_length": c["max_length"],
            "max_position_embeddings": c["max_length"],
            "vocab_size": c["vocab_size"],
            "untie_embeddings_and_output_weights": True,
        }

    def config_to_hf(self, cfg, vocab_size: int) -> dict:
        m = cfg.model
        return {
            "model_type": "tinylm-hf",
            "num_hidden_layers": m.num_layers,
            "hidden_size": m.hidden_size,
            "max_length": m.seq_length,
            "vocab_size": vocab_size,
        }

    def from_hf(self, hf, num_layers, num_heads, padded_vocab) -> dict:
        out = {"embedding.word_embeddings.weight": hf["embed.weight"]}
        out["output_layer.weight"] = hf["lm_head.weight"]
        for i in range(num_layers):
            for kind in ("weight", "bias"):
                out[f"layers.{i}.{kind}"] = hf[f"blocks.{i}.{kind}"]
        return out

    def to_hf(self, sd, num_layers, num_heads, vocab_size) -> dict:
        out = {"embed.weight": sd["embedding.word_embeddings.weight"][:vocab_size]}
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab_size]
        for i in range(num_layers):
            for kind in ("weight", "bias"):
                out[f"blocks.{i}.{kind}"] = sd[f"layers.{i}.{kind}"]
        return out


TINYLM = ModelFamily(
    name="tinylm",
    description="tanh MLP language model (a family defined in a test)",
    build_model=build_model,
    make_forward_step=make_forward_step,
    loss_names=lambda cfg: ("lm_loss",),
    build_datasets=build_datasets,
    flops_per_iteration=lambda cfg, batch, vocab: 6.0 * batch * SEQ * HIDDEN * (vocab + HIDDEN),
    validate=validate,
    hf_adapter=TinyHFAdapter(),
)


# ---- the one registration line, and the generic commands ---------------------------------------
@pytest.fixture(autouse=True)
def registered():
    register_family(TINYLM)


FLAGS = [
    "--mock-data", "--vocab-size", str(VOCAB), "--num-layers", str(LAYERS),
    "--hidden-size", str(HIDDEN), "--num-attention-heads", "1", "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--micro-batch-size", "4",
    "--global-batch-size", "8", "--lr", "0.05", "--log-interval", "1", "--eval-iters", "0",
    "--untie-embeddings-and-output-weights",
]  # fmt: skip


def _model_file(save: Path, iteration: int) -> Path:
    return save / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"


def test_pretrain_trains_it_and_its_checkpoint_loads_back_equal(tmp_path):
    save = tmp_path / "ckpt"
    argv = ["pretrain", "tinylm", *FLAGS, "--train-iters", "6", "--save", str(save)]
    assert gigatron(argv) == 0
    lines = (save / "metrics.jsonl").read_text().splitlines()
    losses = [r["lm_loss"] for r in map(json.loads, lines) if r["type"] == "train"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    saved = safe_load(_model_file(save, 6))
    assert saved["gigatron_family"] == "tinylm"
    # Loading the checkpoint (no further iterations) gives the saved weights, and they are
    # the trained ones, not the initial ones.
    cfg = parse_pretrain_config(
        [*FLAGS, "--train-iters", "6", "--load", str(save)], world_size=1, family="tinylm"
    )
    _, chunks = pretrain(cfg, family="tinylm", keep_model=True)
    loaded = chunks[0].state_dict()
    assert set(loaded) == set(saved["model"])
    for name, tensor in saved["model"].items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)
    initial = build_model(cfg, type("P", (), {"device": "cpu"})(), VOCAB)[0].state_dict()
    assert not torch.equal(initial["layers.0.weight"], loaded["layers.0.weight"])


def test_its_own_rules_refuse_a_flag_it_does_not_take(capsys):
    argv = ["pretrain", "tinylm", *FLAGS, "--train-iters", "1", "--num-experts", "4"]
    assert gigatron(argv) == 2
    err = capsys.readouterr().err
    assert "--num-experts" in err and "tinylm" in err and "Traceback" not in err
    tied = [flag for flag in FLAGS if flag != "--untie-embeddings-and-output-weights"]
    assert gigatron(["pretrain", "tinylm", *tied, "--train-iters", "1"]) == 2
    assert "--untie-embeddings-and-output-weights" in capsys.readouterr().err
    # A family's own rules live in its `validate`. (Where ModelFamily also declares
    # `accepted_fields`, a flag only other families claim is refused before `validate` runs,
    # naming the flag and this family: the assertions above hold either way.)


def test_convert_moves_its_weights_to_and_from_hugging_face(tmp_path):
    hf, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.mkdir()
    config = {"model_type": "tinylm-hf", "num_hidden_layers": LAYERS, "hidden_size": HIDDEN,
              "max_length": SEQ, "vocab_size": VOCAB}  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        shapes |= {f"blocks.{i}.weight": (HIDDEN, HIDDEN), f"blocks.{i}.bias": (HIDDEN,)}
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    save_file(weights, hf / "model.safetensors")

    convert = ["convert", "--load", str(hf), "--save", str(ckpt), "--from", "hf", "--to"]
    assert gigatron([*convert, "gigatron"]) == 0
    (iteration_file,) = ckpt.glob("*/mp_rank_00/model_optim_rng.pt")
    state = safe_load(iteration_file)
    assert state["gigatron_family"] == "tinylm"
    torch.testing.assert_close(state["model"]["layers.1.bias"], weights["blocks.1.bias"])
    torch.testing.assert_close(
        state["model"]["embedding.word_embeddings.weight"], weights["embed.weight"]
    )

    assert gigatron(["convert", "--load", str(ckpt), "--save", str(back),
                     "--from", "gigatron", "--to", "hf", "--no-tokenizer"]) == 0  # fmt: skip
    exported = load_file(back / "model.safetensors")
    assert set(exported) == set(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0)
    assert json.loads((back / "config.json").read_text()) == config


def test_every_family_adapter_follows_the_protocol():
    adapters = {name: get_family(name).hf_adapter for name in family_names()}
    assert {"gpt", "bert", "mamba", "t5", "tinylm"} <= set(adapters)
    assert all(isinstance(adapter, HFAdapter) for adapter in adapters.values() if adapter)
    assert not isinstance(object(), HFAdapter)
