"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V): backward split into B and W.

All three come from one time-driven list scheduler, :func:`list_schedule`:
it plays the pipeline forward in time under given costs and, whenever a rank
is free, runs a ready B, else a ready forward that the rank's limits admit,
else a deferred W. The families differ only in the limits (how many forwards
a rank may run ahead, how many microbatches it may keep alive until their W)
and in the placement; ``zb-auto`` searches over such limits with real costs.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from ...errors import ScheduleError
from ..costs import Costs, StageCosts
from ..ir import B, F, W, Action, Schedule, looped_placement, v_placement
from ..registry import register

_EPS = 1e-9


@dataclass(frozen=True)
class Limits:
    """What a rank may hold, and when it runs a deferred W.

    ``warmup[r]``: most forwards on rank ``r`` whose B has not run (the depth
    of its warm-up). ``alive[r]``: most microbatches on rank ``r`` whose W has
    not run. ``memory``: most activation memory per rank under the costs'
    ``m_b`` / ``m_w`` (counted as the validator counts it). ``fit_w``: when
    true a W runs only in a gap it fits (no B or admitted forward due before
    it would end); when false a W fills any idle moment.
    """

    warmup: tuple[int, ...]
    alive: tuple[int, ...]
    memory: float = float("inf")
    fit_w: bool = False
    strict: bool = False


class _Rank:
    """The scheduler's view of one rank while the schedule is being built."""

    def __init__(self, stages: list[int]):
        self.stages = sorted(stages, reverse=not KNOB.get('shallow_f'))  # the deeper stage's forward first
        self.clock = 0.0
        self.order: list[Action] = []
        self.backwards: list[tuple[float, int, int]] = []  # heap of (arrival, microbatch, stage)
        self.deferred: deque[Action] = deque()
        self.in_flight = self.alive = 0
        self.memory = 0.0
        self.last = F  # the kind of its last F or B: it alternates them when both are ready
        self.started = False  # whether it has run a B (its warm-up is over)
        self.forwards_done = 0
        self.forwards = 0


def list_schedule(placement: tuple[int, ...], microbatches: int, costs: StageCosts, limits: Limits) -> tuple:
    """Build every rank's action list by playing the pipeline forward in time.

    A free rank runs, in this order of preference: the B that became ready
    first; the forward of its deepest stage whose input has arrived, if
    ``limits`` admit it; its oldest deferred W (see :class:`Limits`). Otherwise
    it waits for the next input. Returns one tuple of actions per rank.
    """
    stages, pp = len(placement), len(limits.warmup)
    ranks = [_Rank([s for s in range(stages) if placement[s] == r]) for r in range(pp)]
    for rank in ranks:
        rank.forwards = len(rank.stages) * microbatches
    next_f = [0] * stages
    if "stage_cap" in KNOB:
        KNOB["inflight"] = [0] * stages
    arrival = [[None] * microbatches for _ in range(stages)]  # when F(s, i)'s input is there
    arrival[0] = [0.0] * microbatches
    todo = 3 * stages * microbatches
    wake = [(0.0, r) for r in range(pp)]

    def hand_over(producer: int, consumer: int, end: float) -> float:
        return end if placement[consumer] == placement[producer] else end + costs.comm[producer]

    def ready_forward(r: int, rank: _Rank, now: float):
        for s in rank.stages:
            i = next_f[s]
            if i < microbatches and arrival[s][i] is not None and arrival[s][i] <= now + _EPS and _admits(limits, r, rank, costs.m_b[s], s):
                return Action(F, s, i)
        return None

    def next_due(r: int, rank: _Rank) -> float:
        due = [rank.backwards[0][0]] if rank.backwards else []
        due += [arrival[s][next_f[s]] for s in rank.stages
                if next_f[s] < microbatches and arrival[s][next_f[s]] is not None and _admits(limits, r, rank, costs.m_b[s])]
        return min(due, default=float("inf"))

    while todo:
        if not wake:
            raise ScheduleError("zero-bubble scheduler stalled: no rank can proceed (memory limit too small?)")
        now, r = heapq.heappop(wake)
        rank = ranks[r]
        if rank.clock > now + _EPS:
            continue
        if KNOB.get("b_shallow") and rank.backwards:
            ready = [x for x in rank.backwards if x[0] <= now + _EPS]
            if ready:
                best = min(ready, key=lambda x: (-x[2] if KNOB.get("b_deep") else x[2], x[1]))
                rank.backwards.remove(best); rank.backwards.insert(0, (-1.0,) + best[1:]); heapq.heapify(rank.backwards)
        if "key" in KNOB:
            cands = [Action(B, s_, i_) for a_, i_, s_ in rank.backwards if a_ <= now + _EPS]
            cands += [Action(F, s_, next_f[s_]) for s_ in rank.stages if next_f[s_] < microbatches and arrival[s_][next_f[s_]] is not None and arrival[s_][next_f[s_]] <= now + _EPS and _admits(limits, r, rank, costs.m_b[s_], s_)]
            cands += list(rank.deferred)
            if not cands:
                continue
            action = min(cands, key=KNOB["key"])
            if action.kind == B:
                rank.backwards.remove(next(x for x in rank.backwards if x[1] == action.microbatch and x[2] == action.stage)); heapq.heapify(rank.backwards)
            if action.kind == W:
                rank.deferred.remove(action)
            backward = forward = None
        else:
          backward = bool(rank.backwards) and rank.backwards[0][0] <= now + _EPS
          forward = ready_forward(r, rank, now)
        if KNOB.get("b_shallow") and rank.backwards:
            ready = [x for x in rank.backwards if x[0] <= now + _EPS]
            if ready:
                best = min(ready, key=lambda x: (-x[2] if KNOB.get("b_deep") else x[2], x[1]))
                rank.backwards.remove(best); rank.backwards.insert(0, (-1.0,) + best[1:]); heapq.heapify(rank.backwards)
        if "key" in KNOB: pass
        elif True:
          wants_b = rank.last == F or rank.forwards_done == rank.forwards or KNOB.get("b_first")
          if KNOB.get("f_first"): wants_b = False
          if limits.strict and rank.started:
            action = (Action(B, *heapq.heappop(rank.backwards)[:0:-1]) if backward else None) if wants_b else forward
          elif forward is not None and (not backward or not wants_b):
            action = forward
          elif backward:
            action = Action(B, *heapq.heappop(rank.backwards)[:0:-1])
          else:
            action = None
          if KNOB.get("w_for_f") and rank.deferred and forward is None and (action is None or action.kind == B):
            blocked = any(next_f[s_] < microbatches and arrival[s_][next_f[s_]] is not None and arrival[s_][next_f[s_]] <= now + _EPS and rank.in_flight < limits.warmup[r] and rank.alive >= limits.alive[r] for s_ in rank.stages)
            if blocked:
                if action is not None: heapq.heappush(rank.backwards, (now, action.microbatch, action.stage))
                action = rank.deferred.popleft()
        if action is None:
            if rank.deferred:
                w = rank.deferred[0]
                if not limits.fit_w or next_due(r, rank) >= now + costs.w[w.stage] - _EPS:
                    action = rank.deferred.popleft()
            if action is None:
                continue  # idle until an input arrives (its producer pushed a wake-up)
        end = now + costs.duration(action)
        rank.clock = end
        rank.order.append(action)
        todo -= 1
        heapq.heappush(wake, (end, r))
        kind, s, i = action.kind, action.stage, action.microbatch
        if kind != W:
            rank.last = kind
        rank.started |= kind == B
        rank.forwards_done += kind == F
        rank.memory += {F: costs.m_b[s], B: costs.m_w[s] - costs.m_b[s], W: -costs.m_w[s]}[kind]
        if "inflight" in KNOB:
            KNOB["inflight"][s] += {F: 1, B: -1, W: 0}[kind]
        if kind == F:
            rank.in_flight += 1
            rank.alive += 1
            next_f[s] += 1
            if s + 1 < stages:
                arrival[s + 1][i] = at = hand_over(s, s + 1, end)
                heapq.heappush(wake, (at, placement[s + 1]))
            else:
                heapq.heappush(rank.backwards, (end, i, s))
        elif kind == B:
            rank.in_flight -= 1
            rank.deferred.append(Action(W, s, i))
            if s > 0:
                at, q = hand_over(s, s - 1, end), placement[s - 1]
                heapq.heappush(ranks[q].backwards, (at, i, s - 1))
                heapq.heappush(wake, (at, q))
        else:
            rank.alive -= 1
    return tuple(tuple(rank.order) for rank in ranks)


KNOB = {}
def _admits(limits: Limits, r: int, rank: _Rank, m_b: float, s=None) -> bool:
    """Whether rank ``r`` may start one more forward (of activation ``m_b``)."""
    if "stage_cap" in KNOB and s is not None and KNOB["inflight"][s] >= KNOB["stage_cap"][s] and not (KNOB.get("warm_only") and rank.started):
        return False
    return (
        rank.in_flight < limits.warmup[r]
        and rank.alive < limits.alive[r]
        and rank.memory + m_b <= limits.memory + _EPS
    )


def _unit_costs(stages: int, chunks: int) -> StageCosts:
    return Costs().per_stage(stages, chunks)


def h1_limits(pp: int) -> Limits:
    """ZB-H1: 1F1B's warm-up (rank r holds p-r forwards); at most p alive."""
    return Limits(warmup=tuple(pp - r for r in range(pp)), alive=(pp,) * pp)


def h2_limits(pp: int) -> Limits:
    """ZB-H2: rank r runs 2p-1-2r forwards ahead; at most 2p-1 alive."""
    return Limits(warmup=tuple(2 * pp - 1 - 2 * r for r in range(pp)), alive=(2 * pp - 1,) * pp)


def _zb(family: str, pp: int, microbatches: int, limits: Limits) -> Schedule:
    placement = looped_placement(pp, pp)
    ranks = list_schedule(placement, microbatches, _unit_costs(pp, 1), limits)
    return Schedule(family, pp, microbatches, placement, ranks)


@register("zb-h1", "zero bubble H1: 1F1B's memory, W deferred into the bubbles")
def zb_h1(pp: int, microbatches: int, chunks: int) -> Schedule:
    return _zb("zb-h1", pp, microbatches, h1_limits(pp))


@register("zb-h2", "zero bubble H2: deeper warm-up (2p-1 microbatches), no bubble when F=B=W")
def zb_h2(pp: int, microbatches: int, chunks: int) -> Schedule:
    return _zb("zb-h2", pp, microbatches, h2_limits(pp))


@register("zb-v", "zero bubble V: 2 chunks per rank in a V, 1F1B's memory, no bubble when F=B=W", chunks=(2,), default_chunks=2)
def zb_v(pp: int, microbatches: int, chunks: int) -> Schedule:
    placement = v_placement(pp)
    limits = Limits(warmup=(2 * pp,) * pp, alive=(2 * pp,) * pp, strict=True)
    ranks = list_schedule(placement, microbatches, _unit_costs(2 * pp, 2), limits)
    return Schedule("zb-v", pp, microbatches, placement, ranks)
