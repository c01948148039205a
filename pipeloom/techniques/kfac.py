"""PipeFisher: K-FAC's curvature, inversion and preconditioning placed in the pipeline's bubbles."""

from __future__ import annotations

from ..errors import PipeloomError, whole
from . import Flag, PlanAxis, Technique, register


class Kfac(Technique):
    name = "kfac"
    summary = "K-FAC's work in the bubbles; AdamW on the preconditioned gradients"
    order = 100  # its pieces fill the bubbles of the schedule the others made
    placed_by_runtime = True  # for the model's layers, by the pipeline (the same units: train checks the digest)
    flags = (Flag("optimizer", "adamw, or kfac: PipeFisher, K-FAC's curvature and inversion work in the schedule's "
                  "bubbles and AdamW on the preconditioned gradients (default adamw)", choices=("adamw", "kfac")),
             Flag("kfac_every", "with --optimizer kfac: refresh the curvature every K steps (default: as the bubbles "
                  "allow; what does not fit runs on the critical path: the curvature after its producers, the rest "
                  "at the end of the K steps)", type=int, metavar="K"),
             Flag("kfac_damping", "with --optimizer kfac: damping (default 1e-3)", type=float))

    def active(self, spec) -> bool:
        return spec.optimizer == "kfac"

    def check(self, spec) -> None:
        if spec.kfac_every is not None:
            whole("kfac_every", spec.kfac_every)
        for name in ("kfac_every", "kfac_damping"):
            value = getattr(spec, name)
            if value != type(spec).__dataclass_fields__[name].default and not self.active(spec):
                raise PipeloomError(f"--{name.replace('_', '-')} {value:g} goes with --optimizer kfac")
        if not spec.kfac_damping > 0:
            raise PipeloomError(f"--kfac-damping must be positive, got {spec.kfac_damping:g}")

    def cost_options(self, spec) -> dict:
        return {"kfac": self.active(spec)}

    def transforms(self, spec, priced, stages: int) -> list:
        if not self.active(spec):
            return []
        from ..schedule import Kfac as Transform

        return [Transform(_units(priced.model, priced.spec.seq, priced.spec.vocab_parallel, stages), spec.kfac_every)]

    def report(self, result, priced) -> dict:
        if not self.active(priced.spec):
            return {}
        from ..sim import kfac_report, simulate

        base = simulate(priced.schedule(without=(self.name,)), result.costs)
        return {"kfac": kfac_report(base, result)}

    def pipeline_options(self, spec, costs) -> dict:
        if not self.active(spec):
            return {}
        return {"optimizer": "kfac", "kfac": {"damping": spec.kfac_damping, "every": spec.kfac_every}, "costs": costs}

    def runtime_part(self):
        from ..runtime.handlers.kfac import KfacPart

        return KfacPart

    def describe(self, spec, pipe) -> str:
        return f", K-FAC refreshed every {pipe.schedule.options['kfac']['every']} steps" if self.active(spec) else ""

    def plan_axis(self) -> PlanAxis:
        # AdamW unless asked: K-FAC never steps faster, and what its refresh buys (fewer steps) is the user's to weigh
        return PlanAxis("optimizer", ("adamw",), "optimizers to search: adamw, kfac (PipeFisher), or any: both "
                        "(default {default})", "optimizer", 9, choices=("adamw", "kfac"), priced=True, added=True)

    def plan_fields(self, request, c) -> dict:
        return {"kfac_every": request.kfac_every if c.optimizer == "kfac" else None}

    def plan_cycle(self, c) -> bool:
        return c.optimizer == "kfac"

    def plan_layer_state_bytes(self, request, c) -> float:
        from ..sim.memory import kfac_layer_state_bytes

        return kfac_layer_state_bytes(request.model) if c.optimizer == "kfac" else 0.0

    def plan_step_passes(self, c) -> tuple:
        from ..schedule.transforms.kfac import KFAC_PRE

        return (KFAC_PRE,) if c.optimizer == "kfac" else ()

    def plan_add(self, request, c, schedule, costs):
        if c.optimizer != "kfac":
            return schedule
        from ..schedule import Kfac as Transform
        from ..schedule import validate

        units = _units(request.model, request.seq, c.vocab_parallel, schedule.stages)
        return validate(Transform(units, request.kfac_every).apply(schedule, costs))

    def report_lines(self, report: dict) -> list[str]:
        if "kfac" not in report:
            return []
        from ..schedule.transforms.kfac import MAX_SPREAD, OVERHEAD

        kfac = report["kfac"]
        if kfac["forced"]:
            forced = "forced"
        elif kfac["spread"] and kfac["makespan_change"] <= OVERHEAD + 1e-9:
            forced = f"some pieces fit no bubble: spread to keep the step within {1 + OVERHEAD:.2f}x of AdamW's"
        elif kfac["spread"] and kfac["every"] < MAX_SPREAD:
            forced = (f"some pieces fit no bubble, and the preconditioning every step alone is beyond "
                      f"{1 + OVERHEAD:.2f}x of AdamW's: spread to add at most {OVERHEAD:.0%} more")
        elif kfac["spread"]:
            forced = (f"some pieces fit no bubble; spread over the most steps, {MAX_SPREAD}, the step is still "
                      f"beyond {1 + OVERHEAD:.2f}x of AdamW's")
        else:
            forced = "the steps its pieces need"
        lines = [f"K-FAC: refresh every {kfac['every']} steps ({forced}); step {kfac['step_time_before']:.4g} -> "
                 f"{kfac['step_time_after']:.4g} ({kfac['makespan_change']:+.1%}); {kfac['overflow_pieces']} pieces "
                 "fitted no bubble",
                 f"{'rank':>4} {'busy before':>12} {'busy after':>11} {'bubble filled':>14} {'K-FAC time':>11}"]
        for row in kfac["ranks"]:
            lines.append(f"{row['rank']:>4} {row['utilisation_before']:>12.1%} {row['utilisation_after']:>11.1%} "
                         f"{row['bubble_filled']:>14.1%} {row['kfac_time']:>11.4g}")
        return lines

    def compare_cells(self, report: dict) -> list[tuple[str, str]]:
        if "kfac" not in report:
            return []
        kfac = report["kfac"]
        return [(f"{'K-FAC k':>7}", f"{kfac['every']:>7}"), (f"{'step before':>11}", f"{kfac['step_time_before']:>11.4g}"),
                (f"{'step after':>10}", f"{kfac['step_time_after']:>10.4g}")]


def _units(model, seq: int, vocab_parallel: str, stages: int) -> int | list[int]:
    """K-FAC's pieces per stage: one per linear layer of the model's layers (1 per stage without a model)."""
    if model is None:
        return 1
    from ..sim.formulas import KFAC_UNITS_PER_LAYER
    from ..sim.stages import stage_layers

    return [KFAC_UNITS_PER_LAYER * n for n in stage_layers(model, stages, seq, vocab_parallel=vocab_parallel)]


register(Kfac())
