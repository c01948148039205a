"""DualPipeV: torch's order, its invariants and memory, the overlapped pair's time and form, its refusals.

The runtime's parity with the one-process model is in test_runtime.py.
"""

import types
from collections import Counter

import pytest

from pipeloom.cli import main
from pipeloom.errors import PipeloomError
from pipeloom.schedule import BW, B, F, W, Action, Costs, Offload, Schedule, build, v_placement, validate
from pipeloom.schedule.deps import peak_activation
from pipeloom.schedule.families.dualpipe import OVERLAP_F_B, dualpipev, overlapped
from pipeloom.schedule.ir import parts
from pipeloom.sim import simulate, text_grid


def test_the_order_is_torchs_action_for_action():
    torch = pytest.importorskip("torch")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    for p in range(1, 7):
        for m in range(2 * p, 2 * p + 4):
            schedule = build("dualpipev", p, m)
            stub = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m)  # all the method reads
            for r in range(p):
                theirs = [str(a) for a in ScheduleDualPipeV._calculate_single_rank_operations(stub, r)]
                assert [str(a) for a in schedule.ranks[r]] == theirs, (p, m, r)


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (8, 16)])
def test_every_pass_once_on_its_v_rank(p, m):
    schedule = build("dualpipev", p, m)
    assert schedule.placement == v_placement(p) and schedule.chunks == 2
    done = Counter()
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            split = parts(action)
            if action.kind == OVERLAP_F_B:  # an F of one chunk with the fused backward of the other
                (f, bw) = split
                assert (f.kind, bw.kind) == (F, BW) and {f.stage, bw.stage} == set(schedule.stages_of(rank))
            done.update((a.kind, a.stage, a.microbatch) for a in split)
            assert all(schedule.placement[a.stage] == rank for a in split)
    for s in range(2 * p):
        for i in range(m):
            assert done[F, s, i] == 1
            assert done[BW, s, i] + done[B, s, i] == 1 and done[B, s, i] == done[W, s, i]
    assert sum(done.values()) == sum(len(parts(a)) for actions in schedule.ranks for a in actions)
    # the steady state overlaps: 2(m - 2p + r + 1) + (p - r - 1) pairs on rank r, one fewer on the last
    pairs = [sum(a.kind == OVERLAP_F_B for a in actions) for actions in schedule.ranks]
    assert pairs == [2 * (m - 2 * p + r + 1) + p - r - 1 - (r == p - 1) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_memory_is_two_p_plus_one_chunks_on_every_rank(p):
    """DeepSeek's table: PP + 1 chunk activations per rank (PP = 2p stages), for any m;
    1F1B and ZB-V hold p full stages (2p chunks) on their busiest rank."""
    for m in (2 * p, 3 * p + 1):
        schedule = build("dualpipev", p, m)
        units = Costs(m_b=1.0, m_w=0.5).per_stage(2 * p, 2)
        assert [peak_activation(a, units.memory_delta) for a in schedule.ranks] == [p + 0.5] * p
        assert simulate(schedule).peak_activation == [p + 0.5] * p
    for other in ("zb-v", "1f1b"):
        assert max(simulate(build(other, p, 2 * p)).peak_activation) == p


@pytest.mark.parametrize("p", range(2, 9))
def test_room_delays_the_last_stages_backward_by_whole_intervals(p):
    """With room k (at most m - 2p + 1), rank 0 runs the last stage's backward of i after its forward
    of i + k and before that of i + k + 1; every rank holds k more microbatches of each chunk (2k chunk
    activations, k stages' worth) at its peak, and the unit makespan stays DeepSeek's 3m + p - 1."""
    last = 2 * p - 1
    for room in (1, 2, 3):
        for m in (2 * p, 2 * p + room - 1, 3 * p + room):
            schedule = validate(dualpipev(p, m, 2, room=room))
            k = min(room, m - 2 * p + 1)
            flat = [part for a in schedule.ranks[0] for part in parts(a)]
            forward = {a.microbatch: n for n, a in enumerate(flat) if a.kind == F and a.stage == last}
            for n, a in enumerate(flat):
                if a.kind in (B, BW) and a.stage == last:
                    assert forward[min(a.microbatch + k, m - 1)] < n < forward.get(a.microbatch + k + 1, n + 1)
            result = simulate(schedule)
            assert max(result.peak_activation) == p + 0.5 + k and result.makespan == 3 * m + p - 1


def test_unit_bubble_is_deepseeks_formula():
    """DualPipe's bubble (PP/2 - 1)(F&B + B - 3W), with PP = 2p stages and chunk costs F = W = 1/2,
    full B = 1, F&B = F + B (overlap 0): p - 1 after a rank's 3m of work."""
    for p, m in [(2, 4), (4, 8), (4, 11), (8, 16)]:
        assert simulate(build("dualpipev", p, m)).makespan == 3 * m + p - 1


def test_the_pair_is_timed_by_its_overlap():
    pair = overlapped(Action(F, 0, 3), Action(BW, 3, 1))
    for overlap, time in [(0.0, 1.0 + 2.0 + 0.5), (1.0, 2.5), (0.5, 2.5 + 0.5)]:
        costs = Costs(f=2.0, b=3.0, w=2.0, extra={"overlap": overlap}).per_stage(4, 2)  # chunk: F 1, BW 2.5
        assert costs.duration(pair) == time
    schedule = build("dualpipev", 4, 8)
    spans = [simulate(schedule, Costs(extra={"overlap": x})).makespan for x in (0.0, 0.5, 1.0)]
    assert spans[0] > spans[1] > spans[2]
    with pytest.raises(PipeloomError, match=r"overlap=1.5 is a share of time; give a number in \[0, 1\]"):
        simulate(schedule, Costs(extra={"overlap": 1.5}))


def test_the_pair_reads_and_writes_as_torchs_action():
    pair = overlapped(Action(F, 0, 3), Action(BW, 7, 1))
    assert str(pair) == "(0F3;7B1)OVERLAP_F_B" and Action.parse(str(pair)) == pair
    assert parts(pair) == (Action(F, 0, 3), Action(BW, 7, 1))
    schedule = build("dualpipev", 2, 5)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert "(0F3;3B1)OVERLAP_F_B" in schedule.text().splitlines()[1]


@pytest.mark.parametrize("pair,message", [
    (Action(OVERLAP_F_B, 0, 3, ("F", 0, 3)), "needs two parts at least"),
    (Action(OVERLAP_F_B, 0, 3, ("F", 0, 3, "OVERLAP_F_B", 3, 1)), "holds 'OVERLAP_F_B'; its parts are plain"),
    (overlapped(Action(F, 0, 3), Action(BW, 1, 1)), r"action 1B1 belongs to rank 1"),
])
def test_the_validator_checks_the_pairs_parts(pair, message):
    schedule = build("dualpipev", 2, 4)
    ranks = list(schedule.ranks)
    k = next(k for k, a in enumerate(ranks[0]) if a.kind == OVERLAP_F_B)
    ranks[0] = ranks[0][:k] + (pair,) + ranks[0][k + 1:]
    with pytest.raises(PipeloomError, match=message):
        validate(Schedule("dualpipev", 2, 4, schedule.placement, tuple(ranks)))


def test_a_pair_waits_for_both_halves_inputs():
    """Rank 1's first pair (2F2;1B0) moved before 2B0: its B half needs that BW's gradient."""
    schedule = build("dualpipev", 2, 4)
    one = list(schedule.ranks[1])
    k = next(k for k, a in enumerate(one) if a.kind == OVERLAP_F_B)
    one[k - 1], one[k] = one[k], one[k - 1]
    with pytest.raises(PipeloomError, match=r"rank 1: action \(2F2;1B0\)OVERLAP_F_B \(position 5\) runs before 2B0"):
        validate(Schedule("dualpipev", 2, 4, schedule.placement, (schedule.ranks[0], tuple(one))))


@pytest.mark.parametrize("kwargs,message", [
    (dict(pp=4, microbatches=7), r"dualpipev needs microbatches >= 2\*pp = 8 .* got microbatches=7 with pp=4: "
                                 r"use microbatches=8 or more; or pp <= 3"),
    (dict(pp=2, microbatches=1), r"microbatches=1 with pp=2: use microbatches=4 or more$"),
    (dict(pp=2, microbatches=4, chunks=3), "dualpipev uses chunks=2 stages per rank; got chunks=3"),
])
def test_refusals_name_the_values_and_what_fits(kwargs, message):
    with pytest.raises(PipeloomError, match=message) as err:
        build("dualpipev", **kwargs)
    assert "\n" not in str(err.value)


def test_offload_none_leaves_it_alone():
    assert build("dualpipev", 2, 4, transforms=[Offload("none")]) == build("dualpipev", 2, 4)


def test_offload_goes_around_the_overlapped_pairs():
    """A copied pair's RELOAD comes before the overlapped action whose backward needs it, its OFFLOAD
    after the one whose F made it; the copies cut the peak and hide behind compute."""
    costs = Costs(f=1, b=1, w=1, comm=0.1, m_b=1, m_w=0.5, extra={"offload": 0.5})
    base = build("dualpipev", 4, 16)
    schedule = validate(Offload("full").apply(base, costs))
    before_pairs = 0  # reloads right before an overlapped action
    for actions in schedule.ranks:
        at = {}
        for k, a in enumerate(actions):
            for part in (parts(a) if a.kind == OVERLAP_F_B else (a,)):
                at.setdefault((part.kind, part.stage, part.microbatch), k)
        for k, a in enumerate(actions):
            if a.kind == "RELOAD":
                backward = at.get(("BW", a.stage, a.microbatch), at.get(("B", a.stage, a.microbatch)))
                assert at["OFFLOAD", a.stage, a.microbatch] < k < backward
                before_pairs += actions[backward].kind == OVERLAP_F_B
    assert before_pairs > 0
    before, after = simulate(base, costs), simulate(schedule, costs)
    assert max(after.peak_activation) < 0.6 * max(before.peak_activation)
    assert after.makespan == pytest.approx(before.makespan, rel=1e-12)


def test_simulate_draws_and_compares_it(capsys, tmp_path):
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8",
                 "--plot", str(tmp_path / "d.png"), "--trace", str(tmp_path / "d.json")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 0 and (tmp_path / "d.json").stat().st_size > 0
    assert "& overlapped F and B" in capsys.readouterr().out
    assert main(["simulate", "--compare", "1f1b,zb-v,dualpipev", "--pp", "4", "--microbatches", "8"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["dualpipev"][1:3] == ["8", "27"]
    grid = text_grid(simulate(build("dualpipev", 2, 4)), width=400)
    assert "F3B1" in grid  # a pair wide enough shows both halves' microbatches


def test_trace_transfers_name_the_halves():
    from pipeloom.sim import chrome_trace

    doc = chrome_trace(simulate(build("dualpipev", 2, 4)))
    sends = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "comm"}
    assert sends and all("OVERLAP" not in name for name in sends)
    assert "(0F3;3B1)OVERLAP_F_B" in {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
