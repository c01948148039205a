"""A compact text picture of a simulated schedule, for the terminal.

One line per rank, and one below it for each side stream it uses (the
host copies of offload); time is cut into columns and each column shows the kind
of action that fills most of it, by its kind's letter (:attr:`~pipeloom.schedule.kinds.Kind.grid_letter`:
PyTorch's F forward, I input grad, W weight grad, B fused backward; the
vocabulary passes s, t, e (input layer forward), g (input layer grad);
offload o and reload r; & an overlapped F and B), or
``.`` when the rank is idle most of it. A box wide enough shows
its microbatch after the letter (``F12``; a compound action its parts',
``F3B1``). Long schedules are compressed to fit ``width``; a legend line
follows.
"""

from __future__ import annotations

import math

from ..schedule.ir import parts
from ..schedule.kinds import get
from .simulate import Result

IDLE = "."
EPS = 1e-9


def text_grid(result: Result, width: int = 100) -> str:
    """The schedule as text, each line at most ``width`` characters (at least one column of time)."""
    rows = []
    for rank, events in enumerate(result.events):
        streams: dict = {}
        for ev in events:
            streams.setdefault(get(ev.action.kind).stream, []).append(ev)
        rows.append((f"r{rank}", streams.pop(None, [])))
        rows += [(f"r{rank} {stream}", evs) for stream, evs in streams.items()]
    label = max(len(name) for name, _ in rows) + 1
    scale = _columns_per_unit(result, max(1, width - label))
    length = math.ceil(result.makespan * scale - EPS)
    lines = [f"{name:<{label}}" + _row(events, scale, length) for name, events in rows]
    return "\n".join(lines + [_legend(result, scale)])


def _columns_per_unit(result: Result, columns: int) -> float:
    """Columns per time unit: fill ``columns``, but when there is room give
    the shortest action a whole number of columns so equal actions look equal."""
    if result.makespan <= 0:
        return 1.0
    scale = columns / result.makespan
    shortest = min((ev.end - ev.start for evs in result.events for ev in evs if ev.end > ev.start), default=0.0)
    if shortest and shortest * scale >= 1:
        scale = math.floor(shortest * scale) / shortest
    return scale


def _row(events, scale: float, length: int) -> str:
    """Each column shows the kind busiest in it, or idle when the rank is
    busy less than half of it; boxes whose span (the columns whose middles
    they cover) is wide enough show their microbatch."""
    time_in = [dict() for _ in range(length)]  # column -> kind -> covered fraction
    for ev in events:
        lo, hi = ev.start * scale, ev.end * scale
        for col in range(int(lo), min(math.ceil(hi - EPS), length)):
            cover = min(hi, col + 1) - max(lo, col)
            time_in[col][ev.action.kind] = time_in[col].get(ev.action.kind, 0.0) + cover
    cells = [_letter(max(kinds, key=kinds.get)) if sum(kinds.values()) >= 0.5 else IDLE for kinds in time_in]
    for ev in events:
        first, stop = math.ceil(ev.start * scale - 0.5), math.ceil(ev.end * scale - 0.5)
        text = "".join(f"{_letter(part.kind)}{part.microbatch}" for part in parts(ev.action))
        if stop - first >= len(text):
            cells[first:stop] = text.ljust(stop - first)
    return "".join(cells)


def _letter(kind: str) -> str:
    return get(kind).grid_letter


def _legend(result: Result, scale: float) -> str:
    kinds = dict.fromkeys(ev.action.kind for evs in result.events for ev in evs if ev.end > ev.start)
    names = "  ".join(f"{_letter(k)} {get(k).label}" for k in kinds)
    return f"{names}  {IDLE} idle   (time per column: {1 / scale:.3g})"
