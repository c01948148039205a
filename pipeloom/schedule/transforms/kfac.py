"""PipeFisher as a transform: K-FAC's work cut into pieces and placed in the bubbles.

"PipeFisher: Efficient Training of Large Language Models Using Pipelining
and Fisher Information Matrices" (Osawa et al. 2023). K-FAC
(:mod:`pipeloom.optim.kfac`) needs, per linear layer, the Kronecker factors
A (from the layer inputs of each microbatch's forward) and G (from its
output gradients in the backward), their sum over the data-parallel
replicas, their damped inverses, and at the end of every step the
preconditioning of the gradients. The stage's layers are cut into ``units``
(one per linear layer), and the work into actions of six kinds:

- ``KFAC_A`` (s, j, (u,)): unit u's A from forward j of the capture step,
  after F(s, j); ``KFAC_G`` (s, j, (u,)): its G, after the backward of (s, j);
- ``KFAC_SYNC_A`` / ``KFAC_SYNC_G`` (s, 0, (u,)): the all-reduce of unit u's
  factor over the replicas, into the running average, after every curvature
  piece of that factor;
- ``KFAC_INV`` (s, 0, (u,)): unit u's damped inverses, after both syncs;
- ``KFAC_PRE`` (s, t): the preconditioning of stage s's gradients in step t
  (its ``microbatch`` field is the step), after the stage's last weight
  gradient of the step and, in the cycle's last step, after every inversion:
  the new inverses apply from that step on.

A refresh takes a *cycle* of k copies of the base schedule (a step for the
synchronous families; PipeDream-2BW's ``steps`` steps), unrolled into one
schedule of ``k × steps`` steps: the captures come from the cycle's first
step (microbatches 0 .. m-1), and the pieces go, rank by rank, into the idle
gaps of the base timeline (simulated with the transform's costs), walking
them in time order through copy after copy and putting in each gap, while
one fits with ``margin`` to spare, the available piece that became
available first (curvature before syncs before inversions when tied). k is
the number of copies the pieces need (``every`` forces it). What does not
fit within k copies (or ever, with no bubbles: pp = 1, or 2BW's steady
state) runs on the critical path: a curvature piece right after the action
that made its capture, in the capture step (A after F(s, j), G after the
backward of (s, j)), so that its capture is freed at once, the syncs and
inversions at the end of the cycle's last step; then k is (unless forced)
enough steps for that work to cost at most :data:`OVERHEAD` of a step on
average (the same work wherever it runs). The
synchronous families flush between steps: stage 0's first forward of a step
waits for every stage's preconditioning of the step before.

The sync pieces are collectives over the data-parallel replicas of the
stage, which run the same lists; nothing here crosses pipeline ranks.
Captured layer inputs and output gradients stay in memory until their
curvature piece: :func:`~pipeloom.sim.memory.peak_memory_bytes` counts them
(:func:`~pipeloom.sim.formulas.kfac_capture_bytes`).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from ...errors import PipeloomError, ScheduleError
from ..costs import Costs, StageCosts, register_field
from ..deps import Dependencies, asap
from ..ir import BW, B, F, W, Action, Schedule, parts, shifted
from ..kinds import KINDS, Kind, register, register_inputs
from . import insert

KFAC_A = "KFAC_A"
KFAC_G = "KFAC_G"
KFAC_SYNC_A = "KFAC_SYNC_A"
KFAC_SYNC_G = "KFAC_SYNC_G"
KFAC_INV = "KFAC_INV"
KFAC_PRE = "KFAC_PRE"
#: The pieces of one refresh (the preconditioning runs every step).
PIECES = (KFAC_A, KFAC_G, KFAC_SYNC_A, KFAC_SYNC_G, KFAC_INV)
_PRIORITY = {kind: n for n, kind in enumerate(PIECES)}

# Times of a unit's piece (one microbatch's curvature, one sync, one inversion) on average over a
# stage's units: never split over chunks; the preconditioning is a full stage's, split like F.
for _name in ("kfac_a", "kfac_g", "kfac_sync_a", "kfac_sync_g", "kfac_inv"):
    register_field(_name, split=False)
register_field("kfac_pre")
#: Each unit's share of those times against the average, cycled over a stage's units (a layer's
#: linear layers differ in size: an MLP's factors hold most of a layer's inversion work); the
#: curvature weights time its sync too. None given, every unit costs the average.
UNIT_WEIGHTS = ("kfac_unit_a", "kfac_unit_g", "kfac_unit_inv")
for _name in UNIT_WEIGHTS:
    register_field(_name, per="unit")

#: The refresh interval's upper end when it is chosen by the bubbles.
MAX_EVERY = 20
#: Where pieces fit no bubble, the default interval spreads them over enough steps that the mean
#: step is at most this much longer than without K-FAC (PipeFisher's point: the refresh is nearly
#: free), up to :data:`MAX_SPREAD` steps.
OVERHEAD = 0.10
MAX_SPREAD = 100


class Kfac:
    """The transform. ``units``: pieces per stage (its linear layers), a
    number for every stage or one per stage; ``every``: force the refresh
    interval k (None: the fewest copies whose bubbles hold the pieces, up to
    :data:`MAX_EVERY`, or where some fit none, enough to keep the mean step within
    :data:`OVERHEAD` of the step without K-FAC, :func:`_spread`); ``margin``: a piece
    goes into a gap only if its time times ``1 + margin`` fits."""

    name = "kfac"
    kinds = (*PIECES, KFAC_PRE)
    cost_fields = ("kfac_a", "kfac_g", "kfac_sync_a", "kfac_sync_g", "kfac_inv", "kfac_pre", *UNIT_WEIGHTS)
    room = 0

    def __init__(self, units=1, every: int | None = None, margin: float = 0.05):
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
            raise PipeloomError(f"kfac: refresh interval every={every!r} must be a whole number of steps >= 1")
        if not (isinstance(margin, (int, float)) and 0 <= margin < 10):
            raise PipeloomError(f"kfac: margin {margin!r} must be a fraction >= 0 (e.g. 0.05)")
        self.units, self.every, self.margin = units, every, float(margin)

    def apply(self, schedule: Schedule, costs: Costs | None = None) -> Schedule:
        if schedule.options.get("kfac"):
            raise ScheduleError("the schedule holds K-FAC work already")
        if schedule.options.get("lowered"):
            raise ScheduleError("add K-FAC work before lowering communication")
        units = _units(self.units, schedule.stages)
        per_stage = (costs or Costs()).per_stage(schedule.stages, schedule.chunks)
        base = _with_preconditioning(schedule)
        starts, ends = asap(base, per_stage.duration, per_stage.transfer)
        period = max((max(e) for e in ends if e), default=0.0)
        placed = [_Rank(base, r, starts[r], ends[r], period, units, per_stage, self.margin).fill(self.every)
                  for r in range(schedule.pp)]
        k = self.every or max(1, *(p.copies for p in placed))
        spread = self.every is None and any(p.left for p in placed)
        if spread:
            k = max(k, _spread(schedule, per_stage, period, placed))
        options = {**schedule.options, "kfac": {
            "every": k, "forced": self.every is not None, "spread": spread, "units": list(units),
            "margin": self.margin, "period": schedule.steps, "overflow": [len(p.left) for p in placed],
            "inline": [[[*p.action[:3], *p.action.payload] for p in rank.inline] for rank in placed]}}
        return _unroll(replace(base, options=options), k, placed)


def _spread(schedule: Schedule, costs: StageCosts, period: float, placed: list) -> int:
    """The fewest steps over which the pieces that fit no bubble (they run on the critical
    path) keep the mean step within :data:`OVERHEAD` of ``schedule``'s without K-FAC, whose
    steps take ``period`` with the preconditioning; where the preconditioning alone takes more
    than that, the fewest over which those pieces add at most :data:`OVERHEAD` to it; at most
    :data:`MAX_SPREAD`."""
    ends = asap(schedule, costs.duration, costs.transfer)[1]
    bare = max((max(e) for e in ends if e), default=0.0)
    room = (1 + OVERHEAD) * bare - period
    if room <= 0:
        room = OVERHEAD * bare
    left = max(sum(piece.time for piece in rank.left) for rank in placed)
    return MAX_SPREAD if room <= 0 else min(MAX_SPREAD, max(1, math.ceil(left / room)))


def _units(units, stages: int) -> tuple[int, ...]:
    one = isinstance(units, int) and not isinstance(units, bool)
    values = (units,) * stages if one else tuple(units) if isinstance(units, (list, tuple)) else ()
    if len(values) != stages or not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in values):
        raise PipeloomError(f"kfac: units={units!r} must be a whole number >= 0 per stage "
                            f"(one number, or {stages} of them)")
    return values


def _with_preconditioning(schedule: Schedule) -> Schedule:
    """``schedule`` with KFAC_PRE(s, t) for each of a rank's stages right after the rank's last
    weight gradient of step t (one block per rank and step)."""
    m, extra = schedule.microbatches, []
    for rank, actions in enumerate(schedule.ranks):
        last = {}
        for k, a in enumerate(actions):
            if a.kind in (W, BW):  # what finishes a (stage, microbatch)'s weight gradient
                last[a.microbatch // m] = k
        stages = schedule.stages_of(rank)
        extra.append([(k + 1, n, Action(KFAC_PRE, s, t)) for t, k in last.items() for n, s in enumerate(stages)])
    return replace(schedule, ranks=insert(schedule.ranks, extra))


@dataclass
class _Piece:
    action: Action
    time: float
    ready: float | None  # when its inputs exist (None: waits for other pieces)
    waiting: int = 0  # pieces it still waits for
    then: tuple = ()  # pieces waiting for it

    def key(self):
        a = self.action
        return (self.ready, _PRIORITY[a.kind], a.stage, a.payload, a.microbatch)


class _Rank:
    """One rank's pieces placed into the idle gaps of copy after copy of the base timeline."""

    def __init__(self, base: Schedule, rank, starts, ends, period, units, costs: StageCosts, margin):
        self.rank, self.period, self.margin = rank, period, margin
        self.actions = base.ranks[rank]
        compute = [k for k, a in enumerate(self.actions) if KINDS[a.kind].stream is None]
        pre = [k for k, a in enumerate(self.actions) if a.kind == KFAC_PRE]
        #: index the trailing pieces (and the overflow) go before: the last step's preconditioning
        self.tail = min(k for k in pre if self.actions[k].microbatch == self.actions[pre[-1]].microbatch)
        #: (start, end, index the pieces go before): the idle time before each compute action up to
        #: the tail, and the step's end after it; not after the tail block (the vocabulary passes can
        #: follow a step's preconditioning), where a piece would land after the overflow and the last
        #: step's preconditioning that must follow it
        self.gaps = []
        previous = 0.0
        for k in compute:
            if k > self.tail and self.actions[k].kind != KFAC_PRE:
                break
            self.gaps.append((previous, starts[k], min(k, self.tail)))
            previous = ends[k]
        else:
            self.gaps.append((previous, period, self.tail))
        #: index of each action of the first step in the list (a compound's parts: DualPipeV's pairs)
        self.index = {part: k for k, a in enumerate(self.actions) if a.microbatch < base.microbatches
                      for part in parts(a)}
        self.backward = Dependencies(base).backward
        self.pieces = self._pieces(base, ends, units, costs)
        #: (copy, index, order, action) of every placed piece; ``left``: the overflow
        self.placed: list[tuple] = []
        self.left: list[_Piece] = []
        self.copies = 1

    def _pieces(self, base, ends, units, costs) -> list[_Piece]:
        done = {part: ends[k] for part, k in self.index.items()}  # when each action of the first step ends
        pieces = []
        for s in base.stages_of(self.rank):
            for u in range(units[s]):
                unit = (u,)

                def make(kind, j, ready):
                    return _Piece(Action(kind, s, j, unit), costs.duration(Action(kind, s, j, unit)), ready)
                curvature = {KFAC_A: [make(KFAC_A, j, done[Action(F, s, j)]) for j in range(base.microbatches)],
                             KFAC_G: [make(KFAC_G, j, done[self.backward(s, j)])
                                      for j in range(base.microbatches)]}
                inverse = make(KFAC_INV, 0, None)
                inverse.waiting = 2
                for kind, sync_kind in ((KFAC_A, KFAC_SYNC_A), (KFAC_G, KFAC_SYNC_G)):
                    sync = make(sync_kind, 0, None)
                    sync.waiting, sync.then = base.microbatches, (inverse,)
                    for piece in curvature[kind]:
                        piece.then = (sync,)
                    pieces += curvature[kind] + [sync]
                pieces.append(inverse)
        return pieces

    def fill(self, every: int | None) -> _Rank:
        queues = _Queues(p for p in self.pieces if p.ready is not None)
        remaining = len(self.pieces)
        copy = 0
        while remaining and copy < (every or MAX_EVERY):
            offset, count = copy * self.period, 0
            for gap, (start, end, index) in enumerate(self.gaps):
                cursor, order = offset + start, 0
                end += offset
                while piece := queues.first_fit(cursor, (end - cursor) / (1 + self.margin) + 1e-12):
                    self.placed.append((copy, index, (gap, order), piece.action))
                    cursor, order, count = cursor + piece.time, order + 1, count + 1
                    queues.add(_release(piece, cursor))
            remaining -= count
            if count:
                self.copies = copy + 1
            elif copy:
                break  # from the second copy on every gap looks alike: nothing will fit later either
            copy += 1
        self.left = []
        while piece := queues.first_fit(float("inf"), float("inf")):
            self.left.append(piece)
            queues.add(_release(piece, 0.0))
        return self

    @property
    def inline(self) -> list[_Piece]:
        """The curvature pieces that fit no bubble: each right after its producer, in the capture step."""
        return [p for p in self.left if p.action.kind in (KFAC_A, KFAC_G)]

    @property
    def late(self) -> list[_Piece]:
        """The other pieces that fit no bubble: at the end of the cycle's last step."""
        return [p for p in self.left if p.action.kind not in (KFAC_A, KFAC_G)]

    def after_producer(self, action: Action) -> int:
        """The index right after the action of the first step that made ``action``'s capture."""
        s, j = action.stage, action.microbatch
        return self.index[Action(F, s, j) if action.kind == KFAC_A else self.backward(s, j)] + 1


def _release(piece: _Piece, now: float) -> list[_Piece]:
    """The pieces that waited only for ``piece``, available from ``now``."""
    freed = []
    for other in piece.then:
        other.waiting -= 1
        if other.waiting == 0:
            other.ready = now
            freed.append(other)
    return freed


class _Queues:
    """The available pieces, a heap by priority per (kind, stage): pieces of one queue take the
    same time, so the first that fits is the best-placed head of a queue that fits."""

    def __init__(self, pieces):
        self.heaps: dict[tuple, list] = {}
        self.add(pieces)

    def add(self, pieces) -> None:
        for piece in pieces:
            heapq.heappush(self.heaps.setdefault((piece.action.kind, piece.action.stage), []),
                           (piece.key(), id(piece), piece))

    def first_fit(self, now: float, room: float) -> _Piece | None:
        """Remove and return the highest-priority piece available by ``now`` whose time is at most
        ``room``, or None."""
        heads = [heap[0] for heap in self.heaps.values()
                 if heap and heap[0][2].ready <= now + 1e-12 and heap[0][2].time <= room]
        if not heads:
            return None
        best = min(heads)
        piece = heapq.heappop(self.heaps[best[2].action.kind, best[2].action.stage])[2]
        return piece


def _unroll(base: Schedule, k: int, placed: list[_Rank]) -> Schedule:
    """k copies of ``base`` one after another, each rank's placed pieces in their copies
    (of what did not fit, the curvature right after its producer in the first copy, the rest
    at the end of the last copy, before its last preconditioning)."""
    per_copy = base.total_microbatches
    ranks = []
    for rank, actions in enumerate(base.ranks):
        mine = placed[rank]
        lists = []
        for copy in range(k):
            shift = copy * per_copy
            moved = [shifted(a, copy * base.steps if a.kind == KFAC_PRE else shift) for a in actions]
            extra = [(index, order, a) for c, index, order, a in mine.placed if c == copy]
            if copy == 0:  # before any piece a gap puts at the same index
                extra += [(mine.after_producer(p.action), (-1, n), p.action) for n, p in enumerate(mine.inline)]
            if copy == k - 1:
                extra += [(mine.tail, (len(mine.gaps), n), p.action) for n, p in enumerate(mine.late)]
            lists += insert([moved], [extra])[0]
        ranks.append(tuple(lists))
    return replace(base, ranks=tuple(ranks), steps=base.steps * k)


# -- the kinds and their dependencies ---------------------------------------------
def _settings(schedule: Schedule) -> dict:
    return schedule.options.get("kfac") or {}


def _a_needs(action, deps):
    return (Action(F, action.stage, action.microbatch),)


def _g_needs(action, deps):
    return (deps.backward(action.stage, action.microbatch),)


def _sync_needs(kind):
    def needs(action, deps):
        return tuple(Action(kind, action.stage, j, action.payload) for j in range(deps.schedule.microbatches))
    return needs


def _inv_needs(action, deps):
    return (Action(KFAC_SYNC_A, action.stage, 0, action.payload), Action(KFAC_SYNC_G, action.stage, 0, action.payload))


def _pre_needs(action, deps):
    s, t, m = action.stage, action.microbatch, deps.schedule.microbatches
    found = tuple(Action(W, s, i) if (b := deps.backward(s, i)).kind == B else b for i in range(t * m, (t + 1) * m))
    units = _settings(deps.schedule).get("units")
    if units and t == deps.schedule.steps - 1:
        found += tuple(Action(KFAC_INV, s, 0, (u,)) for u in range(units[s]))
    return found


@register_inputs(kinds=(F,))
def _flush(schedule: Schedule):
    """Synchronous families flush between the cycle's copies: stage 0's first forward of a copy
    after every stage's preconditioning of the copy before."""
    settings = _settings(schedule)
    if not settings or schedule.weight_versions > 1 and settings["period"] == schedule.steps:
        return None
    per_copy = settings["period"] * schedule.microbatches

    def rule(action, deps):
        if action.kind == F and action.stage == 0 and action.microbatch and action.microbatch % per_copy == 0:
            t = action.microbatch // schedule.microbatches - 1
            return tuple(Action(KFAC_PRE, s, t) for s in range(schedule.stages))
        return ()
    return rule


def check_kfac(schedule: Schedule) -> None:
    """A schedule marked with K-FAC work holds every piece of one refresh once per unit and a
    preconditioning of every stage in every step; an unmarked one holds none."""
    found = {a for actions in schedule.ranks for a in actions if a.kind in Kfac.kinds}
    settings = _settings(schedule)
    if not settings:
        if found:
            raise ScheduleError(f"the schedule holds K-FAC work ({next(iter(found))}) but options['kfac'] "
                                "does not describe it")
        return
    units = settings["units"]
    if len(units) != schedule.stages:
        raise ScheduleError(f"options['kfac'] gives units for {len(units)} stages; the schedule has {schedule.stages}")
    for s, count in enumerate(units):
        rank = schedule.placement[s]
        want = [Action(KFAC_PRE, s, t) for t in range(schedule.steps)]
        for u in range(count):
            want += [Action(kind, s, j, (u,)) for kind in (KFAC_A, KFAC_G) for j in range(schedule.microbatches)]
            want += [Action(kind, s, 0, (u,)) for kind in (KFAC_SYNC_A, KFAC_SYNC_G, KFAC_INV)]
        for action in want:
            if action not in found:
                raise ScheduleError(f"rank {rank}: K-FAC piece {action.kind} of stage {s} microbatch "
                                    f"{action.microbatch} {action.payload or ''} is missing")
            found.discard(action)
    if found:
        extra = next(iter(found))
        raise ScheduleError(f"rank {schedule.rank_of(extra)}: K-FAC piece {extra.kind} {extra.stage}:"
                            f"{extra.microbatch} {extra.payload} is not part of the refresh")


_COMMON = dict(torch_csv=None, check=check_kfac)
register(Kind(KFAC_A, "K-FAC A", needs=_a_needs, cost=("kfac_a",), colour="#e5ae38", letter="a",
              weight="kfac_unit_a", **_COMMON))
register(Kind(KFAC_G, "K-FAC G", needs=_g_needs, cost=("kfac_g",), colour="#bcbd22", letter="g",
              weight="kfac_unit_g", **_COMMON))
register(Kind(KFAC_SYNC_A, "K-FAC sync A", needs=_sync_needs(KFAC_A), cost=("kfac_sync_a",), colour="#8c564b",
              letter="y", weight="kfac_unit_a", **_COMMON))
register(Kind(KFAC_SYNC_G, "K-FAC sync G", needs=_sync_needs(KFAC_G), cost=("kfac_sync_g",), colour="#8c564b",
              letter="y", weight="kfac_unit_g", **_COMMON))
register(Kind(KFAC_INV, "K-FAC inverse", needs=_inv_needs, cost=("kfac_inv",), colour="#17becf", letter="i",
              weight="kfac_unit_inv", **_COMMON))
register(Kind(KFAC_PRE, "K-FAC precondition", needs=_pre_needs, cost=("kfac_pre",), colour="#810f7c",
              letter="p", **_COMMON))
