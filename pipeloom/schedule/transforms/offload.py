"""PipeOffload as a transform: activations copied to host after F and back before B, and what B keeps for W.

"PipeOffload: Improving Scalability of Pipeline Parallelism with Memory
Optimization" (Wan et al. 2025). After the forward of a (stage, microbatch)
pair, ``OFFLOAD`` copies the activations it saved to host memory; ``RELOAD``
copies them back before its backward. They run on two side streams per rank
(:attr:`~..kinds.Kind.stream`), the OFFLOADs on ``d2h`` and the RELOADs on
``h2d``, each in list order, so copies overlap compute and the host link
carries both directions at once. Their time is the cost field ``offload``
(one pair's ``m_b`` over the host link); activation memory falls by ``m_b``
when an OFFLOAD ends and rises when a RELOAD starts; host memory holds it
from the OFFLOAD's start to the RELOAD's end. In split-backward schedules the
memory kept from B until W (``m_w``: the weight gradients' inputs) is a second
kind of pair (:data:`PHASES`): ``OFFLOAD_W`` after B, ``RELOAD_W`` before W,
on the same streams, in the time ``offload_w`` (by default ``offload``
scaled by ``m_w / m_b``), placed by the same machinery; a pair below is either.

First no copy delays compute: each rank's copy streams are planned as
timetables (:class:`_Link`), and a pair is copied only where its OFFLOAD fits
``d2h`` after its F's end and its RELOAD (as late as it can) fits ``h2d`` to
end by its backward's start, with an action between them
(:meth:`_Pairs._fit`). A copy goes in the list after the last compute action
that ends by its planned start, the copies in the order of their starts, so
each stream, which runs its copies in list order, starts none later than
planned.

Where that stops short because a rank's forwards outrun ``d2h`` (a warm-up's
back-to-back Fs, when a copy takes longer than an F), the rank's Fs may be
paced to the stream: each F waits for the OFFLOAD a few offloads before it
(``options["offload"]["waits"]``, :func:`_paced`), kept only where the step
grows by at most :data:`PACE_COST`. In 1F1B the warm-up's Fs run ahead of
when the next ranks need them, so pacing them costs little.

Where the worst peak still holds what Bs keep for deferred Ws (a split
backward's cool-down, when the copy streams are full), Ws held there may run
right after their Bs instead (:func:`_moved`: the W moved in the list, the
copies of its ``m_w`` dropped; a move rather than a fused BW, which would send
B's gradient W's time later), one by one on the rank of the worst peak, each
simulated on the whole schedule and kept where that rank's peak falls, no
other's rises, and the step stays within :data:`STEP_COST` of the step
without copies (``options["offload"]["moved"]``). The time budget is spent in
that order: pacing first (at most :data:`PACE_COST`), the moves with what is
left.

Policies (:class:`Offload`), per rank:

- ``selective`` with a ratio r in (0, 1]: sweeping the instants in time
  order, at each one above (1 - r) of the peak without offload, the pair in
  flight that fits and stays off the device the furthest ahead
  (:meth:`_Sweep.cover`).
- ``full``: the lowest peak that sweep reaches, then every other pair that
  still fits (:attr:`_Sweep.lowest`); also for selective where the streams
  cannot reach (1 - r). Where it stops short, the eager placement (each
  OFFLOAD right after its F, each RELOAD as late as the stream back allows,
  :func:`_eager`) is tried too, and the rank keeps the lower simulated peak;
  then the eager copies with paced Fs (:func:`_paced`: full keeps the
  tightest pace within its cost, selective the loosest that reaches (1 - r));
  then moved Ws (full: while the worst peak falls; selective: until it is at
  (1 - r) of the worst peak without offload).

Dependencies: OFFLOAD(s,i) after F(s,i); RELOAD(s,i) after OFFLOAD(s,i);
the backward (B or BW) of an offloaded pair after its RELOAD; a paced F
after the OFFLOAD it waits for; OFFLOAD_W(s,i) after B(s,i), RELOAD_W(s,i)
after OFFLOAD_W(s,i), W(s,i) after RELOAD_W(s,i) where it has one.

Works with every family, DualPipeV's overlapped F-and-backward pairs included
(a pair's RELOAD goes before the compound action whose backward needs it, its
OFFLOAD after the one whose F made it), with vocabulary parallelism (the
vocabulary passes' buffers stay on the device) and with recomputation (then
only the stage inputs that recomputation keeps are offloaded). Nothing is
refused.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace
from functools import cached_property
from itertools import accumulate
from operator import itemgetter
from typing import NamedTuple

from ...errors import PipeloomError, ScheduleError
from ..costs import Costs, StageCosts, register_field
from ..deps import Dependencies, _program, asap
from ..ir import BW, B, F, W, Action, Schedule, parts
from ..kinds import COMPOUND, KINDS, Kind, register, register_inputs
from . import insert

#: Copy a pair's saved activations to host memory (after its F).
OFFLOAD = "OFFLOAD"
#: Copy them back to the device (before its backward).
RELOAD = "RELOAD"
#: Copy what a pair's B keeps for its W (the weight gradients' inputs) to host memory (after its B).
OFFLOAD_W = "OFFLOAD_W"
#: Copy them back to the device (before its W).
RELOAD_W = "RELOAD_W"
#: The side streams they run on, one per direction of the host link (which carries both at once).
OUT_STREAM, BACK_STREAM = "d2h", "h2d"
POLICIES = ("none", "full", "selective")
_NOISE = 1e-9  # relative: memory levels that differ by less are equal
_FIRST, _CHANGE = itemgetter(0), itemgetter(1)

register_field("offload")


def _w_copy_time(values: dict) -> tuple[float, ...]:
    """``offload_w`` not given: ``offload`` scaled by ``m_w / m_b`` (the same host link)."""
    return tuple(t * w / b if b else 0.0 for t, w, b in zip(values["offload"], values["m_w"], values["m_b"]))


register_field("offload_w", derive=_w_copy_time)


class Phase(NamedTuple):
    """One kind of pair: the memory ``held`` (a cost field) from an action of a kind in ``after``
    to one of a kind in ``before``, copied to host by ``out`` and back by ``back``, each taking
    the cost field ``time``."""

    out: str
    back: str
    after: tuple[str, ...]
    before: tuple[str, ...]
    held: str
    time: str


#: The pairs offload copies, a pair being (stage, microbatch, index here): a forward's activations
#: (F to its backward) and what B keeps for W.
PHASES = (Phase(OFFLOAD, RELOAD, (F,), (B, BW), "m_b", "offload"),
          Phase(OFFLOAD_W, RELOAD_W, (B,), (W,), "m_w", "offload_w"))
#: The copy kinds: kind -> (its phase's index, whether it goes to host).
COPIES = {kind: (p, kind == phase.out) for p, phase in enumerate(PHASES) for kind in (phase.out, phase.back)}
_OPENS = {kind: p for p, phase in enumerate(PHASES) for kind in phase.after}
_CLOSES = {kind: p for p, phase in enumerate(PHASES) for kind in phase.before}


def copies(pair) -> tuple[Action, Action]:
    """The two copies of ``pair`` (stage, microbatch, phase): to host and back."""
    phase = PHASES[pair[2]]
    return Action(phase.out, pair[0], pair[1]), Action(phase.back, pair[0], pair[1])


def pair_of(copy: Action) -> tuple[int, int, int]:
    """The pair a copy action moves."""
    return copy.stage, copy.microbatch, COPIES[copy.kind][0]


def spans(actions):
    """(pair, index of the action that opens it, index of the one that closes it) of one rank's
    list, its side-stream actions skipped (a compound action's parts count)."""
    opened = {}
    for k, a in enumerate(actions):
        if KINDS[a.kind].stream:
            continue
        for part in parts(a):
            closes, opens = _CLOSES.get(part.kind), _OPENS.get(part.kind)
            if closes is not None and (part.stage, part.microbatch, closes) in opened:
                pair = part.stage, part.microbatch, closes
                yield pair, opened.pop(pair), k
            if opens is not None:
                opened[part.stage, part.microbatch, opens] = k


def check_policy(policy: str, ratio: float | None = None) -> tuple[str, float]:
    """``(policy, ratio)`` checked: ratio in (0, 1] for selective (1 for full, 0 for none)."""
    if policy not in POLICIES:
        raise PipeloomError(f"unknown offload policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy != "selective":
        if ratio is not None:
            raise PipeloomError(f"an offload ratio ({ratio!r}) goes with the selective policy, not {policy!r}")
        return policy, 1.0 if policy == "full" else 0.0
    if ratio is None:
        raise PipeloomError("selective offload needs a ratio in (0, 1] (--offload-ratio)")
    if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise PipeloomError(f"offload ratio {ratio!r}: must be in (0, 1]")
    return policy, float(ratio)


class Offload:
    """The transform: ``policy`` none, full or selective (with ``ratio``)."""

    name = "offload"
    kinds = tuple(COPIES)
    cost_fields = ("offload", "offload_w")
    room = 0

    def __init__(self, policy: str, ratio: float | None = None):
        self.policy, self.ratio = check_policy(policy, ratio)

    def apply(self, schedule: Schedule, costs: Costs | None = None) -> Schedule:
        if self.policy == "none":
            return schedule
        if schedule.options.get("offload"):
            raise ScheduleError("the schedule is offloaded already")
        if schedule.options.get("lowered"):
            raise ScheduleError("offload a schedule before lowering its communication")
        pairs = _pairs_of(schedule, costs)
        per_stage = pairs.costs
        options = {**schedule.options, "offload": {"policy": self.policy, "ratio": self.ratio}}
        schedule = replace(schedule, options=options)
        ratio = None if self.policy == "full" else self.ratio
        swept, short = pairs.choose(ratio)
        timed = [_timetabled(pairs, {p: v for p, v in swept.items() if pairs.where[p][0] == r})
                 for r in range(schedule.pp)]
        if not short:
            return _assemble(schedule, pairs, timed)
        return _moved(_fallen_back(schedule, pairs, per_stage, timed, short, ratio), pairs, per_stage, short, ratio)


#: The schedules last offloaded, each with its costs and its pairs (:func:`_pairs_of`), the latest last.
_RECENT: list[tuple] = []
#: How many :data:`_RECENT` keeps: the planner and the infeasible hunt take a schedule's policies
#: a few schedules apart (e.g. one per vocabulary-parallel setting in between).
_KEPT = 4


def _pairs_of(schedule: Schedule, costs: Costs | None) -> _Pairs:
    """``schedule``'s pairs under ``costs``, the last few kept for the next call with the same two
    objects: the planner offloads one schedule under one costs with each policy, and what does not
    depend on the policy (each rank's sweep and its lowest peak, the eager copies) is worked out once."""
    for k, (known, priced, pairs) in enumerate(_RECENT):
        if known is schedule and priced is costs:
            _RECENT.append(_RECENT.pop(k))
            return pairs
    pairs = _Pairs(schedule, (costs or Costs()).per_stage(schedule.stages, schedule.chunks))
    for *_, dropped in _RECENT[:-(_KEPT - 1)]:
        dropped.sweeps.clear()  # each sweep refers to its pairs: freed now, not by the collector
    _RECENT[:] = [*_RECENT[-(_KEPT - 1):], (schedule, costs, pairs)]
    return pairs


def _fallen_back(schedule: Schedule, pairs: _Pairs, costs: StageCosts, timed: list, short: set,
                 ratio: float | None) -> Schedule:
    """Where the timetable stops short (full, or selective beyond the stream), the eager copies
    (each pair's copy to host right after its F, :func:`_eager`) are tried too: the rank keeps
    whichever peaks lower (its copies touch no other rank); then paced Fs (:func:`_paced`)."""
    eager, eagerly = _eager(schedule, pairs)
    assembled = (_assemble(schedule, pairs, timed), eagerly)
    times = [asap(each, costs.duration, costs.transfer) for each in assembled]
    peaks = [_levels(each, costs, *timeline) for each, timeline in zip(assembled, times)]
    kept = [1 if r in short and peaks[1][r] < peaks[0][r] else 0 for r in range(schedule.pp)]
    entries = [(timed, eager)[k][r] for r, k in enumerate(kept)]
    best = assembled[kept[0]] if len(set(kept)) == 1 else _assemble(schedule, pairs, entries)
    behind = _behind(eagerly, times[1], short)
    if not behind:
        return best
    before = [peaks[k][r] for r, k in enumerate(kept)]  # a rank's copies touch no other rank
    return _paced(best, schedule, pairs, costs, entries, eager, behind, before, ratio)


class _Pairs:
    """The (stage, microbatch) pairs of a schedule on its timeline without offload: which to copy
    and where their copies fit each rank's copy streams (:meth:`choose`)."""

    def __init__(self, schedule: Schedule, costs: StageCosts):
        self.schedule, self.costs = schedule, costs
        self.starts, self.ends = asap(schedule, costs.duration, costs.transfer)
        #: pair -> (rank, index of the action that opens it (F; B), of the one that closes it (its backward; W))
        self.where: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        #: per rank, (end, index) of its compute actions in list order: where a copy can be issued
        self.issues: list[list[tuple[float, int]]] = []
        for rank, actions in enumerate(schedule.ranks):
            self.issues.append([(self.ends[rank][k], k) for k, a in enumerate(actions) if not KINDS[a.kind].stream])
            self.where.update((pair, (rank, f, b)) for pair, f, b in spans(actions))
        #: pair -> (end of the action that opens it, start of the one that closes it)
        self.gaps = {pair: (self.ends[rank][f], self.starts[rank][b]) for pair, (rank, f, b) in self.where.items()}
        #: the step's time without copies (the last end)
        self.span = max((max(ends, default=0.0) for ends in self.ends), default=0.0)
        #: rank -> its :class:`_Sweep`, once asked (:meth:`choose`)
        self.sweeps: dict[int, _Sweep] = {}
        #: the eager copies' entries, once placed (:func:`_eager`)
        self.eager: list[list[tuple]] | None = None
        #: id of a rank's copy entries -> (them, the rank's list with them: :meth:`listed`)
        self.lists: dict[int, tuple[list, tuple]] = {}
        #: what deriving timing programs found of each rank's list
        #: (:func:`~.offload_program.with_copies`), kept for the placements tried next
        self.derived: dict = {}

    def listed(self, rank: int, entries: list[tuple]) -> tuple[Action, ...]:
        """``rank``'s list with its copy ``entries`` (:func:`~. insert`'s) in it, the same object for
        the same entries (so that what timing it found is kept: :attr:`derived`)."""
        known = self.lists.get(id(entries))
        if known is None or known[0] is not entries:
            known = self.lists[id(entries)] = entries, insert((self.schedule.ranks[rank],), (entries,))[0]
        return known[1]

    def copy(self, pair) -> float:
        """The time of each of the pair's copies."""
        return self.costs.values[PHASES[pair[2]].time][pair[0]]

    def size(self, pair) -> float:
        """The memory the pair's copies move."""
        return self.costs.values[PHASES[pair[2]].held][pair[0]]

    def stream(self) -> _Link:
        """An empty pair of copy streams, times equal within float noise of the schedule's span."""
        slack = _slack(self.span)
        return _Link(_Stream(slack), _Stream(slack))

    @cached_property
    def peak(self) -> float:
        """The largest rank's activation peak without copies."""
        return max(_levels(self.schedule, self.costs, self.starts, self.ends))

    def gap(self, pair) -> tuple[float, float]:
        """End of the action that opens the pair (F; B) and start of the one that closes it (its backward; W)."""
        return self.gaps[pair]

    def eligible(self) -> list[tuple[int, int, int]]:
        """Pairs that move memory, whose gap holds both copies (any gap when copies are free) with
        two actions or more between the actions that open and close them (:func:`copyable`)."""
        found = []
        for pair, (rank, f, b) in self.where.items():
            end, start = self.gap(pair)
            if start - end > 2 * self.copy(pair) and start > end and b - f > 2 and self.size(pair) > 0:
                found.append(pair)
        return found

    def issued_after(self, rank: int, at: float, first: int) -> int | None:
        """The last compute action of ``rank`` from index ``first`` on that ends by ``at`` (a copy
        placed after it starts no earlier than that end, :func:`~..deps.asap`), or None."""
        issues = self.issues[rank]
        k = bisect.bisect_right(issues, (at + _slack(at), math.inf)) - 1
        return issues[k][1] if k >= 0 and issues[k][1] >= first else None

    def choose(self, ratio: float | None) -> tuple[dict, set]:
        """The pairs to copy and their copies' places, pair -> (OFFLOAD's start, RELOAD's start, the
        compute action RELOAD follows) on the rank's copy streams, each copy in a free interval of its
        stream so that no backward waits for its RELOAD. ``ratio`` None (full): on each rank the
        lowest peak the streams reach, then every other pair that still fits (:attr:`_Sweep.lowest`).
        Else the pairs that bring each rank's peak to (1 - ratio) of its value (:meth:`_Sweep.cover`),
        or, where the streams cannot, full's. And the ranks that took full's."""
        chosen, short = {}, set()
        by_rank: dict[int, list] = {}
        for pair in self.eligible():
            by_rank.setdefault(self.where[pair][0], []).append(pair)
        for rank, candidates in sorted(by_rank.items()):
            sweep = self.sweeps.get(rank)
            if sweep is None:
                sweep = self.sweeps[rank] = _Sweep(self, rank, candidates)
            picked = sweep.cover((1 - ratio) * sweep.peak) if ratio is not None else None
            if picked is None:
                picked = sweep.lowest
                short.add(rank)
            chosen.update(picked)
        return chosen, short

    def _fit(self, pair, stream: _Link):
        """Where ``pair``'s copies go on ``stream``: the OFFLOAD as early as its F's end allows, the
        RELOAD as late as its backward allows; (OFFLOAD's start, RELOAD's start, the action RELOAD
        follows), or None where they do not fit with the pair off the device for a while."""
        rank, f, b = self.where[pair]
        copy, (end, start) = self.copy(pair), self.gap(pair)
        leave = stream.out.earliest(end, copy)
        back = stream.back.latest(leave + copy, start, copy)
        if back is None:
            return None
        after = self.issued_after(rank, back, f + 1)
        if after is None or after >= b or self.ends[rank][after] <= leave + copy:
            return None  # its RELOAD would have to be issued before anything ran while it was away
        return leave, back, after

    def _events(self, rank: int) -> list[tuple[float, float]]:
        """(time, change) of the rank's activation memory without offload."""
        return _memory_events(self.schedule.ranks[rank], self.costs, self.starts[rank], self.ends[rank])


class _Sweep:
    """One rank's pairs against a target for its activation peak, swept in time: at each instant
    above the target, the pair in flight whose copies fit the stream and keep it off the device
    the furthest ahead (from its OFFLOAD's end to the end of the action its RELOAD follows, which
    the RELOAD never starts before) is copied, until the instant is at the target."""

    def __init__(self, pairs: _Pairs, rank: int, candidates: list):
        self.pairs = pairs
        events = pairs._events(rank)
        self.grid = sorted({t for t, _ in events}.union(end for end, _ in pairs.issues[rank]))
        self.base = _profile(events, self.grid)
        self.peak = max(self.base, default=0.0)
        self.candidates = sorted(candidates, key=lambda p: (pairs.gap(p)[0], p[1], p[0], p[2]))  # by their F's (B's) end
        #: per candidate, the first instant it is surely back by, wherever it goes (:meth:`_off`'s end
        #: at most: its RELOAD follows an action that ends by the start of the pair's backward)
        self.reach = [bisect.bisect_left(self.grid, pairs.gap(p)[1] - _NOISE) for p in self.candidates]

    def cover(self, target: float, stream: _Link | None = None) -> dict | None:
        """Pairs and their places that keep every instant at or below ``target``, or None."""
        pairs, grid, gaps, candidates = self.pairs, self.grid, self.pairs.gaps, self.candidates
        stream, chosen = stream or self.pairs.stream(), {}
        ends = [0.0] * (len(grid) + 1)  # the savings that end at each instant
        saved, k, count, reaches, limit = 0.0, 0, len(candidates), self.reach, target + _slack(self.peak)
        live = []  # (-reach, order, pair) of the pairs in flight: the furthest reaching first, then by order
        for i, t in enumerate(grid):
            saved -= ends[i]
            while k < count and gaps[candidates[k]][0] < t:
                bisect.insort(live, (-reaches[k], k, candidates[k]))
                k += 1
            while live and -live[-1][0] <= i:
                live.pop()  # surely back by now (those that reach least come last)
            while self.base[i] - saved > limit:
                best = None  # (-end, order, pair, placed): the pair off the furthest ahead, the first on ties
                for reach, order, pair in live:
                    if -reach <= i or best is not None and (reach, order) > best[:2]:
                        break  # neither this pair nor any after it can be off at i, or beat the best
                    placed = pairs._fit(pair, stream)
                    if placed is not None:
                        first, end = self._off(pair, placed)
                        if first <= i < end and (best is None or (-end, order) < best[:2]):
                            best = -end, order, pair, placed
                if best is None:
                    return None
                end, order, pair, placed = -best[0], *best[1:]
                stream.take(pairs.copy(pair), placed)
                chosen[pair] = placed
                live.remove((-self.reach[order], order, pair))
                saved += pairs.size(pair)
                ends[end] += pairs.size(pair)
        return chosen

    @cached_property
    def lowest(self) -> dict:
        """The pairs of the lowest peak :meth:`cover` reaches (to a hundredth of the peak), then
        every other pair whose copies still fit, by their F's end (their copies only delay the
        RELOADs queued behind them: the pairs come back later)."""
        low, high, best = 0.0, self.peak, {}
        while high - low > 1e-2 * self.peak:
            middle = (low + high) / 2
            stream = self.pairs.stream()
            found = self.cover(middle, stream)
            if found is None:
                low = middle
            else:
                high, best, kept = middle, found, stream
        stream = kept if best else self.pairs.stream()
        for pair in self.candidates:
            if pair not in best:
                placed = self.pairs._fit(pair, stream)
                if placed is not None:
                    stream.take(self.pairs.copy(pair), placed)
                    best[pair] = placed
        return best

    def _off(self, pair, placed) -> tuple[int, int]:
        """The instants (grid indices, from, to but not) a placed pair is surely off the device:
        from the first at or after its OFFLOAD's end to the end of the action its RELOAD follows."""
        leave, _, after = placed
        first = bisect.bisect_left(self.grid, leave + self.pairs.copy(pair) - _slack(leave))
        end = bisect.bisect_left(self.grid, self.pairs.ends[self.pairs.where[pair][0]][after] - _slack(leave))
        return first, end


class _Stream:
    """One rank's copy stream: its busy intervals (start, end), in time order; times within
    ``slack`` are equal."""

    def __init__(self, slack: float):
        self.busy: list[tuple[float, float]] = []
        self.slack = slack

    def earliest(self, at: float, length: float) -> float:
        """The earliest start from ``at`` on of a free interval of ``length``."""
        t, slack = at, self.slack
        for start, end in self.busy[max(bisect.bisect_left(self.busy, (at,)) - 1, 0):]:
            if end <= t + slack:
                continue
            if start >= t + length - slack:
                break
            t = end
        return t

    def latest(self, first: float, deadline: float, length: float) -> float | None:
        """The latest start from ``first`` on of a free interval of ``length`` ending by ``deadline``, or None."""
        t, slack, busy = deadline - length, self.slack, self.busy
        for k in range(bisect.bisect_left(busy, (deadline,)) - 1, -1, -1):
            start, end = busy[k]
            if start >= t + length - slack:
                continue
            if end <= t + slack:
                break
            t = start - length
            if t < first - slack:
                return None  # it only moves earlier
        return t if t >= first - slack else None

    def take(self, start: float, length: float) -> None:
        """Hold the stream from ``start`` for ``length``."""
        bisect.insort(self.busy, (start, start + length))


class _Link:
    """One rank's two copy streams: ``out`` (the OFFLOADs) and ``back`` (the RELOADs)."""

    def __init__(self, out: _Stream, back: _Stream):
        self.out, self.back = out, back

    def take(self, length: float, placed) -> None:
        """Hold both for a pair's copies of ``length``, ``placed`` as :meth:`_Pairs._fit` says."""
        self.out.take(placed[0], length)
        self.back.take(placed[1], length)


def _slack(t: float) -> float:
    return _NOISE * max(abs(t), 1.0)


def _forwards(action: Action) -> list[Action]:
    """The Fs ``action`` runs (a compound's: DualPipeV's overlapped F and backward)."""
    return [part for part in parts(action) if part.kind == F]


def copyable(actions) -> list[tuple[int, int, int]]:
    """The pairs of one rank's list, before offload, that a policy may copy: those with at
    least two actions between the actions that open and close them (the copy to host goes
    right after the first, the one back at least one action later: :meth:`_Pairs.eligible`),
    whatever the costs."""
    return [pair for pair, f, b in spans(actions) if b - f > 2]


def early_ws(actions) -> list[Action]:
    """One rank's list with each W right after its B: where the transform may move it
    (:func:`_moved`), so the least a W can hold what its B kept (side-stream actions kept)."""
    split = {(a.stage, a.microbatch) for a in actions if a.kind == W}
    found = []
    for a in actions:
        if a.kind != W:
            found.append(a)
            found += [Action(W, p.stage, p.microbatch) for p in parts(a)
                      if p.kind == B and (p.stage, p.microbatch) in split]
    return found


def copied_pairs(actions) -> list[tuple[int, int, int]]:
    """The pairs a list copies back (with an offload: each it copies)."""
    return [pair_of(a) for a in actions if a.kind in COPIES and not COPIES[a.kind][1]]


def tightest(actions, pairs) -> list[Action]:
    """One rank's list with the copies of ``pairs`` at their tightest: its side-stream
    actions left out, each pair's copy to host right after the action that opens it (F; B) and
    its copy back right before the one that closes it (its backward; W). On any timeline a copy
    to host frees its bytes after that action ends and a copy back holds them before the other
    starts, so this list's :func:`~..deps.peak_activation` is at most the rank's simulated peak
    once ``pairs`` are copied to host, wherever the copies run."""
    pairs = set(pairs)
    found = []
    for a in actions:
        if KINDS[a.kind].stream:
            continue
        members = parts(a)
        found += [copies(pair)[1] for p in members if p.kind in _CLOSES
                  and (pair := (p.stage, p.microbatch, _CLOSES[p.kind])) in pairs]
        found.append(a)
        found += [copies(pair)[0] for p in members if p.kind in _OPENS
                  and (pair := (p.stage, p.microbatch, _OPENS[p.kind])) in pairs]
    return found


def _profile(events: list[tuple[float, float]], grid: list[float]) -> list[float]:
    """A memory profile's level at each time of ``grid`` (which holds every event's time), after
    the ``events`` (in time order, :func:`_memory_events`) up to it."""
    levels, level, k = [], 0.0, 0
    ordered = events
    for t in grid:
        while k < len(ordered) and ordered[k][0] <= t:
            level += ordered[k][1]
            k += 1
        levels.append(level)
    return levels


def _timetabled(pairs: _Pairs, chosen: dict) -> list[tuple]:
    """One rank's copies where their timetable puts them, as :func:`_assemble` takes them: each
    after the last compute action that ends by its planned start, in the order of their starts
    (the copy stream runs them in list order, so none starts later than planned)."""
    entries = []
    for pair, (leave, back, after) in chosen.items():
        rank, f, _ = pairs.where[pair]
        out, home = copies(pair)
        entries.append((pairs.issued_after(rank, leave, f) + 1, leave, 0, pair, out))
        entries.append((after + 1, back, 1, pair, home))
    return entries


def _assemble(schedule: Schedule, pairs: _Pairs, entries: list[list[tuple]], waits: list | None = None) -> Schedule:
    """The schedule with each rank's copy ``entries`` (:func:`~. insert`'s) in its list, and the
    Fs' ``waits`` (:func:`_waits`) if any, timed by the bare schedule's program."""
    from .offload_program import with_copies  # it reads this module's kinds
    result = replace(schedule, ranks=tuple(pairs.listed(r, listed) for r, listed in enumerate(entries)))
    if waits:
        result = replace(result, options={**result.options,
                                          "offload": {**result.options["offload"], "waits": waits}})
    with_copies(result, pairs.schedule, pairs.derived)
    return result


def _timed(schedule: Schedule, costs: StageCosts) -> tuple[list[float], float]:
    """Each rank's activation peak on the simulated timeline, and the step's time (the last end)."""
    starts, ends = asap(schedule, costs.duration, costs.transfer)
    return _levels(schedule, costs, starts, ends), max((max(e, default=0.0) for e in ends), default=0.0)


def _memory_events(actions, costs: StageCosts, starts, ends) -> list[tuple[float, float]]:
    """(time, change) of one rank's activation memory on a timeline, in time order: a rise at its
    action's start, a fall at its end (falls before rises at one instant)."""
    rises, falls = costs.memory_changes(actions)
    events = [(starts[k], d) for k, d in rises]
    events += [(ends[k], d) for k, d in falls]
    events.sort()
    return events


def _levels(schedule: Schedule, costs: StageCosts, starts, ends, before: tuple | None = None) -> list[float]:
    """Each rank's activation peak on the timeline ``starts``, ``ends``; ``before``: (lists, peaks,
    starts, ends) of another timeline, whose peak a rank keeps where its list and times are the same."""
    if before is None:
        return [_level(actions, costs, *times) for actions, *times in zip(schedule.ranks, starts, ends)]
    return [peak if actions is was and [start, end] == old else _level(actions, costs, start, end)
            for actions, start, end, was, peak, *old in zip(schedule.ranks, starts, ends, *before)]


def _level(actions, costs: StageCosts, starts, ends) -> float:
    """One rank's activation peak on a timeline."""
    return max(accumulate(map(_CHANGE, _memory_events(actions, costs, starts, ends)), initial=0.0))


def _eager(schedule: Schedule, pairs: _Pairs) -> tuple[list[list[tuple]], Schedule]:
    """Each rank's copies placed as the list goes rather than on a timetable (and the schedule with
    them, :func:`_assemble`'s): every eligible F pair's OFFLOAD right after its F, the stream left
    to order them, and its RELOAD as late as the copy stream back allows with no backward waiting
    (:func:`_reloads_back_in_time`). What B keeps for W is left to the timetable: eager copies of
    it crowd the stream the warm-up's Fs need (v-half at seq 32768 without recomputation: full's
    cut fell from 2.5x to 2.0x). The entries are kept on ``pairs``: another policy's fallback
    places them alike."""
    if pairs.eager is None:
        by_rank: list[list] = [[] for _ in schedule.ranks]
        for pair in pairs.eligible():
            if pair[2] == 0:
                by_rank[pairs.where[pair][0]].append(pair)
        pairs.eager = [_reloads_back_in_time(pairs, r, eligible) for r, eligible in enumerate(by_rank)]
    return pairs.eager, _assemble(schedule, pairs, pairs.eager)


def _reloads_back_in_time(pairs: _Pairs, rank: int, eligible: list) -> list[tuple]:
    """One rank's eager copy entries (:func:`~. insert`'s): each pair's OFFLOAD right after its F,
    the stream running them in list order; its RELOAD's latest start worked out backwards from the
    last backward, each ending by its backward's start and by the next RELOAD's latest start, and
    issued after the last compute action that ends by it. The stream runs them in that order, so
    none starts later than that and no backward waits: the rank's compute keeps its times
    without copies. A pair whose RELOAD would have to start before its OFFLOAD ends, or be issued
    before any compute action ran while the pair was away (as :meth:`_Pairs._fit` leaves such a
    pair), is left out, and the rest placed again (their OFFLOADs then end sooner), until none is."""
    starts, ends, issues, where = pairs.starts[rank], pairs.ends[rank], pairs.issues[rank], pairs.where
    took = {pair: pairs.copy(pair) for pair in eligible}  # each copy's time, either way
    kept = sorted(eligible, key=lambda p: (where[p][1], p))  # by their Fs
    while True:
        free, away = 0.0, {}  # the stream to host's last end; pair -> the end of its OFFLOAD
        for pair in kept:
            free = away[pair] = max(ends[where[pair][1]], free) + took[pair]
        entries, latest, left = [], math.inf, set()  # latest: the next RELOAD's latest start
        for order, pair in enumerate(sorted(kept, key=lambda p: (starts[where[p][2]], p), reverse=True)):
            out, back = copies(pair)
            by = min(starts[where[pair][2]], latest)
            start = by - took[pair] - _slack(by)  # the slack: its end lands by ``by`` in floats too
            issued = issues[bisect.bisect_right(issues, (start, math.inf)) - 1][1]
            if start < away[pair] or ends[issued] <= away[pair]:
                left.add(pair)  # it would be back before any action ran while it was away
                continue
            latest = start
            entries += [(where[pair][1] + 1, 0, 0, pair, out), (issued + 1, 1, -order, pair, back)]
        if not left:
            return entries
        kept = [pair for pair in kept if pair not in left]


#: Paces tried (:func:`_paced`): an F waits until at most this many of its rank's earlier offloads are unfinished.
PACES = (1, 2)
#: The most time pacing may add to the step (a fraction of the unpaced step).
PACE_COST = 0.02
#: The most time offload may add to the step in all (a fraction of the step without copies): pacing
#: first (at most :data:`PACE_COST`), then Ws moved right after their Bs (:func:`_moved`) with what is left.
STEP_COST = 0.05
#: The most Ws :func:`_moved` tries to move on one rank.
W_TRIES = 6


def _behind(schedule: Schedule, times: tuple, ranks: set) -> set:
    """The ``ranks`` (of eager copies: each OFFLOAD right after its F) where an F starts before the
    previous pair's OFFLOAD ends on the simulated timeline ``times`` (starts, ends): their offload
    stream falls behind."""
    starts, ends = times
    found = set()
    for r in ranks:
        copied = None  # the end of the last OFFLOAD so far
        for k, a in enumerate(schedule.ranks[r]):
            if a.kind == OFFLOAD:
                copied = ends[r][k]
            elif copied is not None and starts[r][k] < copied - _slack(copied) and _forwards(a):
                found.add(r)
                break
    return found


def _paced(best: Schedule, schedule: Schedule, pairs: _Pairs, costs: StageCosts, entries: list, eager: list,
           behind: set, before: list[float], ratio: float | None) -> Schedule:
    """``best`` (copies that delay no compute, in ``schedule``; ``before``: its ranks' peaks), or,
    on the ranks ``behind`` (whose offload stream falls behind their forwards: a warm-up's
    back-to-back Fs make activations faster than the host link takes them), the eager copies with
    the Fs paced to the stream: each F waits for the OFFLOAD ``pace`` offloads before it
    (``options["offload"]["waits"]``). A rank is paced where that lowers its simulated peak; a pace
    of :data:`PACES` counts where the step grows by at most :data:`PACE_COST` and the largest peak
    falls. Full keeps the tightest pace that counts; selective the loosest that reaches
    (1 - ``ratio``) of the largest peak without offload, else the lowest peak."""
    span = pairs.span  # best delays no compute
    target = None if ratio is None else (1 - ratio) * pairs.peak
    found = []
    waited = {}  # (rank, pace) -> its Fs' waits

    def waits(chosen: set, pace: int) -> list[list[int]]:
        """The Fs' waits of the ``chosen`` ranks, in rank order (each rank's worked out once)."""
        for r in chosen:
            if (r, pace) not in waited:
                waited[r, pace] = _waits(schedule.ranks[r], eager[r], pace)
        return [wait for r in sorted(chosen) for wait in waited[r, pace]]

    for pace in PACES if ratio is None else PACES[::-1]:
        chosen = set(behind)
        while chosen:  # the ranks behind paced, then only those whose peak that lowered
            mixed = [eager[r] if r in chosen else entries[r] for r in range(schedule.pp)]
            paced = _assemble(schedule, pairs, mixed, waits(chosen, pace))
            peaks, time = _timed(paced, costs)
            lower = {r for r in chosen if peaks[r] < before[r] - _slack(before[r])}
            if lower == chosen:
                break
            chosen = lower
        if not chosen or max(peaks) >= max(before) - _slack(max(before)) or time > (1 + PACE_COST) * span:
            continue
        if target is None or max(peaks) <= target + _slack(target):
            return paced
        found.append((max(peaks), paced))
    return min(found, key=lambda f: f[0])[1] if found else best


def _moved(offloaded: Schedule, pairs: _Pairs, costs: StageCosts, short: set, ratio: float | None) -> Schedule:
    """``offloaded``, with Ws moved right after their Bs where that lowers a ``short`` rank's peak:
    a W deferred past its B holds what B keeps for it (``m_w``), and in a cool-down the copy
    streams may have no room to take it away. Greedy, while the largest peak is above the target
    (selective: (1 - ``ratio``) of the largest peak without copies; full: none): the rank with
    the largest peak moves a W held at it (:func:`_held_ws`; its copies dropped if it had any,
    :func:`_move_w`); the whole schedule is simulated (its program derived from the one before the
    move: :func:`~.offload_program.with_moved`) and the move kept where that rank's peak
    falls or is reached fewer times, no other rank's rises, and the step stays within
    :data:`STEP_COST` of the step without copies and no shorter (the planner bounds an offloaded
    step by the bare schedule's: offload never shortens a step). It stops where that rank has tried
    :data:`W_TRIES` Ws or holds none at its peak, keeping the fewest moves that reach the lowest
    largest peak. The moves are recorded as ``options["offload"]["moved"]`` (``[stage,
    microbatch, index, follower]``: the W's index in its rank's list without copies, and
    :func:`_follower`, for :func:`unmoved`)."""
    from .offload_program import with_moved, with_program_of  # it reads this module's kinds
    span = pairs.span
    target = 0.0 if ratio is None else (1 - ratio) * pairs.peak
    current, moved, tried, refused = offloaded, {}, dict.fromkeys(short, 0), set()
    timeline, kept = _resumed(current, costs, None)
    peaks = _levels(current, costs, *timeline)
    best = max(peaks), current, {}  # the largest peak, and the fewest moves that reach it
    held = None  # (rank, its peak's instants, its held Ws best first) of the current schedule
    while max(peaks) > target + _slack(target):
        rank = peaks.index(max(peaks))
        if tried.get(rank, W_TRIES) >= W_TRIES:
            break
        if held is None or held[0] != rank:
            at = _peak_times(current.ranks[rank], costs, *(times[rank] for times in timeline))
            held = rank, at, _held_ws(current.ranks[rank], *(times[rank] for times in timeline), at)
        at = held[1]
        pair = next((pair for pair in held[2] if pair not in refused), None)
        if pair is None:
            break
        tried[rank] += 1
        trial = replace(current, ranks=tuple(_move_w(actions, pair) if r == rank else actions
                                             for r, actions in enumerate(current.ranks)))
        with_moved(trial, current, pair)
        times, resumed = _resumed(trial, costs, kept)
        levels = _levels(trial, costs, *times, before=(current.ranks, peaks, *timeline))
        fewer = (levels[rank] < peaks[rank] - _slack(peaks[rank]) or levels[rank] <= peaks[rank] + _slack(peaks[rank])
                 and len(_peak_times(trial.ranks[rank], costs, *(t[rank] for t in times))) < len(at))
        step = max((max(e, default=0.0) for e in times[1]), default=0.0)
        if (fewer and span - _slack(span) <= step <= (1 + STEP_COST) * span
                and all(new <= old + _slack(old) for r, (new, old) in enumerate(zip(levels, peaks)) if r != rank)):
            current, timeline, peaks, kept, held = trial, times, levels, resumed, None
            moved[pair] = pairs.schedule.ranks[rank].index(Action(W, *pair))
            if max(peaks) < best[0] - _slack(best[0]):
                best = max(peaks), current, dict(moved)
        else:
            refused.add(pair)
    _, current, moved = best
    if not moved:
        return offloaded
    record = {**current.options["offload"], "moved": sorted([*pair, k, _follower(pairs.schedule, pair, k)]
                                                            for pair, k in moved.items())}
    recorded = replace(current, options={**current.options, "offload": record})
    with_program_of(recorded, current)  # the record changes no input
    return recorded


def _resumed(schedule: Schedule, costs: StageCosts, kept: tuple | None) -> tuple[tuple, tuple]:
    """:func:`~..deps.asap`'s times of ``schedule``, and (its program, that program's timeline) for
    the next call; ``kept``, such a pair of the program ``schedule``'s was derived from
    (:func:`~.offload_program.with_moved`), is resumed at the first step that differs."""
    program = _program(schedule)
    origin = program.origin
    resume = (*kept[1], origin[1]) if kept is not None and origin is not None and origin[0]() is kept[0] else None
    timeline = program.timeline(costs.duration, costs.transfer, resume=resume)
    return program.lists(*timeline), (program, timeline)


def _peak_times(actions, costs: StageCosts, starts, ends) -> list[float]:
    """The instants one rank's activation memory reaches its peak on a timeline."""
    level = peak = 0.0
    at: list[float] = []
    for t, d in _memory_events(actions, costs, starts, ends):
        level += d
        if level > peak + _slack(peak):
            peak, at = level, [t]
        elif d > 0 and level >= peak - _slack(peak):
            at.append(t)
    return at


def _held_ws(actions, starts, ends, at: list[float]) -> list[tuple[int, int]]:
    """The (stage, microbatch) of each W in ``actions`` that holds what its B kept at instants
    ``at`` (from its B's start, not on host then, not yet running), best to move first: the one held
    at most of them, then the one whose rank idles the longest between its B's end and its start
    (moving it costs least), then the first in the list."""
    opened, away, busy, found = {}, {}, [0.0], []
    for k, a in enumerate(actions):
        busy.append(busy[-1] + (0.0 if KINDS[a.kind].stream else ends[k] - starts[k]))
        if a.kind in (OFFLOAD_W, RELOAD_W):
            away.setdefault((a.stage, a.microbatch), []).append(ends[k] if a.kind == OFFLOAD_W else starts[k])
        for part in parts(a):
            if part.kind == B:
                opened[part.stage, part.microbatch] = k
        if a.kind != W or (pair := (a.stage, a.microbatch)) not in opened:
            continue
        b, off = opened[pair], away.get(pair, ())
        held = sum(starts[b] <= t < starts[k] and not (len(off) == 2 and off[0] <= t < off[1]) for t in at)
        if held:
            found.append(((held, starts[k] - ends[b] - (busy[k] - busy[b + 1])), pair))
    found.sort(key=_FIRST, reverse=True)  # stable: equal keys keep the list's order
    return [pair for _, pair in found]


def _move_w(actions, pair) -> tuple[Action, ...]:
    """One rank's list with the W of ``pair`` (stage, microbatch) right after its B (after the copies
    issued there), the copies of what that B keeps for it dropped."""
    w = Action(W, *pair)
    dropped = {w, *copies((*pair, 1))}
    kept = [a for a in actions if a not in dropped]
    k = next(k for k, a in enumerate(kept) if Action(B, *pair) in parts(a)) + 1
    while k < len(kept) and KINDS[kept[k].kind].stream:
        k += 1
    return (*kept[:k], w, *kept[k:])


def _follower(schedule: Schedule, pair: tuple[int, int], k: int) -> list | None:
    """What came right after the W of ``pair`` (at ``k`` in its rank's list of ``schedule``): the
    ``[kind, stage, microbatch]`` of that action's first part, or None where the W came last."""
    actions = schedule.ranks[schedule.placement[pair[0]]]
    if k + 1 >= len(actions):
        return None
    first = parts(actions[k + 1])[0]
    return [first.kind, first.stage, first.microbatch]


def unmoved(schedule: Schedule) -> Schedule:
    """An offloaded schedule without its copies and with its moved Ws (:func:`_moved`) back in their
    places: the schedule the transform was given, with whatever later transforms added (K-FAC's
    pieces): each W goes back before the action that followed it (the end of the list where none
    did), the latest first, and before the first action a later transform made need it (K-FAC's
    preconditioning of the W's step, which follows the step's last W)."""
    moved = (schedule.options.get("offload") or {}).get("moved", ())
    ranks = [[a for a in actions if a.kind not in COPIES] for actions in schedule.ranks]
    ws = {Action(W, stage, microbatch) for stage, microbatch, *_ in moved}
    for w in ws:
        ranks[schedule.placement[w.stage]].remove(w)
    needs, consumer = Dependencies(schedule), {}  # W -> the first action of its rank's list that needs it
    for r in {schedule.placement[w.stage] for w in ws}:
        for a in ranks[r]:
            for w in ws.intersection(needs(a, True)).difference(consumer):
                consumer[w] = a
    for stage, microbatch, _, follower in sorted(moved, key=lambda m: m[2], reverse=True):
        actions, w = ranks[schedule.placement[stage]], Action(W, stage, microbatch)
        at = len(actions) if follower is None else next(
            k for k, a in enumerate(actions) if any([p.kind, p.stage, p.microbatch] == follower for p in parts(a)))
        actions.insert(min(at, actions.index(consumer[w])) if w in consumer else at, w)
    return replace(schedule, ranks=tuple(map(tuple, ranks)),
                   options={key: v for key, v in schedule.options.items() if key != "offload"})


def _waits(actions, entries: list[tuple], pace: int) -> list[list[int]]:
    """Each F of one rank's list ``actions`` after ``pace`` Fs whose pairs its eager copy
    ``entries`` offload, as ``[stage, microbatch, stage, microbatch]``: it waits for the OFFLOAD of
    the pair ``pace`` offloads before it (the eager copies put each OFFLOAD right after its F, so
    that OFFLOAD is earlier in the list)."""
    copied = {pair[:2] for *_, pair, action in entries if action.kind == OFFLOAD}
    waits, done = [], []
    for a in actions:
        for f in (a,) if a.kind == F else _forwards(a) if a.kind in COMPOUND else ():
            if len(done) >= pace:
                waits.append([f.stage, f.microbatch, *done[-pace]])
            if (f.stage, f.microbatch) in copied:
                done.append((f.stage, f.microbatch))
    return waits


# -- the kinds and their dependencies ---------------------------------------------
def _offloaded(schedule: Schedule) -> frozenset:
    """The pairs the schedule copies."""
    return frozenset(pair for actions in schedule.ranks for pair in copied_pairs(actions))


def _out_needs(action, deps):
    return (Action(PHASES[COPIES[action.kind][0]].after[0], action.stage, action.microbatch),)


def _back_needs(action, deps):
    return (copies(pair_of(action))[0],)


def paced(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """The Fs that wait for an earlier pair's OFFLOAD (:func:`_waits`): pair -> that pair."""
    return {(s, i): (t, j) for s, i, t, j in (schedule.options.get("offload") or {}).get("waits", ())}


@register_inputs(kinds=(F, *_CLOSES))
def _copy_inputs(schedule: Schedule):
    """In offloaded schedules, the action that closes a copied pair (its backward; W) after the
    pair's copy back, and a paced F after the OFFLOAD it waits for."""
    if not schedule.options.get("offload"):
        return None

    def rule(action, deps):
        kind, pair = action.kind, (action.stage, action.microbatch)
        closes = _CLOSES.get(kind)
        if closes is not None and (*pair, closes) in deps.fact("offload", _offloaded):
            return (copies((*pair, closes))[1],)
        if kind == F and (waited := deps.fact("offload waits", paced).get(pair)) is not None:
            return (Action(OFFLOAD, *waited),)
        return ()
    return rule


def check_copies(schedule: Schedule) -> None:
    """Each copy to host has one copy back of its pair and the reverse, on the pair's rank (the
    dependencies put them after the action that opens the pair and before the one that closes
    it); only schedules marked offloaded hold them."""
    offloads, reloads = {}, {}
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            if a.kind in COPIES:
                (offloads if COPIES[a.kind][1] else reloads)[pair_of(a)] = rank
    if not offloads and not reloads:
        return
    if not schedule.options.get("offload"):
        pair = next(iter(offloads or reloads))
        opener = PHASES[pair[2]].after[0]
        raise ScheduleError(f"the schedule copies what {pair[0]}{KINDS[opener].code}{pair[1]} keeps, but "
                            "options['offload'] names no offload policy")
    for pair in offloads.keys() ^ reloads.keys():
        have, missing = copies(pair) if pair in offloads else copies(pair)[::-1]
        rank = schedule.placement[pair[0]]
        raise ScheduleError(f"rank {rank}: {have.kind} {pair[0]}:{pair[1]} has no {missing.kind} of the same stage "
                            "and microbatch")
    for pair, waited in paced(schedule).items():
        rank = schedule.placement[pair[0]]
        if offloads.get((*waited, 0)) != rank:
            raise ScheduleError(f"rank {rank}: F {pair[0]}:{pair[1]} waits for OFFLOAD {waited[0]}:{waited[1]}, "
                                "which is not on its rank (options['offload']['waits'] names offloads of the F's rank)")


def _copy_kind(name: str, label: str, held: str, time: str, out: bool, colour: str, letter: str) -> Kind:
    """A copy kind: to host (``out``) or back, of ``held`` (a memory field) in the time ``time``."""
    sign = -1.0 if out else 1.0
    return register(Kind(name, label, needs=_out_needs if out else _back_needs, memory=((sign, held),),
                         host=((-sign, held),), cost=(time,), colour=colour, letter=letter, torch_csv=None,
                         stream=OUT_STREAM if out else BACK_STREAM, check=check_copies))


_copy_kind(OFFLOAD, "offload", "m_b", "offload", True, "#8172b3", "o")
_copy_kind(RELOAD, "reload", "m_b", "offload", False, "#da8bc3", "r")
_copy_kind(OFFLOAD_W, "offload W", "m_w", "offload_w", True, "#64b5cd", "u")
_copy_kind(RELOAD_W, "reload W", "m_w", "offload_w", False, "#ccb974", "l")
