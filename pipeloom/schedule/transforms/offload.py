"""PipeOffload as a transform: activations copied to host after F and back before B.

"PipeOffload: Improving Scalability of Pipeline Parallelism with Memory
Optimization" (Wan et al. 2025). After the forward of a (stage, microbatch)
pair, ``OFFLOAD`` copies the activations it saved to host memory; ``RELOAD``
copies them back before its backward. Both run on one side stream per rank,
the copy stream (:attr:`~..kinds.Kind.stream`), in list order, so copies
overlap compute and offloads and reloads take turns on one host link. Their
time is the cost field ``offload`` (one pair's ``m_b`` over the host link);
activation memory falls by ``m_b`` when an OFFLOAD ends and rises when a
RELOAD starts; host memory holds it from the OFFLOAD's start to the RELOAD's
end.

Policies (:class:`Offload`):

- ``full``: every pair whose gap between F's end and the backward's start
  has room for both copies (more than twice the copy time; with no copy
  time, any gap: a pair whose backward follows its F directly is kept).
- ``selective`` with a ratio r in (0, 1]: on each rank, while its peak
  activation memory is above (1 - r) of the peak without offload, the pair
  that lives longest among those held at the peak instant is offloaded
  (longest-lived first: those count at the peak the most often, so the
  peak falls faster than the bytes moved grow).

Placement, on the timeline the costs give (the transform's ``costs``, or the
unit costs with free copies): OFFLOAD right after its F; RELOAD issued where
its own copy can finish before its backward, at least one action before it
(a pair with no action left between its OFFLOAD and that point is not
offloaded); then, as other copies queue ahead of it on the one stream,
while a simulated backward waits for its RELOAD, that RELOAD moves earlier
by the wait (a few rounds).
Dependencies: OFFLOAD(s,i) after F(s,i); RELOAD(s,i) after OFFLOAD(s,i);
the backward (B or BW) of an offloaded pair after its RELOAD.

Works with every family, with vocabulary parallelism (the vocabulary
passes' buffers stay on the device) and with recomputation (then only the
stage inputs that recomputation keeps are offloaded). Nothing is refused.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from ...errors import PipeloomError, ScheduleError
from ..costs import Costs, StageCosts, register_field
from ..deps import asap
from ..ir import BW, B, F, Action, Schedule
from ..kinds import KINDS, Kind, register, register_inputs
from . import insert, refuse_compound

#: Copy a pair's saved activations to host memory (after its F).
OFFLOAD = "OFFLOAD"
#: Copy them back to the device (before its backward).
RELOAD = "RELOAD"
#: The side stream both run on.
COPY_STREAM = "copy"
POLICIES = ("none", "full", "selective")
_NOISE = 1e-9  # relative: memory levels that differ by less are equal

register_field("offload")


def check_policy(policy: str, ratio: float | None = None) -> tuple[str, float]:
    """``(policy, ratio)`` checked: ratio in (0, 1] for selective (1 for full, 0 for none)."""
    if policy not in POLICIES:
        raise PipeloomError(f"unknown offload policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy != "selective":
        if ratio is not None:
            raise PipeloomError(f"an offload ratio ({ratio!r}) goes with the selective policy, not {policy!r}")
        return policy, 1.0 if policy == "full" else 0.0
    if ratio is None:
        raise PipeloomError("selective offload needs a ratio in (0, 1] (--offload-ratio)")
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise PipeloomError(f"offload ratio {ratio!r}: must be in (0, 1]")
    return policy, float(ratio)


class Offload:
    """The transform: ``policy`` none, full or selective (with ``ratio``)."""

    name = "offload"
    kinds = (OFFLOAD, RELOAD)
    cost_fields = ("offload",)
    room = 0

    def __init__(self, policy: str, ratio: float | None = None):
        self.policy, self.ratio = check_policy(policy, ratio)

    def apply(self, schedule: Schedule, costs: Costs | None = None) -> Schedule:
        if self.policy == "none":
            return schedule
        refuse_compound(schedule, self.name)
        if schedule.options.get("offload"):
            raise ScheduleError("the schedule is offloaded already")
        if schedule.options.get("lowered"):
            raise ScheduleError("offload a schedule before lowering its communication")
        per_stage = (costs or Costs()).per_stage(schedule.stages, schedule.chunks)
        pairs = _Pairs(schedule, per_stage)
        chosen = pairs.eligible() if self.policy == "full" else pairs.select(self.ratio)
        options = {**schedule.options, "offload": {"policy": self.policy, "ratio": self.ratio}}
        return _place(replace(schedule, options=options), per_stage, pairs, chosen)


class _Pairs:
    """The (stage, microbatch) pairs of a schedule, on its timeline without offload."""

    def __init__(self, schedule: Schedule, costs: StageCosts):
        self.schedule, self.costs = schedule, costs
        self.starts, self.ends = asap(schedule, costs.duration, costs.transfer)
        #: (stage, microbatch) -> (rank, index of F, index of its backward)
        self.where: dict[tuple[int, int], tuple[int, int, int]] = {}
        forwards = {}
        for rank, actions in enumerate(schedule.ranks):
            for k, a in enumerate(actions):
                if a.kind == F:
                    forwards[a.stage, a.microbatch] = k
                elif a.kind in (B, BW):
                    self.where[a.stage, a.microbatch] = (rank, forwards[a.stage, a.microbatch], k)

    def copy(self, pair) -> float:
        return self.costs.offload[pair[0]]

    def gap(self, pair) -> tuple[float, float]:
        """End of the pair's F and start of its backward."""
        rank, f, b = self.where[pair]
        return self.ends[rank][f], self.starts[rank][b]

    def reload_at(self, pair) -> int:
        """Where RELOAD goes first: before the latest action that leaves its copy time to
        finish before the backward, and at least one action before it."""
        rank, f, b = self.where[pair]
        latest = self.gap(pair)[1] - self.copy(pair)
        ends, k = self.ends[rank], b - 1
        while k > f + 1 and ends[k - 1] > latest:
            k -= 1
        return k

    def eligible(self) -> list[tuple[int, int]]:
        """Pairs whose gap holds both copies (any gap when copies are free) and an
        action between the OFFLOAD and the RELOAD."""
        found = []
        for pair, (rank, f, b) in self.where.items():
            end, start = self.gap(pair)
            if start - end > 2 * self.copy(pair) and start > end and self.reload_at(pair) > f + 1:
                found.append(pair)
        return found

    def select(self, ratio: float) -> list[tuple[int, int]]:
        """Longest-lived pairs held at each rank's peak, until the peak is (1 - ratio) of its value."""
        chosen = []
        by_rank: dict[int, list] = {}
        for pair in self.eligible():
            by_rank.setdefault(self.where[pair][0], []).append(pair)
        for rank, candidates in sorted(by_rank.items()):
            away = {pair: self._away(pair) for pair in candidates}
            events = self._events(rank)
            grid = sorted({t for t, _ in events}.union(*away.values()))
            index = {t: k for k, t in enumerate(grid)}
            levels = _Levels(_profile(events, grid))
            held = _Held(len(grid))
            for pair, (leave, back) in away.items():
                held.add(index[leave], index[back], (-self._life(pair), pair[1], pair[0]), pair)
            target = (1 - ratio) * levels.peak + _NOISE * max(levels.peak, 1.0)
            while levels.peak > target:
                pair = held.best(levels.first_peak())
                if pair is None:
                    break
                held.remove(pair)
                chosen.append(pair)
                leave, back = away[pair]
                levels.add(index[leave], index[back], -self.costs.m_b[pair[0]])
        return chosen

    def _life(self, pair) -> float:
        end, start = self.gap(pair)
        return start - end

    def _away(self, pair) -> tuple[float, float]:
        """When an offloaded pair is off the device: from its offload's end to its reload's start."""
        end, start = self.gap(pair)
        return end + self.copy(pair), start - self.copy(pair)

    def _events(self, rank: int) -> list[tuple[float, float]]:
        """(time, change) of the rank's activation memory without offload."""
        events = []
        for k, action in enumerate(self.schedule.ranks[rank]):
            delta = self.costs.memory_delta(action)
            if delta:
                events.append((self.starts[rank][k] if delta > 0 else self.ends[rank][k], delta))
        return events


def copyable(actions) -> list[tuple[int, int]]:
    """The (stage, microbatch) pairs of one rank's list, before offload, that a
    policy may copy: those with at least two actions between
    their F and their backward (OFFLOAD goes right after F, RELOAD at least one
    action later, :meth:`_Pairs.reload_at`), whatever the costs."""
    forwards, found = {}, []
    for k, a in enumerate(actions):
        if a.kind == F:
            forwards[a.stage, a.microbatch] = k
        elif a.kind in (B, BW) and k - forwards.get((a.stage, a.microbatch), k) > 2:
            found.append((a.stage, a.microbatch))
    return found


def tightest(actions, pairs) -> list[Action]:
    """One rank's list with the copies of ``pairs`` at their tightest: its side-stream
    actions left out, each pair's OFFLOAD right after its F and its RELOAD right before
    its backward. On any timeline an OFFLOAD frees its bytes after the F ends and a
    RELOAD holds them before the backward starts, so this list's
    :func:`~..deps.peak_activation` is at most the rank's simulated peak once ``pairs``
    are copied to host, wherever the copies run."""
    pairs = set(pairs)
    found = []
    for a in actions:
        if KINDS[a.kind].stream:
            continue
        pair = a.stage, a.microbatch
        if a.kind in (B, BW) and pair in pairs:
            found.append(Action(RELOAD, *pair))
        found.append(a)
        if a.kind == F and pair in pairs:
            found.append(Action(OFFLOAD, *pair))
    return found


def _profile(events: list[tuple[float, float]], grid: list[float]) -> list[float]:
    """A memory profile's level at each time of ``grid`` (which holds every event's time), after
    the events up to it in time order (falls before rises at one instant)."""
    levels, level, k = [], 0.0, 0
    ordered = sorted(events)
    for t in grid:
        while k < len(ordered) and ordered[k][0] <= t:
            level += ordered[k][1]
            k += 1
        levels.append(level)
    return levels


class _Levels:
    """Numbers on a line of points: add a value over a range of points, read the largest
    number and its first point (a segment tree whose nodes keep the adds over their range)."""

    def __init__(self, values: list[float]):
        n = 1
        while n < len(values):
            n *= 2
        self.n = n
        self.top = [-math.inf] * (2 * n)  # a node's largest number, its own and its ancestors' adds left out
        self.top[n:n + len(values)] = values
        self.extra = [0.0] * (2 * n)  # what was added over a node's whole range
        for i in range(n - 1, 0, -1):
            self.top[i] = max(self.top[2 * i], self.top[2 * i + 1])

    @property
    def peak(self) -> float:
        return self.top[1]

    def first_peak(self) -> int:
        """The first point whose number is the largest but for float noise (a relative 1e-9)."""
        top, extra, i, above = self.top, self.extra, 1, 0.0  # above: the adds of i's ancestors
        least = top[1] - _NOISE * max(abs(top[1]), 1.0)
        while i < self.n:
            above += extra[i]
            i = 2 * i if top[2 * i] + above >= least else 2 * i + 1
        return i - self.n

    def add(self, first: int, end: int, value: float) -> None:
        """Add ``value`` at points ``first`` to ``end - 1``."""
        top, extra, n = self.top, self.extra, self.n
        lo, hi = first + n, end + n
        while lo < hi:
            if lo & 1:
                top[lo] += value
                extra[lo] += value
                lo += 1
            if hi & 1:
                hi -= 1
                top[hi] += value
                extra[hi] += value
            lo //= 2
            hi //= 2
        for i in (first + n, end - 1 + n):
            i //= 2
            while i:
                top[i] = max(top[2 * i], top[2 * i + 1]) + extra[i]
                i //= 2


class _Held:
    """Items held over ranges of points: the least key among those held at a point (each
    item on the O(log n) tree nodes that cover its range, in a heap per node)."""

    def __init__(self, points: int):
        n = 1
        while n < points:
            n *= 2
        self.n = n
        self.heaps: dict[int, list] = {}
        self.removed: set = set()

    def add(self, first: int, end: int, key: tuple, item) -> None:
        """Hold ``item`` at points ``first`` to ``end - 1``."""
        lo, hi = first + self.n, end + self.n
        while lo < hi:
            if lo & 1:
                heapq.heappush(self.heaps.setdefault(lo, []), (key, item))
                lo += 1
            if hi & 1:
                hi -= 1
                heapq.heappush(self.heaps.setdefault(hi, []), (key, item))
            lo //= 2
            hi //= 2

    def remove(self, item) -> None:
        self.removed.add(item)

    def best(self, point: int):
        """The held item of least key at ``point``, or None."""
        found = None
        i = point + self.n
        while i:
            heap = self.heaps.get(i)
            while heap and heap[0][1] in self.removed:
                heapq.heappop(heap)
            if heap and (found is None or heap[0] < found):
                found = heap[0]
            i //= 2
        return None if found is None else found[1]


def _place(schedule: Schedule, costs: StageCosts, pairs: _Pairs, chosen: list) -> Schedule:
    """Insert OFFLOAD right after each chosen pair's F and RELOAD before its backward."""
    from .offload_program import with_copies  # it reads this module's kinds
    issue = {pair: pairs.reload_at(pair) for pair in chosen}
    result = _insert(schedule, pairs, issue)
    for _ in range(8):
        with_copies(result, pairs.schedule)
        late = _late_reloads(result, costs)
        moved = False
        for pair, delay in late.items():
            rank, f, b = pairs.where[pair]
            k = issue[pair]
            when = pairs.ends[rank][k - 1] - delay
            while k > f + 1 and pairs.ends[rank][k - 1] > when:
                k -= 1
            if k < issue[pair]:
                issue[pair], moved = k, True
        if not moved:
            break
        result = _insert(schedule, pairs, issue)
    return result


def _insert(schedule: Schedule, pairs: _Pairs, issue: dict) -> Schedule:
    """The schedule with the copies added: OFFLOAD after F, RELOAD before the
    action at index ``issue[pair]`` (reloads ahead of offloads at one point,
    but after their own pair's offload)."""
    extra: list[list[tuple]] = [[] for _ in schedule.ranks]
    for pair, k in issue.items():
        rank, f, _ = pairs.where[pair]
        extra[rank].append((f + 1, 1, pair, Action(OFFLOAD, *pair)))
        extra[rank].append((k, 2 if k == f + 1 else 0, pair, Action(RELOAD, *pair)))
    return replace(schedule, ranks=insert(schedule.ranks, extra))


def _late_reloads(schedule: Schedule, costs: StageCosts) -> dict[tuple[int, int], float]:
    """Pairs whose backward waits for its RELOAD on the simulated timeline, and how long."""
    starts, ends = asap(schedule, costs.duration, costs.transfer)
    late = {}
    for rank, actions in enumerate(schedule.ranks):
        reloaded, previous = {}, 0.0
        for k, a in enumerate(actions):
            if a.kind == RELOAD:
                reloaded[a.stage, a.microbatch] = ends[rank][k]
                continue
            if a.kind == OFFLOAD:
                continue
            pair = (a.stage, a.microbatch)
            if a.kind in (B, BW) and pair in reloaded and reloaded[pair] > previous + 1e-12:
                if math.isclose(starts[rank][k], reloaded[pair]):
                    late[pair] = reloaded[pair] - previous
            previous = ends[rank][k]
    return late


# -- the kinds and their dependencies ---------------------------------------------
def _offloaded(schedule: Schedule) -> frozenset:
    return frozenset((a.stage, a.microbatch) for actions in schedule.ranks for a in actions if a.kind == RELOAD)


def _offload_needs(action, deps):
    return (Action(F, action.stage, action.microbatch),)


def _reload_needs(action, deps):
    return (Action(OFFLOAD, action.stage, action.microbatch),)


@register_inputs
def _backward_inputs(schedule: Schedule):
    """The backward of an offloaded pair after its RELOAD: in offloaded schedules."""
    if not schedule.options.get("offload"):
        return None

    def rule(action, deps):
        kind = action.kind
        if (kind == B or kind == BW) and (action.stage, action.microbatch) in deps.fact("offload", _offloaded):
            return (Action(RELOAD, action.stage, action.microbatch),)
        return ()
    return rule


def check_copies(schedule: Schedule) -> None:
    """Each OFFLOAD has one RELOAD of its pair and the reverse, on the pair's rank, after
    its F and before its backward; only schedules marked offloaded hold them."""
    offloads, reloads = {}, {}
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            if a.kind == OFFLOAD:
                offloads[a.stage, a.microbatch] = rank
            elif a.kind == RELOAD:
                reloads[a.stage, a.microbatch] = rank
    if not offloads and not reloads:
        return
    if not schedule.options.get("offload"):
        pair = next(iter(offloads or reloads))
        raise ScheduleError(f"the schedule copies {pair[0]}F{pair[1]}'s activations, but options['offload'] "
                            "names no offload policy")
    for pair in offloads.keys() ^ reloads.keys():
        have, missing = (OFFLOAD, RELOAD) if pair in offloads else (RELOAD, OFFLOAD)
        rank = schedule.placement[pair[0]]
        raise ScheduleError(f"rank {rank}: {have} {pair[0]}:{pair[1]} has no {missing} of the same stage and microbatch")


register(Kind(OFFLOAD, "offload", needs=_offload_needs, memory=((-1.0, "m_b"),), host=((1.0, "m_b"),),
              cost=("offload",), colour="#8172b3", letter="o", torch_csv=None, stream=COPY_STREAM,
              check=check_copies))
register(Kind(RELOAD, "reload", needs=_reload_needs, memory=((1.0, "m_b"),), host=((-1.0, "m_b"),),
              cost=("offload",), colour="#da8bc3", letter="r", torch_csv=None, stream=COPY_STREAM,
              check=check_copies))
