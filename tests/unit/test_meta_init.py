"""--init-model-with-meta-device on one process: every family's model built on meta and
materialised equals the eager build bit for bit (parameters and buffers), and the parameters
really are created on meta."""

from __future__ import annotations

import pytest
import torch

from gigatron.config.root import parse_config
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.meta_init import materialize, parameters_on_meta
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.tensor_parallel import ColumnParallelLinear

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16"]  # fmt: skip
FAMILIES = {
    "gpt": [*TINY, "--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
            "--num-query-groups", "2", "--normalization", "RMSNorm"],
    "gpt_moe": [*TINY, "--num-experts", "4", "--moe-router-topk", "2",
                "--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"],
    "bert": TINY,
    "mamba": ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "16", "--hybrid-override-pattern", "M*-", "--mamba-num-groups", "1",
              "--mamba-head-dim", "32"],
    "t5": ["--encoder-num-layers", "1", "--decoder-num-layers", "1", "--hidden-size", "64",
           "--num-attention-heads", "4", "--kv-channels", "16", "--ffn-hidden-size", "128",
           "--encoder-seq-length", "16", "--decoder-seq-length", "8"],
}  # fmt: skip


def _state(chunks) -> dict[str, torch.Tensor]:
    state = {}
    for index, chunk in enumerate(chunks):
        state.update({f"{index}.{k}": v for k, v in chunk.state_dict(keep_vars=False).items()})
        state.update({f"{index}.buffer.{k}": v for k, v in chunk.named_buffers()})
    return state


@pytest.mark.parametrize("name", FAMILIES)
def test_meta_build_equals_eager_build(name):
    family = get_family(name.split("_")[0])
    pctx = ParallelContext.single()
    argv = [*FAMILIES[name], "--vocab-size", "100"]
    eager = _state(family.build_model(parse_config(argv), pctx, 100))
    meta = family.build_model(parse_config([*argv, "--init-model-with-meta-device"]), pctx, 100)
    assert all(p.device.type == "cpu" for chunk in meta for p in chunk.parameters())
    meta_state = _state(meta)
    assert meta_state.keys() == eager.keys()
    for key, value in eager.items():
        assert torch.equal(meta_state[key], value), key


def test_parameters_are_created_on_meta_and_keep_their_attributes():
    pctx = ParallelContext.single()
    with parameters_on_meta():
        layer = ColumnParallelLinear(64, 4096, pctx, bias=True, init_std=0.02)
        table = torch.arange(4)  # other factories stay real
    assert layer.weight.device.type == "meta" and table.device.type == "cpu"
    assert materialize(layer, torch.device("cpu")) == 2
    assert layer.weight.device.type == "cpu" and layer.weight.requires_grad
    assert layer.weight.init_std == 0.02 and layer.weight.partition_dim == 0
    plain = torch.nn.Linear(2, 2)
    with parameters_on_meta():
        plain = torch.nn.Linear(2, 2)
    with pytest.raises(GigatronError, match="no initialiser"):
        materialize(plain, torch.device("cpu"))
