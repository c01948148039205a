"""Forward-only schedules: a family's order kept for evaluation, without backward work.

:func:`forward_only` derives, from any schedule, the schedule that computes
the loss of one step's microbatches and nothing else (torch's
``_ScheduleForwardOnly`` is the same for one stage per rank): each rank's list
keeps, in its order, the actions whose kind computes the loss (``Kind.forward``:
F, and the vocabulary passes up to the loss, IF, S, C, Z and CZ), a compound
action's forward parts as plain actions, for the microbatches of the first
step. Every backward, weight-gradient, copy and curvature action goes, and so
do the options of the techniques whose actions went (``offload``, ``kfac``)
and ``lowered``: lower the result again to run it. The family's order of
forwards stays, so the warm-up of an interleaved or V schedule keeps its
stages busy the same way; removing actions whose results nothing left needs
cannot make an order deadlock.

The result has ``steps=1``, ``weight_versions=1`` (a forward-only pass of a
PipeDream-2BW schedule reads one set of weights) and ``options["forward_only"]``,
which the completeness rules read: each (stage, microbatch) has one F and no
backward, and each rank runs the forward passes of the vocabulary algorithm.
"""

from __future__ import annotations

from dataclasses import replace

from .ir import Schedule, parts
from .kinds import get
from .validate import validate

#: Options of techniques whose actions a forward-only schedule leaves out.
_DROPPED = ("lowered", "offload", "kfac")


def forward_only(schedule: Schedule) -> Schedule:
    """The forward-only schedule of ``schedule`` (see the module docstring), validated."""
    m = schedule.microbatches
    ranks = tuple(
        tuple(part for action in actions for part in parts(action)
              if get(part.kind).forward and part.microbatch < m)
        for actions in schedule.ranks)
    options = {k: v for k, v in schedule.options.items() if k not in _DROPPED}
    return validate(replace(schedule, ranks=ranks, steps=1, weight_versions=1,
                            options={**options, "forward_only": True}))
