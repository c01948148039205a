"""Closed forms for GPipe, 1F1B, interleaved 1F1B (Megatron-LM: "Efficient Large-Scale Language Model
Training on GPU Clusters") and PipeDream-2BW ("Memory-Efficient Pipeline-Parallel DNN Training")."""

import pytest

from pipeloom.schedule import Costs, build
from pipeloom.sim import simulate

SIZES = [(2, 1), (2, 4), (3, 3), (4, 2), (4, 8), (4, 16), (8, 8), (8, 24), (16, 32)]


@pytest.mark.parametrize("pp,m", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_bubble_and_peak(name, pp, m):
    result = simulate(build(name, pp, m))
    assert result.bubble_rate == pytest.approx((pp - 1) / (m + pp - 1))
    assert result.step_bubble_rate == pytest.approx((pp - 1) / (m + pp - 1))  # every rank busy 3m of 3(m+p-1)
    assert result.makespan == pytest.approx(3 * (m + pp - 1))
    assert max(result.peak_activation) == (m if name == "gpipe" else min(pp, m))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16), (4, 12)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_divides_bubble_by_chunks(pp, m, v):
    result = simulate(build("interleaved-1f1b", pp, m, chunks=v))
    bubble = 3 * (pp - 1) / v
    assert result.makespan == pytest.approx(3 * m + bubble)
    assert result.bubble_rate == pytest.approx(bubble / (3 * m + bubble))
    # peak ~ (1 + (p-1)/(v p)) p M_B: v chunks of 1/v each on rank 0
    assert max(result.peak_activation) == pytest.approx(pp + (pp - 1) / v)


def test_uneven_costs_last_stage_heavier():
    """A heavy last stage (an LM head) sets the pace: its idle time is smallest."""
    costs = Costs(f=[1, 1, 1, 3], b=[1, 1, 1, 3], w=[1, 1, 1, 3])
    result = simulate(build("1f1b", 4, 8), costs)
    steady = 8 * 9  # the last stage is busy 8 x (3 + 6)
    assert result.ranks[3].busy == pytest.approx(steady)
    assert result.makespan > steady
    assert min(range(4), key=lambda r: result.ranks[r].idle) == 3


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_comm_cost_delays_every_hop(pp):
    # one microbatch goes down pp-1 links and back up: each hop costs comm
    slow = simulate(build("1f1b", pp, 1), Costs(comm=0.5)).makespan
    assert slow == pytest.approx(3 * pp + 2 * (pp - 1) * 0.5)
    # in steady state rank 0's round trip spans pp microbatches and 2(pp-1) hops
    period = 3 + 2 * (pp - 1) * 0.5 / pp
    longer = [simulate(build("1f1b", pp, m), Costs(comm=0.5)).makespan for m in (64, 64 + pp)]
    assert (longer[1] - longer[0]) / pp == pytest.approx(period)


@pytest.mark.parametrize("pp,m,steps", [(2, 2, 3), (4, 4, 2), (4, 8, 4), (8, 8, 3)])
def test_2bw_has_no_flush_between_steps(pp, m, steps):
    schedule = build("2bw", pp, m, steps=steps)
    one_step = simulate(build("1f1b", pp, m)).makespan
    result = simulate(schedule)
    assert schedule.total_microbatches == m * steps
    # one warm-up and one cool-down for all steps: each later step adds only its work
    assert result.makespan == pytest.approx(one_step + (steps - 1) * 3 * m)
    assert max(result.peak_activation) == pp


def test_2bw_weight_versions():
    schedule = build("2bw", 2, 4, steps=3)
    # microbatch k (1-based) uses version max(floor((k-1)/m) - 1, 0)
    assert [schedule.weight_version(i) for i in range(12)] == [0] * 8 + [1] * 4
    flush = build("1f1b", 2, 4)
    assert [flush.weight_version(i) for i in range(4)] == [0] * 4


def test_2bw_needs_enough_microbatches():
    with pytest.raises(ValueError, match="2bw needs microbatches >= pp"):
        build("2bw", 4, 3)
