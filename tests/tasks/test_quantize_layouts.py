"""Calibration does not depend on the layout a checkpoint was saved in: GPTQ on a tiny GPT saved
at tensor-parallel 2 x pipeline-parallel 2 gives the codes and scales of the same model saved in
one process, bit for bit (the reader merges the shards and the calibration runs the merged model
at tp = pp = 1), and the quantized checkpoint keeps the source's layout.

Under torchrun (one launch of 4 processes, two commands) the calibration's model is split too:
- `--pipeline-model-parallel-size 2` (x 2 data-parallel copies sharing the 6 windows, summed in
  quantize/reduction.py's fixed tree order): the stages pass activations unchanged, so codes,
  scales and fp8 KV-cache scales are bit-equal to one process's;
- `--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2`: a row-parallel layer adds
  its partial products over tp in another order, so the inputs of the layers after it differ in
  the last bits: at least 99% of the codes equal, the others off by one code, scales within
  1e-5 relative (measured here: all codes equal, scales within 3e-7). The same for a 4-expert
  MoE model at `--tensor-model-parallel-size 2` (its experts split over expert tensor
  parallelism: fc2's input features gathered before its statistics)."""

from __future__ import annotations

import torch
from task_helpers import lambada_texts, model_flags, save, tiny_model

from gigatron.cli import main as gigatron_main
from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.checkpoint import read_packed
from gigatron.quantize.rtn import unpack_int4
from gigatron.training.pretrain import parse_pretrain_config
from helpers import gigatron_runs, write_jsonl

SPLIT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def test_gptq_codes_of_a_tp2_pp2_checkpoint_and_split_calibrations(tmp_path):
    cfg, _, chunk = tiny_model()
    save(tmp_path / "tp1", cfg, chunk)
    assert gigatron_main(["convert-checkpoint", "--load-dir", str(tmp_path / "tp1"),
                          "--save-dir", str(tmp_path / "tp2pp2"),
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2"]) == 0  # fmt: skip
    data = write_jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])

    def argv(name: str, out: str, *split: str) -> list[str]:
        return ["quantize", "--load", str(tmp_path / name), "--save", str(tmp_path / out),
                "--method", "int4-weight", "--group-size", "32", "--calib-data", str(data),
                "--calib-size", "6", "--seed", "3", "--kv-cache-dtype", "fp8", *split]  # fmt: skip

    moe_flags = ["--num-experts", "4", "--moe-ffn-hidden-size", "64", "--disable-bias-linear"]
    moe_cfg = parse_pretrain_config(model_flags() + moe_flags, world_size=1)
    (moe,) = build_model(moe_cfg, ParallelContext.single(), vocab_size=50257)
    save(tmp_path / "moe", moe_cfg, moe.eval())
    gigatron_runs(tmp_path, {
        "pp2": (4, argv("tp2pp2", "pp2-q", *SPLIT[2:])),
        "tp2pp2": (4, argv("tp2pp2", "split-q", *SPLIT)),
        "moe-tp2": (4, argv("moe", "moe-tp2-q", *SPLIT[:2])),
    })  # fmt: skip
    for name in ("tp1", "tp2pp2", "moe"):
        assert gigatron_main(argv(name, f"{name}-q")) == 0
    single, info = read_packed(tmp_path / "tp1-q")
    assert info["algorithm"] == "gptq" and len(info["kv_cache_scales"]) == 2
    for other in ("tp2pp2-q", "pp2-q"):
        split, split_info = read_packed(tmp_path / other)
        assert single.keys() == split.keys() and split_info == info
        assert all(torch.equal(single[k], split[k]) for k in single), other
    ranks = sorted(p.name for p in (tmp_path / "tp2pp2-q").glob("iter_*/mp_rank_*"))
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    _assert_close_to_one_process(single, info, *read_packed(tmp_path / "split-q"))
    # Grouped experts at tp 2: fc2's input slices are gathered over expert tensor parallelism.
    single, info = read_packed(tmp_path / "moe-q")
    assert "decoder.layers.0.mlp.experts.linear_fc2" in info["layers"]
    _assert_close_to_one_process(single, info, *read_packed(tmp_path / "moe-tp2-q"))


def _assert_close_to_one_process(single: dict, info: dict, split: dict, split_info: dict) -> None:
    assert single.keys() == split.keys() and split_info["layers"] == info["layers"]
    for name in single:
        if name.endswith("weight_packed"):
            cols = 2 * single[name].shape[-1]
            diff = unpack_int4(single[name], cols).int() - unpack_int4(split[name], cols).int()
            assert (diff == 0).float().mean() >= 0.99 and diff.abs().max() <= 1, name
        else:
            torch.testing.assert_close(split[name], single[name], rtol=1e-5, atol=0)
    for attention, scales in info["kv_cache_scales"].items():
        torch.testing.assert_close(
            split_info["kv_cache_scales"][attention], scales, rtol=1e-5, atol=0
        )


def test_split_sizes_without_a_calibration_are_refused(tmp_path, capsys):
    args = ["quantize", "--load", str(tmp_path), "--save", str(tmp_path / "q"),
            "--method", "int8-weight", "--tensor-model-parallel-size", "2"]  # fmt: skip
    assert gigatron_main(args) == 2
    assert "runs no model; give --calib-data or drop them" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
