"""Recomputation: whole stages rerun in their backward (full), or only the norms and activation functions (cheap)."""

from __future__ import annotations

from ..modes import RECOMPUTE
from . import Flag, PlanAxis, Technique, register

CHOICES = tuple(RECOMPUTE)


class Recompute(Technique):
    name = "recompute"
    summary = "activations recomputed in the backward instead of kept"
    flags = (Flag("recompute", "rerun in the backward whole stages (full) or only the norms and activation functions, "
                  "whose outputs are then not kept (cheap); default none", choices=CHOICES, compared=True),)

    def active(self, spec) -> bool:
        return spec.recompute != "none"

    def cost_options(self, spec) -> dict:
        return {"recompute": RECOMPUTE[spec.recompute]}

    def pipeline_options(self, spec, costs) -> dict:
        return {"recompute": RECOMPUTE[spec.recompute]}

    def runtime_part(self):
        from ..runtime.handlers.compute import RecomputePart

        return RecomputePart

    def describe(self, spec, pipe) -> str:
        return f", recompute {spec.recompute}" if self.active(spec) else ""

    def plan_axis(self) -> PlanAxis:
        # a memory saver, ranked first among them; its values least saving first
        return PlanAxis("recompute", CHOICES, "recomputation to search (default {default})", "recompute", 9,
                        priced=True, saver=0)


register(Recompute())
