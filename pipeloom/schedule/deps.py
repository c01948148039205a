"""What each action kind needs, what it does to memory, and when it can run.

Dependencies are implied by the kinds (DESIGN.md): F(s,i) after F(s-1,i);
B(s,i) and BW(s,i) after F(s,i) and the backward of (s+1,i); W(s,i) after
B(s,i). :func:`asap` runs every rank's list in order, each action as soon as
its rank is free and its inputs exist; the simulator times schedules with it
and the validator finds deadlocks with it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..errors import ScheduleError
from .ir import BW, B, F, W, Action, Schedule


_new = tuple.__new__  # builds an Action without NamedTuple's slower constructor (hot path)


class Dependencies:
    """The implied dependencies of one schedule's actions: ``deps(action)``
    lists the actions whose results ``action`` consumes."""

    def __init__(self, schedule: Schedule):
        self.last = schedule.stages - 1
        self.split = frozenset(a.stage for actions in schedule.ranks for a in actions if a.kind == B)

    def __call__(self, action: Action) -> tuple[Action, ...]:
        kind, s, i, _ = action
        if kind == F:
            return (_new(Action, (F, s - 1, i, ())),) if s > 0 else ()
        if kind == B or kind == BW:
            if s == self.last:
                return (_new(Action, (F, s, i, ())),)
            return _new(Action, (F, s, i, ())), _new(Action, (B if s + 1 in self.split else BW, s + 1, i, ()))
        if kind == W:
            return (_new(Action, (B, s, i, ())),)
        raise ScheduleError(f"action {action}: unknown kind {kind!r}; known kinds: F, B, W, BW")


def activation_delta(action: Action, m_b: float, m_w: float) -> float:
    """Change of the rank's activation memory caused by ``action``.

    F keeps ``m_b``; B frees all but ``m_w`` (kept for W); W frees ``m_w``;
    a fused BW frees ``m_b``.
    """
    return {F: m_b, B: m_w - m_b, W: -m_w, BW: -m_b}.get(action.kind, 0.0)


def asap(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[Action], float] = lambda producer: 0.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every action when each rank runs its list in
    order and an action waits for its inputs; an input produced on another
    rank arrives ``transfer(producer)`` after its producer ends.

    Sends never block (the runtime posts them non-blocking); a receive blocks
    its rank until the data arrives. Raises :class:`ScheduleError` naming the
    ranks, the actions and what they wait for if the lists deadlock.
    """
    deps_of = Dependencies(schedule)
    placement = schedule.placement
    lists = schedule.ranks
    p = len(lists)
    starts = [[0.0] * len(actions) for actions in lists]
    ends = [[0.0] * len(actions) for actions in lists]
    finished: dict[Action, float] = {}
    waiting: dict[Action, list[int]] = {}
    blocked_on: dict[int, Action] = {}
    pos = [0] * p
    clock = [0.0] * p
    ready = deque(range(p))
    get = finished.get
    while ready:
        r = ready.popleft()
        blocked_on.pop(r, None)
        actions, k, t = lists[r], pos[r], clock[r]
        n = len(actions)
        while k < n:
            action = actions[k]
            start = t
            for dep in deps_of(action):
                end = get(dep)
                if end is None:
                    if placement[dep[1]] == r:
                        _local_order_error(schedule, r, k, action, dep)
                    waiting.setdefault(dep, []).append(r)
                    blocked_on[r] = dep
                    break
                if placement[dep[1]] != r:
                    end += transfer(dep)
                if end > start:
                    start = end
            else:
                t = start + duration(action)
                starts[r][k] = start
                ends[r][k] = t
                finished[action] = t
                k += 1
                for other in waiting.pop(action, ()):
                    ready.append(other)
                continue
            break
        pos[r], clock[r] = k, t
    if any(pos[r] < len(lists[r]) for r in range(p)):
        raise ScheduleError(_deadlock_message(schedule, pos, blocked_on))
    return starts, ends


def _local_order_error(schedule: Schedule, rank: int, k: int, action: Action, dep: Action) -> None:
    """An input produced on the same rank must come earlier in its list."""
    try:
        j = schedule.ranks[rank].index(dep)
    except ValueError:
        raise ScheduleError(f"rank {rank}: action {action} needs {dep}, which no rank runs") from None
    raise ScheduleError(f"rank {rank}: action {action} (position {k}) runs before {dep} (position {j}), which it needs")


def _deadlock_message(schedule: Schedule, pos: list[int], blocked_on: dict[int, Action]) -> str:
    """Describe the cycle of waiting ranks (or the first stuck rank)."""
    def waits(r: int) -> str:
        dep = blocked_on[r]
        return f"rank {r} waits at {schedule.ranks[r][pos[r]]} for {dep} from rank {schedule.placement[dep.stage]}"

    for r, dep in sorted(blocked_on.items()):
        if dep not in schedule.ranks[schedule.placement[dep.stage]]:
            return f"rank {r}: action {schedule.ranks[r][pos[r]]} needs {dep}, which no rank runs"

    start = min(blocked_on)
    seen: list[int] = []
    r = start
    while r in blocked_on and r not in seen:
        seen.append(r)
        r = schedule.placement[blocked_on[r].stage]
    if r in seen:
        cycle = seen[seen.index(r):]
        return "deadlock: " + "; ".join(waits(q) for q in cycle) + " (a cycle: none can proceed)"
    return "deadlock: " + "; ".join(waits(q) for q in seen)


def peak_activation(actions: Iterable[Action], m_b: Callable[[int], float], m_w: Callable[[int], float]) -> float:
    """Peak activation memory of one rank's list, which depends on the order only."""
    level = peak = 0.0
    for action in actions:
        level += activation_delta(action, m_b(action.stage), m_w(action.stage))
        peak = max(peak, level)
    return peak
