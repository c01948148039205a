"""PipeOffload: activations copied to host after their forward and back before their backward, fully or selectively."""

from __future__ import annotations

from ..errors import PipeloomError
from . import Flag, PlanAxis, Technique, register, size_text

CHOICES = ("none", "full", "selective")
#: The share of each rank's activation peak that selective offload moves, in the plans the planner makes.
PLAN_RATIO = 0.5


class Offload(Technique):
    name = "offload"
    summary = "activations copied to host memory between their forward and backward, on a copy stream"
    flags = (Flag("offload", "PipeOffload: copy activations to host memory after F and back before the backward, on "
                  "two copy streams per rank (one per direction), delaying no compute but the forwards a stream "
                  "cannot keep up with and the Ws run right after their Bs where the streams cannot take what they "
                  "hold (at most 5%% of the step): each rank's peak as low as the streams allow (full) "
                  "or down by --offload-ratio (selective, else full's and a line that says so); default none",
                  choices=CHOICES, compared=True),
             Flag("offload_ratio", "with --offload selective: the share of each rank's activation peak to move, in "
                  "(0, 1]", type=float, metavar="R"))

    def active(self, spec) -> bool:
        return spec.offload != "none"

    def check(self, spec) -> None:
        if spec.offload != "selective" and spec.offload_ratio is not None:
            raise PipeloomError(f"--offload-ratio {spec.offload_ratio:g} goes with --offload selective")
        if spec.offload == "selective":
            from ..schedule.transforms.offload import check_policy

            check_policy(spec.offload, spec.offload_ratio)

    def transforms(self, spec, priced, stages: int) -> list:
        from ..schedule import Offload as Transform

        return [Transform(spec.offload, spec.offload_ratio)] if self.active(spec) else []

    def runtime_part(self):
        from ..runtime.handlers.offload import OffloadPart

        return OffloadPart

    def describe(self, spec, pipe) -> str:
        if not self.active(spec):
            return ""
        return f", offload {spec.offload}" + (f" {spec.offload_ratio:g}" if spec.offload_ratio is not None else "")

    def report(self, result, priced) -> dict:
        """Policy, the worst rank's peak cut and the step's time against no copies (``cut``, ``time``),
        whether forwards are paced to the copy stream and how many Ws run right after their Bs
        (``paced``, ``moved``), and, per rank, peak host memory, what is offloaded per step and the copy time not
        hidden (bytes and ms with --model, else in the units of --costs), and with --model PipeOffload's k."""
        from ..modes import RECOMPUTE

        schedule, costs, spec = result.schedule, result.costs, priced.spec
        if not self.active(spec):
            return {}
        offloaded = [sum(max(costs.host_delta(a), 0.0) for a in actions) for actions in schedule.ranks]
        cut, time = _against_bare(result)
        done = schedule.options.get("offload") or {}
        report = {"policy": spec.offload, "ratio": spec.offload_ratio, "cut": cut, "time": time,
                  "paced": bool(done.get("waits")), "moved": len(done.get("moved", ()))}
        if priced.model is None:
            report["ranks"] = [{"rank": r, "host": h, "offloaded": o, "exposed": e}
                               for r, (h, o, e) in enumerate(zip(result.peak_host, offloaded, result.exposed))]
            return {"offload": report}
        from ..sim.model import offload_time_ratio

        report["k"] = offload_time_ratio(priced.model, spec.seq, spec.microbatch_size, priced.device, sp=spec.sp,
                                         attention=spec.attention, recompute=RECOMPUTE[spec.recompute],
                                         profile=priced.profile, precision=spec.costed_precision)
        report["ranks"] = [{"rank": r, "host_bytes": h, "offloaded_bytes": o, "exposed_ms": e}
                           for r, (h, o, e) in enumerate(zip(result.peak_host, offloaded, result.exposed))]
        return {"offload": report}

    def report_lines(self, report: dict) -> list[str]:
        if "offload" not in report:
            return []
        offload = report["offload"]
        policy = offload["policy"] + (f" {offload['ratio']:g}" if offload["ratio"] is not None else "")
        bytes_ = "k" in offload
        pace = "each way keeps up" if bytes_ and offload["k"] <= 2 else "copies outlast compute"
        lines = [f"offload {policy}:" + (f" k = T_offload / T_compute per layer = {offload['k']:.3g} "
                                         f"({pace}: out and back on a stream each)" if bytes_ else ""),
                 f"{'rank':>4} {'offloaded/step':>15} {'peak host':>12} {'exposed':>10}"]
        if "cut" in offload:
            lines.insert(1, _cut_line(offload))
        for row in offload["ranks"]:
            if bytes_:
                lines.append(f"{row['rank']:>4} {size_text(row['offloaded_bytes']):>15} {size_text(row['host_bytes']):>12} "
                             f"{row['exposed_ms']:>7.4g} ms")
            else:
                lines.append(f"{row['rank']:>4} {row['offloaded']:>11.4g} M_B {row['host']:>8.4g} M_B {row['exposed']:>10.4g}")
        return lines

    def compare_cells(self, report: dict) -> list[tuple[str, str]]:
        if "offload" not in report:
            return []
        rows, in_bytes = report["offload"]["ranks"], "k" in report["offload"]
        host = max(row["host_bytes" if in_bytes else "host"] for row in rows)
        exposed = max(row["exposed_ms" if in_bytes else "exposed"] for row in rows)
        return [(f"{'max host':>10}", f"{size_text(host) if in_bytes else f'{host:.4g}':>10}"),
                (f"{'max exposed':>11}", f"{exposed:>11.4g}")]

    def plan_axis(self) -> PlanAxis:
        # a memory saver ranked after recomputation: equal plans prefer none, then full, then selective
        return PlanAxis("offload", CHOICES, "offload policies to search (default {default})", "offload", 9,
                        added=True, saver=1, saving=("full", "selective", "none"))

    def plan_allows(self, request, c) -> bool:
        return c.offload == "none" or request.cluster.device.name != "cpu"  # copies need an accelerator

    def plan_fields(self, request, c) -> dict:
        return {"offload_ratio": PLAN_RATIO if c.offload == "selective" else None}

    def plan_add(self, request, c, schedule, costs):
        if c.offload == "none":
            return schedule
        from ..schedule import Offload as Transform
        from ..schedule import validate

        return validate(Transform(c.offload, self.plan_fields(request, c)["offload_ratio"]).apply(schedule, costs))

    def plan_memory_lists(self, c) -> tuple[tuple[str, bool], ...]:
        """First every pair that may be copied (:func:`~pipeloom.schedule.transforms.offload.copyable`,
        from the list without offload, each W right after its B where the transform may move it:
        :func:`~pipeloom.schedule.transforms.offload.early_ws`), then those the offloaded list
        copies (building it)."""
        return () if c.offload == "none" else (("copyable", True), ("copied", False))

    def plan_memory_list(self, step: str, actions) -> list:
        """Each pair copied to host held only while the action that opens it runs (F; B) and from
        the start of the one that closes it (its backward; W)
        (:func:`~pipeloom.schedule.transforms.offload.tightest`)."""
        from ..schedule.transforms.offload import copied_pairs, copyable, early_ws, tightest

        if step == "copyable":
            return tightest(early_ws(actions), copyable(actions))
        return tightest(actions, copied_pairs(actions))


def _against_bare(result) -> tuple[float, float]:
    """The share of the worst rank's activation peak the copies remove, and the step's time as a
    multiple of its time without them: the schedule simulated against the one offload was given
    (:func:`~pipeloom.schedule.transforms.offload.unmoved`: no copies, moved Ws back)."""
    from ..schedule.transforms.offload import unmoved
    from ..sim import simulate

    plain = simulate(unmoved(result.schedule), result.costs)
    before = max(plain.peak_activation)
    return (1 - max(result.peak_activation) / before if before else 0.0,
            result.makespan / plain.makespan if plain.makespan else 1.0)


def _cut_line(offload: dict) -> str:
    """What the copies cut, at what time and why (paced forwards, moved Ws), and for selective
    offload short of its ratio, that it is the most."""
    cut = f"the copies cut the worst rank's activation peak by {offload['cut']:.0%}"
    moved = offload["moved"]
    why = " and ".join(text for text, on in (
        ("pacing forwards to the copy stream where it falls behind", offload["paced"]),
        (f"running {moved} W{'s' * (moved != 1)} right after {'its B' if moved == 1 else 'their Bs'}", moved)) if on)
    if offload["time"] > 1 + 1e-9:
        cut += f", {why + ':' if why else ''} the step takes {offload['time']:.3f}x its time without copies"
    if _short(offload):
        limit = "the copy streams are full where the peak is"
        if moved:
            from ..schedule.transforms.offload import STEP_COST, W_TRIES

            limit += (f"; no further W moved right after its B lowered it within {STEP_COST:.0%} more time, "
                      f"of at most {W_TRIES} tried per rank")
        return f"selective {offload['ratio']:g}: {cut}, not {offload['ratio']:.0%}: more copies would delay compute ({limit})"
    return cut + (" without delaying compute" if offload["policy"] == "full" and offload["time"] <= 1 + 1e-9 else "")


def shortfall(report: dict) -> str | None:
    """The line that says selective offload falls short of its ratio, for ``train`` to print before launch."""
    offload = report.get("offload")
    return "pipeloom train: offload " + _cut_line(offload) if offload and _short(offload) else None


def _short(offload: dict) -> bool:
    """Whether selective offload cut less than its ratio."""
    return offload["policy"] == "selective" and offload["cut"] < offload["ratio"] - 1e-9


register(Offload())
