"""`gigatron evaluate` under torchrun: the data split over two data-parallel copies, and the model
split over tensor-parallel 2 or pipeline-parallel 2, give the single-process results."""

from __future__ import annotations

import json

import pytest
from task_helpers import WIKITEXT, save, tiny_model

from gigatron.checkpoint.convert import convert_checkpoint
from helpers import gigatron_runs

LAYOUTS = {"dp2": None, "tp2": (2, 1), "pp2": (1, 2)}  # (tp, pp) of a converted checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The single-process results and each two-process layout's, evaluated in one launch per
    process count (helpers.gigatron_runs)."""
    directory = tmp_path_factory.mktemp("parallel")
    cfg, _, chunk = tiny_model(32)
    save(directory / "ckpt", cfg, chunk)
    wiki = directory / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:8]))
    flags = ["--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", "8",
             "--micro-batch-size", "3"]  # fmt: skip

    def command(load, name):
        out = directory / f"{name}.json"
        return ["evaluate", "--load", str(load), "--device", "cpu", "--results-file", str(out),
                *flags]  # fmt: skip

    runs = {"single": (1, command(directory / "ckpt", "single"))}
    for layout, sizes in LAYOUTS.items():
        load = directory / "ckpt"
        if sizes is not None:
            load = directory / layout
            convert_checkpoint(directory / "ckpt", load, *sizes)
        runs[layout] = (2, command(load, layout))
    stdout = gigatron_runs(directory, runs)
    assert "validation results on WIKITEXT103 | avg loss:" in stdout["single"]
    return directory, json.loads((directory / "single.json").read_text())


KEYS = ["avg_loss", "ppl", "adjusted_ppl", "num_tokenized_tokens", "scored_tokens", "windows"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_give_the_single_process_results(setup, layout):
    directory, single = setup
    result = json.loads((directory / f"{layout}.json").read_text())
    assert result["dp"] == (2 if layout == "dp2" else 1)
    for key in KEYS:
        assert result[key] == pytest.approx(single[key], rel=1e-5), key
