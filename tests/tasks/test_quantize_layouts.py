"""Calibration does not depend on the layout a checkpoint was saved in: GPTQ on a tiny GPT saved
at tensor-parallel 2 x pipeline-parallel 2 gives the codes and scales of the same model saved in
one process, bit for bit (the reader merges the shards and the calibration runs the merged model
at tp = pp = 1), and the quantized checkpoint keeps the source's layout."""

from __future__ import annotations

import torch
from task_helpers import lambada_texts, save, tiny_model

from gigatron.cli import main as gigatron_main
from gigatron.quantize.checkpoint import read_packed
from helpers import write_jsonl


def test_gptq_codes_of_a_tp2_pp2_checkpoint_equal_the_single_process_ones(tmp_path):
    cfg, _, chunk = tiny_model()
    save(tmp_path / "tp1", cfg, chunk)
    assert gigatron_main(["convert-checkpoint", "--load-dir", str(tmp_path / "tp1"),
                          "--save-dir", str(tmp_path / "tp2pp2"),
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2"]) == 0  # fmt: skip
    data = write_jsonl(tmp_path / "calib.jsonl", [{"text": t} for t in lambada_texts(30)])
    for name in ("tp1", "tp2pp2"):
        argv = ["quantize", "--load", str(tmp_path / name), "--save", str(tmp_path / f"{name}-q"),
                "--method", "int4-weight", "--group-size", "32", "--calib-data", str(data),
                "--calib-size", "4", "--seed", "3"]  # fmt: skip
        assert gigatron_main(argv) == 0
    single, info = read_packed(tmp_path / "tp1-q")
    split, _ = read_packed(tmp_path / "tp2pp2-q")
    assert info["algorithm"] == "gptq" and single.keys() == split.keys()
    assert all(torch.equal(single[k], split[k]) for k in single)
    ranks = sorted(p.name for p in (tmp_path / "tp2pp2-q").glob("iter_*/mp_rank_*"))
    assert ranks == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
