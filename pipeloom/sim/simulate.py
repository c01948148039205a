"""The event simulator: time and memory of a schedule under given costs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import itemgetter, sub
from typing import NamedTuple

from ..errors import PipeloomError
from ..schedule.costs import Costs, StageCosts
from ..schedule.deps import asap
from ..schedule.ir import Action, Schedule, parts
from ..schedule.kinds import COMPOUND, KINDS

_NOISE = 1e-9  # relative to the step: a wait for a side stream shorter than that is rounding


class Event(NamedTuple):
    """One action as it ran (or would run): on ``rank`` from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class RankStats:
    """One rank's time: ``busy`` computing, ``idle`` between its first action's
    start and its last one's end (``span``), in a step of ``makespan``;
    ``peak_activation`` and ``peak_host`` memory; ``exposed``: the time its
    compute waited for side-stream work (host copies) it needed."""

    busy: float
    idle: float
    span: float
    peak_activation: float
    makespan: float
    peak_host: float = 0.0
    exposed: float = 0.0

    @property
    def bubble_rate(self) -> float:
        """Idle share of the rank's own span (the zero-bubble paper's steady-state measure)."""
        return self.idle / self.span if self.span > 0 else 0.0

    @property
    def step_bubble_rate(self) -> float:
        """Idle share of the whole step, (makespan - busy) / makespan: waits before
        the rank's first action and after its last count too."""
        return (self.makespan - self.busy) / self.makespan if self.makespan > 0 else 0.0


@dataclass(frozen=True)
class Result:
    """What the simulator predicts for one schedule under one set of costs.

    ``bubble_rate`` is the largest over ranks of (span - busy) / span, the span
    running from the start of a rank's first action to the end of its last;
    ``step_bubble_rate`` is the idle share of the whole step, (makespan - busy)
    / makespan, over all ranks (their mean, as every rank's step is the makespan).
    Busy time counts the compute stream only: side-stream actions (host
    copies) overlap it. Activation memory is in the unit of ``Costs.m_b`` (M_B
    of a full stage) and includes the vocabulary passes' buffers
    (``Costs.m_v``, from S to T); an action's rise counts from its start,
    its fall from its end.
    """

    schedule: Schedule
    costs: StageCosts
    makespan: float
    bubble_rate: float
    ranks: list[RankStats]
    starts: list[list[float]] = field(repr=False)
    ends: list[list[float]] = field(repr=False)
    #: per rank, its :meth:`memory_timeline` as :meth:`from_times` worked it out (None: worked out when asked)
    timelines: list[list[tuple[float, float]]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_times(cls, schedule: Schedule, costs: StageCosts, starts, ends, exposed=None) -> Result:
        """The result of running every action of ``schedule`` from ``starts`` to ``ends``
        (per rank, in list order): simulated, or measured on the runtime;
        ``exposed``: per rank, the time compute waited for side streams."""
        makespan = max((max(e) for e in ends if e), default=0.0)
        present = set(map(itemgetter(0), chain.from_iterable(schedule.ranks)))  # the kinds it holds
        side = frozenset(name for name, kind in KINDS.items() if kind.stream and name in present)
        hosted = frozenset(name for name, kind in KINDS.items() if kind.host and name in present)
        stats, timelines = [], []
        for rank, actions in enumerate(schedule.ranks):
            times = list(zip(actions, starts[rank], ends[rank]))
            if side:
                compute = [(s, e) for a, s, e in times if a.kind not in side]
                busy = sum(e - s for s, e in compute)
                span = compute[-1][1] - compute[0][0] if compute else 0.0
            else:
                busy = sum(map(sub, ends[rank], starts[rank]))  # the same sum, in the same order
                span = ends[rank][-1] - starts[rank][0] if actions else 0.0
            host = [t for t in times if t[0].kind in hosted] if hosted else []
            timelines.append(_levels(times, costs.memory_delta))
            stats.append(RankStats(
                busy=busy, idle=span - busy, span=span, makespan=makespan,
                peak_activation=max(level for _, level in timelines[-1]),
                peak_host=max(level for _, level in _levels(host, costs.host_delta)),
                exposed=exposed[rank] if exposed else 0.0,
            ))
        bubble = max((s.bubble_rate for s in stats), default=0.0)
        return cls(schedule, costs, makespan, bubble, stats, starts, ends, timelines)

    @cached_property
    def events(self) -> list[list[Event]]:
        """Every action as an :class:`Event`, per rank in list order."""
        return [
            [Event(rank, a, s, e) for a, s, e in zip(actions, self.starts[rank], self.ends[rank])]
            for rank, actions in enumerate(self.schedule.ranks)
        ]

    @property
    def step_bubble_rate(self) -> float:
        return sum(r.step_bubble_rate for r in self.ranks) / len(self.ranks) if self.ranks else 0.0

    @property
    def peak_activation(self) -> list[float]:
        return [r.peak_activation for r in self.ranks]

    @property
    def peak_host(self) -> list[float]:
        return [r.peak_host for r in self.ranks]

    @property
    def exposed(self) -> list[float]:
        return [r.exposed for r in self.ranks]

    def memory_timeline(self, rank: int) -> list[tuple[float, float]]:
        """(time, activation memory) steps of one rank, in time order: memory
        grows when an action starts and shrinks when it ends."""
        if self.timelines is not None:
            return list(self.timelines[rank])
        return _levels(self._times(rank), self.costs.memory_delta)

    def host_timeline(self, rank: int) -> list[tuple[float, float]]:
        """(time, host memory) steps of one rank, as :meth:`memory_timeline`."""
        return _levels(self._times(rank), self.costs.host_delta)

    def _times(self, rank: int):
        """(action, start, end) of one rank's actions, in list order."""
        return zip(self.schedule.ranks[rank], self.starts[rank], self.ends[rank])


def _levels(times, delta) -> list[tuple[float, float]]:
    """(time, level) after each change of a memory that ``delta(action)`` changes,
    from (action, start, end) triples: a rise at the start, a fall at the end
    (each part of a compound action on its own: the F of an overlapped pair
    holds its activations from the start, the backward frees its own at the
    end); changes at one instant in list order."""
    changes, ordered, last = [], True, 0.0
    for action, start, end in times:
        for part in parts(action) if action.kind in COMPOUND else (action,):
            d = delta(part)
            if d:
                t = start if d > 0 else end
                ordered = ordered and t >= last
                last = t
                changes.append((t, len(changes), d))
    points, level = [(0.0, 0.0)], 0.0
    for t, _, d in changes if ordered else sorted(changes):
        level += d
        points.append((t, level))
    return points


def simulate(schedule: Schedule, costs: Costs | StageCosts | None = None) -> Result:
    """Time every action of ``schedule``: each rank runs its list in order; an
    action starts when its rank is free and its inputs exist, an input from
    another rank arriving ``comm`` after its producer ends; side-stream
    actions (host copies) run beside the rank's compute."""
    if not isinstance(costs, StageCosts):
        costs = (costs or Costs()).per_stage(schedule.stages, schedule.chunks)
    exposed = [0.0] * schedule.pp
    starts, ends = asap(schedule, costs.duration, costs.transfer, exposed)
    span = max((max(e, default=0.0) for e in ends), default=0.0)
    exposed = [w if w > _NOISE * span else 0.0 for w in exposed]  # a side stream's end equal but for rounding
    result = Result.from_times(schedule, costs, starts, ends, exposed)
    if not math.isfinite(result.makespan):
        raise PipeloomError(f"the costs are too large: the makespan overflows to {result.makespan}")
    return result
