"""Lower bounds on a schedule's step from one simulation of it: its critical path.

A schedule's order does not depend on the costs, and every action waits for
the one before it on its rank and for its inputs. So the chain of actions
that set one simulated step's end (each started when its predecessor in the
chain ended, or when its input arrived) is a chain under any costs too: its
actions' durations and its transfers, summed under other costs, are a lower
bound on the step under those costs. One simulation of a schedule so bounds
every other candidate that runs the same schedule on other costs (another
microbatch size, data-parallel width, recomputation...), and every one that
runs it with host copies added (offload only adds inputs to the compute
actions), which is what lets the search skip most simulations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..schedule.costs import StageCosts
from ..schedule.deps import Dependencies
from ..schedule.kinds import KINDS, RANK
from ..sim import Result


@dataclass(frozen=True)
class CriticalPath:
    """A chain of actions ending on ``rank``: how often each (kind, stage) runs on it, and how
    often each (kind, stage) producer's output crosses to another rank on it (one action stands
    for each key, to time it under other costs)."""

    rank: int
    runs: tuple[tuple[tuple, int], ...]
    transfers: tuple[tuple[tuple, int], ...]

    def length(self, costs: StageCosts) -> float:
        """The chain's time under ``costs``."""
        return (sum(n * costs.duration(action) for action, n in self.runs)
                + sum(n * costs.transfer(producer) for producer, n in self.transfers))


def critical_path(result: Result) -> CriticalPath:
    """The chain that ends last in ``result`` (a schedule without side-stream actions)."""
    schedule, starts, ends = result.schedule, result.starts, result.ends
    deps_of = Dependencies(schedule)
    where = {action: (r, k) for r, actions in enumerate(schedule.ranks) for k, action in enumerate(actions)}
    by_rank = {name for name, kind in KINDS.items() if kind.owner == RANK}
    reduced = {name for name, kind in KINDS.items() if kind.reduced}
    rank = max(range(schedule.pp), key=lambda r: max(ends[r], default=0.0))
    k = max(range(len(ends[rank])), key=lambda i: ends[rank][i])
    runs: Counter = Counter()
    transfers: Counter = Counter()
    r = rank
    while True:
        action = schedule.ranks[r][k]
        runs[_key(action)] += 1
        start = starts[r][k]
        # the predecessor whose end (plus transfer) is latest: it set this start
        best, best_time, crossed = None, 0.0 if k == 0 else ends[r][k - 1], False
        if k > 0:
            best = (r, k - 1)
        for dep in deps_of(action):
            dr, dk = where[dep]
            owner = dep.stage if dep.kind in by_rank else schedule.placement[dep.stage]
            cross = owner != r or dep.kind in reduced
            arrival = ends[dr][dk] + (result.costs.transfer(dep) if cross else 0.0)
            if arrival > best_time:
                best, best_time, crossed = (dr, dk), arrival, cross
        if best is None or best_time < start - 1e-9 * max(1.0, start):
            break  # nothing made it wait: the chain starts here
        if crossed:
            transfers[_key(schedule.ranks[best[0]][best[1]])] += 1
        r, k = best
    return CriticalPath(rank, _stand_ins(schedule, runs), _stand_ins(schedule, transfers))


def _key(action) -> tuple:
    return action.kind, action.stage


def _stand_ins(schedule, counts: Counter) -> tuple:
    """One action of each (kind, stage) key, with its count."""
    first = {}
    for actions in schedule.ranks:
        for action in actions:
            first.setdefault(_key(action), action)
    return tuple((first[key], n) for key, n in sorted(counts.items()))
