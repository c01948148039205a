"""A technique from outside the package: one transform, its kind, one handler; no pipeloom file changes.

The toy transform here inserts a no-op action ``NOOP`` after every forward. Its kind
and cost field are registered here; the simulator, validator, renderers, torch CSV
export and lowering accept it as they are. The last tests plug a whole technique
(tests/toy_technique.py: a flag, a transform and kind, a cost field, a planner
dimension, a runtime handler) into ``pipeloom simulate``, ``plan`` and ``train``; another
takes a keyword of ``Pipeline`` through its runtime part.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeloom.errors import ScheduleError
from pipeloom.schedule import F, Action, Costs, Schedule, build, lower, to_torch_csv, validate
from pipeloom.schedule.costs import register_field
from pipeloom.schedule.kinds import Kind, register
from pipeloom.sim import chrome_trace, plot_schedule, simulate, text_grid

NOOP = "NOOP"


def _after_forward(action, deps):
    return (Action(F, action.stage, action.microbatch),)


register_field("noop")
register(Kind(NOOP, "no-op", needs=_after_forward, cost=("noop",), colour="#17becf", letter="n", torch_csv=False))


class NoopAfterForward:
    name = "no-op after every forward"
    kinds = (NOOP,)
    cost_fields = ("noop",)
    room = 0

    def apply(self, schedule: Schedule, costs) -> Schedule:
        ranks = tuple(tuple(b for a in actions for b in ((a, Action(NOOP, a.stage, a.microbatch)) if a.kind == F
                                                          else (a,)))
                      for actions in schedule.ranks)
        return replace(schedule, ranks=ranks)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b"])
def test_the_toy_transform_builds_validates_and_lowers(name):
    plain = build(name, 4, 8)
    schedule = build(name, 4, 8, transforms=[NoopAfterForward()])
    assert sum(a.kind == NOOP for actions in schedule.ranks for a in actions) == plain.stages * 8
    lowered = build(name, 4, 8, transforms=[NoopAfterForward()], lowered=True)
    assert Schedule.from_json(lowered.to_json()) == lowered
    assert to_torch_csv(schedule) == to_torch_csv(plain)  # torch never sees the no-op


def test_it_composes_with_vocabulary_parallelism():
    schedule = build("1f1b", 4, 8, vocab_parallel="vocab-1", transforms=[NoopAfterForward()])
    kinds = {a.kind for actions in schedule.ranks for a in actions}
    assert {NOOP, "S", "T", "IF"} <= kinds


def test_the_simulator_times_it_by_its_cost_field():
    schedule = build("1f1b", 2, 4, transforms=[NoopAfterForward()])
    free = simulate(schedule, Costs(extra={"noop": 0.0}))
    slow = simulate(schedule, Costs(extra={"noop": 0.5}))
    assert free.makespan == simulate(build("1f1b", 2, 4)).makespan
    assert slow.makespan > free.makespan
    assert Costs.parse("f=1,noop=0.5") == Costs(f=1.0, extra={"noop": 0.5})


def test_the_validator_applies_its_rule():
    schedule = build("1f1b", 2, 2, transforms=[NoopAfterForward()])
    ranks = list(schedule.ranks)
    ranks[0] = (Action(NOOP, 0, 0),) + tuple(a for a in ranks[0] if a != Action(NOOP, 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: action 0NOOP0 \(position 0\) runs before 0F0"):
        validate(replace(schedule, ranks=tuple(ranks)))


def test_the_renderers_draw_it(tmp_path):
    result = simulate(build("1f1b", 2, 4, transforms=[NoopAfterForward()]), Costs(extra={"noop": 1.0}))
    assert "n no-op" in text_grid(result)
    names = {e["name"] for e in chrome_trace(result)["traceEvents"] if e["ph"] == "X"}
    assert "1NOOP3" in names
    plot_schedule(result, tmp_path / "noop.png")
    assert (tmp_path / "noop.png").stat().st_size > 0


def test_lowered_lists_put_it_among_the_sends():
    lowered = lower(build("1f1b", 2, 2, transforms=[NoopAfterForward()]))
    assert [str(a) for a in lowered.ranks[0]][:4] == ["0RECV_B0", "0F0", "0SEND_F0", "0NOOP0"]


def _noop_worker(rank):
    import torch

    from parity import make_batch, max_rel_error, reference
    from pipeloom import Pipeline
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime import handlers

    calls = []

    @handlers.register(NOOP)
    def noop(action, context):
        assert action.stage in context.stages and context.step.slots[action.stage, action.microbatch].output is not None
        calls.append(action.microbatch)

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = Pipeline(GPT(config), build("1f1b", 2, 4, transforms=[NoopAfterForward()]))
    loss = pipe.step(tokens, targets)
    forwards = [a.microbatch for a in pipe.schedule.ranks[pipe.pp_rank] if a.kind == F]
    return abs(loss - ref_loss) / ref_loss, max_rel_error(pipe.gather_grads(), ref_grads), calls, forwards


@pytest.mark.timeout(120)
def test_the_runtime_runs_it_by_its_handler():
    pytest.importorskip("torch")
    from pipeloom.runtime.local import spawn

    for loss_err, grad_err, calls, forwards in spawn(2, _noop_worker, timeout=90):
        assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)
        assert calls == forwards == [0, 1, 2, 3]


def _part_worker(rank):
    import torch

    from parity import make_batch
    from pipeloom import Pipeline
    from pipeloom.errors import PipeloomError
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime.parts import Part
    from pipeloom.techniques import TECHNIQUES, Technique, register

    class Noting(Part):
        """Takes ``note``, notes the hooks it sees and gives them as ``pipe.notes``."""

        keywords = {"note": None}
        exposes = ("notes",)

        def check(self):
            if self.given["note"] == "bad":
                raise PipeloomError("note='bad'")
            self.notes = [self.given["note"]]

        def setup(self, pipe, model):
            self.notes.append("setup")

        def batch(self, tokens, targets):
            self.notes.append("batch")
            return tokens, targets

    class Note(Technique):
        name = "note"

        def runtime_part(self):
            return Noting

    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    with pytest.raises(PipeloomError, match="note"):  # not a keyword of the schedule's build yet
        Pipeline(GPT(config), "1f1b", pp=1, microbatches=2, note="hello")
    register(Note())
    try:
        with pytest.raises(PipeloomError, match="note='bad'"):
            Pipeline(GPT(config), "1f1b", pp=1, microbatches=2, note="bad")
        pipe = Pipeline(GPT(config), "1f1b", pp=1, microbatches=2, note="hello")
        pipe.step(*make_batch(config, 4, 8))
        return pipe.notes
    finally:
        del TECHNIQUES["note"]


@pytest.mark.timeout(120)
def test_a_plugged_technique_adds_its_part_to_the_pipeline():
    pytest.importorskip("torch")
    from pipeloom.runtime.local import spawn

    assert spawn(1, _part_worker, timeout=90) == [["hello", "setup", "batch"]]


def test_a_kind_without_a_handler_is_named():
    pytest.importorskip("torch")
    from pipeloom.errors import PipeloomError
    from pipeloom.runtime.executor import Executor

    with pytest.raises(PipeloomError, match=r"action 0UNKNOWN1: no runtime handler for kind 'UNKNOWN'; "
                                            r"registered kinds: B, BW, .*, F, .*, W, Z \(add one with "):
        Executor(None, [Action(F, 0, 1), Action("UNKNOWN", 0, 1)])


# -- a whole technique from outside the package, through every command -------------------------------------

def _pipeloom(*args, timeout=200):
    """``pipeloom ARGS`` with the toy technique (tests/toy_technique.py) plugged in."""
    env = {**os.environ, "PIPELOOM_PLUGINS": "toy_technique", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pipeloom", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_simulate_takes_a_plugged_technique():
    flags = ("simulate", "--model", "tiny", "--pp", "2", "--json")
    plain, toy = (json.loads(_pipeloom(*flags, *more).stdout) for more in ((), ("--toy-ms", "0.5")))
    assert toy["toy"] == {"no_ops": 2 * 4}  # one per forward: 2 stages x 4 microbatches
    assert toy["makespan"] > plain["makespan"] and "toy" not in plain
    assert "toy: 8 no-ops" in _pipeloom("simulate", "--model", "tiny", "--toy-ms", "0.5").stdout


def test_plan_searches_a_plugged_dimension():
    found = json.loads(_pipeloom("plan", "--model", "gpt-125m", "--seq", "256", "--gpus", "2", "--global-batch", "8",
                                 "--schedules", "1f1b", "--recompute", "none", "--vocab-parallel", "none",
                                 "--hardware", "cpu", "--top", "40", "--json").stdout)
    by_toy = {}
    for plan in found["plans"]:
        spec = plan["spec"]
        layout = tuple(spec[k] for k in ("pp", "dp", "microbatch_size"))
        by_toy.setdefault(dict(map(tuple, spec["options"]))["toy_ms"], {})[layout] = plan
    assert set(by_toy) == {0.0, 0.5}
    assert found["plans"][0]["spec"]["options"] == [["toy_ms", 0.0]]  # a no-op only costs time
    shared = set(by_toy[0.0]) & set(by_toy[0.5])
    assert shared and all(by_toy[0.5][k]["step_ms"] > by_toy[0.0][k]["step_ms"] for k in shared)
    assert any("--toy-ms 0.5" in plan["command"] for plan in found["plans"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_train_runs_a_plugged_technique(tmp_path):
    flags = ("--seq", "32", "--toy-ms", "0.5")
    shown = json.loads(_pipeloom("train", *flags, "--dry-run", "--json").stdout)
    assert shown["toy"] == {"no_ops": 8}
    done = _pipeloom("train", *flags, "--steps", "2", "--metrics", str(tmp_path / "m.jsonl"))
    assert f"schedule sha256 {shown['schedule_digest']} (every rank's)" in done.stderr and ", toy 0.5 ms" in done.stderr
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
