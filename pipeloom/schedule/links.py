"""The messages a schedule sends between ranks, link by link, and whether each
link delivers them in the order its receiver needs them.

A backend that matches sends to receives by tag (gloo) copes with any order;
one that matches them in posting order (NCCL) needs every link in order.
"""

from __future__ import annotations

from typing import NamedTuple

from .deps import Dependencies
from .ir import Action, Schedule


class OutOfOrder(NamedTuple):
    """On the link ``src -> dst``, ``sent_first`` leaves before ``needed_first``,
    which ``dst`` needs earlier."""

    src: int
    dst: int
    sent_first: Action
    needed_first: Action


def out_of_order_links(schedule: Schedule) -> list[OutOfOrder]:
    """For each link whose messages are needed in another order than they are
    sent, the first pair that crosses. A message is named by its producer."""
    deps = Dependencies(schedule)
    position = {a: k for actions in schedule.ranks for k, a in enumerate(actions)}
    needed: dict[tuple[int, int], list[Action]] = {}
    for dst, actions in enumerate(schedule.ranks):
        for action in actions:
            for dep in deps(action):
                src = schedule.placement[dep.stage]
                if src != dst:
                    needed.setdefault((src, dst), []).append(dep)
    crossings = []
    for (src, dst), messages in sorted(needed.items()):
        sent = sorted(messages, key=position.__getitem__)
        for want, got in zip(messages, sent):
            if want != got:
                crossings.append(OutOfOrder(src, dst, got, want))
                break
    return crossings
