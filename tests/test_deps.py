"""asap's compiled timing against a plain longest path over the schedule, under random costs."""

import gc
import random

import pytest

from pipeloom.schedule import Kfac, Offload, build
from pipeloom.schedule import deps as deps_module
from pipeloom.schedule.costs import COST_FIELDS, Costs
from pipeloom.schedule.deps import Dependencies, asap
from pipeloom.schedule.ir import B, F, W
from pipeloom.schedule.kinds import INPUT_RULES, get, register_inputs

CASES = [
    ("1f1b", 4, 8, {}),
    ("interleaved-1f1b", 4, 8, {"chunks": 2}),
    ("zb-h1", 3, 6, {}),
    ("zb-v", 4, 8, {}),
    ("2bw", 3, 6, {"steps": 2}),
    ("dualpipev", 4, 10, {}),
    ("1f1b", 4, 8, {"transforms": [Offload("full")]}),
    ("interleaved-1f1b", 2, 8, {"chunks": 2, "transforms": [Offload("selective", 0.5)]}),
    ("1f1b", 4, 8, {"vocab_parallel": "vocab-1"}),
    ("zb-v", 2, 6, {"vocab_parallel": "vocab-2"}),
    ("1f1b", 3, 6, {"vocab_parallel": "naive", "lowered": True}),
    ("1f1b", 2, 4, {"transforms": [Kfac(units=3)]}),
]


def random_costs(rng: random.Random, schedule) -> Costs:
    """Every registered cost field, one random value per stage (or rank), often 0; shares in [0, 1]."""
    values = {}
    for name, spec in COST_FIELDS.items():
        count = schedule.stages if spec.per == "stage" else schedule.pp
        top = 1.0 if name == "overlap" else 3.0
        values[name] = [rng.uniform(0.5, 2) if name == "f" else rng.choice([0.0, rng.uniform(0.0, top)])
                        for _ in range(count)]
    own = {name: values.pop(name) for name in list(values) if name in Costs.__dataclass_fields__}
    return Costs(**own, extra=values)


def longest_path(schedule, duration, transfer):
    """Each rank's list in order, each action once its inputs have ended: the rules of asap's docstring,
    sweeping the ranks until none can move."""
    deps = Dependencies(schedule)
    ended = {}
    starts = [[None] * len(actions) for actions in schedule.ranks]
    ends = [[None] * len(actions) for actions in schedule.ranks]
    waits = [0.0] * schedule.pp
    pos, clock = [0] * schedule.pp, [0.0] * schedule.pp
    streams = [{} for _ in range(schedule.pp)]
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(schedule.ranks):
            while pos[r] < len(actions):
                action, k = actions[pos[r]], pos[r]
                inputs = deps(action)
                if any(dep not in ended for dep in inputs):
                    break
                arrive = [ended[dep] + transfer(dep) if schedule.rank_of(dep) != r or get(dep.kind).reduced
                          else ended[dep] for dep in inputs]
                stream = get(action.kind).stream
                if stream:
                    start = max([clock[r], streams[r].get(stream, 0.0)] + arrive)
                else:
                    start = max([clock[r]] + [t for dep, t in zip(inputs, arrive) if not get(dep.kind).stream])
                    side = max([0.0] + [t for dep, t in zip(inputs, arrive) if get(dep.kind).stream])
                    if side > start:
                        waits[r] += side - start
                        start = side
                end = start + duration(action)
                if stream:
                    streams[r][stream] = end
                else:
                    clock[r] = end
                starts[r][k], ends[r][k], ended[action] = start, end, end
                pos[r] += 1
                moved = True
    assert pos == [len(actions) for actions in schedule.ranks]
    return starts, ends, waits


@pytest.mark.parametrize("name,pp,m,options", CASES)
def test_compiled_timing_is_the_longest_path(name, pp, m, options):
    rng = random.Random(f"{name}{pp}{m}{sorted(options)}")
    schedule = build(name, pp, m, **options)
    for _ in range(4):  # one compiled program, timed under several costs
        costs = random_costs(rng, schedule).per_stage(schedule.stages, schedule.chunks)
        waits = [0.0] * schedule.pp
        starts, ends = asap(schedule, costs.duration, costs.transfer, waits)
        assert (starts, ends, waits) == longest_path(schedule, costs.duration, costs.transfer)


@pytest.mark.parametrize("name,pp,m,options", CASES)
def test_an_input_rule_adds_only_to_the_kinds_it_declares(name, pp, m, options):
    """A technique's input rules registered with ``kinds`` (asked only for those kinds' actions)
    add nothing to any other action: asking them of every action finds no input left out."""
    schedule = build(name, pp, m, **options)
    deps = Dependencies(schedule)
    declared = [(factory.kinds, rule) for factory in INPUT_RULES if factory.kinds is not None
                and (rule := factory(schedule)) is not None]
    for action in (a for actions in schedule.ranks for a in actions):
        for kinds, rule in declared:
            assert action.kind in kinds or not rule(action, deps), (action, kinds)


def test_a_rule_is_asked_for_the_kinds_it_declares_only():
    """``register_inputs(kinds=...)``: the dependencies ask its rules of those kinds' actions and of
    no other; registered bare, of every action."""
    schedule = build("zb-h1", 2, 4)
    asked = {"some": set(), "every": set()}

    def factory(of):
        return lambda schedule: lambda action, deps: asked[of].add(action.kind) or ()
    added = [register_inputs(kinds=(W,))(factory("some")), register_inputs(factory("every"))]
    try:
        deps = Dependencies(schedule)
        for action in (a for actions in schedule.ranks for a in actions):
            deps(action)
    finally:
        for rule in added:
            INPUT_RULES.remove(rule)
    assert asked == {"some": {W}, "every": {F, B, W}}


def test_the_compiled_program_goes_with_its_schedule():
    schedule = build("1f1b", 2, 4)  # validated: compiled once
    key = id(schedule)
    entry = deps_module._programs[key]
    asap(schedule, lambda action: 1.0)
    assert deps_module._programs[key] is entry
    del schedule, entry
    gc.collect()
    assert key not in deps_module._programs
