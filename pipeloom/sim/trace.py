"""Chrome trace JSON (Trace Event Format) of a timeline, for Perfetto and chrome://tracing.

One process per rank with a ``compute`` thread (one complete event per
action, named by its PyTorch action string) and a ``comm`` thread (one event
per transfer between ranks, placed on the *sender*: a transfer starts when
its producer ends, as a non-blocking send does; transfers that overlap go
on extra threads ``comm 2``, ``comm 3``, ... since a thread's slices must
nest), flow arrows from each producer to its consumer on another rank, and
an activation-memory counter; side streams (offload's host copies) get a
thread of their own and a host-memory counter.

:func:`chrome_trace_events` takes plain per-rank events, so the runtime can
write its measured timelines in the same format; :func:`chrome_trace` feeds
it a simulator :class:`~pipeloom.sim.simulate.Result`.

Times: one simulator unit is written as one millisecond (``ts`` and ``dur``
are in microseconds); ``otherData.time_unit`` records it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from ..schedule.deps import Dependencies
from ..schedule.ir import BW, B, F, Action, Schedule, parts
from ..schedule.kinds import RANK, get
from .simulate import Event, Result

#: Microseconds per simulator time unit (1 unit = 1 ms).
US_PER_UNIT = 1000.0
COMPUTE_TID, COMM_TID = 0, 1
STREAM_TID = 1000  # the first side stream's thread


class Transfer(NamedTuple):
    """Data from ``producer`` (an event on one rank) to ``consumer`` (on
    another), in flight from ``start`` to ``end``."""

    producer: Event
    consumer: Event
    start: float
    end: float


def transfers_of(
    schedule: Schedule,
    events_per_rank: Sequence[Sequence[Event]],
    comm_time: Callable[[Action], float],
) -> list[Transfer]:
    """Every dependency that crosses ranks, starting when its producer ends
    and taking ``comm_time(producer_action)``; a compound action's part (an
    overlapped pair's F or B) produces in the event of its compound."""
    deps = Dependencies(schedule)
    by_action = {part: ev for events in events_per_rank for ev in events for part in parts(ev.action)}
    transfers = []
    for events in events_per_rank:
        for consumer in events:
            for dep in deps(consumer.action, plain=True):
                producer = by_action[dep]._replace(action=dep)
                if producer.rank != consumer.rank:
                    transfers.append(Transfer(producer, consumer, producer.end, producer.end + comm_time(dep)))
    return transfers


def chrome_trace_events(
    events_per_rank: Sequence[Sequence[Event]],
    stages_per_rank: Sequence[Sequence[int]],
    memory: Sequence[Sequence[tuple[float, float]]] | None = None,
    transfers: Sequence[Transfer] = (),
    metadata: dict | None = None,
    host: Sequence[Sequence[tuple[float, float]]] | None = None,
    memory_unit: str = "M_B",
    memory_name: str = "activation memory",
) -> dict:
    """The Chrome trace document of a timeline.

    ``events_per_rank[r]``: the events (rank, action, start, end) of rank
    ``r``; ``stages_per_rank[r]``: its stages; ``memory[r]``: optional
    (time, level) steps of the counter ``memory_name``, ``host[r]`` its host memory's, each
    level in ``memory_unit`` (``M_B``, or ``bytes`` with model costs);
    ``transfers``: inter-rank transfers; ``metadata``: facts stored in
    ``otherData`` next to the time unit. Actions of a side stream (a kind's
    ``stream``) go on a thread of that name.
    """
    lanes = _comm_lanes(transfers)
    lane_count = [1] * len(stages_per_rank)
    for transfer, lane in zip(transfers, lanes):
        lane_count[transfer.producer.rank] = max(lane_count[transfer.producer.rank], lane + 1)
    streams = sorted({get(ev.action.kind).stream for evs in events_per_rank for ev in evs} - {None})
    trace: list[dict] = []
    for rank, stages in enumerate(stages_per_rank):
        trace += _rank_metadata(rank, stages, lane_count[rank], streams)
    for events in events_per_rank:
        trace += [_compute_event(ev, streams) for ev in events if get(ev.action.kind).drawn]
    for flow_id, (transfer, lane) in enumerate(zip(transfers, lanes)):
        trace += _transfer_events(transfer, flow_id, COMM_TID + lane)
    for rank, points in enumerate(memory or ()):
        trace += [_counter(rank, t, level, memory_name, memory_unit) for t, level in points]
    for rank, points in enumerate(host or ()):
        if any(level for _, level in points):
            trace += [_counter(rank, t, level, "host memory", memory_unit) for t, level in points]
    other = {"time_unit": "ms", "note": "one simulator time unit is written as 1 ms"}
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {**other, **(metadata or {})}}


def chrome_trace(result: Result, name: str | None = None, memory_unit: str = "M_B") -> dict:
    """The Chrome trace document of a simulated schedule, its memory counted in ``memory_unit``."""
    schedule = result.schedule
    facts = {
        "name": name or f"{schedule.family} p={schedule.pp} m={schedule.microbatches}",
        "family": schedule.family,
        "pp": schedule.pp,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "step_bubble_rate": result.step_bubble_rate,
    }
    return chrome_trace_events(
        result.events,
        [schedule.stages_of(rank) for rank in range(schedule.pp)],
        memory=[result.memory_timeline(rank) for rank in range(schedule.pp)],
        host=[result.host_timeline(rank) for rank in range(schedule.pp)],
        transfers=transfers_of(schedule, result.events, result.costs.transfer),
        metadata=facts,
        memory_unit=memory_unit,
    )


def write_chrome_trace(trace: Result | dict, path: str | Path, name: str | None = None,
                       memory_unit: str = "M_B") -> None:
    """Write a Result's trace (named ``name``, its memory counted in ``memory_unit``), or a
    document from :func:`chrome_trace_events`, as JSON to ``path``."""
    document = chrome_trace(trace, name, memory_unit) if isinstance(trace, Result) else trace
    Path(path).write_text(json.dumps(document, separators=(",", ":")))


def _us(t: float) -> float:
    """Microseconds, to the nanosecond."""
    return round(t * US_PER_UNIT, 3)


def _comm_lanes(transfers: Sequence[Transfer]) -> list[int]:
    """A lane per transfer such that transfers of one sender in one lane never overlap."""
    lane_ends: dict[int, list[float]] = {}  # sender rank -> end of the last transfer in each lane
    lanes = [0] * len(transfers)
    for k in sorted(range(len(transfers)), key=lambda k: transfers[k].start):
        t = transfers[k]
        ends = lane_ends.setdefault(t.producer.rank, [])
        lane = next((i for i, end in enumerate(ends) if end <= t.start), len(ends))
        if lane == len(ends):
            ends.append(t.end)
        ends[lane] = t.end
        lanes[k] = lane
    return lanes


def _stream_tid(stream: str, streams: Sequence[str]) -> int:
    """The thread of a side stream: after any comm lanes a rank can have."""
    return STREAM_TID + streams.index(stream)


def _rank_metadata(rank: int, stages: Sequence[int], comm_lanes: int, streams: Sequence[str]) -> list[dict]:
    label = "stage" if len(stages) == 1 else "stages"
    name = f"rank {rank} ({label} {', '.join(map(str, stages))})"

    def meta(kind: str, args: dict, tid: int = COMPUTE_TID) -> dict:
        return {"ph": "M", "name": kind, "pid": rank, "tid": tid, "args": args}

    threads = {0: "compute", **{COMM_TID + lane: f"comm {lane + 1}" if lane else "comm" for lane in range(comm_lanes)},
               **{_stream_tid(stream, streams): stream for stream in streams}}
    out = [meta("process_name", {"name": name}), meta("process_sort_index", {"sort_index": rank})]
    for tid, thread in threads.items():
        out += [meta("thread_name", {"name": thread}, tid), meta("thread_sort_index", {"sort_index": tid}, tid)]
    return out


def _compute_event(ev: Event, streams: Sequence[str] = ()) -> dict:
    a = ev.action
    kind = get(a.kind)
    place = "rank" if kind.owner == RANK else "stage"  # a rank-owned kind's stage field is its rank
    return {
        "ph": "X", "name": str(a), "cat": a.kind, "pid": ev.rank,
        "tid": _stream_tid(kind.stream, streams) if kind.stream else COMPUTE_TID,
        "ts": _us(ev.start), "dur": _us(ev.end - ev.start),
        "args": {place: a.stage, "microbatch": a.microbatch, "kind": a.kind},
    }


def _send_name(action: Action) -> str:
    """PyTorch's name of the send of ``action``'s output: ``1SEND_F3`` or ``1SEND_B3``
    (a vocabulary pass's result, broadcast or reduced: ``3SEND_S3``)."""
    direction = "F" if action.kind == F else "B" if action.kind in (B, BW) else action.kind
    return f"{action.stage}SEND_{direction}{action.microbatch}"


def _transfer_events(transfer: Transfer, flow_id: int, tid: int) -> list[dict]:
    """The comm event on the sender's comm thread ``tid`` and the flow arrow producer -> consumer."""
    src, dst = transfer.producer, transfer.consumer
    comm = {
        "ph": "X", "name": _send_name(src.action), "cat": "comm", "pid": src.rank, "tid": tid,
        "ts": _us(transfer.start), "dur": _us(transfer.end - transfer.start),
        "args": {"from_rank": src.rank, "to_rank": dst.rank, "producer": str(src.action), "consumer": str(dst.action)},
    }
    flow = {"name": "transfer", "cat": "transfer", "id": flow_id, "tid": COMPUTE_TID}
    return [
        comm,
        {**flow, "ph": "s", "pid": src.rank, "ts": _us((src.start + src.end) / 2)},
        {**flow, "ph": "f", "bp": "e", "pid": dst.rank, "ts": _us((dst.start + dst.end) / 2)},
    ]


def _counter(rank: int, t: float, level: float, name: str, unit: str) -> dict:
    return {"ph": "C", "name": name, "pid": rank, "ts": _us(t), "args": {unit: level}}
