"""Vocabulary Parallelism as a transform: :func:`add_vocab_passes`.

The input embedding and the output layer (LM head and softmax cross-entropy)
are split by vocabulary over all p ranks ("Balancing Pipeline Parallelism
with Vocabulary Parallelism", Yeung et al. 2024) and computed in extra passes
on every rank (:data:`~.ir.VOCAB_PASSES`; their dependencies are in
:mod:`~.deps`): the output layer of microbatch i as S on every rank after the
last stage's F(i), a collective C, T, and for vocab-1 and naive a reduce R
of the input gradient, which the last stage's backward of i waits for (the C
for vocab-2); the input layer as IF on every rank, summed into stage 0's
F(i), and IB on every rank after stage 0's backward of i.

The passes are placed into the base schedule's own lists, by the base's
unit-cost timeline (T_F = T_B = T_W = 1 per full stage, no communication,
as the families are built), the passes taking no time there:

- S(r,i) at the first point of rank r's list at or after the end of the last
  stage's F(i) (strictly after on the other ranks, which wait for its output);
- each collective step right before the pass that needs it, at the first
  point strictly after every rank has reached the passes it reduces (T after
  C; naive: Z after C, T after CZ; R after T), so a collective has an action's
  time to complete;
- the passes that the last stage's backward of i waits for move up, on
  every rank, to before the first action that starts no earlier than it,
  where they would land later (so no rank waits on itself through them);
- IF(r,i) at the last point of rank r's list where stage 0's F(i-1) (F(0) for
  i = 0) has not started, so that the sum overlaps a step of work;
- IB(r,i) at the first point after the end of stage 0's backward of i
  (strictly after on the other ranks).

For the collectives to overlap work, the last stage's backward must come
some time after its forward: families that take the option ``head_delay``
delay it by that many intervals (one microbatch's F and backward on a rank),
:data:`HEAD_DELAY` per algorithm as in the paper, which is what
``build(..., vocab_parallel=...)`` does.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import replace

from ..errors import PipeloomError
from .costs import Costs
from .deps import asap
from .ir import BW, CZ, IB, IF, VOCAB_KINDS, VOCAB_PASSES, B, C, F, R, S, T, Z, Action, Schedule

#: The algorithms that add passes (the keys of :data:`~.ir.VOCAB_PASSES`).
ALGORITHMS = tuple(VOCAB_PASSES)
#: Every ``vocab_parallel`` choice: ``none`` (the first stage holds the input
#: layer, the last the output layer) and ``redis`` (transformer layers moved
#: off those stages to balance them) are cost-model choices and add no passes.
MODES = ("none", "redis") + ALGORITHMS
#: Intervals by which the last stage's backward is delayed for each algorithm.
HEAD_DELAY = {"naive": 2, "vocab-1": 2, "vocab-2": 1}

_EPS = 1e-9
_ORDER = {kind: k for k, kind in enumerate(VOCAB_PASSES["naive"])}  # IF, S, C, Z, CZ, T, R, IB


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else a :class:`PipeloomError`."""
    if mode not in MODES:
        raise PipeloomError(f"unknown vocab_parallel mode {mode!r}; modes: {', '.join(MODES)}")
    return mode


class _Timeline:
    """The base lists timed with unit costs, and where a pass lands in them."""

    def __init__(self, schedule: Schedule):
        costs = Costs().per_stage(schedule.stages, schedule.chunks)
        self.starts, self.ends = asap(schedule, costs.duration, costs.transfer)
        self.index = {a: (r, k) for r, actions in enumerate(schedule.ranks) for k, a in enumerate(actions)}

    def start(self, action: Action) -> float:
        r, k = self.index[action]
        return self.starts[r][k]

    def end(self, action: Action) -> float:
        r, k = self.index[action]
        return self.ends[r][k]

    def after(self, rank: int, t: float, strict: bool) -> tuple[int, float]:
        """(position, time): before the rank's first action starting at or
        after ``t`` (after ``t`` when ``strict``), reached at that time."""
        starts = self.starts[rank]
        k = bisect_right(starts, t + _EPS) if strict else bisect_left(starts, t - _EPS)
        return k, max(t, self.ends[rank][k - 1]) if k else t

    def before(self, rank: int, t: float) -> tuple[int, float]:
        """(position, time): after the rank's last action ending by ``t``."""
        k = bisect_right(self.ends[rank], t + _EPS)
        return k, self.ends[rank][k - 1] if k else 0.0


def add_vocab_passes(schedule: Schedule, algorithm: str) -> Schedule:
    """``schedule`` with the passes of ``algorithm`` (naive, vocab-1 or
    vocab-2) placed into every rank's list (see the module docstring), and
    ``options["vocab_parallel"]`` set. Not validated: :func:`~.registry.build`
    validates."""
    if algorithm not in ALGORITHMS:
        raise PipeloomError(f"vocabulary algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
    if any(a.kind in VOCAB_KINDS for actions in schedule.ranks for a in actions):
        raise PipeloomError(f"{schedule.family}: the schedule already has vocabulary passes")
    passes = VOCAB_PASSES[algorithm]
    timeline = _Timeline(schedule)
    ranks, last = range(schedule.pp), schedule.stages - 1
    head, first = schedule.placement[last], schedule.placement[0]
    # the output layer's steps in order, each a collective (if any) and the pass that needs it
    chain = [(S,)] + ([(C, Z), (CZ, T)] if Z in passes else [(C, T)]) + ([(R,)] if R in passes else [])
    gate = _ORDER[R if R in passes else C]  # S .. gate: what the last stage's backward waits for

    def backward(stage: int, i: int) -> Action:
        split = Action(B, stage, i)
        return split if split in timeline.index else Action(BW, stage, i)

    def entry(kind: str, rank: int, i: int, where: tuple[int, float]) -> tuple:
        """(position, time, microbatch, order, action): sorted, the order within a position."""
        return (*where, i, _ORDER[kind], Action(kind, rank, i))

    placed: list[list[tuple]] = [[] for _ in ranks]
    for i in range(schedule.total_microbatches):
        ready = timeline.end(Action(F, last, i))
        late = timeline.start(backward(last, i))
        steps = []
        for n, kinds in enumerate(chain):
            at = [timeline.after(r, ready, n > 0 or r != head) for r in ranks]
            steps.append((kinds, at))
            ready = max(t for _, t in at)
        deadline = timeline.start(Action(F, 0, max(i - 1, 0)))
        done = timeline.end(backward(0, i))
        for r in ranks:
            limit = timeline.after(r, late, False)[0]  # the gate's chain goes before what follows it
            for kinds, at in steps:
                for kind in kinds:
                    where = at[r]
                    if _ORDER[kind] <= gate:
                        where = (min(where[0], limit), min(where[1], late))
                    placed[r].append(entry(kind, r, i, where))
            placed[r].append(entry(IF, r, i, timeline.before(r, deadline)))
            placed[r].append(entry(IB, r, i, timeline.after(r, done, r != first)))

    lists = []
    for r, actions in enumerate(schedule.ranks):
        extra = sorted(placed[r])
        merged, j = [], 0
        for k, action in enumerate(actions):
            while j < len(extra) and extra[j][0] <= k:
                merged.append(extra[j][-1])
                j += 1
            merged.append(action)
        merged += [e[-1] for e in extra[j:]]
        lists.append(tuple(merged))
    return replace(schedule, ranks=tuple(lists), options={**schedule.options, "vocab_parallel": algorithm})
