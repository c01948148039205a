"""V-Min, V-Half and V-ZB ("Pipeline Parallelism with Controllable Memory")."""

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedule import Costs, build, validate
from pipeloom.schedule.families.vshape import BLOCKS, INTERVAL, block_slots
from pipeloom.sim import simulate

FAMILIES = ("v-min", "v-half", "v-zb")
PPS = range(2, 17)

#: Peak activation in M_B once the blocks repeat (m >= 2p), memory held from
#: F until W: the paper's table, (p+4)//3 for V-Min (at most ceil(p/3) + 1),
#: (p+2)//2 for V-Half (at most ceil(p/2) + 1) and p for V-ZB, which also
#: keeps one chunk from its last B to its W.
PEAK = {"v-min": lambda p: (p + 4) // 3, "v-half": lambda p: (p + 2) // 2, "v-zb": lambda p: p + 0.5}
HELD_UNTIL_W = Costs(m_w=1.0)


def bubble_time(name, pp, m, costs=None):
    return simulate(build(name, pp, m), costs).makespan - 3 * m


@pytest.mark.parametrize("pp", PPS)
def test_building_blocks(pp):
    """Microbatch 0's slots along the V: F of stage s, then B back down.
    V-Min and V-Half match the reference layouts; every block leaves a
    rank's four F/B passes distinct modulo the interval (2 slots for W)."""
    gap = {"v-min": 2 if pp % 3 == 0 else 0, "v-half": 3 if pp % 2 == 0 else 0, "v-zb": 0}
    expected = {
        "v-min": lambda i, x: [i, 2 * pp - 1 - i, 2 * pp + x + i, 4 * pp + x - 1 - i],
        "v-half": lambda i, x: [2 * i, 3 * pp - 2 - i, 3 * pp + x + 2 * i - 1, 6 * pp + x - 2 - i],
        "v-zb": lambda i, x: [4 * i, 6 * pp - 4 - 2 * i, 6 * pp - 3 + 4 * i, 12 * pp - 5 - 2 * i],
    }
    for name, block in BLOCKS.items():
        slots = block_slots(pp, block)
        assert slots == [expected[name](i, gap[name]) for i in range(pp)]
        assert all(len({t % INTERVAL for t in lanes}) == 4 for lanes in slots)
        forward = [slots[s][0] for s in range(pp)] + [slots[s][1] for s in reversed(range(pp))]
        hops = [b - a for a, b in zip(forward, forward[1:])]
        assert hops == [block.first] * (pp - 1) + [block.second] * pp


@pytest.mark.parametrize("pp", [1, *PPS])
@pytest.mark.parametrize("name", FAMILIES)
def test_valid_for_any_microbatch_count(name, pp):
    for m in sorted({1, 2, max(1, pp - 1), pp, 2 * pp + 1, 3 * pp}):
        schedule = build(name, pp, m)  # build validates
        assert schedule.stages == 2 * pp and schedule.split_backward
        validate(schedule, memory_limit=PEAK[name](pp), m_w=1.0)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("name", FAMILIES)
def test_peak_activation_matches_the_paper(name, pp):
    for m in (2 * pp, 4 * pp):
        schedule = build(name, pp, m)
        assert max(simulate(schedule, HELD_UNTIL_W).peak_activation) == PEAK[name](pp)
        assert max(simulate(schedule).peak_activation) <= PEAK[name](pp)
    assert max(simulate(build("v-zb", pp, 2 * pp)).peak_activation) == pp


@pytest.mark.parametrize("pp", PPS)
def test_bubble_against_1f1b(pp):
    """Unit costs: V-Half's bubble at most half of 1F1B's, V-Min's at most
    two thirds (both measured ratios stay below 0.50 and 0.67 up to p = 32)."""
    for m in (pp, 2 * pp, 4 * pp):
        ref = bubble_time("1f1b", pp, m)
        assert bubble_time("v-half", pp, m) <= ref / 2
        assert bubble_time("v-min", pp, m) <= 2 * ref / 3
        rate = simulate(build("1f1b", pp, m)).bubble_rate
        for name in ("v-half", "v-min"):
            assert simulate(build(name, pp, m)).bubble_rate < rate


@pytest.mark.parametrize("pp", PPS)
def test_v_zb_has_almost_no_bubble(pp):
    """Within a pass or two of ZB-V's 3m + (p-1)/2; what idles is a constant
    tail of at most about p/2 on the first ranks, so the rate falls as 1/m."""
    for m in (2 * pp, 3 * pp, 4 * pp):
        result = simulate(build("v-zb", pp, m))
        assert result.makespan <= 3 * m + (pp - 1) / 2 + 1
        assert max(rank.idle for rank in result.ranks) <= pp / 2 + 1
        assert result.bubble_rate <= (pp / 2 + 1) / (3 * m)


@pytest.mark.parametrize("pp,m,f,b,w,comm", [
    (8, 24, 18.522, 18.086, 9.337, 0.601),
    (8, 64, 29.718, 29.444, 19.927, 0.527),
    (16, 48, 11.347, 11.248, 8.132, 0.377),
])
def test_profiled_costs(pp, m, f, b, w, comm):
    """The zero-bubble paper's profiled costs: V-Half and V-ZB beat 1F1B;
    V-Min pays for its third of the memory with a bubble that grows with m."""
    costs = Costs(f=f, b=b, w=w, comm=comm)
    ref = simulate(build("1f1b", pp, m), costs).makespan
    assert simulate(build("v-zb", pp, m), costs).makespan < simulate(build("v-half", pp, m), costs).makespan < ref


def test_non_uniform_stages():
    """Per-stage costs (given per chunk), a heavy last stage (on rank 0 in a
    V) and slow links: the order is cost-blind, so the peaks do not move."""
    pp, m = 6, 20
    stages = 2 * pp
    costs = Costs(f=[1.0] * (stages - 1) + [3.0], b=[1.2] * (stages - 1) + [3.5], w=[0.6] * stages, comm=0.25)
    for name in FAMILIES:
        result = simulate(build(name, pp, m), costs)
        busy = m * (3.0 + 3.5 + 1.0 + 1.2 + 2 * 0.6)
        assert result.ranks[0].busy == pytest.approx(busy)
        assert result.makespan >= busy
        assert max(result.peak_activation) <= PEAK[name](pp)


def test_rejects_other_chunk_counts():
    with pytest.raises(PipeloomError, match="chunks=2"):
        build("v-half", 4, 8, chunks=3)
