"""DualPipeV: DeepSeek's DualPipe cut in half into a V, in the order of torch's ``ScheduleDualPipeV``.

DualPipe (DeepSeek-V3) runs microbatches from both ends of the pipeline and
overlaps the forward of one microbatch with the backward of another; Sea AI
Lab's "cut-in-half" folds it into a V on half the ranks: rank ``r`` holds
chunk 0 (stage ``r``) and chunk 1 (stage ``2p-1-r``), and a step needs
m >= 2p microbatches. Rank ``r``'s list, in eight phases (as
``deepseek-ai/DualPipe``'s ``dualpipev.py`` and torch's ``ScheduleDualPipeV``):

1. ``2(p-r-1)`` forwards of chunk 0;
2. ``r+1+k`` times: F of chunk 0, F of chunk 1;
3. ``p-r-1`` times: B of chunk 1 (input gradient only), the oldest pending
   W, F of chunk 1;
4. ``m-2p+r+1-k`` times: F of chunk 0 overlapped with the fused backward (BW)
   of chunk 1, then F of chunk 1 overlapped with BW of chunk 0 (the last
   rank runs its first F of chunk 0 and BW of chunk 1 one after the other:
   that BW waits for a gradient, the F does not);
5. ``p-r-1`` times: BW of chunk 1, then F of chunk 1 overlapped with BW of
   chunk 0;
6. ``r+1+k`` times: the backward of chunk 1, then of chunk 0, fused until
   ``k`` past the middle of the phase and split into B and W from there
   (chunk 0 switches first on even ranks);
7. ``p-r-1`` times: the oldest pending W, then B of chunk 0;
8. ``r+1`` times: the oldest pending W.

``k`` is the room a transform asks for (``room``; torch's order has
``k = 0``): the last stage's backward of each microbatch comes ``k``
intervals (a microbatch's F and backward of both chunks) after its forward,
where the vocabulary passes run. Every rank then holds ``k`` more
microbatches of each chunk: 2k more chunk activations, the k stage
activations that 1F1B's ``k`` more warm-up forwards cost. The room is at
most ``m - 2p + 1`` (phase 4 of rank 0 empty); with fewer microbatches the
passes the last stage waits for move up (:mod:`~..transforms.vocab`).

Each stage runs its forwards, and its backwards (B or BW), in microbatch order.

The overlapped pair is one action of the compound kind ``OVERLAP_F_B``
(:mod:`~..kinds`), like torch's action of that name with its two
``sub_actions``: its parts are the F and the BW, which run as one unit on
the rank. One action rather than two adjacent ones marked as a pair: the
simulator times the unit (the longer part plus the share ``1 - overlap`` of
the shorter, cost field ``overlap``, default 0: the runtime runs the parts
one after the other), renderers draw it as one box, the torch CSV writes it
as torch does (``(0F3;7B1)OVERLAP_F_B``), and no transform or lowering can
slip an action between its parts. Its inputs are both parts' inputs; the
actions that consume either part's result wait for the whole pair, as its
sends follow it.
"""

from __future__ import annotations

from collections import Counter, deque

from ...errors import PipeloomError
from ..ir import BW, B, F, W, Action, Schedule, v_placement
from ..kinds import Kind, register as register_kind
from ..registry import register

#: The kind of an overlapped forward and fused backward: torch's ``OVERLAP_F_B``.
OVERLAP_F_B = "OVERLAP_F_B"

register_kind(Kind(OVERLAP_F_B, "overlapped F and B", compound=True, overlap="overlap", transfer="comm",
                   colour="#8172b3", letter="&", torch_code=OVERLAP_F_B, torch_csv=True))


def overlapped(forward: Action, backward: Action) -> Action:
    """The one action that runs ``forward`` and ``backward`` overlapped."""
    return Action.compound(OVERLAP_F_B, (forward, backward))


def _rank_order(pp: int, microbatches: int, r: int, room: int = 0) -> tuple[Action, ...]:
    """Rank ``r``'s list (see the module docstring): phases 2 and 6 ``room`` rounds longer, phase 4 as many shorter."""
    chunk0, chunk1 = r, 2 * pp - 1 - r
    done: Counter = Counter()  # (stage, F or B) -> microbatches begun; B counts BW too
    pending: deque[Action] = deque()  # W of the split backwards, oldest first
    order: list[Action] = []

    def next_of(kind: str, s: int) -> Action:
        key = s, F if kind == F else B
        action = Action(kind, s, done[key])
        done[key] += 1
        if kind == B:
            pending.append(Action(W, s, action.microbatch))
        return action

    def run(kind: str, s: int) -> None:
        order.append(next_of(kind, s))

    def pair(forward: int, backward: int) -> None:
        order.append(overlapped(next_of(F, forward), next_of(BW, backward)))

    def weight() -> None:
        order.append(pending.popleft())

    last, half = r == pp - 1, (r + 1) // 2
    for _ in range(2 * (pp - r - 1)):
        run(F, chunk0)
    for _ in range(r + 1 + room):
        run(F, chunk0)
        run(F, chunk1)
    for _ in range(pp - r - 1):
        run(B, chunk1)
        weight()
        run(F, chunk1)
    for i in range(microbatches - 2 * pp + r + 1 - room):
        if i == 0 and last:
            run(F, chunk0)
            run(BW, chunk1)
        else:
            pair(chunk0, chunk1)
        pair(chunk1, chunk0)
    for _ in range(pp - r - 1):
        run(BW, chunk1)
        pair(chunk1, chunk0)
    for i in range(r + 1 + room):
        run(B if i >= room + half + (r % 2 == 0) else BW, chunk1)
        run(B if i >= room + half else BW, chunk0)
    for _ in range(pp - r - 1):
        weight()
        run(B, chunk0)
    for _ in range(r + 1):
        weight()
    return tuple(order)


@register("dualpipev", "DualPipeV: V-shape, forward of one microbatch overlapped with backward of another "
          "(needs microbatches >= 2pp)", chunks=(2,), default_chunks=2)
def dualpipev(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """``room``: intervals between the last stage's forward and backward, at most m - 2p + 1 (the module docstring)."""
    if microbatches < 2 * pp:
        fits = f"; or pp <= {microbatches // 2}" if microbatches >= 2 else ""
        raise PipeloomError(
            f"dualpipev needs microbatches >= 2*pp = {2 * pp} (two chunks per rank, as torch's ScheduleDualPipeV); "
            f"got microbatches={microbatches} with pp={pp}: use microbatches={2 * pp} or more{fits}"
        )
    room = min(room, microbatches - 2 * pp + 1)
    ranks = tuple(_rank_order(pp, microbatches, r, room) for r in range(pp))
    return Schedule("dualpipev", pp, microbatches, v_placement(pp), ranks)
