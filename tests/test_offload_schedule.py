"""PipeOffload in the schedule language and the simulator: the transform's
placement and selection, the validator's rules for OFFLOAD/RELOAD and
OFFLOAD_W/RELOAD_W, and the copy stream's timing and memory against
hand-computed cases."""

import json
import random
from dataclasses import replace

import pytest

from pipeloom.cli import main
from pipeloom.errors import PipeloomError, ScheduleError
from pipeloom.schedule import (BW, FAMILIES, OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, Action, B, Costs, F, Offload,
                               Schedule, W, build, lower, to_torch_csv, validate)
from pipeloom.schedule.deps import asap, peak_activation
from pipeloom.schedule.transforms import offload
from pipeloom.schedule.transforms.offload import (PACE_COST, STEP_COST, copied_pairs, copyable, early_ws, tightest,
                                                  unmoved)
from pipeloom.sim import chrome_trace, simulate, text_grid
from pipeloom.sim.model import costs_from_model, offload_time_ratio

COSTS = Costs(f=1, b=1.5, w=0.5, comm=0.1, m_b=1, m_w=0.5, extra={"offload": 0.2})


def offloaded(schedule):
    return {(a.stage, a.microbatch) for actions in schedule.ranks for a in actions if a.kind == RELOAD}


def one_rank(actions, offload=True):
    """A hand-written one-rank schedule of two microbatches."""
    return Schedule("gpipe", 1, 2, (0,), (tuple(Action.parse(a) for a in actions),),
                    options={"offload": {"policy": "full", "ratio": 1.0}} if offload else {})


def test_copies_sit_after_f_and_before_the_backward():
    schedule = build("1f1b", 2, 4, transforms=[Offload("full")])
    assert schedule.options["offload"] == {"policy": "full", "ratio": 1.0}
    pairs = offloaded(schedule)
    assert pairs and all(stage == 0 for stage, _ in pairs)  # the last stage's B follows its F: nothing to gain
    for actions in schedule.ranks:
        for stage, mb in pairs & {(a.stage, a.microbatch) for a in actions}:
            k = actions.index
            f, o, r, b = (k(Action(kind, stage, mb)) for kind in ("F", OFFLOAD, RELOAD, BW))
            assert o == f + 1 and o < r < b
            assert any(a.kind not in (OFFLOAD, RELOAD) for a in actions[o + 1:r])  # something runs while it is away


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_offloads_lowers_and_never_raises_the_peak(name):
    options = {"steps": 2} if name == "2bw" else {}
    base = build(name, 4, 8, costs=COSTS, **options)
    schedule = build(name, 4, 8, transforms=[Offload("full")], costs=COSTS, **options)
    assert offloaded(schedule)
    validate(lower(schedule))
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert unmoved(schedule) == base
    before, after = simulate(base, COSTS), simulate(schedule, COSTS)
    assert max(after.peak_activation) < max(before.peak_activation)
    # copies of 0.2 per F hide; Ws moved right after their Bs cost at most STEP_COST
    limit = STEP_COST if schedule.options["offload"].get("moved") else 0.02
    assert before.makespan <= after.makespan <= before.makespan * (1 + limit)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_its_list_bounds_the_offloaded_peak_on_any_costs(name):
    """The planner's memory bound: every pair a policy copies is ``copyable`` in the list without
    offload, and a list's peak with its copied pairs held only in F and from their backward on is
    at most the simulated peak, under costs unlike the unit costs that placed the copies; so is
    the list without offload with every copyable pair so and every W right after its B (where
    the transform may move it)."""
    rng = random.Random(name)
    options = {"steps": 2} if name == "2bw" else {}
    base = build(name, 4, 8, **options)
    for policy, ratio in (("full", None), ("selective", 0.5)):
        schedule = build(name, 4, 8, transforms=[Offload(policy, ratio)], **options)
        for _ in range(4):
            costs = Costs(f=rng.uniform(0.5, 2), b=rng.uniform(0.5, 2), w=rng.uniform(0.2, 1), comm=rng.uniform(0, 0.5),
                          m_b=1, m_w=rng.uniform(0.1, 0.9), extra={"offload": rng.uniform(0, 3)})
            result = simulate(schedule, costs)
            delta = result.costs.memory_delta
            for rank, (bare, actions) in enumerate(zip(base.ranks, schedule.ranks)):
                copied = set(copied_pairs(actions))
                assert copied <= set(copyable(bare))
                least = peak_activation(tightest(early_ws(bare), copyable(bare)), delta)
                bound = peak_activation(tightest(actions, copied), delta)
                assert least <= bound * (1 + 1e-12) and bound <= result.peak_activation[rank] * (1 + 1e-12)
                if rank == 0:
                    assert least < peak_activation(bare, delta)  # copying lowers the bound


SPLIT = sorted(name for name in FAMILIES if build(name, 4, 8).split_backward)


@pytest.mark.parametrize("name", SPLIT)
def test_what_b_keeps_for_w_is_copied_in_every_split_family(name, monkeypatch):
    """Each split-backward family whose Ws wait after their Bs copies what B keeps for W: OFFLOAD_W
    after the B, RELOAD_W after it and before the W, in a valid schedule that lowers and round-trips;
    the peak is never above the same placement without those copies (their time made too long to
    fit), and lower where Ws wait longest; no time added (no W moved, to see the copies alone)."""
    monkeypatch.setattr(offload, "W_TRIES", 0)
    without = Costs(**{**COSTS.__dict__, "extra": {**COSTS.extra, "offload_w": 1e9}})
    schedule = build(name, 4, 8, transforms=[Offload("full")], costs=COSTS)
    bare = build(name, 4, 8, transforms=[Offload("full")], costs=without)
    validate(lower(schedule))
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert not any(a.kind == OFFLOAD_W for actions in bare.ranks for a in actions)
    moved = 0
    for actions in schedule.ranks:
        at = {a: k for k, a in enumerate(actions)}
        for a in actions:
            if a.kind == OFFLOAD_W:
                moved += 1
                b, r, w = (at[Action(kind, a.stage, a.microbatch)] for kind in (B, RELOAD_W, W))
                assert b < at[a] < r < w
    assert moved or name == "v-min"  # its Ws follow their Bs
    after, before = simulate(schedule, COSTS), simulate(bare, COSTS)
    assert max(after.peak_activation) <= max(before.peak_activation)
    if name in ("zb-h1", "zb-h2", "zb-v", "v-zb", "zb-auto"):
        assert max(after.peak_activation) < max(before.peak_activation)
    assert after.makespan == pytest.approx(before.makespan, rel=1e-12)


def test_with_vocabulary_passes():
    costs = Costs(f=1, b=1, w=1, m_b=1, s=0.2, t=0.2, m_v=0.3, extra={"offload": 0.1})
    base = build("1f1b", 4, 8, vocab_parallel="vocab-2", costs=costs)
    schedule = build("1f1b", 4, 8, vocab_parallel="vocab-2", transforms=[Offload("full")], costs=costs)
    assert schedule.vocab_parallel == "vocab-2" and offloaded(schedule)
    validate(lower(schedule))
    assert max(simulate(schedule, costs).peak_activation) < max(simulate(base, costs).peak_activation)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "1f1b", "v-half", "zb-h1"])
def test_selective_cuts_each_ranks_peak_by_its_ratio_with_fewer_copies(name):
    """Selective r brings each rank's activation peak to (1 - r) of its value, or where the copy
    stream cannot (the last ranks' pairs live too briefly) as low as full does; fewer pairs for a
    smaller r, and fewer than full."""
    base = simulate(build(name, 4, 16, costs=COSTS), COSTS).peak_activation
    schedule = build(name, 4, 16, transforms=[Offload("full")], costs=COSTS)
    full, copied = simulate(schedule, COSTS).peak_activation, {"full": offloaded(schedule)}
    for ratio in (0.1, 0.5):
        schedule = build(name, 4, 16, transforms=[Offload("selective", ratio)], costs=COSTS)
        peaks = simulate(schedule, COSTS).peak_activation
        assert all(p <= (1 - ratio) * b * (1 + 1e-9) or p <= f for p, b, f in zip(peaks, base, full))
        assert peaks[0] <= (1 - ratio) * base[0] * (1 + 1e-9)  # the first rank holds the most, the longest
        copied[ratio] = offloaded(schedule)
    assert 0 < len(copied[0.1]) < len(copied[0.5]) < len(copied["full"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_copies_stall_compute_only_where_paced_or_ws_moved(name, monkeypatch):
    """Whatever the copies cost, each compute action runs when it would without offload (no backward
    waits for its RELOAD: a pair whose copies do not fit the copy stream's free time is not copied),
    unless the schedule paces forwards to the copy stream (then the step grows by at most
    PACE_COST and the peak is lower than without pacing) or moves Ws right after their Bs (then
    by at most STEP_COST, and the peak is lower than without the moves). The peak never rises;
    the slower the link, the fewer pairs fit."""
    rng = random.Random(name)
    options = {"steps": 2} if name == "2bw" else {}
    bare = build(name, 4, 12, **options)
    for _ in range(4):
        f = rng.uniform(0.5, 2)
        costs = Costs(f=f, b=rng.uniform(0.5, 2), w=rng.uniform(0.2, 1), comm=rng.uniform(0, 0.5),
                      m_b=rng.choice([1, 3]), m_w=rng.choice([0.25, 0.5]))
        plain = simulate(bare, costs)
        copied = {}
        for copy in (0.0, 0.2 * f, f, 3 * f):
            for policy in (("full",), ("selective", 0.5)):
                priced = Costs(**{**costs.__dict__, "extra": {"offload": copy}})
                schedule = Offload(*policy).apply(bare, priced)
                result = simulate(schedule, priced)
                waits, moved = (schedule.options["offload"].get(key) for key in ("waits", "moved"))
                if moved:
                    assert result.makespan <= plain.makespan * (1 + STEP_COST) * (1 + 1e-12)
                    with monkeypatch.context() as unmoving:
                        unmoving.setattr(offload, "W_TRIES", 0)
                        kept = simulate(Offload(*policy).apply(bare, priced), priced)
                    assert max(result.peak_activation) < max(kept.peak_activation)
                elif waits:
                    assert result.makespan <= plain.makespan * (1 + PACE_COST) * (1 + 1e-12)
                    unpaced = replace(schedule, options={**schedule.options, "offload": {
                        k: v for k, v in schedule.options["offload"].items() if k != "waits"}})
                    assert max(result.peak_activation) < max(simulate(unpaced, priced).peak_activation)
                else:
                    assert result.exposed == pytest.approx([0.0] * 4, abs=1e-9)
                    assert result.makespan == pytest.approx(plain.makespan, rel=1e-12)
                assert max(result.peak_activation) <= max(plain.peak_activation) * (1 + 1e-12)
                copied[copy, policy[0]] = len(offloaded(schedule))
        assert copied[0.0, "full"] >= copied[0.2 * f, "full"] >= copied[3 * f, "full"]


def test_paced_forwards_wait_for_their_offload():
    """Where a warm-up's forwards outrun the copy stream, each F of a paced rank waits for an earlier
    pair's OFFLOAD: the simulated F starts no earlier than that copy ends; the validator refuses a
    wait for an offload on another rank."""
    costs = Costs(f=1, b=2, comm=0.1, m_b=1, extra={"offload": 1.8})
    schedule = Offload("full").apply(build("1f1b", 4, 8), costs)
    waits = schedule.options["offload"]["waits"]
    assert waits
    per_stage = costs.per_stage(schedule.stages, schedule.chunks)
    starts, ends = asap(schedule, per_stage.duration, per_stage.transfer)
    at = {a: (r, k) for r, actions in enumerate(schedule.ranks) for k, a in enumerate(actions)}
    for stage, microbatch, waited_stage, waited in waits:
        r, k = at[Action(F, stage, microbatch)]
        q = at[Action(OFFLOAD, waited_stage, waited)]
        assert q[0] == r and starts[r][k] >= ends[r][q[1]] - 1e-12
    wrong = [[0, 3, 1, 0]]
    with pytest.raises(ScheduleError, match="waits for OFFLOAD 1:0, which is not on its rank"):
        validate(replace(schedule, options={**schedule.options, "offload": {**schedule.options["offload"],
                                                                              "waits": wrong}}))


@pytest.mark.parametrize("name", ["interleaved-1f1b", "v-half", "v-min", "1f1b"])
def test_selective_half_removes_more_than_half_of_full_saving(name):
    peaks = {}
    for policy in (("none",), ("selective", 0.5), ("full",)):
        schedule = build(name, 4, 16, transforms=[Offload(*policy)], costs=COSTS)
        peaks[policy[0]] = max(simulate(schedule, COSTS).peak_activation)
    saving = peaks["none"] - peaks["full"]
    assert saving > 0
    assert peaks["none"] - peaks["selective"] > 0.5 * saving


def test_simulator_times_the_copy_stream_by_hand():
    """F0 [0,1]; OFFLOAD0 [1,2.5] beside F1 [1,2]; RELOAD0 issued at 2 waits for the
    stream until 2.5 and ends at 4; B0 waits for it (2 exposed) [4,5]; B1 [5,6]."""
    schedule = validate(one_rank(["0F0", "0OFFLOAD0", "0F1", "0RELOAD0", "0B0", "0B1"]))
    result = simulate(schedule, Costs(f=1, b=1, w=0, m_b=1, extra={"offload": 1.5}))
    assert result.starts[0] == [0, 1, 1, 2.5, 4, 5]
    assert result.ends[0] == [1, 2.5, 2, 4, 5, 6]
    assert result.makespan == 6
    assert result.exposed == [2.0]
    assert result.ranks[0].busy == 4  # the copies overlap compute
    # activation: +1 at 0, +1 at 1, offload's -1 and reload's +1 at 2.5, -1 at 5 and 6; host: 1 from 1 to 4
    assert result.memory_timeline(0) == [(0, 0), (0, 1), (1, 2), (2.5, 1), (2.5, 2), (5, 1), (6, 0)]
    assert result.peak_activation == [2]
    assert result.host_timeline(0) == [(0, 0), (1, 1), (4, 0)]
    assert result.peak_host == [1]


def test_offload_ends_before_the_next_forward_ends():
    """A fast link: F0's offload ends at 1.25, before F1 ends; the reload issued at 2
    still delays B0 by its 0.25 (no action lies between it and B0 to hide it)."""
    schedule = validate(one_rank(["0F0", "0OFFLOAD0", "0F1", "0RELOAD0", "0B0", "0B1"]))
    result = simulate(schedule, Costs(f=1, b=1, w=0, m_b=1, extra={"offload": 0.25}))
    assert result.exposed == [0.25] and result.makespan == 4.25
    assert result.memory_timeline(0) == [(0, 0), (0, 1), (1, 2), (1.25, 1), (2, 2), (3.25, 1), (4.25, 0)]


def test_simulator_times_the_copies_of_what_b_keeps_for_w_by_hand():
    """m_w = 2 > m_b = 1 (B rebuilds what W reads); offload 0.25 moves m_b, so offload_w = 0.5.
    F0 [0,1]; I0 [1,2] (+1 at its start); OFFLOAD_W0 [2,2.5] beside F1 [2,3]; I1 [3,4]; W1 [4,5];
    RELOAD_W0 issued at 5 [5,5.5]; W0 waits for it (0.5 exposed) [5.5,6.5]. The peak is 3 at 2,
    not the 4 that I1 reaches without the copies; host holds 2 from 2 to 5.5."""
    costs = Costs(f=1, b=1, w=1, m_b=1, m_w=2, extra={"offload": 0.25})
    actions = ["0F0", "0I0", "0OFFLOAD_W0", "0F1", "0I1", "0W1", "0RELOAD_W0", "0W0"]
    result = simulate(validate(one_rank(actions)), costs)
    assert result.starts[0] == [0, 1, 2, 2, 3, 4, 5, 5.5] and result.ends[0] == [1, 2, 2.5, 3, 4, 5, 5.5, 6.5]
    assert result.exposed == [0.5]
    assert result.memory_timeline(0) == [(0, 0), (0, 1), (1, 2), (2, 3), (2.5, 1), (3, 2), (5, 0), (5, 2), (6.5, 0)]
    assert result.peak_activation == [3]
    assert result.host_timeline(0) == [(0, 0), (2, 2), (5.5, 0)]
    bare = simulate(validate(one_rank([a for a in actions if "LOAD" not in a], offload=False)), costs)
    assert bare.peak_activation == [4]
    # the planner's bound, the copies at their tightest (OFFLOAD_W's bytes gone as I0 ends): below the simulated 3
    assert peak_activation(tightest(bare.schedule.ranks[0], [(0, 0, 1)]), result.costs.memory_delta) == 2


def test_validator_rules():
    with pytest.raises(ScheduleError, match="RELOAD"):
        validate(one_rank(["0F0", "0OFFLOAD0", "0F1", "0B0", "0B1"]))
    with pytest.raises(ScheduleError, match="0RELOAD0.*runs before 0OFFLOAD0"):
        validate(one_rank(["0F0", "0RELOAD0", "0OFFLOAD0", "0F1", "0B0", "0B1"]))
    with pytest.raises(ScheduleError, match="0B0.*runs before 0RELOAD0"):
        validate(one_rank(["0F0", "0OFFLOAD0", "0F1", "0B0", "0RELOAD0", "0B1"]))
    with pytest.raises(ScheduleError, match="0OFFLOAD0.*runs before 0F0"):
        validate(one_rank(["0OFFLOAD0", "0F0", "0F1", "0RELOAD0", "0B0", "0B1"]))
    with pytest.raises(ScheduleError, match="names no offload policy"):
        validate(one_rank(["0F0", "0OFFLOAD0", "0F1", "0RELOAD0", "0B0", "0B1"], offload=False))
    with pytest.raises(ScheduleError, match="0OFFLOAD0 appears 2 times"):
        validate(one_rank(["0F0", "0OFFLOAD0", "0OFFLOAD0", "0F1", "0RELOAD0", "0B0", "0B1"]))
    split = ["0F0", "0F1", "0I0", "0OFFLOAD_W0", "0I1", "0RELOAD_W0", "0W0", "0W1"]
    validate(one_rank(split))
    with pytest.raises(ScheduleError, match="OFFLOAD_W 0:0 has no RELOAD_W"):
        validate(one_rank([a for a in split if a != "0RELOAD_W0"]))
    with pytest.raises(ScheduleError, match="0OFFLOAD_W0.*runs before 0I0"):
        validate(one_rank(["0F0", "0F1", "0OFFLOAD_W0", "0I0", "0I1", "0RELOAD_W0", "0W0", "0W1"]))
    with pytest.raises(ScheduleError, match="0W0.*runs before 0RELOAD_W0"):
        validate(one_rank(["0F0", "0F1", "0I0", "0OFFLOAD_W0", "0I1", "0W0", "0RELOAD_W0", "0W1"]))
    with pytest.raises(ScheduleError, match="what 0I0 keeps.*names no offload policy"):
        validate(one_rank(split, offload=False))


def test_policy_errors_and_torch_csv():
    with pytest.raises(PipeloomError, match="unknown offload policy 'half'"):
        Offload("half")
    with pytest.raises(PipeloomError, match=r"ratio 1.5: must be in \(0, 1\]"):
        Offload("selective", 1.5)
    with pytest.raises(PipeloomError, match="needs a ratio"):
        Offload("selective")
    with pytest.raises(PipeloomError, match="goes with the selective policy"):
        Offload("full", 0.5)
    assert build("1f1b", 2, 4, transforms=[Offload("none")]) == build("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="offloaded already"):
        Offload("full").apply(build("1f1b", 2, 4, transforms=[Offload("full")]))
    with pytest.raises(PipeloomError, match="OFFLOAD"):
        to_torch_csv(build("1f1b", 2, 4, transforms=[Offload("full")]))


def test_renderers_draw_the_copy_streams():
    schedule = build("1f1b", 2, 4, transforms=[Offload("full")], costs=COSTS)
    result = simulate(schedule, COSTS)
    lines = text_grid(result).splitlines()
    assert lines[1].startswith("r0 d2h") and "o" in lines[1] and "r" not in lines[1].split()[2]
    assert lines[2].startswith("r0 h2d") and "r" in lines[2].split()[2] and "o" not in lines[2].split()[2]
    assert "o offload" in lines[-1] and "r reload" in lines[-1]
    trace = chrome_trace(result)["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    copies = [e for e in trace if e.get("cat") in (OFFLOAD, RELOAD)]
    assert copies and all(threads[e["pid"], e["tid"]] == ("d2h" if e["cat"] == OFFLOAD else "h2d") for e in copies)
    assert any(e.get("name") == "host memory" for e in trace)


def test_model_costs_and_k():
    costs = costs_from_model("6.2b", 8, 4096, 1, "a100", attention="ring")
    m_b = costs.m_b[1]
    assert costs.extra["offload"][1] == pytest.approx(1e3 * m_b / 15e9)  # ms over the a100's 15 GB/s host link
    cheap = costs_from_model("6.2b", 8, 4096, 1, "a100", attention="ring", recompute="cheap")
    # 34 bsh -> 20 bsh per layer (plus the ring's log-sum-exp, the same in both)
    bsh = 4096 * 4096
    assert (m_b - cheap.m_b[1]) == pytest.approx(14 * bsh * 4)  # stage 1 holds 4 layers
    # the paper's estimate: k = 10 / (3(6h + s)) x FLOP/s / host B/s, with our achievable FLOP/s (312e12 x 0.5)
    k = offload_time_ratio("6.2b", 4096, 1, "a100", attention="ring", recompute="cheap")
    estimate = 10 / (3 * (6 * 4096 + 4096)) * 156e12 / 15e9
    assert k == pytest.approx(estimate, rel=0.02)
    assert offload_time_ratio("6.2b", 16384, 1, "a100", attention="ring", recompute="cheap") < 1 < k


@pytest.mark.parametrize("hidden,seq", [(4096, 4096), (8192, 4096), (4096, 16384), (2048, 2048)])
def test_k_is_the_papers_formula_under_the_papers_assumptions(hidden, seq):
    """PipeOffload's k = 10 / (3(6h + s)) x FLOP/s / host bytes/s when the layer keeps 20bsh bytes
    (cheap recomputation) and compute runs at the paper's A100 rate (220 TFLOP/s, 15 GB/s to the host,
    as its reference implementation sets them): 1.7 at h = s = 4096."""
    from dataclasses import replace

    from pipeloom.sim.specs import Device, get_model

    paper = Device("paper-a100", 220e12, 80 * 2**30, 50e9, 15e9, 1.0, 2e12)
    model = replace(get_model("6.2b"), hidden=hidden, heads=hidden // 128)
    k = offload_time_ratio(model, seq, 1, paper, recompute="cheap")
    assert k == pytest.approx(10 / (3 * (6 * hidden + seq)) * 220e12 / 15e9, rel=0.005)


@pytest.mark.parametrize("name,chunks,seq,recompute", [
    ("1f1b", 1, 4096, False), ("interleaved-1f1b", 2, 16384, "cheap"), ("v-half", 2, 4096, "cheap"),
    ("dualpipev", 2, 4096, False), ("zb-v", 2, 32768, False)])
def test_eager_copies_keep_every_compute_action_on_time(name, chunks, seq, recompute):
    """The eager placement (each F pair's OFFLOAD right after its F, its RELOAD as late as the stream
    back allows) makes no backward wait, with copies slower (k up to 2.1) or faster than compute:
    simulated, every compute action starts at its time without copies, to the bit, and pairs are copied."""
    costs = costs_from_model("6.2b", 8, seq, 1, "a100", chunks=chunks, attention="ring", recompute=recompute)
    bare = build(name, 8, 32, chunks)
    pairs = offload._pairs_of(bare, costs)
    marked = replace(bare, options={**bare.options, "offload": {"policy": "full", "ratio": 1.0}})
    entries, eagerly = offload._eager(marked, pairs)
    assert all(entries[r] for r in range(4))
    starts, _ = asap(eagerly, pairs.costs.duration, pairs.costs.transfer)
    for r, actions in enumerate(eagerly.ranks):
        assert [t for t, a in zip(starts[r], actions) if a.kind not in offload.COPIES] == pairs.starts[r]


@pytest.mark.parametrize("name,chunks,least,paced,moved", [
    ("1f1b", 1, 0.40, True, False), ("interleaved-1f1b", 2, 0.42, False, False), ("v-half", 2, 0.40, False, True),
    ("zb-v", 2, 0.35, False, True), ("zb-h1", 1, 0.18, False, True)])
def test_the_papers_standard_setting(name, chunks, least, paced, moved):
    """6.2B, seq 4096, pp 8, 32 microbatches, A100, cheap recomputation (k = 1.21): full and
    selective 0.5 cut the worst rank's activation peak by at least ``least`` (issue 32: 40% for
    1f1b, interleaved-1f1b and v-half at no more than 1.05x the step; for the zero-bubble schedules
    what this placement reaches, docs/benchmarks.md says why; zb-v and zb-h1 cut 3% and nothing
    before what B keeps for W was copied too), full at least as much as selective. No time added,
    but where the forwards are ``paced`` to the copy stream (1f1b's warm-ups: at most PACE_COST)
    or Ws are ``moved`` right after their Bs (v-half's cool-down: in all at most 1.05x)."""
    costs = costs_from_model("6.2b", 8, 4096, 1, "a100", chunks=chunks, recompute="cheap")
    bare = simulate(build(name, 8, 32, chunks), costs)
    cuts = {}
    for policy in (("selective", 0.5), ("full",)):
        schedule = build(name, 8, 32, chunks, transforms=[Offload(*policy)], costs=costs)
        result = simulate(schedule, costs)
        assert bool(schedule.options["offload"].get("waits")) == paced
        assert bool(schedule.options["offload"].get("moved")) == moved
        if paced or moved:
            assert bare.makespan <= result.makespan <= bare.makespan * (1 + (PACE_COST if paced else 0.05))
        else:
            assert result.makespan == pytest.approx(bare.makespan, rel=1e-12)
        cuts[policy[0]] = 1 - max(result.peak_activation) / max(bare.peak_activation)
    assert cuts["full"] >= cuts["selective"] >= least


def test_selective_short_of_its_ratio_says_so_before_launch():
    from pipeloom.techniques.offload import _cut_line, shortfall

    def report(policy, ratio, cut, time=1.0, paced=False, moved=0):
        return {"policy": policy, "ratio": ratio, "cut": cut, "time": time, "paced": paced, "moved": moved}

    assert shortfall({"offload": report("selective", 0.5, 0.29)}) == (
        "pipeloom train: offload selective 0.5: the copies cut the worst rank's activation peak by 29%, not 50%: "
        "more copies would delay compute (the copy streams are full where the peak is)")
    assert shortfall({"offload": report("selective", 0.5, 0.44, 1.016, moved=8)}) == (
        "pipeloom train: offload selective 0.5: the copies cut the worst rank's activation peak by 44%, running 8 Ws "
        "right after their Bs: the step takes 1.016x its time without copies, not 50%: more copies would delay "
        "compute (the copy streams are full where the peak is; no further W moved right after its B lowered it "
        "within 5% more time, of at most 6 tried per rank)")
    assert shortfall({"offload": report("selective", 0.5, 0.5)}) is None
    assert shortfall({"offload": report("full", None, 0.1)}) is None
    assert shortfall({}) is None
    assert _cut_line(report("full", None, 0.57, 1.0127, paced=True)) == (
        "the copies cut the worst rank's activation peak by 57%, pacing forwards to the copy stream where it falls "
        "behind: the step takes 1.013x its time without copies")
    assert _cut_line(report("full", None, 0.43, 1.0161, moved=8)) == (
        "the copies cut the worst rank's activation peak by 43%, running 8 Ws right after their Bs: the step takes "
        "1.016x its time without copies")
    assert _cut_line(report("full", None, 0.2, 1.03, paced=True, moved=1)).endswith(
        "pacing forwards to the copy stream where it falls behind and running 1 W right after its B: the step "
        "takes 1.030x its time without copies")


def test_simulate_says_how_many_ws_run_right_after_their_bs(capsys):
    """v-half at the standard setting: simulate's report counts the moved Ws and times the step
    against v-half's own order (the Ws back where the family put them)."""
    assert main(["simulate", "--schedule", "v-half", "--pp", "8", "--microbatches", "32", "--chunks", "2",
                 "--model", "6.2b", "--seq", "4096", "--microbatch-size", "1", "--hardware", "a100",
                 "--attention", "ring", "--recompute", "cheap", "--offload", "selective", "--offload-ratio", "0.5",
                 "--json"]) == 0
    offload = json.loads(capsys.readouterr().out)["offload"]
    assert offload["moved"] > 0 and not offload["paced"]
    assert offload["cut"] >= 0.40 and 1 < offload["time"] <= 1.05


def test_cli(capsys, tmp_path):
    assert main(["simulate", "--pp", "4", "--microbatches", "8", "--model", "6.2b", "--seq", "4096",
                 "--microbatch-size", "1", "--hardware", "a100", "--attention", "ring", "--offload", "full",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    offload = report["offload"]
    assert offload["policy"] == "full" and offload["k"] > 1
    assert [row["rank"] for row in offload["ranks"]] == [0, 1, 2, 3]
    first, last = offload["ranks"][0], offload["ranks"][-1]
    assert first["offloaded_bytes"] > first["host_bytes"] > 0  # k > 1: fewer pairs at a time
    # copy time shows only where forwards wait for the stream (paced), which lengthens the step by at most PACE_COST
    assert (first["exposed_ms"] > 0) == offload["paced"] and offload["time"] <= 1 + PACE_COST
    assert last["offloaded_bytes"] == last["host_bytes"] == 0  # the last stage's B follows its F
    peaks = []
    for offload in ([], ["--offload", "full"]):  # k < 1 here
        assert main(["simulate", "--pp", "4", "--microbatches", "8", "--model", "6.2b", "--seq", "16384",
                     "--microbatch-size", "1", "--hardware", "a100", "--attention", "ring", "--recompute", "cheap",
                     "--json", *offload]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["peak_memory_bytes"])
    assert all(a >= b for a, b in zip(*peaks)) and peaks[0][0] > peaks[1][0]
    plot = tmp_path / "off.png"
    assert main(["simulate", "--pp", "4", "--microbatches", "8", "--offload", "selective", "--offload-ratio", "0.5",
                 "--costs", "offload=0.2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "offload selective 0.5:" in out and "r0 d2h" in out and "r0 h2d" in out and plot.stat().st_size > 0
    assert main(["simulate", "--compare", "1f1b,v-half", "--pp", "4", "--microbatches", "8", "--costs", "offload=0.3",
                 "--offload", "full"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "max host" in table[0] and "max exposed" in table[0]
    assert [line.split()[0] for line in table[1:]] == ["1f1b", "v-half"]
    assert main(["simulate", "--offload-ratio", "0.5"]) == 2
    assert "--offload-ratio 0.5 goes with --offload selective" in capsys.readouterr().err
    assert main(["simulate", "--offload", "selective"]) == 2
    assert "needs a ratio" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "v-half", "gpipe"])
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("copy", [0.9, 1.8])
def test_the_placement_times_copies_as_the_compiled_program_does(name, policy, copy):
    """The placement times each attempt with a program derived from the bare schedule's (not
    compiled again): the same starts, ends and copy waits as compiling it, on any costs, paced
    forwards included (1f1b at the slower copy)."""
    from pipeloom.schedule import deps
    from pipeloom.schedule.transforms.offload_program import _derive

    rng = random.Random(7)
    costs = Costs(f=1, b=1.5, w=0.5, comm=0.3, m_b=1, m_w=0.5, extra={"offload": copy})
    bare = build(name, 4, 8)
    schedule = Offload(policy, 0.5 if policy == "selective" else None).apply(bare, costs)
    assert offloaded(schedule)
    if name == "1f1b" and copy > 1:
        assert schedule.options["offload"]["waits"]
    derived, compiled = _derive(schedule, bare), deps._Program(schedule)
    assert derived is not None
    per_stage = costs.per_stage(schedule.stages, schedule.chunks)
    times: dict = {}

    def drawn(tag):
        return lambda a: times.setdefault((tag, a.kind, a.stage, a.payload), rng.random())

    for duration, transfer in ((per_stage.duration, per_stage.transfer), (drawn("d"), drawn("t"))):
        waits = [[0.0] * schedule.pp for _ in range(2)]
        assert derived.run(duration, transfer, waits[0]) == compiled.run(duration, transfer, waits[1])
        assert waits[0] == waits[1]


@pytest.mark.parametrize("name,chunks", [("zb-v", 2), ("zb-h1", 1)])
def test_each_move_is_timed_as_the_compiled_program_does(name, chunks, monkeypatch):
    """Each W the placement tries to move is timed with a program derived from the schedule's
    before the move (not compiled again), resumed from that one's timeline at the first step the
    move changes: the same starts, ends and copy waits as compiling it, on any costs (the standard setting with blockwise attention: Ws move with their copies and without)."""
    from pipeloom.schedule import deps
    from pipeloom.schedule.transforms import offload_program

    rng, derive, tried = random.Random(7), offload_program._derive_moved, []
    costs = costs_from_model("6.2b", 8, 4096, 1, "a100", chunks=chunks, attention="ring", recompute="cheap")
    per_stage = costs.per_stage(8 * chunks, chunks)
    times: dict = {}

    def drawn(tag):
        return lambda a: times.setdefault((tag, a.kind, a.stage, a.payload), rng.random())

    def compared(schedule, current, pair):
        derived, compiled, before = derive(schedule, current, pair), deps._Program(schedule), deps._program(current)
        assert derived is not None and derived.origin[0]() is before
        for duration, transfer in ((per_stage.duration, per_stage.transfer), (drawn("d"), drawn("t"))):
            waits = [[0.0] * schedule.pp for _ in range(2)]
            times = compiled.run(duration, transfer, waits[1])
            assert derived.run(duration, transfer, waits[0]) == times
            assert waits[0] == waits[1]
            # resumed from the timeline before the move, at its first changed step: the same times
            resume = (*before.timeline(duration, transfer), derived.origin[1])
            assert derived.lists(*derived.timeline(duration, transfer, resume=resume)) == times
        rank = schedule.placement[pair[0]]
        tried.append(len(current.ranks[rank]) - len(schedule.ranks[rank]))  # the copies dropped
        return derived

    monkeypatch.setattr(offload_program, "_derive_moved", compared)
    schedule = build(name, 8, 32, chunks, transforms=[Offload("full")], costs=costs)
    assert schedule.options["offload"]["moved"] and set(tried) == {0, 2}  # Ws moved with their copies and without


def test_moved_ws_go_back_in_place_past_the_pieces_k_fac_adds_later():
    """K-FAC's pieces go in after the copies and moved Ws: ``unmoved`` puts each W back before the
    action that followed it, not at its old index (which the pieces shifted), so the schedule is valid."""
    from pipeloom.builder import build_run
    from pipeloom.spec import RunSpec

    schedule = build_run(RunSpec(schedule="v-half", optimizer="kfac", offload="full", recompute="cheap"))
    assert schedule.options["offload"].get("moved") and schedule.options.get("kfac")
    bare = validate(unmoved(schedule))
    for stage, microbatch, *_ in schedule.options["offload"]["moved"]:
        actions = bare.ranks[schedule.placement[stage]]
        assert actions.index(Action(W, stage, microbatch)) > actions.index(Action(B, stage, microbatch)) + 1


def test_a_moved_w_that_came_last_goes_back_before_its_steps_preconditioning():
    """A W moved from the end of its step's list goes back before what K-FAC made need it since (the
    step's preconditioning), not to the end of the cycle's list."""
    from pipeloom.builder import build_run
    from pipeloom.spec import RunSpec

    schedule = build_run(RunSpec(schedule="v-half", pp=1, microbatches=2, seq=64, recompute="cheap", precision="bf16",
                                 vocab_parallel="vocab-1", offload="full", optimizer="kfac"))
    last = [entry for entry in schedule.options["offload"]["moved"] if entry[3] is None]
    assert last and schedule.options["kfac"]["every"] > 1  # a W that came last, in a cycle of several steps
    bare = validate(unmoved(schedule))
    for stage, microbatch, *_ in last:
        actions = bare.ranks[schedule.placement[stage]]
        assert actions.index(Action(W, stage, microbatch)) < actions.index(Action("KFAC_PRE", stage, 0))
