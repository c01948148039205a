"""V-Min, V-Half and V-ZB: the memory-controlled V-shape schedules of
"Pipeline Parallelism with Controllable Memory" (Qi, Wan, Huang, Lin, NeurIPS 2024).

Every rank holds two chunks in a V (stages ``r`` and ``2p-1-r``) and the
backward is split into B and W. As in the paper, work is laid out in unit
*slots*, one pass per slot (T_F = T_B = T_W); the simulator later times the
resulting order with the real costs.

1. *Building block*: the slots of one microbatch's 4p F and B passes along
   the V. Each sweep (F: down chunk 0, up chunk 1; B: down chunk 1, up
   chunk 0) advances ``first`` slots per pass in its first half and
   ``second`` in its second half; the first B follows the last F after the
   smallest gap that lets the block repeat without collisions. A rank's two
   activations together live about ``2p (first + second)`` slots, so with
   one microbatch per 6 slots the peak is about ``(first + second) / 6`` of
   1F1B's: V-Min (1, 1) a third, V-Half (2, 1) a half, V-ZB (4, 2) all.
2. *Repeating*: microbatch ``j`` uses the block shifted by ``6 j`` slots
   (per microbatch a rank runs 2 F, 2 B and 2 W); W passes fill the free
   slots, oldest B first.
3. *Reordering*: warm-up passes (before the first block ends) move to the
   earliest free slot after their inputs where activation memory stays
   within the steady state's peak; the cool-down (after the last block
   starts) is rebuilt slot by slot, each rank running its ready F or B that
   comes first in the block order, else its oldest pending W.

Squeezing out the idle slots is left to the simulator: each rank runs its
list in order, every pass as soon as its inputs exist.

``room`` inserts that many intervals between the last stage's F and B
in the block (and keeps them in the warm-up and cool-down), the room the
Vocabulary Parallelism paper makes for its output-layer passes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import accumulate

from ..ir import B, F, W, Action, Schedule, v_placement
from ..registry import register

#: Slots per microbatch on one rank: F and B of both chunks, and their W.
INTERVAL = 6

# A rank's passes of one microbatch, by lane: 0 F chunk 0, 1 F chunk 1,
# 2 B chunk 1, 3 B chunk 0, then the W of each B (lane of the B + 2). A pass
# is coded ``microbatch << 3 | lane``.
_KIND = (F, F, B, B, W, W)
_CHUNK = (0, 1, 1, 0, 1, 0)
_MEMORY = (1, 1, 0, 0, -1, -1)  # chunk activations held from F until W
_SHIFT, _MASK = 3, 7
_UNPLACED = 1 << 62


@dataclass(frozen=True)
class Block:
    """Slots between consecutive passes of a sweep along the V: ``first`` in
    the first half of the sweep, ``second`` in the second half."""

    first: int
    second: int

    def hops(self, pp: int, gap: int) -> list[int]:
        """Slots between consecutive passes of :func:`_path` (F down chunk 0,
        turn, up chunk 1, gap, B down chunk 1, turn, up chunk 0)."""
        a, b = self.first, self.second
        return [a] * (pp - 1) + [b] * pp + [gap] + [a] * pp + [b] * (pp - 1)


BLOCKS = {"v-min": Block(1, 1), "v-half": Block(2, 1), "v-zb": Block(4, 2)}


def _path(pp: int) -> list[tuple[int, int]]:
    """(rank, lane) of one microbatch's F and B passes in dependency order."""
    down, up = range(pp), range(pp - 1, -1, -1)
    return [(r, 0) for r in down] + [(r, 1) for r in up] + [(r, 2) for r in down] + [(r, 3) for r in up]


def block_slots(pp: int, block: Block, room: int = 0) -> list[list[int]]:
    """``slots[rank][lane]`` of microbatch 0's F and B passes (lanes 0-3), with
    the smallest gap after the last F that leaves every rank's four passes
    in distinct slots modulo :data:`INTERVAL`, plus ``room`` intervals
    (room for vocabulary passes between the last stage's F and B)."""
    for gap in range(1, INTERVAL + 1):
        slots = [[0] * 4 for _ in range(pp)]
        hops = block.hops(pp, gap + INTERVAL * room)
        for (rank, lane), t in zip(_path(pp), accumulate([0] + hops)):
            slots[rank][lane] = t
        if all(len({t % INTERVAL for t in lanes}) == 4 for lanes in slots):
            return slots
    raise ValueError(f"{block} cannot repeat every {INTERVAL} slots without collisions")


def _predecessors(pp: int) -> list[list[tuple[int, int] | None]]:
    """``pred[rank][lane]``: the (rank, lane) of the same microbatch whose
    result the pass needs (None for stage 0's forward)."""
    pred = [[None] * 6 for _ in range(pp)]
    path = _path(pp)
    for before, (rank, lane) in zip(path, path[1:]):
        pred[rank][lane] = before
    for rank in range(pp):
        pred[rank][4], pred[rank][5] = (rank, 2), (rank, 3)
    return pred


@dataclass
class _Tail:
    """A rank's cool-down: its unplaced F and B passes by lane (code -> slot
    in block order, by microbatch), its W passes waiting for a slot, its
    activation level and how many passes it still has to place."""

    lanes: dict[int, dict[int, int]]
    pending: deque[int]
    level: int
    left: int


class _Timeline:
    """Every rank's slots: ``occ[rank][t]`` is the pass there (or None),
    ``pos[rank][code]`` the slot of a pass, ``mem[rank][t]`` the chunk
    activations held after slot ``t``; ``cap`` is the largest of them in the
    repeated blocks."""

    def __init__(self, pp: int, microbatches: int, block: Block, room: int = 0):
        self.pp, self.m = pp, microbatches
        self.pred = _predecessors(pp)
        # slots a pass comes at least after its input: 1, and for the last
        # stage's B (rank 0, lane 2) the head delay too
        self.lag = [[1] * 6 for _ in range(pp)]
        self.lag[0][2] += INTERVAL * room
        base = block_slots(pp, block, room)
        self.first_done = base[0][3]  # the last pass of microbatch 0's block
        self.last_start = INTERVAL * (microbatches - 1)  # the first of the last block
        length = INTERVAL * (microbatches - 1) + max(map(max, base)) + 1
        self.occ = [[None] * length for _ in range(pp)]
        self.pos = [[_UNPLACED] * (microbatches << _SHIFT) for _ in range(pp)]
        for rank in range(pp):
            for lane, start in enumerate(base[rank]):
                self._repeat(rank, lane, start)
            self._fill_w(rank)
        self.mem = [self._memory(occ) for occ in self.occ]
        self.cap = max(map(max, self.mem))

    def _repeat(self, rank: int, lane: int, start: int) -> None:
        slots = range(start, start + INTERVAL * self.m, INTERVAL)
        codes = range(lane, self.m << _SHIFT, 1 << _SHIFT)
        self.occ[rank][start: slots.stop: INTERVAL] = codes
        self.pos[rank][lane::1 << _SHIFT] = slots

    def _fill_w(self, rank: int) -> None:
        """Put the W of every B into the first free slot after it, oldest B first."""
        occ, pos = self.occ[rank], self.pos[rank]
        pending: deque[int] = deque()
        for t, code in enumerate(occ):
            if code is None:
                if pending:
                    w = pending.popleft() + 2
                    occ[t], pos[w] = w, t
            elif code & _MASK in (2, 3):
                pending.append(code)
        for code in pending:
            pos[code + 2] = len(occ)
            occ.append(code + 2)

    @staticmethod
    def _memory(occ: list) -> list[int]:
        """Chunk activations held after each slot."""
        return list(accumulate(0 if code is None else _MEMORY[code & _MASK] for code in occ))

    def _ready(self, rank: int, code: int) -> int:
        """The first slot after the pass's input (by its lag) and after the
        same lane's previous microbatch."""
        lane = code & _MASK
        ready = self.pos[rank][code - (1 << _SHIFT)] + 1 if code >> _SHIFT else 0
        pred = self.pred[rank][lane]
        if pred is not None:
            ready = max(ready, self.pos[pred[0]][code - lane + pred[1]] + self.lag[rank][lane])
        return ready

    def warm_up(self) -> None:
        """Pull every warm-up pass, in slot order, as early as it can go."""
        passes = sorted(
            (t, rank, code)
            for rank, occ in enumerate(self.occ)
            for t, code in enumerate(occ[: self.first_done])
            if code is not None
        )
        for _, rank, code in passes:
            self._pull(rank, code)

    def _pull(self, rank: int, code: int) -> None:
        """Move a pass to the earliest free slot after its inputs where the
        rank's memory stays within the cap (an F holds one more chunk from
        its new slot to its old one)."""
        occ, mem, cur = self.occ[rank], self.mem[rank], self.pos[rank][code]
        lo = self._ready(rank, code)
        delta = _MEMORY[code & _MASK]
        if delta > 0 and lo < cur:
            span = mem[lo:cur]
            if self.cap in span:  # only after the last slot at the cap
                lo = cur - span[::-1].index(self.cap)
        try:
            t = occ.index(None, lo, cur)
        except ValueError:
            return
        occ[t], occ[cur] = code, None
        self.pos[rank][code] = t
        if delta:
            mem[t:cur] = [level + delta for level in mem[t:cur]]

    def cool_down(self) -> None:
        """Rebuild every slot after the last block starts: each rank runs its
        ready F or B that comes first in the block order (an F only while
        memory stays within the cap), else its oldest pending W."""
        start = self.last_start + 1
        tails = [self._clear_from(rank, start) for rank in range(self.pp)]
        left = sum(tail.left for tail in tails)
        t, stuck = start, False
        while left:
            placed = 0
            for rank, tail in enumerate(tails):
                code = self._pick(rank, t, tail, stuck or tail.level < self.cap)
                if code is not None:
                    self._place(rank, t, code, tail)
                    placed += 1
            left -= placed
            stuck = not placed  # no rank can move: let memory pass the cap
            t += 1

    def _clear_from(self, rank: int, start: int) -> _Tail:
        """Take the rank's passes at and after slot ``start`` off the timeline."""
        occ, pos = self.occ[rank], self.pos[rank]
        tail = _Tail({}, deque(), self.mem[rank][start - 1], 0)
        for t in range(start, len(occ)):
            code = occ[t]
            if code is not None:
                if code & _MASK < 4:
                    tail.lanes.setdefault(code & _MASK, {})[code] = t
                pos[code], occ[t] = _UNPLACED, None
                tail.left += 1
        for code in occ[:start]:
            if code is not None and code & _MASK in (2, 3) and pos[code + 2] == _UNPLACED:
                tail.pending.append(code + 2)
        return tail

    def _pick(self, rank: int, t: int, tail: _Tail, may_grow: bool) -> int | None:
        """The ready F or B first in block order, else the oldest pending W."""
        pos, pred, lag = self.pos, self.pred[rank], self.lag[rank]
        ready = []
        for lane, codes in tail.lanes.items():
            code = next(iter(codes))
            before = pred[lane]
            waits = before is not None and pos[before[0]][code - lane + before[1]] + lag[lane] > t
            if not waits and (may_grow or lane >= 2):
                ready.append((codes[code], code))
        if ready:
            return min(ready)[1]
        return tail.pending[0] if tail.pending else None

    def _place(self, rank: int, t: int, code: int, tail: _Tail) -> None:
        """Put a pass in slot ``t``; a B makes its W pending."""
        occ = self.occ[rank]
        occ.extend([None] * (t + 1 - len(occ)))
        occ[t] = code
        self.pos[rank][code] = t
        lane = code & _MASK
        tail.level += _MEMORY[lane]
        tail.left -= 1
        if lane >= 4:
            tail.pending.popleft()
            return
        codes = tail.lanes[lane]
        del codes[code]
        if not codes:
            del tail.lanes[lane]
        if lane >= 2:
            tail.pending.append(code + 2)

    def actions(self, rank: int) -> tuple[Action, ...]:
        """The rank's passes in slot order."""
        stages = (rank, 2 * self.pp - 1 - rank)
        return tuple(
            Action(_KIND[code & _MASK], stages[_CHUNK[code & _MASK]], code >> _SHIFT)
            for code in self.occ[rank]
            if code is not None
        )


def v_schedule(family: str, pp: int, microbatches: int, room: int = 0) -> Schedule:
    """The schedule of ``family``'s building block (see :data:`BLOCKS`), the
    last stage's B ``room`` more intervals after its F."""
    timeline = _Timeline(pp, microbatches, BLOCKS[family], room)
    timeline.warm_up()
    timeline.cool_down()
    ranks = tuple(timeline.actions(rank) for rank in range(pp))
    return Schedule(family, pp, microbatches, v_placement(pp), ranks)


@register("v-min", "V-shape blocks, about 1/3 of 1F1B's activation memory", chunks=(2,), default_chunks=2)
def v_min(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    return v_schedule("v-min", pp, microbatches, room)


@register("v-half", "V-shape blocks, about 1/2 of 1F1B's activation memory", chunks=(2,), default_chunks=2)
def v_half(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    return v_schedule("v-half", pp, microbatches, room)


@register("v-zb", "V-shape blocks, 1F1B's activation memory and almost no bubble", chunks=(2,), default_chunks=2)
def v_zb(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    return v_schedule("v-zb", pp, microbatches, room)
