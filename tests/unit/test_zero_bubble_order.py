"""The ZB-H1 order (parallel/schedules.py) on a zero-latency simulation of all ranks: every
step once, no deadlock, 1F1B's peak memory, and a shorter iteration than 1F1B's."""

from __future__ import annotations

import pytest

from gigatron.parallel.schedules import pipeline_schedule_order, zb_h1_schedule_order


def simulate(
    orders: list[list[tuple]], costs: dict[str, float], last_costs: dict[str, float] | None = None
) -> tuple[float, list[int]]:
    """(makespan, peak live micro-batches per rank: forwarded and not yet weight-gradient'ed).
    A forward needs the previous stage's forward; B (or 1F1B's whole backward) the next stage's
    B; W its own B. `last_costs`: the last rank's costs where they differ."""
    pp = len(orders)
    done: dict[tuple, float] = {}
    clock, position, live, peak = [0.0] * pp, [0] * pp, [0] * pp, [0] * pp
    last_kind = {"F": "F", "B": "B", "W": "B"}
    while any(position[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            kind, _, mb = orders[rank][position[rank]]
            if kind == "F":
                deps = [("F", rank - 1, mb)] if rank > 0 else []
            elif kind == "W":
                deps = [("B", rank, mb)]
            else:
                deps = [("F", rank, mb)] + ([("B", rank + 1, mb)] if rank < pp - 1 else [])
            if not all(d in done for d in deps):
                continue
            cost = (last_costs or costs)[kind] if rank == pp - 1 else costs[kind]
            clock[rank] = max([clock[rank]] + [done[d] for d in deps]) + cost
            done[(last_kind[kind] if kind != "W" else "W", rank, mb)] = clock[rank]
            releases = kind == "W" or (kind == "B" and "W" not in costs)
            live[rank] += 1 if kind == "F" else (-1 if releases else 0)
            peak[rank] = max(peak[rank], live[rank])
            position[rank] += 1
            progressed = True
        assert progressed, f"deadlock at {position}"
    return max(clock), peak


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_runs_with_1f1b_memory_and_a_smaller_bubble(pp, m):
    zb = [zb_h1_schedule_order(pp, rank, m) for rank in range(pp)]
    for order in zb:
        for kind in "FBW":
            assert sorted(mb for k, _, mb in order if k == kind) == list(range(m))
    # forward 1, input gradient 1, weight gradient 1 (1F1B's backward: 2)
    zb_time, zb_peak = simulate(zb, {"F": 1.0, "B": 1.0, "W": 1.0})
    # gigatron's last stage runs its whole backward in B (its loss allows one backward)
    ours, _ = simulate(zb, {"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 2.0, "W": 0.0})
    one_f_one_b = [pipeline_schedule_order(pp, rank, m) for rank in range(pp)]
    base_time, base_peak = simulate(one_f_one_b, {"F": 1.0, "B": 2.0})
    assert max(zb_peak) == max(base_peak) == min(pp, m)
    work = 3.0 * m
    assert base_time - work == pytest.approx(3.0 * (pp - 1))  # 1F1B: (p - 1)(F + B + W)
    # ZB-H1: (p - 1)(F + B - W), the paper's figure: a third of 1F1B's bubble here
    assert zb_time - work == pytest.approx(1.0 * (pp - 1))
    # (p - 1)(F + B) + W: below 1F1B's from p = 3 on, equal at p = 2 (docs/frontier.md)
    assert ours - work == pytest.approx(2.0 * (pp - 1) + 1.0)
    assert ours < base_time or pp == 2
