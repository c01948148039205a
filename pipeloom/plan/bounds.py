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

from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass

from ..schedule.costs import StageCosts
from ..schedule.deps import _program
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
    """The chain that ends last in ``result`` (a schedule without side-stream actions), read off the
    timing program that simulated it (:func:`~pipeloom.schedule.deps.asap`'s): each action's inputs
    are the action before it on its rank, then the producers of its inputs in the order its kind's
    rules name them, each marked where its result crosses to another rank or through a collective."""
    schedule, starts, ends = result.schedule, result.starts, result.ends
    program = _program(schedule)
    n = program.n
    inputs_at = dict(zip(program.steps[0], program.steps[1]))
    flat_ends = [end for rank in ends for end in rank]
    offsets = [a for a, _ in program.bounds]
    transfer, timed, key_at = result.costs.transfer, program.timed, dict(zip(program.steps[0], program.steps[2]))
    rank = max(range(schedule.pp), key=lambda r: max(ends[r], default=0.0))
    k = max(range(len(ends[rank])), key=lambda i: ends[rank][i])
    runs: Counter = Counter()
    transfers: Counter = Counter()
    r = rank
    while True:
        action = schedule.ranks[r][k]
        runs[_key(action)] += 1
        start = starts[r][k]
        slot = offsets[r] + k
        # the predecessor whose end (plus transfer) is latest: it set this start
        best, best_time, crossed = None, 0.0 if k == 0 else ends[r][k - 1], False
        if k > 0:
            best = slot - 1
        for q in inputs_at[slot][1:]:  # the first is the rank's previous action
            cross = q >= n
            dep = q - n if cross else q
            arrival = flat_ends[dep] + (transfer(timed[key_at[dep]]) if cross else 0.0)
            if arrival > best_time:
                best, best_time, crossed = dep, arrival, cross
        if best is None or best_time < start - 1e-9 * max(1.0, start):
            break  # nothing made it wait: the chain starts here
        r = bisect_right(offsets, best) - 1
        k = best - offsets[r]
        if crossed:
            transfers[_key(schedule.ranks[r][k])] += 1
    return CriticalPath(rank, _stand_ins(schedule, runs), _stand_ins(schedule, transfers))


def _key(action) -> tuple:
    return action.kind, action.stage


def _stand_ins(schedule, counts: Counter) -> tuple:
    """One action of each (kind, stage) key, its first in the lists, with its count."""
    first, wanted = {}, len(counts)
    for actions in schedule.ranks:
        for action in actions:
            key = action.kind, action.stage
            if key in counts and key not in first:
                first[key] = action
                if len(first) == wanted:
                    break
        if len(first) == wanted:
            break
    return tuple((first[key], n) for key, n in sorted(counts.items()))
