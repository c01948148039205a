"""The renderers: Chrome trace JSON, PNG/SVG pictures, the text grid."""

import json
from collections import Counter

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedule import Action, Schedule, build
from pipeloom.sim import Costs, Event, chrome_trace, chrome_trace_events, plot_schedule, simulate, text_grid, write_chrome_trace


def split_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every fused backward split into B then W (a zero-bubble-like list)."""
    ranks = tuple(
        tuple(x for a in actions for x in ((a._replace(kind="B"), a._replace(kind="W")) if a.kind == "BW" else (a,)))
        for actions in schedule.ranks
    )
    return Schedule("split", schedule.pp, schedule.microbatches, schedule.placement, ranks)


@pytest.fixture
def interleaved():
    return simulate(build("interleaved-1f1b", 4, 8, chunks=2), Costs(comm=0.25, m_w=0.5))


def by_phase(trace):
    phases = {}
    for event in trace["traceEvents"]:
        phases.setdefault(event["ph"], []).append(event)
    return phases


def test_trace_names_processes_and_threads(interleaved, tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace(interleaved, path)
    trace = json.loads(path.read_text())
    meta = by_phase(trace)["M"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (stages {r}, {r + 4})" for r in range(4)}
    assert {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"} == {r: r for r in range(4)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for rank in range(4):
        assert threads[rank, 0] == "compute" and threads[rank, 1] == "comm"
    assert trace["otherData"]["time_unit"] == "ms"


def test_trace_has_one_compute_event_per_action(interleaved):
    trace = chrome_trace(interleaved)
    compute = [e for e in by_phase(trace)["X"] if e["tid"] == 0]
    schedule = interleaved.schedule
    assert sorted(e["name"] for e in compute) == sorted(str(a) for actions in schedule.ranks for a in actions)
    first = next(e for e in compute if e["name"] == "0F0")
    assert first["args"] == {"stage": 0, "microbatch": 0, "kind": "F"}
    assert first["dur"] == pytest.approx(500.0)  # 0.5 units of a chunk, 1 unit = 1 ms = 1000 us


def test_trace_transfers_and_flows_pair_up(interleaved):
    phases = by_phase(chrome_trace(interleaved))
    comm = [e for e in phases["X"] if e["tid"] != 0]
    schedule = interleaved.schedule
    # every stage boundary crosses ranks here: p*(S-1) microbatch transfers each way
    assert len(comm) == 2 * schedule.total_microbatches * (schedule.stages - 1)
    assert all(e["dur"] == pytest.approx(250.0) and e["args"]["from_rank"] == e["pid"] for e in comm)
    starts, ends = phases["s"], phases["f"]
    assert sorted(e["id"] for e in starts) == sorted(e["id"] for e in ends) == list(range(len(comm)))
    assert all(e["bp"] == "e" for e in ends)
    ends_by_id = {e["id"]: e for e in ends}
    assert all(ends_by_id[e["id"]]["pid"] != e["pid"] for e in starts)


def test_trace_memory_counter_follows_the_timeline(interleaved):
    counters = by_phase(chrome_trace(interleaved))["C"]
    assert Counter(e["pid"] for e in counters) == {r: len(interleaved.memory_timeline(r)) for r in range(4)}
    peak = max(e["args"]["M_B"] for e in counters if e["pid"] == 0)
    assert peak == pytest.approx(interleaved.peak_activation[0])


def test_overlapping_transfers_get_their_own_comm_threads():
    result = simulate(build("1f1b", 4, 8), Costs(comm=3.0))  # transfers longer than the actions between them
    phases = by_phase(chrome_trace(result))
    for rank in range(4):
        lanes = {}
        for e in (e for e in phases["X"] if e["pid"] == rank and e["tid"] != 0):
            lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in lanes.values():
            spans.sort()
            assert all(a_end <= b_start + 1e-6 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert max(e["tid"] for e in phases["X"]) > 1


def test_trace_events_take_a_measured_timeline_without_a_result():
    events = [[Event(0, Action("F", 0, 0), 0.0, 1.5)], [Event(1, Action("F", 1, 0), 2.0, 3.0)]]
    trace = chrome_trace_events(events, [[0], [1]], metadata={"source": "measured"})
    assert json.loads(json.dumps(trace))["otherData"]["source"] == "measured"
    assert [e["name"] for e in trace["traceEvents"] if e["ph"] == "X"] == ["0F0", "1F0"]
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 (stage 0)", "rank 1 (stage 1)"]


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_png_and_svg(interleaved, tmp_path, suffix):
    path = tmp_path / f"schedule{suffix}"
    plot_schedule(interleaved, path)
    data = path.read_bytes()
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    else:
        assert b"<svg" in data[:2000]


def test_plot_draws_split_backward(tmp_path):
    path = tmp_path / "split.png"
    plot_schedule(simulate(split_backward(build("1f1b", 4, 8))), path)
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("unit,scale,label", [("M_B", 1, "activation memory (M_B)"),
                                              ("bytes", 2**30, "activation memory (GiB)")])
def test_the_memory_panel_draws_the_results_levels_in_their_unit(interleaved, unit, scale, label):
    """Levels in bytes are drawn in GiB (from one GiB up): every rank's steps as the result has them."""
    from matplotlib.figure import Figure

    from pipeloom.sim.plot import _draw_memory

    costs = Costs(m_b=3 * 2**30) if unit == "bytes" else Costs()
    result = simulate(interleaved.schedule, costs)
    ax = Figure().subplots()
    _draw_memory(ax, result, unit)
    assert ax.get_ylabel() == label and len(ax.get_lines()) == result.schedule.pp
    for rank, line in enumerate(ax.get_lines()):
        points = dict(result.memory_timeline(rank))
        assert list(line.get_xdata()) == list(points) and list(line.get_ydata()) == [v / scale for v in points.values()]


def test_the_memory_panel_draws_measured_levels_given_in_mib_below_a_gib(interleaved):
    from matplotlib.figure import Figure

    from pipeloom.sim.plot import _draw_memory

    measured = [[(0.0, 0), (1.0, 3 * 2**20), (2.0, 2**19)] for _ in range(interleaved.schedule.pp)]
    ax = Figure().subplots()
    _draw_memory(ax, interleaved, "bytes", measured, "memory allocated")
    assert ax.get_ylabel() == "memory allocated (MiB)"
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[0, 3, 0.5]] * interleaved.schedule.pp


def test_plot_refuses_other_formats(interleaved, tmp_path):
    with pytest.raises(PipeloomError, match=r"\.png or \.svg.*'\.txt'"):
        plot_schedule(interleaved, tmp_path / "schedule.txt")


def test_text_grid_one_line_per_rank_with_the_kind_letters():
    result = simulate(split_backward(build("1f1b", 4, 8)))
    lines = text_grid(result, width=80).splitlines()
    assert len(lines) == 4 + 1
    assert all(line.startswith(f"r{r} ") and len(line) <= 80 for r, line in enumerate(lines[:4]))
    assert all(set(line[3:]) >= {"F", "I", "W"} for line in lines[:4])
    assert lines[0][3:].startswith("F0")  # rank 0 starts at once, with room for the microbatch
    assert lines[3][3:5] == ".."  # rank 3 waits for microbatch 0 to arrive
    assert "F forward" in lines[-1] and "I input grad" in lines[-1] and "W weight grad" in lines[-1]


def test_text_grid_compresses_large_schedules():
    result = simulate(build("1f1b", 16, 128))
    lines = text_grid(result, width=60).splitlines()
    assert len(lines) == 17
    assert all(len(line) <= 60 for line in lines[:16])
    assert set("".join(lines[:16])) <= set("rF B.0123456789")
    assert "B fused backward" in lines[-1]
