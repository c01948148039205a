"""Vocabulary Parallelism as a transform: its kinds, their rules, :func:`add_vocab_passes`.

The input embedding and the output layer (LM head and softmax cross-entropy)
are split by vocabulary over all p ranks ("Balancing Pipeline Parallelism
with Vocabulary Parallelism", Yeung et al. 2024) and computed in extra passes
on every rank (:data:`VOCAB_PASSES`; rank-owned kinds, registered below with
their dependencies): the output layer of microbatch i as S on every rank after the
last stage's F(i), a collective C, T, and for vocab-1 and naive a reduce R
of the input gradient, which the last stage's backward of i waits for (the C
for vocab-2); the input layer as IF on every rank, summed into stage 0's
F(i), and IB on every rank after stage 0's backward of i.

The passes are placed into the base schedule's own lists, by the base's
unit-cost timeline (T_F = T_B = T_W = 1 per full stage, no communication,
as the families are built), the passes taking no time there, and a compound
action (DualPipeV's overlapped F and backward) one place in a list, its
parts timed as it is (a pass goes before or after it, never between them):

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
  (strictly after on the other ranks);
- with weight versions (2bw: V = 2), IF(r,i) and S(r,i) of step t no earlier
  than rank r's T and IB of step t - V: the vocabulary shards' version of
  step t is made once their gradient of step t - V is applied, as a stage's
  is (:func:`check_versions` refuses lists that cannot keep this order).

Dependencies: S(r,i) after the last stage's F(i); C(r,i) after S(q,i) on
every rank q; Z(r,i) after C(r,i) and CZ(r,i) after Z(q,i) on every q
(naive); T(r,i) after C(r,i) (CZ(r,i) for naive); R(r,i) after T(q,i) on
every q; the last stage's backward of i also after R (vocab-1, naive) or C
(vocab-2) of its own rank; IF(r,i) after nothing, stage 0's F(i) after IF(q,i)
on every q; IB(r,i) after stage 0's backward of i.

For the collectives to overlap work, the last stage's backward must come
some time after its forward: the transform asks the family for that room
(:attr:`VocabPasses.room`, :data:`HEAD_DELAY` intervals per algorithm as in
the paper; an interval is one microbatch's F and backward on a rank).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import replace
from operator import itemgetter

from ...errors import PipeloomError, ScheduleError
from ...modes import VOCAB_ALGORITHMS, VocabMode
from ..costs import Costs
from ..deps import asap
from ..ir import BW, B, F, W, Action, Schedule, parts
from ..kinds import RANK, Kind, get, register, register_inputs
from . import insert

# The passes of Vocabulary Parallelism ("Balancing Pipeline Parallelism with
# Vocabulary Parallelism"), on every rank over its shard of the vocabulary.
#: Output layer, first pass: the shard's logits, local max and sum (vocab-2 also
#: the products that the input gradient needs).
S = "S"
#: The collective step after S: the global max and sum (vocab-2 also reduces
#: the input gradient; naive: the all-reduce of the max only).
C = "C"
#: naive only: exponentials and the local sum once the global max is known.
Z = "Z"
#: naive only: the all-reduce of the sums.
CZ = "CZ"
#: Output layer, second pass: the weight gradient (vocab-1 and naive also the
#: corrected softmax and the shard's part of the input gradient).
T = "T"
#: vocab-1 and naive: the reduce of the input gradient to the last stage.
R = "R"
#: Input layer forward: the shard's embedding rows, summed into stage 0's input.
IF = "IF"
#: Input layer backward: the shard's embedding gradient, from stage 0's gradient.
IB = "IB"

#: The passes of each vocabulary-parallel algorithm, per rank and microbatch.
VOCAB_PASSES = {
    "naive": (IF, S, C, Z, CZ, T, R, IB),
    "vocab-1": (IF, S, C, T, R, IB),
    "vocab-2": (IF, S, C, T, IB),
}
VOCAB_KINDS = frozenset(VOCAB_PASSES["naive"])
#: The algorithms that add passes (the keys of :data:`VOCAB_PASSES`).
ALGORITHMS = tuple(m.value for m in VOCAB_ALGORITHMS)
#: Every ``vocab_parallel`` choice: ``none`` (the first stage holds the input
#: layer, the last the output layer) and ``redis`` (transformer layers moved
#: off those stages to balance them) are cost-model choices and add no passes.
MODES = tuple(m.value for m in VocabMode)
#: Intervals by which the last stage's backward is delayed for each algorithm.
HEAD_DELAY = {"naive": 2, "vocab-1": 2, "vocab-2": 1}

_EPS = 1e-9
_ORDER = {kind: k for k, kind in enumerate(VOCAB_PASSES["naive"])}  # IF, S, C, Z, CZ, T, R, IB


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`MODES`, else a :class:`PipeloomError`."""
    return VocabMode.of(mode).value


class _Timeline:
    """The base lists timed with unit costs, and where a pass lands in them (a compound
    action's parts where the compound is: DualPipeV's overlapped pairs)."""

    def __init__(self, schedule: Schedule):
        costs = Costs().per_stage(schedule.stages, schedule.chunks)
        self.starts, self.ends = asap(schedule, costs.duration, costs.transfer)
        self.index = {part: (r, k) for r, actions in enumerate(schedule.ranks) for k, a in enumerate(actions)
                      for part in parts(a)}

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
    m, versions = schedule.microbatches, schedule.weight_versions
    updated: dict[tuple[int, int], tuple] = {}  # (rank, step) -> the key of its last T or IB of that step

    def update_of(r: int, i: int) -> tuple | None:
        """With weight versions, the key of rank r's last T or IB of the step whose update
        makes microbatch i's version; else None."""
        return updated.get((r, i // m - versions)) if versions > 1 else None

    def versioned(r: int, e: tuple) -> tuple:
        """Entry ``e`` (an S or IF of rank r), moved to just after :func:`update_of` where it came earlier."""
        done = update_of(r, e[-1].microbatch)
        return (*done[:3], done[3] + 0.5, e[-1]) if done and done > e[:4] else e

    for i in range(schedule.total_microbatches):
        ready = timeline.end(Action(F, last, i))
        late = timeline.start(backward(last, i))
        steps = []
        for n, kinds in enumerate(chain):
            at = [timeline.after(r, ready, n > 0 or r != head) for r in ranks]
            if n == 0:  # S: after its version's update (the collective steps follow it)
                at = [max(where, done[:2]) if (done := update_of(r, i)) else where for r, where in zip(ranks, at)]
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
                    placed[r].append(versioned(r, entry(kind, r, i, where)) if kind == S else entry(kind, r, i, where))
            placed[r].append(versioned(r, entry(IF, r, i, timeline.before(r, deadline))))
            placed[r].append(entry(IB, r, i, timeline.after(r, done, r != first)))
            grads = [e[:4] for e in placed[r][-len(passes):] if e[-1].kind in (T, IB)]
            updated[r, i // m] = max(updated.get((r, i // m), ()), *grads)  # () sorts first

    result = replace(schedule, ranks=insert(schedule.ranks, placed),
                     options={**schedule.options, "vocab_parallel": algorithm})
    if versions > 1 and m < versioned_microbatches(schedule.pp, algorithm):
        check_versions(result)  # says why before a later transform times an order that cannot run
    return result


class VocabPasses:
    """The transform: the passes of ``algorithm`` (naive, vocab-1 or vocab-2)
    added to a schedule whose family left :attr:`room` intervals between the
    last stage's forward and backward."""

    kinds = tuple(VOCAB_KINDS)
    cost_fields = ("s", "t", "c", "r", "e_f", "e_b", "e_comm", "m_v")

    def __init__(self, algorithm: str):
        if algorithm not in ALGORITHMS:
            raise PipeloomError(f"vocabulary algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.algorithm = algorithm
        self.name = f"vocabulary passes ({algorithm})"
        self.room = HEAD_DELAY[algorithm]

    def apply(self, schedule: Schedule, costs=None) -> Schedule:
        return add_vocab_passes(schedule, self.algorithm)


# -- the kinds and their dependencies ---------------------------------------------
class _Facts:
    """What the rules need of one schedule's vocabulary passes."""

    def __init__(self, schedule: Schedule):
        algorithm = schedule.vocab_parallel
        if algorithm is None:
            raise ScheduleError(
                "the schedule holds vocabulary passes, but its options['vocab_parallel'] names no algorithm "
                f"({', '.join(ALGORITHMS)})")
        passes = VOCAB_PASSES[algorithm]
        self.head_rank = schedule.placement[-1]
        #: what the last stage's backward waits for besides its F: the reduced input gradient
        self.gate = R if R in passes else C
        self.before_t = CZ if CZ in passes else C  # the collective T waits for


def _facts(deps) -> _Facts:
    return deps.fact("vocab", _Facts)


def _one(kind: str):
    """The rule: the ``kind`` pass of the same rank and microbatch."""
    def needs(action, deps):
        return (Action(kind, action.stage, action.microbatch),)
    return needs


def _every(kind: str):
    """The rule of a collective: the ``kind`` pass of every rank."""
    def needs(action, deps):
        _facts(deps)
        return deps.every(kind, action.microbatch)
    return needs


def _s_needs(action, deps):
    _facts(deps)
    return (Action(F, deps.last, action.microbatch),)


def _t_needs(action, deps):
    return (Action(_facts(deps).before_t, action.stage, action.microbatch),)


def _ib_needs(action, deps):
    _facts(deps)
    return (deps.backward(0, action.microbatch),)


def _if_needs(action, deps):
    _facts(deps)
    return ()


@register_inputs(kinds=(F, B, BW))
def _pipeline_inputs(schedule: Schedule):
    """Stage 0's F(i) after every rank's IF(i); the last stage's backward of i after
    the gate (R, or C for vocab-2) of its rank: in schedules with vocabulary passes."""
    algorithm = schedule.vocab_parallel
    if algorithm is None:
        return None
    last, head = schedule.stages - 1, schedule.placement[-1]
    gate = R if R in VOCAB_PASSES[algorithm] else C

    def rule(action, deps):
        kind, s = action.kind, action.stage
        if kind == F and s == 0:
            return deps.every(IF, action.microbatch)
        if (kind == B or kind == BW) and s == last:
            return (Action(gate, head, action.microbatch),)
        return ()
    return rule


def check_passes(schedule: Schedule) -> None:
    """Each (rank, microbatch) runs each pass of the vocabulary algorithm exactly once, and no other
    (in a forward-only schedule, each of its passes up to the loss)."""
    found = {a for actions in schedule.ranks for a in actions if a.kind in VOCAB_KINDS}
    algorithm = schedule.vocab_parallel
    if algorithm is None:
        if found:
            action = next(iter(found))
            raise ScheduleError(
                f"rank {action.stage}: vocabulary pass {action}, but options['vocab_parallel'] names no algorithm "
                f"({', '.join(VOCAB_PASSES)})"
            )
        return
    passes = VOCAB_PASSES[algorithm]
    if schedule.forward_only:
        passes = tuple(kind for kind in passes if get(kind).forward)
    pp, total = schedule.pp, schedule.total_microbatches
    # as many distinct passes as wanted, each one of them: all there (else the checks below say what is wrong)
    complete = (len(found) == pp * total * len(passes) and set(map(itemgetter(0), found)) <= set(passes)
                and set(map(itemgetter(3), found)) == {()} and 0 <= min(map(itemgetter(1), found))
                and max(map(itemgetter(1), found)) < pp and 0 <= min(map(itemgetter(2), found))
                and max(map(itemgetter(2), found)) < total)
    for action in () if complete else found:
        if action.kind not in passes:
            raise ScheduleError(
                f"rank {action.stage}: action {action} is not a pass of {algorithm} (its passes: {', '.join(passes)})"
            )
    for rank in range(0 if complete else schedule.pp):
        for mb in range(schedule.total_microbatches):
            for kind in passes:
                if Action(kind, rank, mb) not in found:
                    raise ScheduleError(f"rank {rank}: the {algorithm} pass {Action(kind, rank, mb)} is missing")
    if schedule.weight_versions > 1:
        check_versions(schedule)


#: With weight versions: the kinds that run with a step's weights, and those that finish a step's
#: gradient, whose update makes the weights of the step ``weight_versions`` later.
_READS, _FINISHES = (F, IF, S, T), (B, W, BW, T, IB)


def versioned_microbatches(pp: int, algorithm: str) -> int:
    """The fewest microbatches per step with which 2bw (1F1B without a flush, its warm-up longer by
    the :data:`HEAD_DELAY` the passes ask for) passes :func:`check_versions`."""
    return pp - 1 + HEAD_DELAY[algorithm]


def check_versions(schedule: Schedule) -> None:
    """With weight versions (2bw), each rank runs a stage's F, and its shards' IF, S and T, of
    step t only after its passes that finish their gradient of step t - V (B, W, BW; T, IB),
    whose update makes step t's weights: a third version would be needed otherwise."""
    m, versions, algorithm = schedule.microbatches, schedule.weight_versions, schedule.vocab_parallel

    def unit(a: Action) -> int | None:
        """Whose weights ``a`` reads or whose gradient it finishes: a stage's, or (None) the shards'."""
        return a.stage if a.kind in (F, B, W, BW) else None
    for rank, actions in enumerate(schedule.ranks):
        last = {(unit(a), a.microbatch // m): (k, a) for k, a in enumerate(actions) if a.kind in _FINISHES}
        for k, a in enumerate(actions):
            end, grad = last.get((unit(a), a.microbatch // m - versions), (-1, None))
            if a.kind in _READS and end > k:
                delay = HEAD_DELAY[algorithm]
                raise ScheduleError(
                    f"{schedule.family} with {algorithm}: rank {rank} runs {a} before {grad}, whose update makes "
                    f"{a}'s weights (a third weight version); the passes delay the last stage's backward by {delay} "
                    f"interval{'s' if delay > 1 else ''}: use microbatches >= "
                    f"{versioned_microbatches(schedule.pp, algorithm)} (got {m})")


def _kind(name: str, label: str, needs, **facts) -> None:
    register(Kind(name, label + " (vocab)", owner=RANK, needs=needs, check=check_passes, **facts))


_kind(S, "output layer", _s_needs, cost=("s",), transfer="c", reduced=True, memory=((1.0, "m_v"),),
      colour="#8172b3", letter="s", forward=True)
_kind(C, "softmax statistics", _every(S), colour="#b0a0d0", forward=True)
_kind(Z, "exponentials", _one(C), transfer="c", reduced=True, colour="#b0a0d0", forward=True)
_kind(CZ, "softmax sums", _every(Z), colour="#b0a0d0", forward=True)
_kind(T, "output layer grad", _t_needs, cost=("t",), transfer="r", reduced=True, memory=((-1.0, "m_v"),),
      colour="#937860", letter="t")
_kind(R, "input grad reduce", _every(T), colour="#c0a890")
_kind(IF, "input layer", _if_needs, cost=("e_f",), transfer="e_comm", reduced=True, colour="#da8bc3", letter="e", forward=True)
_kind(IB, "input layer grad", _ib_needs, cost=("e_b",), colour="#da8bc3", letter="g")
