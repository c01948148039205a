"""Weight versions (PipeDream-2BW): a family without a flush runs several steps per call."""

from __future__ import annotations

from ..errors import PipeloomError, whole
from . import Flag, Technique, register


class WeightVersions(Technique):
    name = "weight_versions"
    summary = "no flush: two weight versions, the update delayed one step (2bw)"
    flags = (Flag("schedule_steps", "steps a family without a flush (2bw) builds per call (default: the family's)",
                  type=int, metavar="N"),)

    def active(self, spec) -> bool:
        from ..schedule import get_family

        return "steps" in get_family(spec.schedule).options

    def check(self, spec) -> None:
        if spec.schedule_steps is not None:
            whole("schedule_steps", spec.schedule_steps)
        if spec.schedule_steps is not None and not self.active(spec):
            raise PipeloomError(f"--schedule-steps sets how many steps a family without a flush builds per call "
                                f"(2bw); {spec.schedule} builds one step")

    def build_options(self, spec) -> dict:
        return {"steps": spec.schedule_steps} if spec.schedule_steps is not None else {}

    def runtime_part(self):
        from ..runtime.versions import VersionsPart

        return VersionsPart

    def plan_steady(self, schedule: str) -> bool:
        from ..schedule import get_family

        return "steps" in get_family(schedule).options

    def plan_weight_versions(self, schedule: str) -> int:
        return 2 if self.plan_steady(schedule) else 1


register(WeightVersions())
