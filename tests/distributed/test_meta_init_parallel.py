"""--init-model-with-meta-device at tp 2 and pp 2 (one spawn of 2 processes): each rank's
materialised chunks equal its eager chunks bit for bit, and the tp shards put together equal the
one-process model's tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.families import get_family
from gigatron.parallel.context import ParallelContext, run_distributed
from parallel_helpers import gather_tensor_parallel

pytestmark = pytest.mark.distributed

FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--swiglu",
         "--position-embedding-type", "rope", "--vocab-size", "100",
         "--make-vocab-size-divisible-by", "64"]  # fmt: skip
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}  # fmt: skip

TIED_COPY = {"output_layer.weight": "embedding.word_embeddings.weight"}


def _build(layout: str, pctx: ParallelContext, *extra: str):
    cfg = parse_config([*FLAGS, *LAYOUTS[layout], *extra], world_size=2)
    return get_family("gpt").build_model(cfg, pctx, 100)


def run(rank: int, world_size: int, out_dir: str) -> None:
    full = {}
    for layout in LAYOUTS:
        tp = 2 if layout == "tp2" else 1
        pctx = ParallelContext.from_sizes(tp=tp, pp=2 // tp)
        eager = _build(layout, pctx)
        meta = _build(layout, pctx, "--init-model-with-meta-device")
        for index, (a, b) in enumerate(zip(eager, meta, strict=True)):
            for (name, p), (name_b, q) in zip(a.named_parameters(), b.named_parameters()):
                assert name == name_b and torch.equal(p, q), (layout, name)
                key = f"{layout}.{pctx.pp_rank}.{index}.{name}"
                full[key] = gather_tensor_parallel(q.detach(), q, pctx)
    torch.save(full, Path(out_dir) / f"rank{rank}.pt")


def test_meta_init_is_bit_identical_at_tp2_and_pp2(tmp_path):
    run_distributed(run, 2, str(tmp_path))
    reference = {}
    for layout in LAYOUTS:
        cfg = parse_config([*FLAGS, "--init-model-with-meta-device"])
        (chunk,) = get_family("gpt").build_model(cfg, ParallelContext.single(), 100)
        reference[layout] = dict(chunk.named_parameters())
    got = {**torch.load(tmp_path / "rank0.pt"), **torch.load(tmp_path / "rank1.pt")}
    # tp 2: the gathered shards are the one-process tensors
    for name, param in reference["tp2"].items():
        assert torch.equal(got[f"tp2.0.0.{name}"], param.detach()), name
    # pp 2: the two stages' tensors (layers keep their global numbers) are the model's
    for stage in (0, 1):
        prefix = f"pp2.{stage}.0."
        names = [k[len(prefix) :] for k in got if k.startswith(prefix)]
        assert f"decoder.layers.{2 * stage + 1}.mlp.linear_fc2.weight" in names
        for name in names:
            # the last stage's copy of the tied embedding
            want = TIED_COPY.get(name, name)
            assert torch.equal(got[prefix + name], reference["pp2"][want].detach()), name
