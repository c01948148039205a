"""The validator: is a schedule complete, ordered, deadlock-free and within memory?"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import chain
from operator import itemgetter

from ..errors import ScheduleError
from .costs import Costs
from .deps import _program, peak_activation
from .ir import Schedule, parts
from .kinds import COMPOUND, KINDS, RANK, checks, get

_KIND, _STAGE, _MICROBATCH = itemgetter(0), itemgetter(1), itemgetter(2)


def validate(
    schedule: Schedule,
    memory_limit: float | None = None,
    m_w: float = 0.0,
) -> Schedule:
    """Check ``schedule`` and return it unchanged, or raise :class:`ScheduleError`
    naming the rank, the action and the reason.

    Checks: every stage is placed on a real rank and every action is of a
    registered kind (:mod:`~.kinds`) and sits on the rank that owns it (its
    stage's, or the rank a rank-owned kind names), a compound action's parts
    too (plain actions, two at least); no action appears twice;
    each kind's completeness rule holds (each (stage, microbatch) has one F
    and either one BW or one B and one W; the passes of a vocabulary
    algorithm, the sends and receives of a lowered schedule); every action
    comes after its dependencies produced on the same rank; the ranks' lists
    cannot deadlock when receives block and sends do not (a collective waits
    for every rank); and, with ``memory_limit``, no rank's activation memory
    exceeds it (in units of one full stage's M_B, a chunk counting its share;
    ``m_w`` is the fraction of M_B kept from B to W; other kinds' buffers are
    not counted).

    Order and deadlock come from compiling the schedule's timing program (what
    :func:`~pipeloom.schedule.deps.asap` runs, kept for the simulator): an input that is not
    ready must come from a later action of another rank.
    """
    _check_shape(schedule)
    compound = any(not COMPOUND.isdisjoint(map(_KIND, actions)) for actions in schedule.ranks)
    flat = replace(schedule, ranks=tuple(tuple(p for a in actions for p in parts(a)) for actions in schedule.ranks)
                   ) if compound else schedule
    _check_once(flat)
    for check in checks():
        check(flat)
    _program(schedule)  # compiling its timing program finds misordered inputs and deadlocks
    if memory_limit is not None:
        units = Costs(m_b=1.0, m_w=m_w).per_stage(schedule.stages, schedule.chunks)
        for rank, actions in enumerate(schedule.ranks):
            peak = peak_activation(actions, units.memory_delta)
            if peak > memory_limit + 1e-9:
                raise ScheduleError(
                    f"rank {rank}: peak activation memory {peak:g} M_B exceeds the limit {memory_limit:g} M_B"
                )
    return schedule


def _check_shape(schedule: Schedule) -> None:
    p = schedule.pp
    if p < 1:
        raise ScheduleError(f"pp={p}: a pipeline needs at least 1 rank")
    if len(schedule.ranks) != p:
        raise ScheduleError(f"the schedule has {len(schedule.ranks)} action lists for pp={p}; it needs one per rank")
    if schedule.microbatches < 1:
        raise ScheduleError(f"microbatches={schedule.microbatches}: a step needs at least 1 microbatch")
    for stage, rank in enumerate(schedule.placement):
        if not 0 <= rank < p:
            raise ScheduleError(f"stage {stage} is placed on rank {rank}, outside 0..{p - 1}")
    total = schedule.total_microbatches
    for rank, actions in enumerate(schedule.ranks):
        if _plainly_placed(schedule, rank, actions, total):
            continue  # else the same checks, action by action, to name the first that fails
        placed = set()  # (kind, stage) of the actions checked to belong here
        for action in (p for a in actions for p in _parts(rank, a)):
            if (action.kind, action.stage) not in placed:
                _check_place(schedule, rank, action)
                placed.add((action.kind, action.stage))
            if not 0 <= action.microbatch < total:
                raise ScheduleError(
                    f"rank {rank}: action {action} names microbatch {action.microbatch}; "
                    f"microbatches are 0..{total - 1}"
                )


def _plainly_placed(schedule: Schedule, rank: int, actions, total: int) -> bool:
    """True when ``actions`` (rank ``rank``'s list) holds no compound action, each of its (kind,
    stage) is registered and belongs to ``rank``, and every microbatch is in 0..``total - 1``: what
    :func:`_check_shape` checks action by action, in a few passes over the list."""
    if not actions:
        return True
    kinds = set(map(_KIND, actions))
    if not kinds <= KINDS.keys() or not COMPOUND.isdisjoint(kinds):
        return False
    microbatches = set(map(_MICROBATCH, actions))
    if min(microbatches) < 0 or max(microbatches) >= total:
        return False
    placement, stages = schedule.placement, schedule.stages
    for kind, stage in set(zip(map(_KIND, actions), map(_STAGE, actions))):
        if KINDS[kind].owner == RANK:
            if stage != rank:
                return False
        elif not 0 <= stage < stages or placement[stage] != rank:
            return False
    return True


def _check_place(schedule: Schedule, rank: int, action) -> None:
    """``action``'s kind is registered, it names a real stage (or rank) and it belongs to ``rank``."""
    p = schedule.pp
    if action.kind not in KINDS:
        raise ScheduleError(f"rank {rank}: action {action}: unknown kind {action.kind!r}; "
                            f"registered kinds: {', '.join(KINDS)}")
    by_rank = get(action.kind).owner == RANK
    if by_rank:
        if not 0 <= action.stage < p:
            raise ScheduleError(
                f"rank {rank}: action {action} (a pass of one rank) names rank {action.stage}; "
                f"ranks are 0..{p - 1}"
            )
    elif not 0 <= action.stage < schedule.stages:
        raise ScheduleError(
            f"rank {rank}: action {action} names stage {action.stage}; stages are 0..{schedule.stages - 1}"
        )
    owner = schedule.rank_of(action)
    if owner != rank:
        holds = f"shard {owner}" if by_rank else f"stage {action.stage}"
        raise ScheduleError(f"rank {rank}: action {action} belongs to rank {owner}, which holds {holds}")


def _parts(rank: int, action) -> tuple:
    """A compound action's parts, checked to be two plain actions at least; else the action."""
    if action.kind not in COMPOUND:
        return (action,)
    if len(action.payload) % 3 or len(action.payload) < 6:
        raise ScheduleError(f"rank {rank}: compound action {action} needs two parts at least, each as "
                            f"(kind, stage, microbatch) in its payload; got {action.payload!r}")
    found = parts(action)
    inner = next((p for p in found if p.kind in COMPOUND or p.kind not in KINDS), None)
    if inner is not None:
        raise ScheduleError(f"rank {rank}: compound action {action} holds {inner.kind!r}; its parts are plain "
                            f"registered kinds")
    return found


def _check_once(schedule: Schedule) -> None:
    """No action appears twice."""
    if len(set(chain.from_iterable(schedule.ranks))) == schedule.num_actions():
        return
    counts = Counter(a for actions in schedule.ranks for a in actions)
    for action, n in counts.items():
        if n > 1:
            raise ScheduleError(
                f"rank {schedule.rank_of(action)}: action {action} appears {n} times; each must run exactly once")
