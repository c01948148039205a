"""Zero-bubble schedules (ZB-H1, ZB-H2, ZB-V): backward split into B and W.

All of them, and ``zb-auto``, come from one time-driven list scheduler,
:func:`list_schedule`: it plays the pipeline forward in time under given
costs and, whenever a rank is free, picks its next action by a few fixed
rules; W passes, which nothing waits for, fill the moments when nothing else
can run. The families differ only in their :class:`Policy` (how far a rank
may run ahead, how many microbatches it may keep alive until their W, which
of F and B goes first, which idle moments a W may fill) and in the
placement. ZB-H1, ZB-H2 and ZB-V are built with unit costs (T_F = T_B =
T_W), as in the zero-bubble paper; the simulator then times the order with
the real costs.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import NamedTuple

from ...errors import ScheduleError
from ..costs import Costs, StageCosts
from ..ir import B, F, W, Action, Schedule, looped_placement, v_placement
from ..registry import register

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """How each rank of :func:`list_schedule` chooses its next action.

    ``warmup[r]``: most forwards rank ``r`` holds whose B has not run (its
    warm-up depth). ``alive[r]``: most microbatches rank ``r`` holds whose W
    has not run. ``memory``: most activation memory per rank under the costs'
    ``m_b`` and ``m_w``, counted as the validator counts it. ``forward_first``:
    false alternates F and B as 1F1B does when both are ready; true runs a
    ready forward whenever the limits admit it and, when only the memory held
    by deferred W passes keeps a ready forward out, runs a W to make room.
    ``fill``: when a deferred W may run while nothing else can: ``"idle"``
    at any idle moment; ``"fit"`` only in a gap it fits (no B or admitted
    forward due before it would end); ``"even"`` in a gap it fits, or in a
    shorter one when waiting would make this rank's idle time so far plus
    its work the largest of all ranks (the zero-bubble paper's rule, which
    compares idle times, for stages of any cost).
    ``room``: time the last stage's B waits after its F (room for
    vocabulary passes).
    """

    warmup: tuple[float, ...]
    alive: tuple[float, ...]
    memory: float = math.inf
    forward_first: bool = False
    fill: str = "idle"
    room: float = 0.0

    def delayed(self, intervals: int, per_interval: int) -> Policy:
        """This policy with the last stage's B delayed by ``intervals`` unit-cost
        intervals (F + B + W of a full stage, 3), each rank admitting
        ``per_interval`` more forwards and alive microbatches per interval."""
        more = intervals * per_interval
        return replace(
            self,
            warmup=tuple(x + more for x in self.warmup),
            alive=tuple(x + more for x in self.alive),
            room=3.0 * intervals,
        )


class Lists(NamedTuple):
    """What :func:`list_schedule` built: every rank's actions and, as the
    scheduler played them, the time the last one ends (``makespan``), the
    longest span of a rank from its first action's start to its last one's
    end (``span``) and the most activation memory a rank held (``peak``).
    The times are never before the simulator's ASAP times of the same lists
    (which may start a pass the scheduler held back), and equal to them when
    no W is held back while its rank idles (``fill="idle"``, not
    ``forward_first``)."""

    ranks: tuple[tuple[Action, ...], ...]
    makespan: float
    span: float
    peak: float


class _Rank:
    """One rank's state while :func:`list_schedule` builds the lists."""

    def __init__(self, index: int, stages: list[int], policy: Policy, work: float):
        self.warmup, self.alive_limit = policy.warmup[index], policy.alive[index]
        self.deep_first = sorted(stages, reverse=True)  # forwards: the deeper stage first
        self.queues = {s: deque() for s in stages}  # B passes that will be ready: (arrival, microbatch)
        self.backwards = [(s, self.queues[s]) for s in sorted(stages)]  # the shallower stage first
        self.deferred: deque[tuple[int, int]] = deque()  # (stage, microbatch) of W passes, oldest B first
        self.order: list[Action] = []
        self.work = work  # time of all the rank's actions
        self.start = self.clock = 0.0  # its first action's start; its last one's end
        self.idle = 0.0  # idle time since its first action
        self.in_flight = self.alive = 0
        self.memory = self.peak = 0.0
        self.last = F  # kind of the last F or B run


def list_schedule(
    placement: tuple[int, ...], microbatches: int, costs: StageCosts, policy: Policy, bound: float = math.inf
) -> Lists | None:
    """Every rank's action list, built by playing the pipeline forward in time.

    A free rank runs its ready B of the shallowest stage, or the ready forward
    of its deepest stage that the policy admits (which of the two first: see
    :class:`Policy`); otherwise its oldest deferred W when ``policy.fill``
    lets it; otherwise it waits for the next input. Forwards and B passes of
    a stage run in microbatch order. Returns None as soon as some rank's span
    must exceed ``bound``: its idle time so far plus all its work does.
    """
    stages, pp = len(placement), len(policy.warmup)
    duration = {F: costs.f, B: costs.b, W: costs.w}
    comm, m_b, m_w = costs.comm, costs.m_b, costs.m_w
    ranks = [
        _Rank(r, mine, policy, microbatches * sum(costs.f[s] + costs.b[s] + costs.w[s] for s in mine))
        for r in range(pp)
        for mine in ([s for s in range(stages) if placement[s] == r],)
    ]
    next_f = [0] * stages
    arrival = [[0.0] * microbatches] + [[math.inf] * microbatches for _ in range(stages - 1)]
    wake = [(0.0, r) for r in range(pp)]
    todo = 3 * stages * microbatches
    limit, fill, room = policy.memory + _EPS, policy.fill, policy.room
    longest = max(rank.work for rank in ranks)  # the longest span any rank will have, at least

    def admits(rank: _Rank, s: int, freed: float = 0.0, released: int = 0) -> bool:
        """Whether a forward of stage ``s`` fits once ``freed`` memory and
        ``released`` alive microbatches are given back (by a W)."""
        return (
            rank.in_flight < rank.warmup
            and rank.alive - released < rank.alive_limit
            and rank.memory - freed + m_b[s] <= limit
        )

    def forward(rank: _Rank, now: float, freed: float = 0.0, released: int = 0) -> tuple | None:
        for s in rank.deep_first:
            i = next_f[s]
            if i < microbatches and arrival[s][i] <= now + _EPS and admits(rank, s, freed, released):
                return F, s, i
        return None

    def backward(rank: _Rank, now: float) -> tuple | None:
        for s, queue in rank.backwards:
            if queue and queue[0][0] <= now + _EPS:
                return B, s, queue[0][1]
        return None

    def next_due(rank: _Rank) -> float:
        due = [queue[0][0] for _, queue in rank.backwards if queue]
        due += [arrival[s][next_f[s]] for s in rank.deep_first if next_f[s] < microbatches and admits(rank, s)]
        return min(due, default=math.inf)

    def choose(rank: _Rank, now: float) -> tuple | None:
        """(kind, stage, microbatch) of the rank's next action, or None to wait."""
        if policy.forward_first:
            f = forward(rank, now)
            if f is not None:
                return f
            if rank.deferred:
                s, i = rank.deferred[0]
                if forward(rank, now, m_w[s], 1) is not None:
                    return W, s, i
            b = backward(rank, now)
        else:
            b = backward(rank, now)
            f = forward(rank, now) if b is None or rank.last == B else None
            if f is not None:
                return f
        if b is not None:
            return b
        if rank.deferred:
            s, i = rank.deferred[0]
            if fill == "idle":
                return W, s, i
            gap = next_due(rank) - now
            if gap >= duration[W][s] - _EPS or (fill == "even" and rank.idle + gap + rank.work > longest + _EPS):
                return W, s, i
        return None

    def hand_over(producer: int, consumer: int, end: float) -> float:
        return end if placement[consumer] == placement[producer] else end + comm[producer]

    def notify(consumer: int, at: float) -> None:
        """Wake ``consumer`` when an input reaches it, unless it is busy until then."""
        if ranks[consumer].clock < at:
            heapq.heappush(wake, (at, consumer))

    while todo:
        if not wake:
            raise ScheduleError("zero-bubble scheduler stalled: the memory limit leaves no rank able to proceed")
        now, r = heapq.heappop(wake)
        rank = ranks[r]
        if rank.clock > now + _EPS:
            continue
        action = choose(rank, now)
        if action is None:
            continue  # idle until an input arrives: its producer pushed a wake-up
        kind, s, i = action
        if rank.order:
            rank.idle += now - rank.clock
            if rank.idle + rank.work > longest:
                longest = rank.idle + rank.work
                if longest > bound + _EPS:
                    return None
        else:
            rank.start = now
        end = rank.clock = now + duration[kind][s]
        rank.order.append(Action.from_fields((kind, s, i, ())))
        heapq.heappush(wake, (end, r))
        todo -= 1
        if kind == F:
            next_f[s] += 1
            rank.in_flight += 1
            rank.alive += 1
            rank.memory += m_b[s]
            if s + 1 < stages:
                arrival[s + 1][i] = at = hand_over(s, s + 1, end)
                notify(placement[s + 1], at)
            else:
                rank.queues[s].append((end + room, i))
                notify(r, end + room)
        elif kind == B:
            rank.queues[s].popleft()
            rank.deferred.append((s, i))
            rank.in_flight -= 1
            rank.memory += m_w[s] - m_b[s]
            if s > 0:
                at, q = hand_over(s, s - 1, end), placement[s - 1]
                ranks[q].queues[s - 1].append((at, i))
                notify(q, at)
        else:
            rank.deferred.popleft()
            rank.alive -= 1
            rank.memory -= m_w[s]
        if rank.memory > rank.peak:
            rank.peak = rank.memory
        if kind != W:
            rank.last = kind
    return Lists(
        tuple(tuple(rank.order) for rank in ranks),
        max(rank.clock for rank in ranks),
        max(rank.clock - rank.start for rank in ranks),
        max(rank.peak for rank in ranks),
    )


def h1_policy(pp: int) -> Policy:
    """ZB-H1: 1F1B's warm-up (rank r holds p-r forwards) and at most p
    microbatches alive, so rank r defers up to r W passes."""
    return Policy(warmup=tuple(pp - r for r in range(pp)), alive=(pp,) * pp)


def h2_policy(pp: int) -> Policy:
    """ZB-H2: rank r runs 2p-1-2r forwards ahead; at most 2p-1 alive."""
    return Policy(warmup=tuple(2 * pp - 1 - 2 * r for r in range(pp)), alive=(2 * pp - 1,) * pp)


def v_policy(pp: int) -> Policy:
    """ZB-V: 2p chunk activations (p full stages) held from F to B per rank,
    up to p more chunks' W deferred, forwards first.

    With unit costs and m >= 2p this gives the makespan 3m + (p-1)/2, no
    bubble and the peak p·M_B, plus at most p chunks' M_W (p·M_W/2) when
    M_W > 0. Deferring fewer W passes leaves half-unit gaps near the end on
    the first ranks (about p/4 to p/3 extra are needed, growing with p)."""
    return Policy(warmup=(2 * pp,) * pp, alive=(3 * pp,) * pp, forward_first=True)


def _single_chunk(family: str, pp: int, microbatches: int, policy: Policy) -> Schedule:
    """One stage per rank, the order built with unit costs."""
    placement = looped_placement(pp, pp)
    lists = list_schedule(placement, microbatches, Costs().per_stage(pp, 1), policy)
    return Schedule(family, pp, microbatches, placement, lists.ranks)


@register("zb-h1", "zero bubble H1: 1F1B's memory, W passes deferred into the bubbles")
def zb_h1(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """``room``: intervals by which the last stage's B follows its F."""
    return _single_chunk("zb-h1", pp, microbatches, h1_policy(pp).delayed(room, 1))


@register("zb-h2", "zero bubble H2: 2p-1 microbatches of warm-up, no bubble when F=B=W")
def zb_h2(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """``room``: intervals by which the last stage's B follows its F."""
    return _single_chunk("zb-h2", pp, microbatches, h2_policy(pp).delayed(room, 1))


@register("zb-v", "zero bubble V: 2 chunks per rank in a V, 1F1B's memory, about no bubble when F=B=W",
          chunks=(2,), default_chunks=2)
def zb_v(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """``room``: intervals by which the last stage's B follows its F
    (each rank holds two more chunk activations per interval)."""
    placement = v_placement(pp)
    policy = v_policy(pp).delayed(room, 2)
    ranks = list_schedule(placement, microbatches, Costs().per_stage(2 * pp, 2), policy).ranks
    return Schedule("zb-v", pp, microbatches, placement, ranks)
