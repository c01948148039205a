"""What really happened in a step: the measured timeline, its trace, and measured costs.

The runtime records every action's start and end (seconds from the start of
the step, per rank). Gathered over the pipeline, they become simulator
:class:`~pipeloom.sim.Event` lists in milliseconds, so a measured step is
written in the simulator's Chrome trace format and its per-stage times can be
fed back to :func:`pipeloom.sim.simulate`.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean, median

import torch.distributed as dist

from ..schedule import BW, B, F, W, Costs
from ..schedule.transforms.vocab import IB, IF, C, S, T
from ..schedule.costs import COST_FIELDS
from ..schedule.deps import Dependencies
from ..schedule.kinds import KINDS
from ..sim import Event, Result
from ..sim.trace import chrome_trace_events, transfers_of
from .handlers.compute import WEIGHTS_IN_B


def gather_timeline(pipe, cycle: bool = False) -> list[list[Event]]:
    """Every pipeline rank's events of the last step (ms), on every rank; ``cycle``: of the
    calls of the last whole cycle of the schedule (a K-FAC refresh: every call of it, its
    actions numbered as the schedule numbers them, :meth:`~.pipeline.Pipeline.in_cycle`)."""
    return gather_measured(pipe, cycle)[0]


def gather_measured(pipe, cycle: bool = False) -> tuple[list[list[Event]], list[list[tuple[float, int]]]]:
    """:func:`gather_timeline`'s events, and each rank's memory levels where its steps read them
    (:attr:`~.pipeline.Pipeline.record_memory`): (ms, bytes above the start of its first call), at
    the start of each call, then after each action, at the action's end, in time order."""
    steps = pipe.last_cycle if cycle else pipe.last_step and [pipe.last_step]
    if steps is None:
        raise RuntimeError(f"no {f'whole cycle of {pipe.cycle} calls' if cycle else 'step'} has run yet")
    mine = [(step.wall_start, [(t.action, 1e3 * t.start, 1e3 * t.end) for t in step.timeline], step.levels,
             step.clock.base) for step in steps]
    parts: list = [None] * pipe.pp
    dist.all_gather_object(parts, mine, group=pipe.pp_group)
    origin = min(wall for calls in parts for wall, *_ in calls)
    events, memory = [], []
    for rank, calls in enumerate(parts):
        events.append([])
        levels = []
        for call, (wall, actions, read, base) in enumerate(calls):
            shift = 1e3 * (wall - origin)
            timed = [Event(rank, pipe.in_cycle(a, call) if cycle else a, s + shift, e + shift) for a, s, e in actions]
            events[-1] += timed
            if read:
                held = base - calls[0][3]  # what this call started with above the first call's start
                levels += [(shift, held), *((event.end, held + level) for event, level in zip(timed, read))]
        memory.append(sorted(levels, key=lambda point: point[0]))
    return events, memory


#: Vocabulary passes and the cost field their measured duration gives (the
#: collective C's duration holds its wait: it becomes the collective's time).
_VOCAB_FIELDS = {S: "s", T: "t", IF: "e_f", IB: "e_b", C: "c"}
_FIELDS = ("f", "b", "w", "comm", *_VOCAB_FIELDS.values())


def measured_costs(events: list[list[Event]], schedule) -> Costs:
    """Per-stage costs (ms) from a measured timeline: the median duration of each
    kind per stage (a fused BW counts as B, with W = 0), per rank for the
    vocabulary passes, and, for T_comm, the median wait of a consumer that sat
    idle for an input from another rank; a technique's other timed kinds of one
    cost field (K-FAC's pieces) their mean per stage, in that field."""
    durations: dict[tuple[str, int], list[float]] = {}
    for rank_events in events:
        for ev in rank_events:
            kind = B if ev.action.kind == BW else ev.action.kind
            durations.setdefault((kind, ev.action.stage), []).append(ev.end - ev.start)

    def each(kind: str, n: int, of=median) -> list[float]:
        return [of(durations.get((kind, s), [0.0])) for s in range(n)]

    vocab = {field: each(kind, schedule.pp) for kind, field in _VOCAB_FIELDS.items()}
    others = {KINDS[kind].cost[0]: each(kind, schedule.stages, fmean) for kind in {k for k, _ in durations}
              if kind not in (F, B, W) and len(KINDS[kind].cost) == 1 and not KINDS[kind].stream
              and COST_FIELDS[KINDS[kind].cost[0]].per == "stage"}
    return Costs(f=each(F, schedule.stages), b=each(B, schedule.stages), w=each(W, schedule.stages),
                 comm=[_comm_wait(events, schedule)] * schedule.stages, **vocab, extra=others)


def median_costs(measured: list[Costs]) -> Costs:
    """The per-stage median of several steps' :func:`measured_costs`."""
    def of(values):
        return [median(c) for c in zip(*values)]

    return Costs(**{k: of(getattr(m, k) for m in measured) for k in _FIELDS},
                 extra={k: of(m.extra[k] for m in measured) for k in measured[0].extra})


def full_stage_costs(costs: Costs, schedule) -> Costs:
    """Per-stage costs folded into one full stage (the mean over ranks of a rank's
    stages summed), for simulating other families with other chunk counts."""
    def fold(values):
        return sum(values) / schedule.pp

    return Costs(f=fold(costs.f), b=fold(costs.b), w=fold(costs.w), comm=median(costs.comm),
                 **{k: median(getattr(costs, k)) for k in _VOCAB_FIELDS.values()})


def measured_result(events: list[list[Event]], schedule) -> Result:
    """The measured step as a simulator :class:`~pipeloom.sim.Result` (ms from its first
    action's start: :func:`first_start`), with the simulator's bubble rate and memory, to compare or draw."""
    origin = first_start(events)
    costs = measured_costs(events, schedule).per_stage(schedule.stages, schedule.chunks)
    return Result.from_times(schedule, costs, [[e.start - origin for e in evs] for evs in events],
                             [[e.end - origin for e in evs] for evs in events])


def first_start(events: list[list[Event]]) -> float:
    """When the first action of a measured step started (ms, on its gathered clock)."""
    return min(e.start for evs in events for e in evs)


def _comm_wait(events: list[list[Event]], schedule) -> float:
    deps = Dependencies(schedule)
    end = {ev.action: ev.end for rank_events in events for ev in rank_events}
    waits = []
    for rank_events in events:
        previous_end = 0.0
        for ev in rank_events:
            for dep in deps(ev.action):
                if schedule.rank_of(dep) != ev.rank and end[dep] >= previous_end:
                    waits.append(max(0.0, ev.start - end[dep]))
            previous_end = ev.end
    return median(waits) if waits else 0.0


#: The measured trace's memory counter, and what it counts (``otherData["memory"]``).
MEMORY_COUNTER = "memory allocated"
MEMORY_NOTE = ("bytes held above the start of the step (of a cycle's first call), read after each action is "
               "launched and drawn at its end: the caching allocator's allocated bytes on a GPU, the resident set "
               "on a CPU (which follows the live tensors with glibc's MALLOC_MMAP_THRESHOLD_=65536)")


def write_trace(pipe, path: str | Path, cycle: bool = False) -> None:
    """Write the last step's measured timeline (``cycle``: the last whole cycle's, :func:`gather_timeline`)
    as a Chrome trace (global rank 0 writes; every pipeline rank must call this), with each rank's
    :data:`MEMORY_COUNTER` where its steps read it (:attr:`~.pipeline.Pipeline.record_memory`). With split B
    and W, ``otherData["weight_grads_in_B"]`` names, per stage, the module types whose weight
    gradients B computed rather than W (:data:`~pipeloom.runtime.handlers.compute.WEIGHTS_IN_B`)."""
    events, memory = gather_measured(pipe, cycle)
    schedule = pipe.schedule
    notes: list = [None] * pipe.pp
    dist.all_gather_object(notes, pipe.context.extras.get(WEIGHTS_IN_B, {}), group=pipe.pp_group)
    in_b = {f"stage {s}": kinds for part in notes for s, kinds in sorted(part.items())}
    costs = measured_costs(events, schedule)
    transfers = transfers_of(schedule, events, lambda producer: costs.comm[producer.stage])
    read = any(memory)
    doc = chrome_trace_events(
        events, [schedule.stages_of(r) for r in range(schedule.pp)], transfers=transfers,
        memory=memory if read else None, memory_unit="bytes", memory_name=MEMORY_COUNTER,
        metadata={"source": "measured", "family": schedule.family, "pp": schedule.pp, "dp": pipe.dp,
                  "microbatches": schedule.microbatches, "note": "measured on the runtime; times in ms",
                  **({"memory": MEMORY_NOTE} if read else {}), **({"weight_grads_in_B": in_b} if in_b else {})},
    )
    if dist.get_rank() == 0:
        import json

        Path(path).write_text(json.dumps(doc))
