"""The messages a schedule sends between ranks, link by link, in the order they are sent.

A backend that matches a link's sends to its receives in posting order
(NCCL; gloo with one tag) needs each receiver to post its receives in this
order, even where it needs a later message first (V schedules cross so).
"""

from __future__ import annotations

from typing import NamedTuple

from .ir import BW, B, F, Schedule


class Message(NamedTuple):
    """The ``kind`` ("activation" or "gradient") that ``stage`` makes for ``microbatch``."""

    kind: str
    stage: int
    microbatch: int


def sent_message(schedule: Schedule, action) -> tuple[int, Message] | None:
    """(receiving rank, message) that ``action`` sends to another rank, if any."""
    s, placement = action.stage, schedule.placement
    if action.kind == F and s < schedule.stages - 1:
        kind, to = "activation", s + 1
    elif action.kind in (B, BW) and s > 0:
        kind, to = "gradient", s - 1
    else:
        return None
    if placement[to] == placement[s]:
        return None
    return placement[to], Message(kind, s, action.microbatch)


def link_messages(schedule: Schedule) -> dict[tuple[int, int], list[Message]]:
    """For each link ``(src, dst)`` of ranks, its messages in the order ``src`` sends them."""
    links: dict[tuple[int, int], list[Message]] = {}
    for src, actions in enumerate(schedule.ranks):
        for action in actions:
            sent = sent_message(schedule, action)
            if sent:
                links.setdefault((src, sent[0]), []).append(sent[1])
    return dict(sorted(links.items()))
