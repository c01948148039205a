"""GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B and PipeDream-2BW."""

from __future__ import annotations

from ...errors import PipeloomError
from ..ir import BW, F, Action, Schedule, looped_placement
from ..registry import register


def one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the
    remaining backwards (GPipe is the case ``warmup = len(forwards)``)."""
    order = forwards[:warmup]
    pending = iter(forwards[warmup:])
    for backward in backwards:
        order.extend(f for f in [next(pending, None)] if f is not None)
        order.append(backward)
    return order


def _single_chunk(family: str, pp: int, microbatches: int, warmup, steps: int = 1, versions: int = 1) -> Schedule:
    n = microbatches * steps
    ranks = []
    for r in range(pp):
        fwd = [Action(F, r, i) for i in range(n)]
        bwd = [Action(BW, r, i) for i in range(n)]
        ranks.append(tuple(one_f_one_b(fwd, bwd, min(warmup(r), n))))
    return Schedule(family, pp, microbatches, looped_placement(pp, pp), tuple(ranks), steps=steps, weight_versions=versions)


@register("gpipe", "all forwards, then all backwards (GPipe)", fused=True)
def gpipe(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """Every rank runs all its forwards first, so the last stage's backward of a microbatch comes
    ``microbatches`` intervals after its forward: the room vocabulary passes ask for (``room``)
    is there once ``microbatches > room`` (with fewer, the passes it waits for move up)."""
    return _single_chunk("gpipe", pp, microbatches, warmup=lambda r: microbatches)


@register("1f1b", "one forward, one backward (PipeDream-Flush)", fused=True)
def one_f_one_b_flush(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    """``room`` more warm-up forwards on every rank delay the last
    stage's backward by as many intervals (room for vocabulary passes)."""
    return _single_chunk("1f1b", pp, microbatches, warmup=lambda r: pp - r - 1 + room)


@register("2bw", "PipeDream-2BW: 1F1B with no flush, two weight versions, update every step", fused=True)
def pipedream_2bw(pp: int, microbatches: int, chunks: int, steps: int = 4, room: int = 0) -> Schedule:
    if microbatches < pp:
        raise PipeloomError(
            f"2bw needs microbatches >= pp so that at most two weight versions are in flight; "
            f"got microbatches={microbatches} with pp={pp}"
        )
    if not isinstance(steps, int) or steps < 1:
        raise PipeloomError(f"2bw: steps={steps!r} must be a whole number >= 1")
    return _single_chunk("2bw", pp, microbatches, warmup=lambda r: pp - r - 1 + room, steps=steps, versions=2)


def _rounds(pp: int, microbatches: int) -> int:
    """Microbatches per round of interleaving (PyTorch's rule): ``microbatches``
    split evenly into ``max(1, microbatches // pp)`` rounds."""
    def fits(m: int) -> bool:
        return m % max(1, m // pp) == 0

    if not fits(microbatches):
        below = next(m for m in range(microbatches - 1, 0, -1) if fits(m))
        above = next(m for m in range(microbatches + 1, 2 * microbatches + 2) if fits(m))
        raise PipeloomError(
            f"interleaved-1f1b with pp={pp} runs microbatches in {microbatches // pp} equal rounds, "
            f"which microbatches={microbatches} does not divide; use {below} or {above}"
        )
    return microbatches // max(1, microbatches // pp)


@register("interleaved-1f1b", "1F1B over v looped chunks per rank (Megatron-LM)", chunks=None, default_chunks=2,
          fused=True)
def interleaved_1f1b(pp: int, microbatches: int, chunks: int, room: int = 0) -> Schedule:
    per_round = _rounds(pp, microbatches)
    ranks = []
    for r in range(pp):
        fwd, bwd = [], []
        for first in range(0, microbatches, per_round):
            group = range(first, first + per_round)
            fwd += [Action(F, c * pp + r, i) for c in range(chunks) for i in group]
            bwd += [Action(BW, c * pp + r, i) for c in reversed(range(chunks)) for i in group]
        warmup = min((chunks - 1) * per_round + 2 * (pp - 1 - r) + room, len(fwd))
        ranks.append(tuple(one_f_one_b(fwd, bwd, warmup)))
    return Schedule("interleaved-1f1b", pp, microbatches, looped_placement(pp, pp * chunks), tuple(ranks))
