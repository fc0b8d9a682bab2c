"""T5 against Hugging Face `T5ForConditionalGeneration` (random init from a small T5 v1.1
config, nothing downloaded): same logits, and a round trip of the weight map; plus the relative
position buckets against Hugging Face's and the pipeline stage layout."""

from __future__ import annotations

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

from gigatron.config import parse_config
from gigatron.families.t5.hf_t5 import T5HFAdapter
from gigatron.models.t5 import build_t5_model, relative_position_buckets, t5_stage_layout
from gigatron.parallel.context import ParallelContext

VOCAB, ENC, DEC, HIDDEN, HEADS, KV = 99, 16, 12, 64, 4, 8


def hf_t5_model(scale_outputs: bool) -> T5ForConditionalGeneration:
    torch.manual_seed(3)
    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=KV, d_ff=96, num_layers=2, num_decoder_layers=3,
        num_heads=HEADS, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=scale_outputs,
        decoder_start_token_id=0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # norms away from 1, so the map of every tensor is tested
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.normal_(1.0, 0.2)
    return model


def t5_config(values: dict, *flags: str):
    argv = [
        "--encoder-num-layers", str(values["encoder_num_layers"]),
        "--decoder-num-layers", str(values["decoder_num_layers"]),
        "--hidden-size", str(values["hidden_size"]),
        "--num-attention-heads", str(values["num_attention_heads"]),
        "--kv-channels", str(values["kv_channels"]),
        "--ffn-hidden-size", str(values["ffn_hidden_size"]),
        "--encoder-seq-length", str(ENC), "--decoder-seq-length", str(DEC),
        "--position-embedding-type", "relative",
        "--relative-attention-num-buckets", str(values["relative_attention_num_buckets"]),
        "--relative-attention-max-distance", str(values["relative_attention_max_distance"]),
        "--normalization", "RMSNorm", "--norm-epsilon", str(values["layernorm_epsilon"]),
        "--disable-bias-linear", "--geglu", "--openai-gelu",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--vocab-size", str(VOCAB),
        "--make-vocab-size-divisible-by", "8", *flags,
    ]  # fmt: skip
    return parse_config(argv)


def _inputs():
    generator = torch.Generator().manual_seed(5)
    enc = torch.randint(1, VOCAB, (3, ENC), generator=generator)
    dec = torch.randint(1, VOCAB, (3, DEC), generator=generator)
    enc_valid = torch.ones(3, ENC, dtype=torch.long)
    enc_valid[1, 10:] = 0
    dec_valid = torch.ones(3, DEC, dtype=torch.long)
    dec_valid[2, 7:] = 0
    return enc, dec, enc_valid, dec_valid


def _relative_error(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scale_outputs", [False, True])
def test_same_logits_as_hugging_face_and_the_map_round_trips(scale_outputs):
    hf = hf_t5_model(scale_outputs)
    adapter = T5HFAdapter()
    values = adapter.config_from_hf(hf.config)
    (model,) = build_t5_model(t5_config(values), ParallelContext.single(), vocab_size=VOCAB)
    assert model.vocab_size == 104
    hf_state = hf.state_dict()
    state = adapter.from_hf(hf_state, None, HEADS, model.vocab_size, scale_outputs)
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    model.eval()
    enc, dec, enc_valid, dec_valid = _inputs()
    with torch.no_grad():
        expected = hf(
            input_ids=enc, attention_mask=enc_valid, decoder_input_ids=dec,
            decoder_attention_mask=dec_valid,
        ).logits  # fmt: skip
        logits = model(enc, dec, enc_valid, dec_valid)
    assert logits.shape == (3, DEC, 104)
    real = dec_valid.bool()
    assert _relative_error(logits[..., :VOCAB][real], expected[real]) < 1e-4
    back = adapter.to_hf(model.state_dict(), None, HEADS, VOCAB, scale_outputs)
    for name, tensor in hf_state.items():
        assert torch.allclose(back[name], tensor, atol=1e-6), name


def test_relative_buckets_match_hugging_face():
    from transformers.models.t5.modeling_t5 import T5Attention

    for bidirectional in (True, False):
        position = torch.arange(40)[None, :] - torch.arange(30)[:, None]
        expected = T5Attention._relative_position_bucket(
            position, bidirectional=bidirectional, num_buckets=32, max_distance=128
        )
        ours = relative_position_buckets(30, 40, bidirectional, 32, 128)
        assert torch.equal(ours, expected)
    # Hand-computed: bidirectional, 8 buckets (4 per side, 2 exact), max distance 20: key
    # distance d >= 2 goes to 4 + 2 + floor(2 log(d / 2) / log(10)), 6 up to d = 6, then 7.
    row = relative_position_buckets(1, 12, True, 8, 20)[0].tolist()
    assert row == [0, 5, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7]


def test_stage_layout_puts_the_encoder_before_the_split_rank():
    assert t5_stage_layout(1, None, 2, 3) == [(range(2), range(3), True)]
    assert t5_stage_layout(2, None, 2, 3) == [(range(2), None, True), (None, range(3), False)]
    assert t5_stage_layout(4, 1, 2, 3) == [
        (range(2), None, True), (None, range(0, 1), False),
        (None, range(1, 2), False), (None, range(2, 3), False),
    ]  # fmt: skip


def _validated(family: str, *flags: str):
    from gigatron.config.validate import finalize_config
    from gigatron.families import get_family
    from gigatron.families.accepted import check_family_config

    cfg = parse_config(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                        "4", *flags])  # fmt: skip
    finalize_config(cfg)
    check_family_config(get_family(family), cfg)
    return cfg


def test_family_rules():
    from gigatron.errors import GigatronError

    cfg = _validated("t5", "--encoder-seq-length", "64", "--decoder-seq-length", "32")
    assert cfg.model.seq_length == 64 and cfg.model.max_position_embeddings == 64
    with pytest.raises(GigatronError, match="--decoder-seq-length is not set"):
        _validated("t5", "--encoder-seq-length", "64")
    with pytest.raises(GigatronError, match="rope: T5 has learned_absolute"):
        _validated("t5", "--encoder-seq-length", "64", "--decoder-seq-length", "32",
                   "--position-embedding-type", "rope")  # fmt: skip
    seq = ("--encoder-seq-length", "64", "--decoder-seq-length", "32")
    cfg = _validated("t5", *seq, "--pipeline-model-parallel-size", "4")
    assert cfg.parallel.pipeline_model_parallel_split_rank == 2  # the even split
    with pytest.raises(GigatronError, match="split-rank 4: must lie in 1..3"):
        _validated("t5", *seq, "--pipeline-model-parallel-size", "4",
                   "--pipeline-model-parallel-split-rank", "4")  # fmt: skip
    with pytest.raises(GigatronError, match="cannot give every one of the 1 encoder and 3"):
        _validated("t5", *seq, "--pipeline-model-parallel-size", "4",
                   "--pipeline-model-parallel-split-rank", "1")  # fmt: skip
    with pytest.raises(GigatronError, match="relative position table must live on one stage"):
        _validated("t5", *seq, "--pipeline-model-parallel-size", "4",
                   "--position-embedding-type", "relative")  # fmt: skip
    for family in ("gpt", "bert", "mamba"):
        with pytest.raises(
            GigatronError, match=r"--encoder-num-layers: the .* not use it \(only t5"
        ):
            _validated(family, "--seq-length", "64", "--encoder-num-layers", "2")


def test_flops_hand_count():
    from gigatron.config.validate import finalize_config
    from gigatron.families import get_family

    cfg = parse_config(
        ["--encoder-num-layers", "1", "--decoder-num-layers", "1", "--hidden-size", "8",
         "--num-attention-heads", "2", "--ffn-hidden-size", "16", "--encoder-seq-length", "4",
         "--decoder-seq-length", "2"]
    )  # fmt: skip
    finalize_config(cfg)
    # Per encoder token: qkv 2*8*24 = 384, scores+values 4*4*8 = 128, projection 128,
    # MLP 2*2*8*16 = 512 -> 1152, x 4 tokens = 4608. Per decoder token: 384 + 4*2*8 + 128 + 512
    # + logits 2*8*10 = 1248, x 2 = 2496. Cross-attention: per decoder token q 128, scores+values
    # 4*4*8 = 128, projection 128; keys/values 2*8*16 = 256 per encoder token -> 768 + 1024.
    forward = 4608 + 2496 + 1792
    assert get_family("t5").flops_per_iteration(cfg, 3, 10) == 3 * forward * 3


@pytest.mark.parametrize(
    "recompute",
    [
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "2",
        ],
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "1",
        ],
        ["--recompute-granularity", "selective"],
    ],  # fmt: skip
    ids=["full-uniform", "full-block", "selective"],
)
def test_recomputation_gives_the_same_gradients(recompute):
    values = T5HFAdapter().config_from_hf(hf_t5_model(False).config)

    def gradients(*flags):
        cfg = t5_config(values, "--hidden-dropout", "0.1", *flags)
        (model,) = build_t5_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
        model.train()
        torch.manual_seed(0)  # the same dropout masks in both runs
        enc, dec, enc_valid, dec_valid = _inputs()
        model(enc, dec, enc_valid, dec_valid).float().pow(2).mean().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, recomputed = gradients(), gradients(*recompute)
    for name, grad in plain.items():
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gigatron_convert_imports_and_exports_a_hugging_face_folder(tmp_path):
    """`gigatron convert` from a saved T5ForConditionalGeneration folder into an encoder |
    decoder pipeline at tp 2, and back: the same files (bit-exact: d_kv 16 and d_model 64 make
    the query and output scalings powers of two), and the reloaded model's logits."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM

    from gigatron.checkpoint.hf_convert import gigatron_to_hf, hf_to_gigatron

    torch.manual_seed(3)
    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
        num_heads=HEADS, relative_attention_num_buckets=8, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", decoder_start_token_id=0,
    )  # fmt: skip
    hf = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "layer_norm" in name:
                param.normal_(1.0, 0.2)
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    hf.save_pretrained(hf_dir)
    hf_to_gigatron(hf_dir, ckpt, tp=2, pp=2, family="t5", log=lambda _: None)
    assert len(list((ckpt / "release").iterdir())) == 4
    gigatron_to_hf(ckpt, back, log=lambda _: None)
    original = load_file(hf_dir / "model.safetensors")
    exported = load_file(back / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    saved = json.loads((hf_dir / "config.json").read_text())
    assert json.loads((back / "config.json").read_text()) == saved
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(back).eval()
    enc, dec, enc_valid, dec_valid = _inputs()
    with torch.no_grad():
        args = dict(input_ids=enc, attention_mask=enc_valid, decoder_input_ids=dec,
                    decoder_attention_mask=dec_valid)  # fmt: skip
        assert torch.equal(reloaded(**args).logits, hf(**args).logits)
