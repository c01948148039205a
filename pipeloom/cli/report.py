"""The facts of a simulated run, as JSON (``--json``) and as tables."""

from __future__ import annotations

from ..builder import full_stage_m_b
from ..techniques import TECHNIQUES, ordered


def report(result, priced) -> dict:
    """The facts of ``result``, the simulated run of ``priced`` (a :class:`~pipeloom.builder.Priced`
    spec): what ``simulate --json`` and ``train --dry-run --json`` print."""
    schedule, spec = result.schedule, priced.spec
    report = {
        "schedule": schedule.family,
        "schedule_digest": schedule.digest(),
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "chunks": schedule.chunks,
        "stages": schedule.stages,
        "steps": schedule.steps,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "step_bubble_rate": result.step_bubble_rate,
        "peak_activation": result.peak_activation,
        "ranks": [
            {
                "rank": r,
                "stages": schedule.stages_of(r),
                "busy": stats.busy,
                "idle": stats.idle,
                "bubble_rate": stats.bubble_rate,
                "step_bubble_rate": stats.step_bubble_rate,
                "peak_activation": stats.peak_activation,
            }
            for r, stats in enumerate(result.ranks)
        ],
    }
    if priced.model is not None:
        from ..sim.memory import STATE_BYTES_PER_PARAM, held_memory_bytes, peak_memory_bytes

        model, device, profile = priced.model, priced.device, priced.profile
        full = full_stage_m_b(result.costs, schedule.pp)
        state = ({"bytes_per_param": profile.bytes_per_param, "cast_bytes_per_param": profile.cast_bytes_per_param}
                 if profile else {"bytes_per_param": STATE_BYTES_PER_PARAM[spec.costed_precision]})
        report.update(
            model=model.name, vocab=model.vocab, device=spec.device, hardware=device.name, seq=spec.seq,
            microbatch_size=spec.microbatch_size, costs=priced.source, time_unit="ms",
            peak_activation=[x / full for x in result.peak_activation],
            peak_activation_bytes=result.peak_activation,
            peak_memory_bytes=peak_memory_bytes(model, result, spec.seq, microbatch_size=spec.microbatch_size,
                                                sp=spec.sp, attention=spec.attention, **state),
            held_memory_bytes=held_memory_bytes(model, schedule, spec.seq, bytes_per_param=state["bytes_per_param"]),
        )
        for row, value in zip(report["ranks"], report["peak_activation"]):
            row["peak_activation"] = value
    for technique in TECHNIQUES.values():
        report.update(technique.report(result, priced))
    return report


def memory_unit(report: dict) -> str:
    """What a run's simulated memory is counted in: bytes with a model's costs, else M_B (the
    unit of its trace's and plot's memory)."""
    return "bytes" if "peak_activation_bytes" in report else "M_B"


def rank_table(report: dict) -> str:
    unit = f" ({report['time_unit']})" if "time_unit" in report else ""
    lines = [
        f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']} "
        f"stages={report['stages']}  makespan={report['makespan']:.4g}{unit}  "
        f"span bubble={report['bubble_rate']:.1%} (worst rank)  step bubble={report['step_bubble_rate']:.1%}",
        *([f"costs: {report['costs']}"] if "costs" in report else []),
        "",
    ]
    memory = report.get("peak_memory_bytes")
    header = (f"{'rank':>4}  {'stages':<10} {'busy':>10} {'idle':>10}  {'span bubble':>11}  {'step bubble':>11} "
              f"{'peak act (M_B)':>15}")
    lines.append(header + ("  peak memory (GiB)" if memory else ""))
    for row in report["ranks"]:
        line = (f"{row['rank']:>4}  {','.join(map(str, row['stages'])):<10} {row['busy']:>10.4g} {row['idle']:>10.4g}  "
                f"{row['bubble_rate']:>11.1%}  {row['step_bubble_rate']:>11.1%} {row['peak_activation']:>15.4g}")
        if memory:
            line += f"  {memory[row['rank']] / 2**30:>17.2f}"
        lines.append(line)
    for technique in TECHNIQUES.values():
        extra = technique.report_lines(report)
        if extra:
            lines += ["", *extra]
    return "\n".join(lines)


def title(report: dict) -> str:
    """The schedule, its shape and, with a model, the model and where it runs."""
    title = f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']}"
    if "model" in report:
        title += f", {report['model']} (V={report['vocab']}), seq {report['seq']}, {report['hardware']}"
    return title


def setting_table(flag: str, reports: list[dict]) -> str:
    """One run under each value of ``flag`` (each report's ``setting``), side by side."""
    memory = "peak_memory_bytes" in reports[0]
    unit = f" ({reports[0]['time_unit']})" if "time_unit" in reports[0] else ""
    width = max(9, len(flag), *(len(str(r["setting"])) for r in reports))
    lines = [
        title(reports[0]) + f"; times{unit}, throughput relative to {flag} {reports[0]['relative_to']}",
        *([f"costs: {reports[0]['costs']}"] if "costs" in reports[0] else []),
        "",
        f"{flag:<{width}} {'makespan':>10} {'throughput':>10} {'busy max':>10} {'busy min':>10} {'busy mean':>10} "
        + ("max peak memory (GiB)" if memory else "max peak act (M_B)"),
    ]
    for r in reports:
        peak = max(r["peak_memory_bytes"]) / 2**30 if memory else max(r["peak_activation"])
        lines.append(f"{str(r['setting']):<{width}} {r['makespan']:>10.5g} {r['relative_throughput']:>9.3f}x "
                     f"{r['busy_max']:>10.5g} {r['busy_min']:>10.5g} {r['busy_mean']:>10.5g} {peak:>21.4g}")
    return "\n".join(lines)


def compare_table(reports: list[dict]) -> str:
    """Several schedules on the same costs, side by side, with the techniques' columns."""
    width = max(18, *(len(r["schedule"]) for r in reports))
    columns = [technique for technique in ordered() if technique.compare_cells(reports[0])]
    headers = [header for technique in columns for header, _ in technique.compare_cells(reports[0])]
    lines = [*([f"costs: {reports[0]['costs']}"] if "costs" in reports[0] else []),
             " ".join([f"{'schedule':<{width}} {'stages':>6} {'makespan':>10}  {'span bubble':>11}  {'step bubble':>11} "
                       f"{'max peak act':>13}", *headers])]
    for r in reports:
        cells = [cell for technique in columns for _, cell in technique.compare_cells(r)]
        lines.append(" ".join([f"{r['schedule']:<{width}} {r['stages']:>6} {r['makespan']:>10.4g}  "
                               f"{r['bubble_rate']:>11.1%}  {r['step_bubble_rate']:>11.1%} "
                               f"{max(r['peak_activation']):>13.4g}", *cells]))
    return "\n".join(lines)
