"""`gigatron convert` between Hugging Face folders and gigatron checkpoints, per family, from
random-init `transformers` models (nothing downloaded): the imported checkpoint gives the same
logits as the Hugging Face model, import -> export (through a tp = 2, pp = 2 layout) is bit-exact,
and the exported folder loads with `transformers.AutoModelFor*` and gives the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_hf_deepseek import _hf_config as deepseek_config
from test_hf_gpt_oss import _hf_config as gpt_oss_config

from gigatron.checkpoint.hf_convert import gigatron_to_hf, hf_to_gigatron
from gigatron.checkpoint.safetensors_io import INDEX_FILE, SafetensorsFolder
from gigatron.checkpoint.torch_format import safe_load
from gigatron.config import config_from_dict
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext

VOCAB, SEQ = 100, 16
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)


def _llama_like(config_class, **extra):
    values = dict(SMALL, intermediate_size=96, num_key_value_heads=2, max_position_embeddings=64)
    values.update(rms_norm_eps=1e-5, tie_word_embeddings=False)
    values.update(extra)
    return config_class(**values)


CASES = {
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32
    ),
    "llama3-gqa-rope-scaling": lambda: _llama_like(
        transformers.LlamaConfig,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-linear-rope-tied": lambda: _llama_like(
        transformers.LlamaConfig,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "mistral": lambda: _llama_like(transformers.MistralConfig, head_dim=16, sliding_window=None),
    "qwen2-qkv-bias": lambda: _llama_like(transformers.Qwen2Config),
    "mixtral": lambda: _llama_like(
        transformers.MixtralConfig, num_local_experts=4, num_experts_per_tok=2
    ),
    # The parity tests' configurations (the same small random models).
    "gpt-oss": gpt_oss_config,
    "deepseek-v3": deepseek_config,
    "bert": lambda: transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
    ),  # fmt: skip
}
AUTO = {"bert": transformers.AutoModelForPreTraining}


def _hf_model(name: str, folder: Path):
    torch.manual_seed(7)
    config = CASES[name]()
    model = transformers.AutoModelForPreTraining.from_config(config) if name == "bert" else (
        transformers.AutoModelForCausalLM.from_config(config)
    )  # fmt: skip
    with torch.no_grad():  # draw every tensor (HF starts biases, norms, routers at constants)
        for param in model.parameters():
            param.normal_(0.0, 0.1).add_(1.0 if param.dim() == 1 else 0.0)
    model.eval().save_pretrained(folder)
    return model


def _inputs():
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(SEQ).expand(2, SEQ)


def _hf_logits(model, name: str) -> torch.Tensor:
    tokens, _ = _inputs()
    with torch.no_grad():
        out = model(tokens)
    return out.prediction_logits if name == "bert" else out.logits


def _gigatron_logits(release: Path, name: str) -> torch.Tensor:
    """Logits of the imported (tp = 1) checkpoint's model."""
    state = safe_load(release / "mp_rank_00" / "model_optim_rng.pt")
    cfg = config_from_dict(state["args"])
    family = get_family(state["gigatron_family"])
    (model,) = family.build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
    model.load_state_dict(state["model"], strict=True)
    model.eval()
    tokens, positions = _inputs()
    with torch.no_grad():
        if name == "bert":
            types = torch.zeros_like(tokens)
            return model(tokens, positions, None, tokentype_ids=types)[0][..., :VOCAB]
        return model(tokens, positions)[..., :VOCAB]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    with SafetensorsFolder(folder) as source:
        return {name: source.tensor(name) for name in source.names()}


@pytest.mark.parametrize("name", list(CASES))
def test_import_same_logits_and_export_bit_exact(tmp_path, name):
    hf_dir = tmp_path / "hf"
    hf = _hf_model(name, hf_dir)
    expected = _hf_logits(hf, name)

    release = hf_to_gigatron(hf_dir, tmp_path / "ckpt", log=lambda _: None)
    assert _relative_error(_gigatron_logits(release, name), expected) < 1e-4

    # Through a tensor- and pipeline-parallel layout and back: bit-exact.
    hf_to_gigatron(hf_dir, tmp_path / "ckpt22", tp=2, pp=2, log=lambda _: None)
    assert len(list((tmp_path / "ckpt22" / "release").iterdir())) == 4
    gigatron_to_hf(tmp_path / "ckpt22", tmp_path / "back", log=lambda _: None)
    original, exported = _weights(hf_dir), _weights(tmp_path / "back")
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    auto = AUTO.get(name, transformers.AutoModelForCausalLM)
    reloaded = auto.from_pretrained(tmp_path / "back").eval()
    assert _relative_error(_hf_logits(reloaded, name), expected) < 1e-6


def test_sharded_export_with_index_reads_back(tmp_path):
    hf_dir = tmp_path / "hf"
    hf = _hf_model("qwen2-qkv-bias", hf_dir)
    hf_to_gigatron(hf_dir, tmp_path / "ckpt", log=lambda _: None)
    gigatron_to_hf(tmp_path / "ckpt", tmp_path / "back", max_shard_bytes=40_000, log=print)
    index = json.loads((tmp_path / "back" / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3
    assert sum(len(load_file(tmp_path / "back" / s)) for s in shards) == len(index["weight_map"])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert _relative_error(_hf_logits(reloaded, "x"), _hf_logits(hf, "x")) < 1e-6
    # and a sharded folder imports again
    hf_to_gigatron(tmp_path / "back", tmp_path / "again", log=lambda _: None)
    assert (
        _relative_error(_gigatron_logits(tmp_path / "again" / "release", "x"), _hf_logits(hf, "x"))
        < 1e-4
    )


def test_unsupported_rope_and_unknown_tensors_are_refused(tmp_path):
    config = _llama_like(
        transformers.LlamaConfig, rope_parameters={"rope_type": "yarn", "factor": 2.0}
    )
    folder = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    with pytest.raises(GigatronError, match="rope_type 'yarn'"):
        hf_to_gigatron(folder, tmp_path / "out", log=lambda _: None)


def test_tensors_without_a_place_are_refused(tmp_path):
    folder = tmp_path / "hf"
    _hf_model("qwen2-qkv-bias", folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(GigatronError, match="o_proj.bias"):
        hf_to_gigatron(folder, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out" / "release").exists()


@pytest.mark.parametrize(
    "name", ["gpt2", "llama3-gqa-rope-scaling", "llama-linear-rope-tied", "qwen2-qkv-bias",
             "mixtral", "bert"],
)  # fmt: skip
def test_export_of_a_model_that_was_not_imported(tmp_path, name):
    """Without the stored Hugging Face config the adapter writes one from the gigatron config."""
    hf_dir = tmp_path / "hf"
    hf = _hf_model(name, hf_dir)
    release = hf_to_gigatron(hf_dir, tmp_path / "ckpt", log=lambda _: None)
    path = release / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(path)
    del state["hf_config"]
    torch.save(state, path)
    gigatron_to_hf(tmp_path / "ckpt", tmp_path / "back", log=lambda _: None)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == hf.config.model_type
    auto = AUTO.get(name, transformers.AutoModelForCausalLM)
    reloaded = auto.from_pretrained(tmp_path / "back").eval()
    assert _relative_error(_hf_logits(reloaded, name), _hf_logits(hf, name)) < 1e-5


def test_mixtral_into_an_expert_parallel_layout_and_back(tmp_path):
    hf_dir = tmp_path / "hf"
    _hf_model("mixtral", hf_dir)
    hf_to_gigatron(hf_dir, tmp_path / "ckpt", tp=2, ep=2, log=lambda _: None)
    files = sorted(p.name for p in (tmp_path / "ckpt" / "release").iterdir())
    assert files == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    state = safe_load(tmp_path / "ckpt" / "release" / "mp_rank_01_001" / "model_optim_rng.pt")
    assert state["model"]["decoder.layers.0.mlp.experts.linear_fc1.weight"].shape[0] == 2
    gigatron_to_hf(tmp_path / "ckpt", tmp_path / "back", log=lambda _: None)
    original, exported = _weights(hf_dir), _weights(tmp_path / "back")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_flags_without_meaning_for_the_pair_are_refused(tmp_path):
    from gigatron.checkpoint.hf_convert import main

    (tmp_path / "in").mkdir()
    base = ["--load", str(tmp_path / "in"), "--save", str(tmp_path / "out")]
    with pytest.raises(GigatronError, match="--target-tensor-parallel-size: no meaning"):
        main(["--from", "gigatron", "--to", "hf", *base, "--target-tensor-parallel-size", "2"])
    with pytest.raises(GigatronError, match="--family, --megatron-te-names: no meaning"):
        main(["--from", "megatron", "--to", "gigatron", *base, "--family", "gpt",
              "--megatron-te-names"])  # fmt: skip
    with pytest.raises(GigatronError, match="--max-shard-size: no meaning"):
        main(["--from", "hf", "--to", "gigatron", *base, "--max-shard-size", "1GB"])


def _round_trip_at_tp2(hf, tmp_path, family: str) -> None:
    """HF -> gigatron at tp 2 -> HF gives back every weight exactly."""
    hf.save_pretrained(tmp_path / "hf")
    hf_to_gigatron(tmp_path / "hf", tmp_path / "ckpt", tp=2, log=lambda _: None)
    state = safe_load(tmp_path / "ckpt" / "release" / "mp_rank_01" / "model_optim_rng.pt")
    assert state["gigatron_family"] == family
    gigatron_to_hf(tmp_path / "ckpt", tmp_path / "back", log=lambda _: None)
    original, exported = _weights(tmp_path / "hf"), _weights(tmp_path / "back")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


@pytest.mark.parametrize("tied", [False, True], ids=["t5-v1.1", "t5-tied-scaled"])
def test_t5_through_tensor_parallel_and_back(tmp_path, tied):
    torch.manual_seed(4)
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=tied, dropout_rate=0.0,
    )  # fmt: skip
    hf = transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    _round_trip_at_tp2(hf, tmp_path, "t5")
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "back").eval()
    tokens, _ = _inputs()
    with torch.no_grad():
        expected = hf(input_ids=tokens, decoder_input_ids=tokens).logits
        logits = reloaded(input_ids=tokens, decoder_input_ids=tokens).logits
    assert torch.equal(logits, expected)


def test_mamba2_through_tensor_parallel_and_back(tmp_path):
    torch.manual_seed(5)
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_heads=4, head_dim=32, expand=2, state_size=16,
        n_groups=2, num_hidden_layers=2, chunk_size=16,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    _round_trip_at_tp2(hf, tmp_path, "mamba")
