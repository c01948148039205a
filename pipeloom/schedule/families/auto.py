"""zb-auto: the automatic zero-bubble scheduler.

Given per-stage T_F, T_B, T_W, T_comm and a memory limit, it searches the
order of F, B and W on every rank as the zero-bubble paper does: a heuristic
list scheduler (:func:`~.zero_bubble.list_schedule`) played in time with the
real costs, run over a small grid of switches (:func:`policies`). It keeps
the schedule whose longest rank span (first action's start to last one's
end) is shortest, then the one that ends first. That span is the paper's
"cost" and sets pipeloom's bubble rate, (span - busy) / span; it is the step
time once steps tile into each other (the paper bypasses the optimizer's
synchronisation for that); the makespan is the step time with a flush.
The switches:

* warm-up depth per rank, under the memory limit: the forwards that end
  before the rank's first B can start (T_comm counted), one more (the first
  B waits a little, the rank not at all), or ZB-H2's depths;
* F and B alternating (1F1B) or forwards first (a W makes room when only
  deferred W passes' memory keeps a forward out);
* W passes fill any idle moment, or only gaps they fit, or also shorter gaps
  when waiting would make the rank's span the longest so far (the paper's
  rule). A W also runs, when nothing else can, to free memory at the limit.

ZB-H1's and ZB-H2's own orders are candidates too, so zb-auto's longest span
is never above either's when given at least their memory. A candidate stops
as soon as some rank's idle time so far plus its work exceeds the best span
found, and the search stops at a schedule that reaches the lower bounds of
span and makespan (ZB-H2 does under unit costs).

On the paper's profiled models (1.5B to 28.3B, m = 3p to 8p) at its ZB-2p
memory, 2p·M_B, the bubble rates are at most 0.0001 above the paper's ZB-2p
figures and up to 0.0010 below, e.g. 6.2B at m = 24: 0.0025 (paper 0.0029,
ZB-H2 0.0698); at p·M_B they equal ZB-H1's, as the paper's ZB-1p figures do
(``bench/zb_auto.py``). A search takes 0.01-0.5 s there, and 2-3 s at
p = 64, m = 512 with real costs on a 2-core VM.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ...errors import PipeloomError
from ..costs import Costs, StageCosts
from ..deps import asap, peak_activation
from ..ir import Schedule, looped_placement
from ..registry import register
from .zero_bubble import Lists, Policy, h1_policy, h2_policy, list_schedule

_EPS = 1e-9


def first_b_depth(costs: StageCosts) -> tuple[float, ...]:
    """Per rank, the forwards that end before its first B can start (at least 1),
    when every pass runs as early as its inputs allow."""
    pp = len(costs.f)
    start, t = [], 0.0
    for s in range(pp):
        start.append(t)
        t += costs.f[s] + (costs.comm[s] if s + 1 < pp else 0.0)
    ready = [0.0] * pp  # when rank s may start its first B
    ready[-1] = t
    for s in range(pp - 2, -1, -1):
        ready[s] = ready[s + 1] + costs.b[s + 1] + costs.comm[s + 1]
    return tuple(max(1, math.floor((ready[s] - start[s]) / costs.f[s] + _EPS)) if costs.f[s] > 0 else math.inf
                 for s in range(pp))


def policies(pp: int, costs: StageCosts, memory: float) -> list[Policy]:
    """The grid of switches zb-auto tries (see the module docstring), the likeliest
    first: the 5 of the 24 combinations of depth (with the memory cap alone as a
    fourth), F/B order and W filling that together come within 0.0002 of the
    best of all 24 in bubble rate on a benchmark of 142 cases: the paper's
    profiled models, uniform and random per-stage costs under several limits."""
    unlimited = (math.inf,) * pp
    fits = first_b_depth(costs)
    deeper, h2 = tuple(d + 1 for d in fits), h2_policy(pp).warmup
    grid = [
        (h2, False, "even"), (deeper, False, "idle"), (fits, False, "idle"), (deeper, False, "fit"),
        (deeper, True, "even"),
    ]
    return list(dict.fromkeys(
        Policy(warmup=depth, alive=unlimited, memory=memory, forward_first=first, fill=fill)
        for depth, first, fill in grid
    ))


@register("zb-auto", "automatic zero bubble: searches the F/B/W order under real costs and a memory limit")
def zb_auto(
    pp: int, microbatches: int, chunks: int, costs: Costs | None = None, memory_limit: float | None = None,
    memory_unit: float = 1.0, room: int = 0,
) -> Schedule:
    """``costs`` (default unit costs) are the real per-stage costs; ``memory_limit``
    is the most activation memory per rank, in units of ``memory_unit`` of ``costs.m_b``'s
    (a run's: one full stage's M_B, :func:`~pipeloom.builder.build_run`; default 1, ``costs.m_b``'s own
    unit), the errors saying what would fit in those units (default: what ZB-H2 holds under these
    costs, (2p-1)·M_B for uniform stages; ``options["memory_limit"]`` holds it in ``costs.m_b``'s unit). ``room``:
    intervals by which the last stage's B follows its F (room for vocabulary
    passes): every candidate admits that many more forwards on each rank, and
    the last stage's B waits that many times its F + B + W.

    ZB-H1's and ZB-H2's orders (built with unit costs) are timed by the
    simulator, the searched ones by the scheduler's own clock (never earlier
    than the simulator's, so the schedule may do better than it was chosen
    for); ties go to the earlier candidate: ZB-H1, ZB-H2, then the grid's order."""
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise PipeloomError(f"zb-auto: costs={costs!r} must be a pipeloom.schedule.Costs")
    stage, unit = costs.per_stage(pp, 1), Costs().per_stage(pp, 1)
    placement = looped_placement(pp, pp)
    fixed = [list_schedule(placement, microbatches, unit, policy.delayed(room, 1))
             for policy in (h1_policy(pp), h2_policy(pp))]
    if stage != unit:  # real costs: peaks now, times once they fit (unit costs: the lists' own are the simulator's)
        fixed = [lists._replace(peak=_peak(lists.ranks, stage)) for lists in fixed]
    limit = _limit(memory_limit, memory_unit, stage, fixed[1].peak)
    floor = _lower_bounds(microbatches, stage)
    interval = stage.f[-1] + stage.b[-1] + stage.w[-1]  # the last stage's
    searched = [replace(policy.delayed(room, 1), room=room * interval) for policy in policies(pp, stage, limit)]
    best = None
    for candidate in [*(lists for lists in fixed if lists.peak <= limit + _EPS), *searched]:
        if isinstance(candidate, Policy):
            candidate = list_schedule(placement, microbatches, stage, candidate, best.span if best else math.inf)
        elif stage != unit:
            candidate = _timed(candidate, placement, microbatches, stage)
        if candidate is None or candidate.peak > limit + _EPS or not _better(candidate.span, candidate.makespan, best):
            continue
        best = candidate
        if not _better(*floor, best):
            break  # it reaches the lower bounds: nothing can do better
    if best is None:
        need = min(lists.peak for lists in fixed) / memory_unit
        raise PipeloomError(f"zb-auto: no schedule fits memory_limit={memory_limit:g}; ZB-H1 needs {need:g}")
    return Schedule("zb-auto", pp, microbatches, placement, best.ranks, options={"memory_limit": limit})


def _better(span: float, makespan: float, than: Lists | None) -> bool:
    """Whether a longest span ``span`` and end ``makespan`` beat ``than``'s: a
    shorter span, or the same one and an earlier end."""
    if than is None:
        return True
    if abs(span - than.span) > _EPS:
        return span < than.span
    return makespan < than.makespan - _EPS


def _lower_bounds(microbatches: int, costs: StageCosts) -> tuple[float, float]:
    """(span, makespan) no schedule beats: a rank's work, and the time its
    first input takes to reach it plus that work (one stage per rank)."""
    work = [microbatches * (f + b + w) for f, b, w in zip(costs.f, costs.b, costs.w)]
    reach = [sum(costs.f[q] + costs.comm[q] for q in range(s)) for s in range(len(work))]
    return max(work), max(r + x for r, x in zip(reach, work))


def _peak(ranks: tuple, costs: StageCosts) -> float:
    return max(peak_activation(actions, costs.memory_delta) for actions in ranks)


def _timed(lists: Lists, placement: tuple[int, ...], microbatches: int, costs: StageCosts) -> Lists:
    """``lists`` with the times the simulator gives them under ``costs``."""
    ranks = lists.ranks
    starts, ends = asap(Schedule("zb-auto", len(ranks), microbatches, placement, ranks), costs.duration, costs.transfer)
    return lists._replace(makespan=max(e[-1] for e in ends), span=max(e[-1] - s[0] for s, e in zip(starts, ends)))


def _limit(memory_limit: float | None, unit: float, costs: StageCosts, h2_peak: float) -> float:
    """The memory limit to search under, in ``costs.m_b``'s unit: ZB-H2's peak unless given
    (in units of ``unit``); at least one microbatch's activations on the heaviest stage."""
    if memory_limit is None:
        return h2_peak
    for name, value in (("memory_limit", memory_limit), ("memory_unit", unit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise PipeloomError(f"zb-auto: {name}={value!r} must be a positive number (activation memory per rank)")
    need = max(costs.m_b) / unit
    if memory_limit < need - _EPS * max(need, 1.0):
        raise PipeloomError(
            f"zb-auto: memory_limit={memory_limit!r} is below one microbatch's activations on the heaviest stage; "
            f"it needs at least {need:.4g}"
        )
    return float(memory_limit) * unit
