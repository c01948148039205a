"""The validator: is a schedule complete, ordered, deadlock-free and within memory?"""

from __future__ import annotations

from collections import Counter

from ..errors import ScheduleError
from .deps import activation_delta, asap, peak_activation
from .ir import BW, VOCAB_KINDS, VOCAB_PASSES, B, F, W, Action, Schedule

_COMPUTE = (F, B, W, BW)


def validate(
    schedule: Schedule,
    memory_limit: float | None = None,
    m_w: float = 0.0,
) -> Schedule:
    """Check ``schedule`` and return it unchanged, or raise :class:`ScheduleError`
    naming the rank, the action and the reason.

    Checks: every stage is placed on a real rank and every action sits on the
    rank of its stage (a vocabulary pass on the rank it names); each (stage,
    microbatch) has exactly one F and either one BW or one B and one W; with
    vocabulary passes, each (rank, microbatch) has exactly one of each pass of
    the algorithm ``options["vocab_parallel"]`` names; every action comes
    after its dependencies produced on the same rank; the ranks' lists cannot
    deadlock when receives block and sends do not (a collective waits for
    every rank); and, with ``memory_limit``, no rank's activation memory
    exceeds it (in units of one full stage's M_B, a chunk counting its share;
    ``m_w`` is the fraction of M_B kept from B to W; vocabulary buffers are
    not counted).

    Order and deadlock come from one dry run of :func:`~pipeloom.schedule.deps.asap`:
    an input that is not ready must come from a later action of another rank.
    """
    _check_shape(schedule)
    _check_complete(schedule)
    _check_vocab_complete(schedule)
    asap(schedule, duration=lambda action: 0.0)
    if memory_limit is not None:
        share = 1.0 / schedule.chunks
        for rank, actions in enumerate(schedule.ranks):
            peak = peak_activation(actions, lambda action: activation_delta(action, share, share * m_w))
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
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if action.kind in VOCAB_KINDS:
                if not 0 <= action.stage < p:
                    raise ScheduleError(
                        f"rank {rank}: vocabulary pass {action} names rank {action.stage}; ranks are 0..{p - 1}"
                    )
            elif not 0 <= action.stage < schedule.stages:
                raise ScheduleError(
                    f"rank {rank}: action {action} names stage {action.stage}; stages are 0..{schedule.stages - 1}"
                )
            if not 0 <= action.microbatch < schedule.total_microbatches:
                raise ScheduleError(
                    f"rank {rank}: action {action} names microbatch {action.microbatch}; "
                    f"microbatches are 0..{schedule.total_microbatches - 1}"
                )
            owner = schedule.rank_of(action)
            if owner != rank:
                holds = f"shard {owner}" if action.kind in VOCAB_KINDS else f"stage {action.stage}"
                raise ScheduleError(f"rank {rank}: action {action} belongs to rank {owner}, which holds {holds}")


def _check_complete(schedule: Schedule) -> None:
    counts = Counter(a for actions in schedule.ranks for a in actions if a.kind in _COMPUTE)
    for action, n in counts.items():
        if n > 1:
            rank = schedule.placement[action.stage]
            raise ScheduleError(f"rank {rank}: action {action} appears {n} times; each must run exactly once")
    for stage in range(schedule.stages):
        rank = schedule.placement[stage]
        for mb in range(schedule.total_microbatches):
            def has(kind):
                return counts.get((kind, stage, mb, ()), 0) > 0
            if not has(F):
                raise ScheduleError(f"rank {rank}: the forward {stage}F{mb} is missing")
            split = has(B), has(W)
            if has(BW):
                if any(split):
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} microbatch {mb} has both a fused backward {stage}B{mb} "
                        f"and a split one; use BW or B and W, not both"
                    )
            elif split == (False, False):
                raise ScheduleError(f"rank {rank}: the backward of stage {stage} microbatch {mb} is missing")
            elif not all(split):
                missing = f"{stage}W{mb}" if split[0] else f"{stage}I{mb}"
                raise ScheduleError(f"rank {rank}: {missing} is missing (a split backward needs both B and W)")


def _check_vocab_complete(schedule: Schedule) -> None:
    """Each (rank, microbatch) runs each pass of the vocabulary algorithm exactly once, and no other."""
    counts = Counter(a for actions in schedule.ranks for a in actions if a.kind in VOCAB_KINDS)
    algorithm = schedule.vocab_parallel
    if algorithm is None:
        if counts:
            action = next(iter(counts))
            raise ScheduleError(
                f"rank {action.stage}: vocabulary pass {action}, but options['vocab_parallel'] names no algorithm "
                f"({', '.join(VOCAB_PASSES)})"
            )
        return
    passes = VOCAB_PASSES[algorithm]
    for action, n in counts.items():
        if action.kind not in passes:
            raise ScheduleError(
                f"rank {action.stage}: action {action} is not a pass of {algorithm} (its passes: {', '.join(passes)})"
            )
        if n > 1:
            raise ScheduleError(f"rank {action.stage}: action {action} appears {n} times; each must run exactly once")
    for rank in range(schedule.pp):
        for mb in range(schedule.total_microbatches):
            for kind in passes:
                if Action(kind, rank, mb) not in counts:
                    raise ScheduleError(f"rank {rank}: the {algorithm} pass {Action(kind, rank, mb)} is missing")
