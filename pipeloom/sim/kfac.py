"""What PipeFisher's bubble work does to a schedule: utilisation, refresh interval, step time."""

from __future__ import annotations

from ..schedule.costs import StageCosts
from ..schedule.ir import Action
from ..schedule.kinds import KINDS
from ..schedule.transforms.kfac import KFAC_PRE, PIECES
from .simulate import Result, simulate


def kfac_report(base: Result, result: Result) -> dict:
    """Compare ``base`` (a schedule simulated without K-FAC) with ``result`` (the same schedule
    through :class:`~pipeloom.schedule.Kfac`, under the same costs).

    ``every``: the refresh interval k in steps (a cycle is k copies of the base), ``forced``
    by the user or ``spread`` (pieces fitted no bubble: k keeps their cost within
    :data:`~pipeloom.schedule.transforms.kfac.OVERHEAD` of a step); ``step_time``
    before and after (the cycle's makespan over its steps) and their ``makespan_change``
    (after / before - 1); per rank: ``utilisation`` before and after (compute-stream busy time
    over the step or cycle), ``kfac_time`` (the refresh's pieces), ``overflow_time`` (those
    that fitted no bubble: the curvature right after its producers, the rest at the end of the
    cycle) and ``bubble_filled``, the share of
    the bubbles the pieces fill: their time in bubbles over the rank's idle time in the cycle
    with the pieces taking no time (the preconditioning and the flushes kept).
    """
    settings = result.schedule.options["kfac"]
    bare = without_pieces(result)
    before_steps, after_steps = base.schedule.steps, result.schedule.steps
    ranks = []
    for rank, (old, empty) in enumerate(zip(base.ranks, bare.ranks)):
        events = result.events[rank]
        pieces = [e for e in events if e.action.kind in PIECES]
        kfac = sum(e.end - e.start for e in pieces)
        overflow = _overflow(events, settings["overflow"][rank], settings["inline"][rank], after_steps - 1)
        in_bubbles = kfac - overflow
        bubble = bare.makespan - empty.busy
        ranks.append({
            "rank": rank,
            "utilisation_before": old.busy / base.makespan if base.makespan else 0.0,
            "utilisation_after": result.ranks[rank].busy / result.makespan if result.makespan else 0.0,
            "kfac_time": kfac,
            "overflow_time": overflow,
            "bubble_filled": in_bubbles / bubble if bubble > 0 else 0.0,
        })
    before, after = base.makespan / before_steps, result.makespan / after_steps
    return {
        "every": settings["every"], "forced": settings["forced"], "spread": settings["spread"],
        "units": settings["units"],
        "margin": settings["margin"], "overflow_pieces": sum(settings["overflow"]),
        "step_time_before": before, "step_time_after": after,
        "makespan_change": after / before - 1 if before else 0.0,
        "ranks": ranks,
    }


_PIECE_FIELDS = frozenset(name for kind in PIECES for name in KINDS[kind].cost)


def without_pieces(result: Result) -> Result:
    """``result``'s schedule simulated with the refresh's pieces taking no time (the
    preconditioning and the flushes kept): the bubbles the pieces had to fill."""
    free = {name: (0.0,) * len(values) if name in _PIECE_FIELDS else values
            for name, values in result.costs.values.items()}
    return simulate(result.schedule, StageCosts(free))


def _overflow(events, count: int, inline: list, last: int) -> float:
    """Time of the ``count`` pieces that fitted no bubble: the ``inline`` ones (as
    ``[kind, stage, microbatch, unit]``, right after their producers) and the rest right before
    the rank's preconditioning of step ``last``."""
    time, late = 0.0, count - len(inline)
    if late:
        first = next(k for k, e in enumerate(events) if e.action.kind == KFAC_PRE and e.action.microbatch == last)
        time = sum(e.end - e.start for e in events[first - late:first])
    inline = {Action(kind, s, j, (u,)) for kind, s, j, u in inline}
    return time + sum(e.end - e.start for e in events if e.action in inline)
