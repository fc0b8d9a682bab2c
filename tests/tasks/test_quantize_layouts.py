"""Calibration does not depend on the layout a checkpoint was saved in: GPTQ on a tiny GPT saved
at tensor-parallel 2 x pipeline-parallel 2 gives the codes and scales of the same model saved in
one process, bit for bit (the reader merges the shards and the calibration runs the merged model
at tp = pp = 1), and the quantized checkpoint keeps the source's layout. Under torchrun the two
processes share the calibration windows (3 each) and sum their statistics in the fixed tree
order of quantize/reduction.py: codes, scales and fp8 KV-cache scales bit-equal again."""

from __future__ import annotations

import torch
from task_helpers import lambada_texts, save, tiny_model

from gigatron.cli import main as gigatron_main
from gigatron.quantize.checkpoint import read_packed
from helpers import gigatron_runs, write_jsonl


def test_gptq_codes_of_a_tp2_pp2_checkpoint_equal_the_single_process_ones(tmp_path):
    cfg, _, chunk = tiny_model()
    save(tmp_path / "tp1", cfg, chunk)
    assert gigatron_main(["convert-checkpoint", "--load-dir", str(tmp_path / "tp1"),
                          "--save-dir", str(tmp_path / "tp2pp2"),
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2"]) == 0  # fmt: skip
    data = write_jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])

    def argv(name: str, out: str) -> list[str]:
        return ["quantize", "--load", str(tmp_path / name), "--save", str(tmp_path / out),
                "--method", "int4-weight", "--group-size", "32", "--calib-data", str(data),
                "--calib-size", "6", "--seed", "3", "--kv-cache-dtype", "fp8"]  # fmt: skip

    gigatron_runs(tmp_path, {"torchrun": (2, argv("tp2pp2", "torchrun-q"))})
    for name in ("tp1", "tp2pp2"):
        assert gigatron_main(argv(name, f"{name}-q")) == 0
    single, info = read_packed(tmp_path / "tp1-q")
    assert info["algorithm"] == "gptq" and len(info["kv_cache_scales"]) == 2
    for other in ("tp2pp2-q", "torchrun-q"):
        split, split_info = read_packed(tmp_path / other)
        assert single.keys() == split.keys() and split_info == info
        assert all(torch.equal(single[k], split[k]) for k in single), other
    ranks = sorted(p.name for p in (tmp_path / "tp2pp2-q").glob("iter_*/mp_rank_*"))
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
