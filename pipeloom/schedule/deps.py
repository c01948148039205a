"""What each action kind needs, what it does to memory, and when it can run.

Dependencies are implied by the kinds (docs/design.md): F(s,i) after F(s-1,i);
B(s,i) and BW(s,i) after F(s,i) and the backward of (s+1,i); W(s,i) after
B(s,i). The vocabulary passes of rank r (see :data:`~.ir.VOCAB_PASSES`):
S(r,i) after the last stage's F(i); C(r,i) after S(q,i) on every rank q;
Z(r,i) after C(r,i) and CZ(r,i) after Z(q,i) on every q (naive); T(r,i) after
C(r,i) (CZ(r,i) for naive); R(r,i) after T(q,i) on every q; the last stage's
backward of i also after R (vocab-1, naive) or C (vocab-2) of its own rank;
IF(r,i) after nothing, stage 0's F(i) after IF(q,i) on every q; IB(r,i)
after stage 0's backward of i. :func:`asap` runs every rank's list in order,
each action as soon as its rank is free and its inputs exist; the simulator
times schedules with it and the validator finds deadlocks with it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable

from ..errors import ScheduleError
from .ir import (
    BW, CZ, IB, IF, REDUCED_KINDS, VOCAB_KINDS, VOCAB_PASSES, B, C, F, R, S, T, W, Z, Action, Schedule,
)


_new = tuple.__new__  # builds an Action without NamedTuple's slower constructor (hot path)


class Dependencies:
    """The implied dependencies of one schedule's actions: ``deps(action)``
    lists the actions whose results ``action`` consumes."""

    def __init__(self, schedule: Schedule):
        self.last = schedule.stages - 1
        self.split = frozenset(a.stage for actions in schedule.ranks for a in actions if a.kind == B)
        self.algorithm = schedule.vocab_parallel
        passes = VOCAB_PASSES.get(self.algorithm, ())
        self.ranks = range(schedule.pp)
        self.head_rank = schedule.placement[self.last]
        #: what the last stage's backward waits for besides its F: the reduced input gradient
        self.gate = (R if R in passes else C) if passes else None
        self.inputs = IF in passes
        self.before_t = CZ if CZ in passes else C  # the collective T waits for

    def __call__(self, action: Action) -> tuple[Action, ...]:
        kind, s, i, _ = action
        if kind == F:
            if s > 0:
                return (_new(Action, (F, s - 1, i, ())),)
            return self._every(IF, i) if self.inputs else ()
        if kind == B or kind == BW:
            if s == self.last:
                forward = _new(Action, (F, s, i, ()))
                if self.gate is None:
                    return (forward,)
                return forward, _new(Action, (self.gate, self.head_rank, i, ()))
            return _new(Action, (F, s, i, ())), self._backward(s + 1, i)
        if kind == W:
            return (_new(Action, (B, s, i, ())),)
        if kind in VOCAB_KINDS:
            if self.algorithm is None:
                raise ScheduleError(
                    f"action {action} is a vocabulary pass, but the schedule's options name no vocab_parallel "
                    f"algorithm ({', '.join(VOCAB_PASSES)})"
                )
            return self._vocab(kind, s, i)
        raise ScheduleError(
            f"action {action}: unknown kind {kind!r}; known kinds: F, B, W, BW, {', '.join(sorted(VOCAB_KINDS))}"
        )

    def _backward(self, s: int, i: int) -> Action:
        return _new(Action, (B if s in self.split else BW, s, i, ()))

    def _every(self, kind: str, i: int) -> tuple[Action, ...]:
        """``kind`` of microbatch ``i`` on every rank: the inputs of a collective."""
        return tuple(_new(Action, (kind, q, i, ())) for q in self.ranks)

    def _vocab(self, kind: str, r: int, i: int) -> tuple[Action, ...]:
        if kind == S:
            return (_new(Action, (F, self.last, i, ())),)
        if kind == C:
            return self._every(S, i)
        if kind == Z:
            return (_new(Action, (C, r, i, ())),)
        if kind == CZ:
            return self._every(Z, i)
        if kind == T:
            return (_new(Action, (self.before_t, r, i, ())),)
        if kind == R:
            return self._every(T, i)
        if kind == IB:
            return (self._backward(0, i),)
        return ()  # IF


def activation_delta(action: Action, m_b: float, m_w: float, m_v: float = 0.0) -> float:
    """Change of the rank's activation memory caused by ``action``.

    F keeps ``m_b``; B frees all but ``m_w`` (kept for W); W frees ``m_w``;
    a fused BW frees ``m_b``; a vocabulary S keeps ``m_v`` (its softmax
    buffer) until T frees it.
    """
    return {F: m_b, B: m_w - m_b, W: -m_w, BW: -m_b, S: m_v, T: -m_v}.get(action.kind, 0.0)


def asap(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[Action], float] = lambda producer: 0.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every action when each rank runs its list in
    order and an action waits for its inputs; an input produced on another
    rank, or reduced over every rank (:data:`~.ir.REDUCED_KINDS`), arrives
    ``transfer(producer)`` after its producer ends.

    Sends never block (the runtime posts them non-blocking); a receive blocks
    its rank until the data arrives. Raises :class:`ScheduleError` naming the
    ranks, the actions and what they wait for if the lists deadlock.
    """
    deps_of = Dependencies(schedule)
    placement = schedule.placement
    vocab, reduced = VOCAB_KINDS, REDUCED_KINDS
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
                owner = dep[1] if dep[0] in vocab else placement[dep[1]]
                if end is None:
                    if owner == r:
                        _local_order_error(schedule, r, k, action, dep)
                    waiting.setdefault(dep, []).append(r)
                    blocked_on[r] = dep
                    break
                if owner != r or dep[0] in reduced:
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
        return f"rank {r} waits at {schedule.ranks[r][pos[r]]} for {dep} from rank {schedule.rank_of(dep)}"

    for r, dep in sorted(blocked_on.items()):
        if dep not in schedule.ranks[schedule.rank_of(dep)]:
            return f"rank {r}: action {schedule.ranks[r][pos[r]]} needs {dep}, which no rank runs"

    start = min(blocked_on)
    seen: list[int] = []
    r = start
    while r in blocked_on and r not in seen:
        seen.append(r)
        r = schedule.rank_of(blocked_on[r])
    if r in seen:
        cycle = seen[seen.index(r):]
        return "deadlock: " + "; ".join(waits(q) for q in cycle) + " (a cycle: none can proceed)"
    return "deadlock: " + "; ".join(waits(q) for q in seen)


def peak_activation(actions: Iterable[Action], delta: Callable[[Action], float]) -> float:
    """Peak activation memory of one rank's list, which depends on the order
    only; ``delta(action)`` is the action's :func:`activation_delta`."""
    level = peak = 0.0
    for action in actions:
        level += delta(action)
        peak = max(peak, level)
    return peak
