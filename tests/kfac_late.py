"""Shared by the K-FAC tests: a schedule as the transform placed it before the curvature that fits no
bubble followed its producer, with that curvature at the end of the cycle (every capture held till then)."""

from dataclasses import replace

from pipeloom.schedule.transforms.kfac import KFAC_PRE


def curvature_late(schedule):
    """``schedule`` with each rank's inline curvature pieces (``options["kfac"]["inline"]``) moved to just
    before the pieces at the end of the cycle's last step."""
    kfac, last = schedule.options["kfac"], schedule.steps - 1
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        inline = {tuple(entry) for entry in kfac["inline"][rank]}
        moved = [a for a in actions if (a.kind, a.stage, a.microbatch, *a.payload) in inline]
        rest = [a for a in actions if (a.kind, a.stage, a.microbatch, *a.payload) not in inline]
        tail = next(k for k, a in enumerate(rest) if a.kind == KFAC_PRE and a.microbatch == last)
        tail -= kfac["overflow"][rank] - len(moved)
        ranks.append(tuple(rest[:tail] + moved + rest[tail:]))
    return replace(schedule, ranks=tuple(ranks))
