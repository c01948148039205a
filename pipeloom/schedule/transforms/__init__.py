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
from ..ir import Schedule


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
