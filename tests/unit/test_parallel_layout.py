import pytest

from gigatron.errors import GigatronError
from gigatron.parallel.context import Grid, ParallelContext, describe_layout_error
from gigatron.parallel.pipeline import chunk_layer_ranges


def test_megatron_rank_order():
    grid = Grid(tp=2, cp=1, dp=2, pp=2)
    # tp varies fastest, then dp, then pp (Megatron's order with cp = 1).
    assert grid.groups_varying(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.groups_varying(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.groups_varying(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.coords_of(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1}


def test_expert_groups_carved_from_dp():
    groups = Grid(tp=1, cp=1, dp=4, pp=1, ep=2).expert_groups()
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["expert_dp"] == [[0, 2], [1, 3]]
    assert groups["expert_tp"] == [[0], [1], [2], [3]]


def test_expert_groups_with_tensor_parallel_experts():
    # etp = tp = 2 (default): ep groups hold one tp rank each, expert-tp groups are the tp groups.
    groups = Grid(tp=2, cp=1, dp=4, pp=2, ep=2).expert_groups()
    assert groups["ep"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expert_dp"][:2] == [[0, 4], [1, 5]]
    assert groups["expert_tp"] == Grid(tp=2, dp=4, pp=2).groups_varying(["tp"])
    # etp = 1: ep spans the tensor-parallel ranks.
    groups = Grid(tp=2, cp=1, dp=2, pp=1, ep=2, etp=1).expert_groups()
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["expert_dp"] == [[0, 2], [1, 3]]
    assert groups["expert_tp"] == [[0], [1], [2], [3]]


def test_expert_layout_errors():
    assert "must be 1 or the tensor-parallel size 4" in describe_layout_error(
        8, tp=4, cp=1, pp=1, ep=1, etp=2
    )
    assert "does not divide data-parallel 2" in describe_layout_error(4, tp=2, cp=1, pp=1, ep=4)
    assert describe_layout_error(4, tp=2, cp=1, pp=1, ep=4, etp=1) is None


def test_layout_error_shows_arithmetic():
    message = describe_layout_error(6, tp=2, cp=1, pp=2, ep=1)
    assert (
        "world size 6 is not divisible by tensor-parallel 2 x context-parallel 1 x pipeline-parallel 2 = 4"
        in message
    )


def test_single_context():
    ctx = ParallelContext.single()
    assert (ctx.tp_size, ctx.dp_size, ctx.pp_size, ctx.tp_rank) == (1, 1, 1, 0)
    assert ctx.is_pipeline_first_stage() and ctx.is_pipeline_last_stage()
    assert ctx.size("embedding") == 1


def test_chunk_layer_ranges_interleaved_and_uneven():
    ranges = chunk_layer_ranges(8, pp_size=2, num_virtual_stages=2)
    assert [list(r) for r in ranges[0]] == [[0, 1], [4, 5]]
    assert [list(r) for r in ranges[1]] == [[2, 3], [6, 7]]
    uneven = chunk_layer_ranges(7, pp_size=3, first_stage_layers=1)
    assert [list(chunks[0]) for chunks in uneven] == [[0], [1, 2, 3], [4, 5, 6]]
    with pytest.raises(GigatronError, match="not divisible by the pipeline size 4"):
        chunk_layer_ranges(6, pp_size=4)
