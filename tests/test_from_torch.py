"""torch.distributed.pipelining's schedules imported: torch's own orders, the round trip of every family
through torch's CSV, the runtime against the one-process model, the command line, the refusals."""

import json
import subprocess
import sys
import types
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.pipelining import schedules  # noqa: E402

from parity import check, parity_worker  # noqa: E402
from pipeloom.cli import main  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.schedule import FAMILIES, TORCH_SCHEDULES, build, from_torch, write_torch_csv  # noqa: E402

#: Torch's classes whose order is a pipeloom family's, action for action.
SAME = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved-1f1b",
        "ScheduleDualPipeV": "dualpipev"}


def torch_order(name, pp, microbatches):
    """Torch's ``pipeline_order`` of class ``name`` (2 stages per rank for the multi-stage ones), its
    compute actions' strings per rank, and the class built (for its ``_dump_csv``)."""
    cls = getattr(schedules, name)
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    stages = [types.SimpleNamespace(num_stages=pp * (1 if single else 2), group_size=pp, group_rank=0, submod=None)
              for _ in range(1 if single else 2)]
    built = cls(stages[0] if single else stages, microbatches)
    order = [[str(a) for a in built.pipeline_order[r] if a is not None and a.is_compute_op] for r in range(pp)]
    return order, built


def sizes(pp):
    return sorted({pp, pp + 1, 2 * pp, 3 * pp})


@pytest.mark.parametrize("name", TORCH_SCHEDULES)
def test_each_rank_runs_torchs_order(name, tmp_path):
    """p = 2..8: the imported lists are torch's pipeline_order, action for action (1F1B's last rank:
    torch's drawn order runs F1..Fm, not what its _step_microbatches runs); a lowered CSV of the
    multi-stage classes (sends, receives, unshards, reshards, gradient reductions) imports the same."""
    tried = 0
    for pp in range(2, 9):
        for m in sizes(pp):
            try:
                ours = from_torch(name, pp, m)
            except PipeloomError as err:
                assert "refuses" in str(err)
                continue
            tried += 1
            order, built = torch_order(name, pp, m)
            got = [[str(a) for a in actions] for actions in ours.ranks]
            if name == "Schedule1F1B":  # torch draws every forward of the last rank one microbatch late
                got[-1] = [str(a._replace(microbatch=a.microbatch + (a.kind == "F"))) for a in ours.ranks[-1]]
            assert got == order, (pp, m)
            assert ours.family == f"torch:{name}" and ours.microbatches == m and ours.pp == pp
            if name in SAME:
                assert replace(ours, family=SAME[name]) == build(SAME[name], pp, m, ours.chunks)
            if not isinstance(built, schedules.PipelineScheduleSingle):
                path = tmp_path / f"{name}-{pp}-{m}.csv"
                built._dump_csv(str(path))
                assert from_torch(path, pp, m).ranks == ours.ranks
    assert tried >= 7 * 2  # two sizes or more per pp


def test_the_kinds_map_and_placement_is_inferred(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text("0F0,0F1,,3F0,3I0,3W0,(3F1;0B0)OVERLAP_F_B,3B1,0I1,0W1\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n")
    schedule = from_torch(str(path), 2, 2)
    assert schedule.placement == (0, 1, 1, 0)  # a V, read from where each stage runs
    assert [a.kind for a in schedule.ranks[0]] == ["F", "F", "F", "B", "W", "OVERLAP_F_B", "BW", "B", "W"]
    assert [a.kind for a in schedule.ranks[1]] == ["F", "F", "F", "F", "BW", "BW", "BW", "BW"]
    assert schedule.family == f"torch:{path}"
    interleaved = from_torch("interleaved1f1b", 4, 8, chunks=3)  # torch's short name, any case
    assert interleaved.placement == tuple(s % 4 for s in range(12))


def first_that_builds(name, pp, chunks):
    for m in (2 * pp, pp, 3 * pp, 4 * pp):
        try:
            return build(name, pp, m, chunks)
        except PipeloomError:
            continue
    return None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_round_trips_through_torchs_csv(name, tmp_path):
    """to_torch_csv then from_torch gives the schedule back; 2bw's lists too, but its steps and weight
    versions are pipeloom's alone (torch's CSV holds one step of total_microbatches microbatches)."""
    chunk_counts = [None] if FAMILIES[name].chunks is not None else [2, 3]
    built = [first_that_builds(name, pp, chunks) for pp in (2, 3, 4) for chunks in chunk_counts]
    assert all(built)
    for schedule in built:
        path = tmp_path / f"{name}-{schedule.pp}-{schedule.chunks}.csv"
        write_torch_csv(schedule, path)
        back = from_torch(path, schedule.pp, schedule.total_microbatches)
        if schedule.steps == 1:
            assert replace(back, family=name) == schedule
        else:
            assert (back.ranks, back.placement) == (schedule.ranks, schedule.placement)


@pytest.mark.parametrize("source,args,message", [
    ("ScheduleNope", (4, 8), "unknown torch schedule 'ScheduleNope'; torch's schedules: ScheduleGPipe, Schedule1F1B"),
    ("ScheduleInterleaved1F1B", (4, 9), "torch's ScheduleInterleaved1F1B refuses pp=4 microbatches=9 chunks=2: "
     "Interleaved 1F1B requires the number of microbatches to be a multiple of the number of rounds (2), but got 9; "
     "microbatches=8 fits"),
    ("ScheduleDualPipeV", (4, 6), "DualPipeV requires at least as many microbatches as stages, but got 6 microbatches "
     "and 8 stages; microbatches=8 fits"),
    ("Schedule1F1B", (4, 2), "must be greater than or equal to the number of stages (4); microbatches=4 fits"),
    ("ScheduleZBVZeroBubble", (4, 8, 3), "refuses pp=4 microbatches=8 chunks=3: ZBV requires exactly 2 stages per rank"),
    ("ScheduleGPipe", (4, 8, 2), "ScheduleGPipe holds one stage per rank; chunks=2 does not fit: use chunks=1"),
    ("ScheduleGPipe", (0, 8), "pp=0: must be a whole number >= 1"),
    (int, (4, 8), "int is not a torch.distributed.pipelining schedule class"),
])
def test_refusals_name_the_value_and_what_fits(source, args, message):
    with pytest.raises(PipeloomError) as err:
        from_torch(source, *args)
    assert message in str(err.value)


@pytest.mark.parametrize("text,args,message", [
    ("0F0,0Q0\n", (1, 1), "rank 0: unknown action kind 'Q'"),
    ("0F0,0B0,0X\n", (1, 1), "rank 0: cannot read action '0X'"),
    ("0F0,0S0\n", (1, 1), "action 0S0 (kind S) is no torch action"),
    ("0F0,1F0\n1B0,0B0\n", (2, 1), "stage 1 runs on ranks 0 and 1; a stage belongs to one rank"),
    ("0F0,0B0\n2F0,2B0\n", (2, 1), "stage 1 has no action"),
    ("\n\n", (2, 1), "no action; a line per rank lists its actions, such as 0F0,0F1,0B0,0B1"),
    ("0F0,0B0\n1F0,1B0\n", (4, 1), "holds pp=2; pp=4 does not fit"),
    ("0F0,0B0\n1F0,1B0\n", (2, 3), "holds microbatches=1; microbatches=3 does not fit"),
    ("0F0,0B0\n1F0\n", (2, 1), "rank 1: the backward of stage 1 microbatch 0 is missing"),
])
def test_a_bad_csv_is_one_clear_error(text, args, message, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PipeloomError) as err:
        from_torch(str(path), *args)
    assert f"torch:{path}" in str(err.value) and message in str(err.value)


def test_reading_a_csv_needs_no_torch(tmp_path):
    path = tmp_path / "zbv.csv"
    write_torch_csv(build("zb-v", 2, 4), path)
    code = ("import sys; sys.modules['torch'] = None; from pipeloom.schedule import build; "
            f"assert build('torch:{path}', 2, 4).chunks == 2")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.timeout(120)
def test_torch_schedules_run_and_match_one_process():
    """Torch's interleaved 1F1B and ZB-V at pp=2, m=4 in pipeloom's runtime: the one-process loss and gradients."""
    names = ["torch:ScheduleInterleaved1F1B", "torch:ScheduleZBVZeroBubble"]
    check(spawn(2, parity_worker, [(n, dict(schedule=n, pp=2, microbatches=4)) for n in names], {}, 8, 16, timeout=90))


def test_simulate_a_torch_schedule_and_compare_it(capsys, tmp_path):
    costs = ["--costs", "f=18.522,b=18.086,w=9.337,comm=0.601", "--pp", "4", "--microbatches", "8"]
    assert main(["simulate", "--torch-schedule", "ScheduleInterleavedZeroBubble", *costs, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"] == "torch:ScheduleInterleavedZeroBubble" and out["stages"] == 8
    assert main(["simulate", "--torch-schedule", "ScheduleInterleavedZeroBubble", *costs]) == 0
    assert "r3 " in capsys.readouterr().out  # the text grid
    trace, csv = tmp_path / "t.json", tmp_path / "s.csv"
    assert main(["simulate", "--compare", "1f1b,zb-v,torch:ScheduleZBVZeroBubble", *costs, "--trace", str(trace),
                 "--torch-csv", str(csv), "--plot", str(tmp_path / "c.svg"), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)["compare"]
    assert [r["schedule"] for r in reports] == ["1f1b", "zb-v", "torch:ScheduleZBVZeroBubble"]
    assert (tmp_path / "t-torch-ScheduleZBVZeroBubble.json").exists() and (tmp_path / "c.svg").exists()
    exported = tmp_path / "s-zb-v.csv"  # zb-v exported, then simulated from its CSV: the same makespan
    assert main(["simulate", "--schedule", f"torch:{exported}", *costs, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] == reports[1]["makespan"]


@pytest.mark.parametrize("args,message", [
    (["--torch-schedule", "Nope"], "unknown torch schedule 'Nope'"),
    (["--torch-schedule", "ScheduleGPipe", "--compare", "1f1b"], "name it there as torch:ScheduleGPipe"),
    (["--torch-schedule", "ScheduleDualPipeV", "--pp", "4", "--microbatches", "6"], "microbatches=8 fits"),
    (["--schedule", "nope"], "or torch:NAME: one of torch's schedule classes, or a CSV torch wrote"),
])
def test_simulate_refusals_are_one_line(args, message, capsys):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
