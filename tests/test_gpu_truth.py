"""The simulator and the planner against what a GPU measured (``bench/results/gpu/*.json``, written by
``bench/gpu_truth.py``; its README says how each was made): peak memory per rank within 10% with the
GPU's own profile, within 15% from the formulas. CI has no GPU: these keep the predictions honest
without one. K-FAC's rows are checked against the simulator on the schedule each run had. Offload's rows
are checked on their measured timelines (:data:`OFFLOAD_TRACES`): their peak depends on whether a copy to
host ends before the next forward starts, which the profile's times do not predict for this host-bound
model (the runtime's forwards ran 31 ms against the profile's 17), so what is checked is the simulator's
memory accounting of the copies (device memory freed when a copy to host ends, taken when a copy back
starts) on the times the run had; with the profile's times the prediction is 11.5% over (issue 32)."""

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kfac_late import curvature_late
from pipeloom.builder import Priced, build_run
from pipeloom.cli import _parser
from pipeloom.cli.flags import spec_of
from pipeloom.plan import Cluster, Costing, PlanRequest
from pipeloom.plan.command import candidate_of
from pipeloom.sim import Result, simulate
from pipeloom.sim.formulas import KFAC_STATE_COPIES, kfac_factor_bytes
from pipeloom.sim.memory import peak_memory_bytes
from pipeloom.sim.profile import Profile
from pipeloom.sim.specs import get_model

ROOT = Path(__file__).resolve().parent.parent
TRUTHS = {path.stem: json.loads(path.read_text())
          for path in sorted((ROOT / "bench" / "results" / "gpu").glob("*.json"))
          if json.loads(path.read_text()).get("benchmark") == "gpu_truth"}
ROWS = [(gpu, row) for gpu, truth in TRUTHS.items() for row in truth["rows"] if "--offload" not in row["flags"]]
KFAC = [(gpu, row) for gpu, row in ROWS if "kfac" in row["flags"]]
ROWS = [(gpu, row) for gpu, row in ROWS if "kfac" not in row["flags"]]
IDS = [f"{gpu} {row['model']} {row['flags']}" for gpu, row in ROWS]


def test_there_is_gpu_truth():
    assert len(ROWS) >= 5


def _planned_gib(truth: dict, row: dict, profiled: bool) -> float:
    c = candidate_of(spec_of(_parser().parse_args(["train", "--seq", str(truth["seq"]), *shlex.split(row["flags"])])))
    request = PlanRequest(dataclasses.replace(get_model(row["model"]), vocab=truth["vocab"]), truth["seq"],
                          c.microbatch_size * c.microbatches, Cluster.of("h100", 1),
                          profile=Profile.from_dict(truth["profile"]) if profiled else None)
    return Costing(request).evaluate(c).peak_memory_bytes[0] / 2**30


@pytest.mark.parametrize("gpu,row", ROWS, ids=IDS)
def test_planner_peak_within_10_percent_with_the_gpus_profile_15_from_formulas(gpu, row):
    truth, measured = TRUTHS[gpu], row["measured_peak_gib"]
    if row["model"] == truth["profile"]["model"]["name"]:
        assert abs(_planned_gib(truth, row, True) / measured - 1) <= 0.10
    assert abs(_planned_gib(truth, row, False) / measured - 1) <= 0.15


def _simulated_gib(tmp_path, truth: dict, row: dict, profiled: bool) -> float:
    flags = shlex.split(row["flags"])
    if "--steps" in flags:  # how long train ran: not the simulator's
        at = flags.index("--steps")
        del flags[at:at + 2]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(truth["profile"]))
    done = subprocess.run([sys.executable, "-m", "pipeloom", "simulate", "--model", row["model"], "--vocab",
                           str(truth["vocab"]), "--seq", str(truth["seq"]), "--device", "cuda",
                           *(("--profile", str(profile)) if profiled else ()),
                           *flags, "--json"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["peak_memory_bytes"][0] / 2**30


#: Commits whose K-FAC rows ran train without the profile, its pieces placed by the formulas (the H100
#: file's note: the first call's rows); the others' train took the profile.
PLACED_BY_FORMULAS = {"1649795"}
#: Commits before cd1b363, whose runs held every capture for the curvature that fits no bubble till the end
#: of the refresh cycle; later runs do that curvature right after its producer, as the schedule places it.
CURVATURE_LATE = {"1649795", "b4b7b8f", "58dcab0"}


def _kfac_as_run_gib(tmp_path, truth: dict, row: dict) -> float:
    """The peak ``simulate`` predicts for a K-FAC row's run as it ran, placed by the costs train had: the rows
    of :data:`CURVATURE_LATE` ran the curvature that fits no bubble at the end of the refresh cycle, each
    capture held till then (``curvature_late``), later ones as the schedule places it; a run of one cycle (``--steps`` at most k) measured the first refresh,
    whose captures wait without factors or inverses of an earlier one (pp 1: one rank holds every layer)."""
    flags = shlex.split(row["flags"])
    at = flags.index("--steps")
    steps = int(flags.pop(at + 1))
    del flags[at]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(truth["profile"]))
    commit = row.get("commit", truth.get("commit"))
    profiled = commit not in PLACED_BY_FORMULAS
    spec = spec_of(_parser().parse_args(["simulate", "--model", row["model"], "--vocab", str(truth["vocab"]), "--seq",
                                         str(truth["seq"]), "--device", "cuda",
                                         *(("--profile", str(profile)) if profiled else ()), *flags]))
    priced = Priced(spec)
    schedule = build_run(spec, priced.costs)
    assert schedule.pp == 1
    state = ({"bytes_per_param": priced.profile.bytes_per_param,
              "cast_bytes_per_param": priced.profile.cast_bytes_per_param} if profiled else {})
    ran = curvature_late(schedule) if commit in CURVATURE_LATE else schedule
    peak = peak_memory_bytes(priced.model, simulate(ran, priced.costs), spec.seq,
                             microbatch_size=spec.microbatch_size, **state)[0]
    if steps <= schedule.options["kfac"]["every"]:
        peak -= (KFAC_STATE_COPIES - 1) * priced.model.layers * sum(a + g for a, g in kfac_factor_bytes(priced.model))
    return peak / 2**30


@pytest.mark.parametrize("gpu,row", KFAC, ids=[f"{gpu} {row['model']} {row['flags']}" for gpu, row in KFAC])
def test_simulated_kfac_peak_within_10_percent(tmp_path, gpu, row):
    """K-FAC's factors, inverses, the refresh's sums or new inverses, and the captures waiting for their
    curvature, for the schedule the row's run had (:func:`_kfac_as_run_gib`)."""
    assert abs(_kfac_as_run_gib(tmp_path, TRUTHS[gpu], row) / row["measured_peak_gib"] - 1) <= 0.10


#: The measured timelines of offload rows (``pipeloom train --trace``, kept under bench/results/gpu/): file ->
#: (truth file, the row's flags, its commit where the row names one).
OFFLOAD_TRACES = {
    "h200-trace-gpt350m-gpipe-8x2-offload-full.json":
        ("nvidia-h200", "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload full", None),
    "h200-trace-gpt350m-gpipe-8x2-offload-selective.json":
        ("nvidia-h200", "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload selective "
                        "--offload-ratio 0.5", None),
    "h200-trace-gpt350m-gpipe-8x2-offload-full-f973110.json":
        ("nvidia-h200", "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload full", "f973110"),
}


@pytest.mark.parametrize("trace", sorted(OFFLOAD_TRACES))
def test_offloaded_peak_on_the_runs_own_timeline_within_10_percent(tmp_path, trace):
    """The schedule the run had (built with the profile it trained with) is what its trace shows, action for
    action, and the simulator's memory accounting on the trace's start and end times gives the measured peak."""
    gpu, flags, commit = OFFLOAD_TRACES[trace]
    truth = TRUTHS[gpu]
    row = next(r for r in truth["rows"] if r["flags"] == flags and r.get("commit") == commit)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(truth["profile"]))
    spec = spec_of(_parser().parse_args(["simulate", "--model", row["model"], "--vocab", str(truth["vocab"]), "--seq",
                                         str(truth["seq"]), "--device", "cuda", "--profile", str(profile),
                                         *shlex.split(flags)]))
    priced = Priced(spec)
    schedule = build_run(priced.spec, priced.costs)
    events = {(e["args"]["kind"], e["args"]["stage"], e["args"]["microbatch"]): (e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3)
              for e in json.loads((ROOT / "bench" / "results" / "gpu" / trace).read_text())["traceEvents"]
              if e["ph"] == "X"}
    actions = schedule.ranks[0]
    assert schedule.pp == 1 and sorted(events) == sorted((a.kind, a.stage, a.microbatch) for a in actions)
    starts, ends = zip(*(events[a.kind, a.stage, a.microbatch] for a in actions))
    measured = Result.from_times(schedule, priced.costs.per_stage(schedule.stages, schedule.chunks), [list(starts)],
                                 [list(ends)])
    peak = peak_memory_bytes(priced.model, measured, spec.seq, microbatch_size=spec.microbatch_size,
                             bytes_per_param=priced.profile.bytes_per_param,
                             cast_bytes_per_param=priced.profile.cast_bytes_per_param)[0]
    assert abs(peak / 2**30 / row["measured_peak_gib"] - 1) <= 0.10


@pytest.mark.parametrize("gpu,row", [ROWS[0]], ids=IDS[:1])
def test_simulate_says_the_planners_peak(tmp_path, gpu, row):
    assert _simulated_gib(tmp_path, TRUTHS[gpu], row, True) == pytest.approx(_planned_gib(TRUTHS[gpu], row, True),
                                                                                 rel=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_script_runs_here_quick(tmp_path):
    """``bench/gpu_truth.py --quick`` (the tiny model on this CPU) writes rows the checks above read."""
    out = tmp_path / "cpu.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_truth.py"), "--quick", "--steps", "3", "--out", str(out)],
                   check=True, capture_output=True, timeout=280, cwd=tmp_path)
    written = json.loads(out.read_text())
    assert written["benchmark"] == "gpu_truth" and Profile.from_dict(written["profile"]).model.vocab == 256
    assert [row["flags"] for row in written["rows"]] and all(
        row["measured_step_ms"] > 0 and row["predicted_peak_gib"] > 0 for row in written["rows"])
