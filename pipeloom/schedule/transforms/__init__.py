"""Transforms: ``apply(schedule, costs) -> Schedule``, after a family generates its order.

A technique that adds work to any schedule is a transform: an object with

- ``name``: how messages name it;
- ``kinds``: the action kinds it adds (registered in :mod:`~..kinds`);
- ``cost_fields``: the cost fields that time them (:func:`~..costs.register_field`);
- ``room``: intervals (one microbatch's F and backward on a rank) it needs
  between the last stage's forward and backward, 0 for none; :func:`~..registry.build`
  asks the family for the largest room its transforms need;
- ``apply(schedule, costs)``: the schedule with its work added (not validated:
  ``build`` validates once, after every transform).

:class:`~.vocab.VocabPasses` (Vocabulary Parallelism) is the built-in one.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from ..costs import Costs
from ..ir import Action, Schedule


class Transform(Protocol):
    name: str
    kinds: Sequence[str]
    cost_fields: Sequence[str]
    room: int

    def apply(self, schedule: Schedule, costs: Costs | None) -> Schedule: ...


def apply_all(schedule: Schedule, transforms: Sequence[Transform], costs: Costs | None = None) -> Schedule:
    """``schedule`` after each of ``transforms`` in turn."""
    for transform in transforms:
        schedule = transform.apply(schedule, costs)
    return schedule


def insert(ranks: Sequence[Sequence[Action]], extra: Sequence[list[tuple]]) -> tuple[tuple[Action, ...], ...]:
    """The lists ``ranks`` with ``extra[r]``'s entries added to rank r's list: each
    entry ``(index, *keys, action)`` goes before the action at ``index`` (at the
    end past the list's length); entries at one index in the order of their keys."""
    lists = []
    for actions, entries in zip(ranks, extra):
        entries = sorted(entries)
        merged, j = [], 0
        for k, action in enumerate(actions):
            while j < len(entries) and entries[j][0] <= k:
                merged.append(entries[j][-1])
                j += 1
            merged.append(action)
        merged += [e[-1] for e in entries[j:]]
        lists.append(tuple(merged))
    return tuple(lists)
