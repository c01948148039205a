"""The classic pipeline picture of a simulated schedule, as PNG or SVG.

Top panel: one row per rank (rank 0 on top), one box per action coloured by
kind, later chunks of interleaved and V schedules in lighter shades,
microbatch numbers where the boxes are big enough; a compound action
(DualPipeV's overlapped F and B) is one framed box, its parts stacked in it
as in DeepSeek's pictures. Bottom panel: activation
memory of every rank over time. Side-stream actions (offload's host copies)
get a lane under their rank's row, and host memory a dotted line. :func:`plot_schedules` draws several
schedules' timelines one above the other on one time axis (``pipeloom
simulate --compare``); :func:`plot_rank_comparison` draws per-rank
bars of several runs side by side (the vocabulary modes of ``pipeloom
simulate --vocab-parallel A,B,...``). matplotlib is imported only when
drawing, and only its Figure API (Agg for PNG, its SVG writer for SVG), never
pyplot.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PipeloomError
from ..paths import suffix_problem
from ..schedule.ir import parts
from ..schedule.kinds import COMPOUND, RANK, get
from .simulate import Result

SUFFIXES = (".png", ".svg")
WIDTH_IN, DPI = 14.0, 110
MAX_LABELS = 4000  # above this many boxes, never write microbatch numbers
RASTER_ABOVE = 5000  # boxes drawn as a bitmap inside SVGs above this many
TIME_LABEL = "time (simulator units; ms with model costs)"
#: What a memory level is divided by to draw it in each unit (levels in bytes drawn in GiB or MiB).
_MEMORY_SCALES = {"M_B": 1.0, "GiB": 2.0**30, "MiB": 2.0**20}


def plot_schedule(result: Result, path: str | Path, memory_unit: str = "M_B", memory=None,
                  memory_name: str = "activation memory") -> None:
    """Draw ``result`` to ``path``; the suffix (.png or .svg) picks the format. ``memory_unit``: what
    its memory is counted in, ``M_B`` or ``bytes`` (model costs: drawn in GiB, or MiB below one GiB);
    ``memory``: per rank, (time, level) steps to draw instead of its own (a measured run's), named
    ``memory_name``."""
    path = _checked_path(path)
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    rows_in = _rows_in(result)
    fig = Figure(figsize=(WIDTH_IN, rows_in + 2.6))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [rows_in, 2.0]})
    _draw_timeline(top, result, rows_in)
    _draw_memory(bottom, result, memory_unit, memory, memory_name)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def plot_schedules(results: list[Result], path: str | Path) -> None:
    """Draw the timelines of ``results`` one above the other on one time axis
    to ``path``; the suffix (.png or .svg) picks the format."""
    path = _checked_path(path)
    from matplotlib.figure import Figure

    rows = [_rows_in(result) for result in results]
    fig = Figure(figsize=(WIDTH_IN, sum(rows) + 0.6 * len(rows) + 0.5))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": rows})[:, 0]
    span = max(result.makespan for result in results)
    for ax, result, rows_in in zip(axes, results, rows):
        _draw_timeline(ax, result, rows_in, span)
    axes[-1].set_xlabel(TIME_LABEL)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def _checked_path(path: str | Path) -> Path:
    path = Path(path)
    if why := suffix_problem(path, SUFFIXES):
        raise PipeloomError(f"cannot plot to {str(path)!r}: {why}")
    return path


def _rows_in(result: Result) -> float:
    """Inches for the rows of ``result``'s timeline."""
    return min(max(1.6, 0.35 * result.schedule.pp), 10.0)


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``colour`` mixed with white, more for later chunks (none for chunk 0)."""
    from matplotlib.colors import to_rgb

    mix = 0.5 * chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1.0 - c) * mix for c in to_rgb(colour))


def _boxes(result: Result) -> list[list[tuple]]:
    """Per rank, every box as (event, lo, hi): its band in the rank's row (:func:`_rows`),
    shared by a compound action's parts, each an event of its own, stacked in it."""
    out = []
    for events in result.events:
        boxes = []
        for ev, (lo, hi) in zip(events, _rows(events)):
            split = parts(ev.action)
            step = (hi - lo) / len(split)
            boxes += [(ev._replace(action=part), lo + j * step, lo + (j + 1) * step) for j, part in enumerate(split)]
        out.append(boxes)
    return out


def _box_colours(result: Result, boxes) -> list[list[tuple[float, float, float]]]:
    """The fill of every box, per rank: its kind's colour, lighter for later chunks."""
    schedule = result.schedule
    chunk_of = {s: k for r in range(schedule.pp) for k, s in enumerate(schedule.stages_of(r))}

    def key(action) -> tuple[str, int]:
        """Kind and chunk; a rank-owned kind (whose stage field is a rank) counts as chunk 0."""
        return action.kind, 0 if get(action.kind).owner == RANK else chunk_of[action.stage]

    palette = {}
    for row in boxes:
        for ev, _, _ in row:
            k = key(ev.action)
            if k not in palette:
                palette[k] = _shade(get(k[0]).colour, k[1], schedule.chunks)
    return [[palette[key(ev.action)] for ev, _, _ in row] for row in boxes]


def _draw_timeline(ax, result: Result, rows_in: float, span: float | None = None) -> None:
    """The boxes of ``result`` on a time axis of ``span`` (default: its makespan)."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    p, span = result.schedule.pp, span or result.makespan or 1.0
    drawn = _boxes(result)
    colours = _box_colours(result, drawn)

    def corners(spans):
        x0, x1, lo, hi = np.array(spans, dtype=float).reshape(-1, 4).T
        return np.stack([np.stack(corner, axis=1) for corner in ((x0, lo), (x1, lo), (x1, hi), (x0, hi))], axis=1)

    boxes = corners([(ev.start, ev.end, rank + lo, rank + hi) for rank, row in enumerate(drawn) for ev, lo, hi in row])
    px_per_unit = WIDTH_IN * DPI * 0.9 / span
    shortest = min((ev.end - ev.start for evs in result.events for ev in evs), default=0.0)
    wide = shortest * px_per_unit >= 4  # white edges between boxes; none (and no seams) when dense
    fills = np.array([c for row in colours for c in row]).reshape(-1, 3)
    ax.add_collection(PolyCollection(
        boxes, facecolors=fills, edgecolors="white" if wide else "none", linewidths=0.5,
        antialiased=wide, rasterized=len(boxes) > RASTER_ABOVE,
    ))
    framed = [(ev, rank + lo, rank + hi) for rank, events in enumerate(result.events)
              for ev, (lo, hi) in zip(events, _rows(events)) if ev.action.kind in COMPOUND]
    if framed:
        frames = corners([(ev.start, ev.end, lo, hi) for ev, lo, hi in framed])
        edges = [get(ev.action.kind).colour for ev, _, _ in framed]
        ax.add_collection(PolyCollection(frames, facecolors="none", edgecolors=edges, linewidths=1.2))
    row_px = rows_in * DPI / p
    if len(boxes) <= MAX_LABELS and row_px >= 10:
        _label_boxes(ax, drawn, colours, px_per_unit, fontsize=min(8.0, row_px * 0.45))
    ax.set_xlim(0, span)
    ax.set_ylim(p - 0.5, -0.5)
    step = max(1, p // 16)
    ax.set_yticks(range(0, p, step), [f"rank {r}" for r in range(0, p, step)])
    _legend(ax, result)
    schedule = result.schedule
    ax.set_title(
        f"{schedule.family}   p={p}   m={schedule.microbatches}   stages={schedule.stages}   "
        f"makespan={result.makespan:g}   span bubble={result.bubble_rate:.1%}   step bubble={result.step_bubble_rate:.1%}"
    )


def _rows(events) -> list[tuple[float, float]]:
    """Each event's band within its rank's row: all of it, or, on a rank with side-stream
    actions (host copies), the upper part for compute and a lane below for those."""
    side = [get(ev.action.kind).stream is not None for ev in events]
    if not any(side):
        return [(-0.42, 0.42)] * len(events)
    return [(0.16, 0.42) if s else (-0.42, 0.12) for s in side]


def _legend(ax, result: Result) -> None:
    from matplotlib.patches import Patch

    kinds = dict.fromkeys(part.kind for evs in result.events for ev in evs if ev.end > ev.start
                          for part in (ev.action, *parts(ev.action)))
    handles = [Patch(facecolor="none", edgecolor=get(k).colour, label=f"{k} {get(k).label}: parts in one frame")
               if k in COMPOUND else Patch(color=get(k).colour, label=f"{k} {get(k).label}") for k in kinds]
    if result.schedule.chunks > 1:
        handles.append(Patch(color=_shade("#8c8c8c", 1, 2), label="lighter: later chunk"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)


def _label_boxes(ax, boxes, colours, px_per_unit: float, fontsize: float) -> None:
    """Microbatch numbers in the boxes wide enough to hold them, white on dark boxes, black on light."""
    for rank, row in enumerate(boxes):
        for (ev, lo, hi), fill in zip(row, colours[rank]):
            text = str(ev.action.microbatch)
            size = fontsize * min(1.0, (hi - lo) / 0.84)
            if (ev.end - ev.start) * px_per_unit >= size * 0.75 * len(text) + 3:
                ink = "white" if 0.299 * fill[0] + 0.587 * fill[1] + 0.114 * fill[2] < 0.6 else "black"
                ax.text((ev.start + ev.end) / 2, rank + (lo + hi) / 2, text, ha="center", va="center", fontsize=size,
                        color=ink)


def _draw_memory(ax, result: Result, unit: str, memory=None, name: str = "activation memory") -> None:
    from matplotlib import colormaps

    p = result.schedule.pp
    cmap = colormaps["viridis"]
    host = memory is None and any(result.peak_host)
    levels = [result.memory_timeline(rank) for rank in range(p)] if memory is None else memory
    if unit == "bytes":  # GiB, or MiB below one GiB
        unit = "GiB" if max((level for points in levels for _, level in points), default=0) >= 2**30 else "MiB"
    scale = _MEMORY_SCALES[unit]
    for rank in range(p):
        lines = [(levels[rank], "-", f"rank {rank}")]
        if host:
            lines.append((result.host_timeline(rank), ":", None))
        for points, style, label in lines:
            final = dict(points)  # the level each instant ends at
            ax.step(list(final), [level / scale for level in final.values()], where="post",
                    color=cmap(rank / max(1, p - 1)), linewidth=1.0, linestyle=style, label=label)
    if host:
        ax.plot([], [], color="grey", linestyle=":", label="host (offloaded)")
    if p <= 8:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(1.01, 1.0, f"colour: rank 0 (dark)\nto rank {p - 1} (light)", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_ylabel(f"{name} ({unit})")
    ax.set_xlabel(TIME_LABEL)
    ax.set_ylim(bottom=0)


def plot_rank_comparison(
    path: str | Path,
    labels: list[str],
    busy: list[list[float]],
    memory: list[list[float]],
    *,
    busy_label: str = "busy",
    memory_label: str = "peak memory",
    title: str = "",
) -> None:
    """Grouped bars per rank, one colour per label: compute (``busy[k][rank]``)
    on top, peak memory (``memory[k][rank]``) below; the suffix of ``path``
    (.png or .svg) picks the format."""
    path = _checked_path(path)
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    ranks = len(busy[0])
    width = 0.8 / len(labels)
    cmap = colormaps["tab10"]
    fig = Figure(figsize=(max(6.0, 0.9 * ranks + 3.0), 6.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for ax, values, label in ((top, busy, busy_label), (bottom, memory, memory_label)):
        for k, (name, per_rank) in enumerate(zip(labels, values)):
            xs = [r - 0.4 + width * (k + 0.5) for r in range(ranks)]
            ax.bar(xs, per_rank, width=width, color=cmap(k % 10), label=name)
        ax.set_ylabel(label)
    top.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    top.set_title(title)
    bottom.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
