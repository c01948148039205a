"""zb-auto: the automatic zero-bubble scheduler.

Given per-stage T_F, T_B, T_W, T_comm and a memory limit, it searches the
order of F, B and W on every rank as the zero-bubble paper does: a heuristic
list scheduler (:func:`~.zero_bubble.list_schedule`) played in time with the
real costs, run over a small grid of switches (:func:`policies`), keeping the
schedule with the smallest makespan that respects the memory limit. The
switches:

* warm-up depth per rank: as deep as memory allows (forwards until the first
  B is ready), only the forwards that end before the first B can start, or
  ZB-H2's depths;
* F and B alternating (1F1B) or forwards first;
* W passes filling any idle moment, or only gaps they fit.

ZB-H1's and ZB-H2's own orders are candidates too, so zb-auto never does
worse than either when given at least their memory. Cost: 8 list schedules
and 2 simulations, a few seconds at p = 64, m = 512.
"""

from __future__ import annotations

import math

from ...errors import PipeloomError
from ..costs import Costs, StageCosts
from ..deps import asap, peak_activation
from ..ir import Schedule
from ..registry import register
from .zero_bubble import Lists, Policy, h2_policy, list_schedule, zb_h1, zb_h2

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
    """The grid of switches zb-auto tries (see the module docstring): the 6 of
    the 16 combinations of depth, F/B order and W filling that came closest to
    the best of all 16 (under 0.01% longer on average) on a benchmark of
    uniform, profiled and random per-stage costs, each under 4 memory limits."""
    unlimited = (math.inf,) * pp
    fits, h2 = first_b_depth(costs), h2_policy(pp).warmup
    grid = [
        (h2, True, False), (fits, True, True), (fits, True, False),
        (unlimited, False, False), (h2, True, True), (fits, False, False),
    ]
    return [
        Policy(warmup=depth, alive=unlimited, memory=memory, forward_first=first, fit_w=fit)
        for depth, first, fit in grid
    ]


@register("zb-auto", "automatic zero bubble: searches the F/B/W order under real costs and a memory limit")
def zb_auto(
    pp: int, microbatches: int, chunks: int, costs: Costs | None = None, memory_limit: float | None = None
) -> Schedule:
    """``costs`` (default unit costs) are the real per-stage costs; ``memory_limit``
    is the most activation memory per rank, in the unit of ``costs.m_b`` (default:
    what ZB-H2 holds under these costs, (2p-1)·M_B for uniform stages).

    ZB-H1's and ZB-H2's orders are timed by the simulator, the searched ones by
    the scheduler's own clock (never earlier than the simulator's); ties go to
    the earlier candidate: ZB-H1, ZB-H2, then the grid's order."""
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise PipeloomError(f"zb-auto: costs={costs!r} must be a pipeloom.schedule.Costs")
    stage = costs.per_stage(pp, 1)
    h1, h2 = zb_h1(pp, microbatches, 1), zb_h2(pp, microbatches, 1)
    limit = _limit(memory_limit, stage, h2.ranks)
    candidates = [Lists(fixed.ranks, _makespan(fixed, stage)) for fixed in (h1, h2)]
    for policy in dict.fromkeys(policies(pp, stage, limit)):
        candidates.append(list_schedule(h1.placement, microbatches, stage, policy))
    for _, k in sorted((lists.makespan, k) for k, lists in enumerate(candidates)):
        ranks = candidates[k].ranks
        if _peak(ranks, stage) <= limit + _EPS:
            break
    else:
        raise PipeloomError(f"zb-auto: no schedule fits memory_limit={limit:g}; ZB-H1 needs {_peak(h1.ranks, stage):g}")
    return Schedule("zb-auto", pp, microbatches, h1.placement, ranks, options={"memory_limit": limit})


def _makespan(schedule: Schedule, costs: StageCosts) -> float:
    return max((ends[-1] for ends in asap(schedule, costs.duration, costs.transfer)[1] if ends), default=0.0)


def _peak(ranks: tuple, costs: StageCosts) -> float:
    return max(peak_activation(actions, costs.memory_delta) for actions in ranks)


def _limit(memory_limit: float | None, costs: StageCosts, h2_ranks: tuple) -> float:
    """The memory limit to search under: ZB-H2's peak unless given; at least one
    microbatch's activations on the heaviest stage."""
    if memory_limit is None:
        return _peak(h2_ranks, costs)
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)):
        raise PipeloomError(f"zb-auto: memory_limit={memory_limit!r} must be a number (activation memory per rank)")
    need = max(costs.m_b)
    if memory_limit < need - _EPS:
        raise PipeloomError(
            f"zb-auto: memory_limit={memory_limit!r} is below one microbatch's activations on the heaviest stage; "
            f"it needs at least {need:g}"
        )
    return float(memory_limit)
