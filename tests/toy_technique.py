"""A technique from outside pipeloom, for the plug-in tests: a no-op action after every forward.

Imported by every command through ``PIPELOOM_PLUGINS=toy_technique``, it registers a flag
(``--toy-ms``, the no-op's time), a kind and the transform that places it, a cost field, a
planner dimension (``--toy-ms`` 0 or 0.5) and the kind's runtime handler: nothing in pipeloom
names it.
"""

from dataclasses import replace

from pipeloom.errors import PipeloomError
from pipeloom.schedule import F, Action, Schedule
from pipeloom.schedule.costs import register_field
from pipeloom.schedule.kinds import Kind
from pipeloom.schedule.kinds import register as register_kind
from pipeloom.techniques import Flag, Technique, register

TOY = "TOY"


def _after_forward(action, deps):
    return (Action(F, action.stage, action.microbatch),)


register_field("toy")
register_kind(Kind(TOY, "toy no-op", needs=_after_forward, cost=("toy",), colour="#17becf", letter="t",
                   torch_csv=False))


class AfterEveryForward:
    name = "toy no-op after every forward"
    kinds = (TOY,)
    cost_fields = ("toy",)
    room = 0

    def apply(self, schedule: Schedule, costs) -> Schedule:
        ranks = tuple(tuple(b for a in actions for b in ((a, Action(TOY, a.stage, a.microbatch)) if a.kind == F
                                                          else (a,)))
                      for actions in schedule.ranks)
        return replace(schedule, ranks=ranks)


class Toy(Technique):
    name = "toy"
    summary = "a no-op after every forward"
    flags = (Flag("toy_ms", "the toy no-op's time after every forward, in ms (default 0: no no-op)", type=float,
                  default=0.0),)

    def active(self, spec) -> bool:
        return spec.option("toy_ms") > 0

    def check(self, spec) -> None:
        if spec.option("toy_ms") < 0:
            raise PipeloomError(f"--toy-ms {spec.option('toy_ms'):g}: a time cannot be negative")

    def costs(self, spec, costs):
        return replace(costs, extra={**costs.extra, "toy": spec.option("toy_ms")})

    def transforms(self, spec, priced, stages):
        return [AfterEveryForward()] if self.active(spec) else []

    def report(self, result, priced):
        if not self.active(priced.spec):
            return {}
        return {"toy": {"no_ops": sum(a.kind == TOY for actions in result.schedule.ranks for a in actions)}}

    def report_lines(self, report):
        return [f"toy: {report['toy']['no_ops']} no-ops"] if "toy" in report else []

    def plan_dimension(self, request):
        return "toy_ms", (0.0, 0.5)

    def setup_runtime(self) -> None:
        from pipeloom.runtime.handlers import register as register_handler

        register_handler(TOY, lambda action, context: None)

    def describe(self, spec, pipe) -> str:
        return f", toy {spec.option('toy_ms'):g} ms" if self.active(spec) else ""


register(Toy())
