"""`gigatron evaluate` under torchrun: the data split over two data-parallel copies, and the model
split over tensor-parallel 2 or pipeline-parallel 2, give the single-process results."""

from __future__ import annotations

import json

import pytest
from task_helpers import WIKITEXT, save, tiny_model

from gigatron.checkpoint.convert import convert_checkpoint
from helpers import gigatron


def _evaluate(load, out, flags, nproc):
    result = gigatron("evaluate", "--load", str(load), "--device", "cpu",
                      "--results-file", str(out), *flags, nproc=nproc)  # fmt: skip
    return json.loads(out.read_text()), result.stdout


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = tmp_path_factory.mktemp("parallel")
    cfg, _, chunk = tiny_model(32)
    save(directory / "ckpt", cfg, chunk)
    wiki = directory / "wiki.test.tokens"
    wiki.write_text("".join(WIKITEXT.read_text(encoding="utf-8").splitlines(True)[:8]))
    flags = ["--task", "WIKITEXT103", "--valid-data", str(wiki), "--overlapping-eval", "8",
             "--micro-batch-size", "3"]  # fmt: skip
    single, stdout = _evaluate(directory / "ckpt", directory / "single.json", flags, 1)
    assert "validation results on WIKITEXT103 | avg loss:" in stdout
    return directory, flags, single


KEYS = ["avg_loss", "ppl", "adjusted_ppl", "num_tokenized_tokens", "scored_tokens", "windows"]


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_parallel_layouts_give_the_single_process_results(setup, layout):
    directory, flags, single = setup
    load = directory / "ckpt"
    if layout != "dp2":
        load = directory / layout
        tp, pp = (2, 1) if layout == "tp2" else (1, 2)
        if not load.exists():
            convert_checkpoint(directory / "ckpt", load, tp, pp)
    result, _ = _evaluate(load, directory / f"{layout}.json", flags, 2)
    assert result["dp"] == (2 if layout == "dp2" else 1)
    for key in KEYS:
        assert result[key] == pytest.approx(single[key], rel=1e-5), key
