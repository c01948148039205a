"""Zero-bubble families (ZB-H1, ZB-H2, ZB-V, zb-auto) against the closed forms of
"Zero Bubble Pipeline Parallelism"."""

import random

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedule import Costs, Schedule, build, validate
from pipeloom.schedule.families.zero_bubble import h1_policy, list_schedule
from pipeloom.schedule.ir import looped_placement
from pipeloom.sim import simulate

PROFILED = Costs(f=18.522, b=18.086, w=9.337, comm=0.601)  # the zero-bubble paper's 1.5B model


def sizes(m_of):
    return [(p, m) for p in range(2, 9) for m in sorted(set(m_of(p)))]


def split_makespan(p, m):
    """Unit costs with B/W split: (m+p-1)(T_F+T_B) + T_W for m <= p, 3m + p - 1 beyond."""
    return max(3 * m + p - 1, 2 * (m + p - 1) + 1)


def heavy_last(p):
    """A heavier last stage (an LM head) with more activation memory."""
    return Costs(f=[1] * (p - 1) + [2.4], b=[1] * (p - 1) + [2.4], w=[1] * (p - 1) + [1.5],
                 m_b=[1] * (p - 1) + [1.5], m_w=0.3)


def heavy_first(p):
    return Costs(f=[1.8] + [1] * (p - 1), b=[1.5] + [1] * (p - 1), w=[0.7] + [1] * (p - 1), comm=0.1)


@pytest.mark.parametrize("p,m", sizes(lambda p: (1, p - 1, p, 2 * p, 3 * p)))
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_h1_h2_makespan(name, p, m):
    assert simulate(build(name, p, m)).makespan == split_makespan(p, m)


@pytest.mark.parametrize("p,m", sizes(lambda p: (p, 2 * p, 3 * p)))
def test_h1_memory_per_rank(p, m):
    result = simulate(build("zb-h1", p, m), Costs(m_w=0.5))
    # rank i (1-based) holds (p-i+1) M_B + (i-1) M_W
    assert result.peak_activation == [(p - i + 1) + (i - 1) * 0.5 for i in range(1, p + 1)]
    assert max(simulate(build("zb-h1", p, m)).peak_activation) == p


@pytest.mark.parametrize("p,m", sizes(lambda p: (2 * p, 3 * p)))
def test_h2_has_no_bubble(p, m):
    result = simulate(build("zb-h2", p, m))
    assert result.bubble_rate == 0
    assert max(result.peak_activation) == 2 * p - 1
    # rank i (1-based) holds (2p-2i+1) M_B + (2i-2) M_W
    per_rank = simulate(build("zb-h2", p, m), Costs(m_w=0.5)).peak_activation
    assert per_rank == [(2 * p - 2 * i + 1) + (2 * i - 2) * 0.5 for i in range(1, p + 1)]


@pytest.mark.parametrize("p,m", sizes(lambda p: (2 * p, 2 * p + 1, 3 * p, 4 * p)) + [(12, 24), (16, 32), (16, 80)])
def test_v_makespan_and_memory(p, m):
    result = simulate(build("zb-v", p, m))
    assert result.makespan == pytest.approx(3 * m + (p - 1) / 2)  # a chunk's F takes 1/2
    assert max(result.peak_activation) == p
    assert result.bubble_rate == 0
    # no bubble within a rank's span, but the step's ends idle: (p-1)/2 of 3m + (p-1)/2 on every rank
    assert [r.step_bubble_rate for r in result.ranks] == pytest.approx([(p - 1) / 2 / result.makespan] * p)
    assert result.step_bubble_rate == pytest.approx((p - 1) / 2 / result.makespan)
    # up to p chunks' W may wait: at most p M_W / 2 on top of p M_B
    assert max(simulate(build("zb-v", p, m), Costs(m_w=0.5)).peak_activation) <= p + p * 0.25


@pytest.mark.parametrize("p", range(2, 17))
def test_every_family_validates(p):
    # (memory limit in M_B, M_W as a fraction of M_B): zb-auto searched with unit costs, where M_W = 0
    limits = {"zb-h1": (p, 0.5), "zb-h2": (2 * p - 1, 0.5), "zb-v": (p + p * 0.25, 0.5), "zb-auto": (2 * p - 1, 0.0)}
    for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p}):
        for name, (limit, m_w) in limits.items():
            validate(build(name, p, m), memory_limit=limit, m_w=m_w)


def test_one_rank():
    for name in ("zb-h1", "zb-h2", "zb-v", "zb-auto"):
        result = simulate(build(name, 1, 3))
        assert result.makespan == 9 and result.bubble_rate == 0


def test_v_needs_two_chunks():
    with pytest.raises(PipeloomError, match="chunks=2"):
        build("zb-v", 4, 8, chunks=1)


COSTS = {
    "unit": lambda p: Costs(),
    "unit m_w": lambda p: Costs(m_w=0.5),
    "profiled": lambda p: PROFILED,
    "comm": lambda p: Costs(f=1, b=1.2, w=0.7, comm=0.5, m_w=0.4),
    "heavy last": heavy_last,
    "heavy first": heavy_first,
}


def longest_span(result):
    """The step time when steps tile into each other: what zb-auto minimises first."""
    return max(rank.span for rank in result.ranks)


@pytest.mark.parametrize("p,m", [(2, 5), (4, 3), (4, 8), (4, 16), (6, 24), (8, 12)])
@pytest.mark.parametrize("costs", COSTS)
def test_auto_at_least_as_good_as_h1_and_h2(costs, p, m):
    costs = COSTS[costs](p)
    for name in ("zb-h1", "zb-h2"):
        fixed = simulate(build(name, p, m), costs)
        limit = max(fixed.peak_activation)
        auto = simulate(build("zb-auto", p, m, costs=costs, memory_limit=limit), costs)
        assert longest_span(auto) <= longest_span(fixed) + 1e-9
        assert max(auto.peak_activation) <= limit + 1e-9


def test_auto_uses_spare_memory():
    """Between ZB-H1's and ZB-H2's memory, zb-auto beats ZB-H1 outright."""
    for costs in (PROFILED, Costs(f=1, b=1.2, w=0.7, comm=0.5, m_w=0.4)):
        h1 = simulate(build("zb-h1", 4, 8), costs)
        auto = simulate(build("zb-auto", 4, 8, costs=costs, memory_limit=5.5), costs)
        assert longest_span(auto) < 0.98 * longest_span(h1) and auto.makespan < 0.98 * h1.makespan
        assert max(auto.peak_activation) <= 5.5


@pytest.mark.parametrize("limit", [1.5, 3, 4.5, 9])
def test_auto_respects_memory_limit(limit):
    costs = heavy_last(6)  # the heavy last stage needs 1.5 for one microbatch
    schedule = build("zb-auto", 6, 12, costs=costs, memory_limit=limit)
    assert max(simulate(schedule, costs).peak_activation) <= limit + 1e-9
    assert schedule.options["memory_limit"] == limit


def test_auto_default_limit_is_h2_memory():
    schedule = build("zb-auto", 4, 8)
    assert schedule.options["memory_limit"] == 7
    assert simulate(schedule).makespan == 3 * 8 + 3


def random_costs(rng, p):
    """Per-stage times, communication and memory drawn at random."""
    f = [rng.uniform(0.5, 2) for _ in range(p)]
    m_b = [rng.uniform(0.6, 1.5) for _ in range(p)]
    return Costs(f=f, b=[x * rng.uniform(0.8, 1.3) for x in f], w=[x * rng.uniform(0.3, 1) for x in f],
                 comm=[rng.choice([0, 0.1, 0.5]) for _ in range(p)], m_b=m_b,
                 m_w=[x * rng.choice([0, 0.3, 0.5]) for x in m_b])


def test_auto_random_costs_valid_within_memory_and_never_worse_than_h1_h2():
    rng = random.Random(7)
    for _ in range(60):
        p, m = rng.randint(1, 7), rng.randint(1, 20)
        costs = random_costs(rng, p)
        limit = rng.uniform(max(costs.m_b), 2.5 * p * max(costs.m_b))
        schedule = validate(build("zb-auto", p, m, costs=costs, memory_limit=limit))
        auto = simulate(schedule, costs)
        assert max(auto.peak_activation) <= limit + 1e-9
        for name in ("zb-h1", "zb-h2"):
            fixed = simulate(build(name, p, m), costs)
            if max(fixed.peak_activation) <= limit:
                assert longest_span(auto) <= longest_span(fixed) + 1e-9


def test_auto_errors():
    with pytest.raises(PipeloomError, match="needs at least 1.5"):
        build("zb-auto", 4, 8, costs=heavy_last(4), memory_limit=1.2)
    with pytest.raises(PipeloomError, match="must be a pipeloom.schedule.Costs"):
        build("zb-auto", 4, 8, costs="f=1")


def test_list_schedule_time_matches_simulator():
    """The scheduler's own clock and memory agree with the simulator on the orders it builds."""
    costs = Costs(f=18.522, b=18.086, w=9.337, comm=0.601, m_w=0.4)
    for p, m in [(3, 7), (5, 12)]:
        placement = looped_placement(p, p)
        lists = list_schedule(placement, m, costs.per_stage(p, 1), h1_policy(p))
        result = simulate(validate(Schedule("check", p, m, placement, lists.ranks)), costs)
        assert (result.makespan, longest_span(result)) == pytest.approx((lists.makespan, lists.span))
        assert max(result.peak_activation) == pytest.approx(lists.peak)


def test_list_schedule_stops_at_bound():
    """Given a bound on the longest span, the scheduler gives up once a rank must exceed it."""
    p, m = 4, 8
    placement, stage = looped_placement(p, p), PROFILED.per_stage(p, 1)
    lists = list_schedule(placement, m, stage, h1_policy(p))
    assert list_schedule(placement, m, stage, h1_policy(p), bound=lists.span) == lists
    assert list_schedule(placement, m, stage, h1_policy(p), bound=lists.span - 1) is None


# -- zb-auto against the zero-bubble paper (Qi et al., ICLR 2024) ------------------------------------
# Per model: p, its profiled T_F, T_B, T_W, T_comm (ms; REFERENCE.md), h and a; per m, Table 5's bubble
# rates of ZB-H1, ZB-H2 and ZB-2p. The paper's rate is (cost - m(T_F+T_B+T_W)) / cost, cost the longest
# time of a stage from its first pass's start to its last one's end: pipeloom's (span) bubble rate for
# uniform stages. Memory as in the paper's Table 1: M_W / M_B = 32h / (34h + 5as), s = 1024.
PAPER = {
    "1.5B": ((8, 18.522, 18.086, 9.337, 0.601, 2304, 24),
             {24: (0.1585, 0.1083, 0.0433), 32: (0.1242, 0.0837, 0.0039), 64: (0.0674, 0.0444, 0.0026)}),
    "6.2B": ((8, 29.718, 29.444, 19.927, 0.527, 4096, 32),
             {24: (0.1323, 0.0698, 0.0029), 32: (0.1045, 0.0559, 0.0022), 64: (0.0554, 0.0294, 0.0010)}),
    "14.6B": ((16, 11.347, 11.248, 8.132, 0.377, 5120, 40),
              {48: (0.1397, 0.0672, 0.0066), 64: (0.1088, 0.0516, 0.0054), 128: (0.0576, 0.0266, 0.0028)}),
    "28.3B": ((32, 10.419, 10.207, 7.715, 0.408, 6144, 48),
              {96: (0.1421, 0.0641, 0.0038), 128: (0.1106, 0.0490, 0.0029), 256: (0.0594, 0.0257, 0.0018)}),
}
PAPER_ROWS = [(model, m) for model, (_, rates) in PAPER.items() for m in rates]


def paper_costs(model):
    (p, f, b, w, comm, h, a), _ = PAPER[model]
    return p, Costs(f=f, b=b, w=w, comm=comm, m_w=32 * h / (34 * h + 5 * a * 1024))


@pytest.mark.parametrize("model,m", PAPER_ROWS)
def test_paper_zb_2p(model, m):
    """At 2p·M_B zb-auto's bubble is within 0.005 of the paper's ZB-2p (near zero where ZB-H2's is not)."""
    p, costs = paper_costs(model)
    h1, h2, zb_2p = PAPER[model][1][m]
    auto = simulate(build("zb-auto", p, m, costs=costs, memory_limit=2 * p), costs)
    assert auto.bubble_rate == pytest.approx(zb_2p, abs=0.005)
    assert max(auto.peak_activation) <= 2 * p + 1e-9
    # the control: the same costs and rate give the paper's handcrafted schedules' figures
    for name, paper in (("zb-h1", h1), ("zb-h2", h2)):
        assert simulate(build(name, p, m), costs).bubble_rate == pytest.approx(paper, abs=0.005)


@pytest.mark.parametrize("model", PAPER)
def test_paper_zb_1p_never_worse_than_h1(model):
    """At p·M_B (1F1B's memory) zb-auto is never worse than ZB-H1 (the paper's ZB-1p equals it)."""
    p, costs = paper_costs(model)
    m = min(PAPER[model][1])
    auto = simulate(build("zb-auto", p, m, costs=costs, memory_limit=p), costs)
    assert auto.bubble_rate <= simulate(build("zb-h1", p, m), costs).bubble_rate + 1e-12
    assert max(auto.peak_activation) <= p + 1e-9
