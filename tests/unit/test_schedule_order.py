"""Pipeline schedule orders, checked against an independent derivation, hand-written orders,
and a simulation of all ranks (no deadlock, in-flight micro-batches, bubble time)."""

from __future__ import annotations

import pytest
import torch

from gigatron.errors import GigatronError
from gigatron.parallel.pipeline import backward_from_output, deallocate_output
from gigatron.parallel.schedules import (
    _chunk_iterators,
    check_pipeline_schedule,
    num_warmup_steps,
    pipeline_schedule_order,
)


def reference_order(pp: int, rank: int, m: int, v: int = 1, group: int | None = None) -> list:
    """Megatron's order from first principles: the k-th forward ("virtual micro-batch" k) maps to
    a chunk and a micro-batch by arithmetic on k; the k-th backward is the same micro-batch on
    the mirrored chunk; warm-up forwards, then one forward + one backward, then backwards."""
    group = group or pp
    total = m * v
    full_groups = m // group

    def chunk_and_microbatch(k: int) -> tuple[int, int]:
        if k < full_groups * group * v:
            g, r = divmod(k, group * v)
            return r // group, g * group + r % group
        rest = m - full_groups * group  # the last, smaller group
        r = k - full_groups * group * v
        return r // rest, full_groups * group + r % rest

    def forward(k: int) -> tuple:
        chunk, mb = chunk_and_microbatch(k)
        return ("F", chunk, mb)

    def backward(k: int) -> tuple:
        chunk, mb = chunk_and_microbatch(k)
        return ("B", v - 1 - chunk, mb)

    if v == 1:
        warmup = min(pp - rank - 1, m)
    else:
        warmup = min(2 * (pp - rank - 1) + (v - 1) * group, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def simulate(orders: list[list[tuple]], pp: int, v: int, forward_cost=1.0, backward_cost=2.0):
    """Run every rank's order with data dependencies between model stages (stage = chunk * pp
    + rank) and zero-cost communication. Returns (makespan, busy time per rank, peak number of
    micro-batches in flight per rank); raises AssertionError on a deadlock."""
    stages = pp * v
    done: dict[tuple, float] = {}  # (kind, stage, mb) -> finish time
    clock = [0.0] * pp
    position = [0] * pp
    in_flight = [0] * pp
    peak = [0] * pp
    busy = [0.0] * pp
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            kind, chunk, mb = orders[rank][position[rank]]
            stage = chunk * pp + rank
            if kind == "F":
                deps = [("F", stage - 1, mb)] if stage > 0 else []
            else:
                deps = [("F", stage, mb)]
                deps += [("B", stage + 1, mb)] if stage < stages - 1 else []
            if not all(d in done for d in deps):
                continue
            cost = forward_cost if kind == "F" else backward_cost
            start = max([clock[rank]] + [done[d] for d in deps])
            clock[rank] = start + cost
            busy[rank] += cost
            done[(kind, stage, mb)] = clock[rank]
            in_flight[rank] += 1 if kind == "F" else -1
            peak[rank] = max(peak[rank], in_flight[rank])
            position[rank] += 1
            progressed = True
        assert progressed, f"deadlock at positions {position}"
    return max(clock), busy, peak


PP2_M4_1F1B = {
    0: "F0 F1 B0 F2 B1 F3 B2 B3",
    1: "F0 B0 F1 B1 F2 B2 F3 B3",
}
# pp = 2, 2 chunks, m = 4, G = 2: forwards run (chunk, mb) = 00 01 10 11 02 03 12 13.
PP2_V2_M4_INTERLEAVED = {
    0: "F00 F01 F10 F11 F02 B10 F03 B11 F12 B00 F13 B01 B12 B13 B02 B03",
    1: "F00 F01 F10 B10 F11 B11 F02 B00 F03 B01 F12 B12 F13 B13 B02 B03",
}


def parse(text: str, chunked: bool) -> list[tuple]:
    steps = []
    for token in text.split():
        if chunked:
            steps.append((token[0], int(token[1]), int(token[2])))
        else:
            steps.append((token[0], 0, int(token[1])))
    return steps


@pytest.mark.parametrize("rank", [0, 1])
def test_hand_written_orders(rank):
    one = parse(PP2_M4_1F1B[rank], chunked=False)
    assert pipeline_schedule_order(2, rank, 4) == one
    assert reference_order(2, rank, 4) == one
    interleaved = parse(PP2_V2_M4_INTERLEAVED[rank], chunked=True)
    assert pipeline_schedule_order(2, rank, 4, num_chunks=2) == interleaved
    assert reference_order(2, rank, 4, v=2) == interleaved


ONE_F_ONE_B = [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 7, 8, 16)]
INTERLEAVED = [
    (pp, m, v, g)
    for pp in (2, 3, 4)
    for v in (2, 3, 4)
    for m in (pp, 2 * pp, 3 * pp, 2 * pp + pp // 2 + pp)
    for g in (None, pp + 1, 2 * pp)
    if (g or pp) <= m and (m % (g or pp) == 0 or m % (g or pp) >= pp)
]


@pytest.mark.parametrize("pp,m", ONE_F_ONE_B)
def test_1f1b_matches_reference_and_runs(pp, m):
    orders = [pipeline_schedule_order(pp, r, m) for r in range(pp)]
    for rank in range(pp):
        assert orders[rank] == reference_order(pp, rank, m)
        assert sorted(orders[rank]) == sorted([(k, 0, i) for k in "FB" for i in range(m)]), (
            "every micro-batch runs forward and backward exactly once"
        )
    makespan, busy, peak = simulate(orders, pp, 1)
    # At most pp - rank micro-batches hold activations on a rank (not m, as in GPipe).
    assert peak == [min(pp - rank, m) for rank in range(pp)]
    # The bubble: (pp - 1) forward+backward slots on top of the m micro-batches.
    assert makespan == pytest.approx((m + pp - 1) * 3.0)
    assert max(busy) == pytest.approx(m * 3.0)


@pytest.mark.parametrize("pp,m,v,g", INTERLEAVED)
def test_interleaved_matches_reference_and_runs(pp, m, v, g):
    group = g or pp
    orders = [pipeline_schedule_order(pp, r, m, v, g) for r in range(pp)]
    for rank in range(pp):
        assert orders[rank] == reference_order(pp, rank, m, v, group)
        assert sorted(orders[rank]) == sorted(
            [(k, c, i) for k in "FB" for c in range(v) for i in range(m)]
        )
    # Chunk costs are 1/v of a full stage's, so the stage does the same work as in 1F1B.
    makespan, busy, peak = simulate(orders, pp, v, forward_cost=1.0 / v, backward_cost=2.0 / v)
    for rank in range(pp):
        warmup = num_warmup_steps(pp, rank, m, v, group)
        assert peak[rank] == min(warmup + 1, m * v)
    # Interleaving shrinks the bubble: never worse than 1F1B's (pp - 1) slots, and for the
    # default group size exactly (pp - 1) / v slots.
    assert makespan <= (m + pp - 1) * 3.0 + 1e-9
    if g is None and m % pp == 0:
        assert makespan == pytest.approx((m + (pp - 1) / v) * 3.0)


def test_forward_only_is_all_forwards_in_table_order():
    assert pipeline_schedule_order(4, 0, 4, forward_only=True) == [("F", 0, i) for i in range(4)]
    assert pipeline_schedule_order(2, 1, 4, 2, forward_only=True) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("F", 0, 3), ("F", 1, 2), ("F", 1, 3),
    ]  # fmt: skip


def test_schedule_constraints_are_explained():
    with pytest.raises(GigatronError, match="last group of 2"):
        check_pipeline_schedule(4, 6, num_chunks=2)  # 6 micro-batches, groups of 4
    with pytest.raises(GigatronError, match="microbatch-group-size-per-virtual-pipeline-stage 2"):
        check_pipeline_schedule(4, 8, num_chunks=2, group_size=2)
    with pytest.raises(GigatronError, match="between the pipeline size 2"):
        check_pipeline_schedule(2, 4, num_chunks=2, group_size=6)
    with pytest.raises(GigatronError, match="at least 1"):
        check_pipeline_schedule(2, 0)
    # Valid: multiples of the group, or a last group of at least pp micro-batches; and 1F1B
    # accepts any number of micro-batches.
    assert check_pipeline_schedule(4, 8, num_chunks=2) == 4
    assert check_pipeline_schedule(2, 5, num_chunks=2, group_size=3) == 3
    assert check_pipeline_schedule(4, 3) == 4


def test_why_groups_need_pp_microbatches():
    """Groups smaller than pp deadlock: the first stage waits for a micro-batch still going round
    the ring while the ring waits for that stage's backward. A last group smaller than pp loses
    the benefit of interleaving (no shorter than 1F1B)."""
    pp, v = 4, 2
    with pytest.raises(AssertionError, match="deadlock"):
        simulate([reference_order(pp, r, 8, v, group=2) for r in range(pp)], pp, v, 0.5, 1.0)
    m = 6  # groups of 4 and 2
    makespan, _, _ = simulate(
        [reference_order(pp, r, m, v, group=4) for r in range(pp)], pp, v, 0.5, 1.0
    )
    assert makespan >= (m + pp - 1) * 3.0


def test_deallocated_output_backward_matches_autograd():
    torch.manual_seed(0)
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    (x @ weight + 1.0).backward(grad)
    expected_w, expected_x = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    output = x @ weight + 1.0
    deallocate_output(output)
    assert output.numel() == 1, "the storage of the sent output is released"
    backward_from_output(output, grad)
    torch.testing.assert_close(weight.grad, expected_w)
    torch.testing.assert_close(x.grad, expected_x)


def test_shared_iterator_gives_each_chunk_every_microbatch():
    views = _chunk_iterators(iter(range(4)), num_chunks=2)
    order = pipeline_schedule_order(2, 0, 4, num_chunks=2)
    seen = {(c, mb): next(views[c]) for kind, c, mb in order if kind == "F"}
    assert all(seen[(c, mb)] == mb for c in range(2) for mb in range(4))
