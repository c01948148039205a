"""What ``pipeloom train`` shows of a run: the dry run before it, the measured step beside the simulated after."""

from __future__ import annotations

import json
import os
from statistics import median

from ..errors import PipeloomError
from ..paths import prepare_output
from ..schedule import FAMILIES, build
from ..sim.plot import SUFFIXES
from ..spec import RunSpec


def dry_run(config, spec: RunSpec) -> int:
    """What the run will do, without starting a worker: the facts ``simulate`` prints for ``spec``
    (as JSON with ``--json``: the same object), the schedule's grid, and the simulated step as
    ``--plot``'s picture and ``--trace``'s Chrome trace."""
    from ..cli.report import memory_unit, rank_table
    from ..cli.simulate import simulate_spec
    from ..sim.grid import text_grid

    facts, result = simulate_spec(spec)
    if config.plot:
        from ..sim import plot_schedule

        plot_schedule(result, prepare_output("--plot", config.plot, SUFFIXES), memory_unit(facts))
    if config.trace:
        from ..sim import write_chrome_trace

        write_chrome_trace(result, prepare_output("--trace", config.trace), memory_unit=memory_unit(facts))
    if config.json:
        print(json.dumps(facts, indent=2))
    else:
        print(f"dry run: {spec.world} process{'es' if spec.world > 1 else ''}, schedule sha256 "
              f"{facts['schedule_digest']}")
        print(rank_table(facts))
        print()
        print(text_grid(result))
    return 0


def report(schedule, timelines, step_times, memory: list[str] = ()) -> str:
    """The measured step beside the simulator's prediction from the measured costs, ``memory``'s
    lines (:func:`memory_lines`), and what the simulator predicts for the other families with those costs."""
    from ..runtime.timeline import full_stage_costs, measured_costs, measured_result, median_costs
    from ..sim import simulate

    costs = median_costs([measured_costs(events, schedule) for events in timelines])
    seen = [measured_result(events, schedule) for events in timelines]
    own = simulate(schedule, costs)
    step_ms, span = 1e3 * median(step_times), median(r.makespan for r in seen)
    kfac = schedule.options.get("kfac")
    what = (f"the timeline of the last K-FAC refresh cycle, {schedule.steps} steps" if kfac
            else f"timelines of the last {len(timelines)} steps")
    lines = [
        f"report: {schedule.family}, pp={schedule.pp}, {schedule.microbatches} microbatches ({what})",
        f"  measured {'cycle' if kfac else 'step '}  {step_ms:9.2f} ms   (with the optimizer step; the schedule's actions span "
        f"{span:.2f} ms, bubble seen {median(r.bubble_rate for r in seen):.1%})",
        f"  simulated       {own.makespan:9.2f} ms   (the actions, from the measured costs; bubble "
        f"{own.bubble_rate:.1%}; simulated / measured span {own.makespan / span:.3f})",
        "  measured costs per stage (ms): " + ", ".join(
            f"{k} {' '.join(f'{v:.2f}' for v in getattr(costs, k))}" for k in ("f", "b", "w", "comm")),
        *(["  vocabulary passes per rank (ms): " + ", ".join(
            f"{k} {' '.join(f'{v:.2f}' for v in getattr(costs, k))}" for k in ("s", "t", "c", "e_f", "e_b"))]
          if schedule.vocab_parallel else []),
        *(["  K-FAC pieces per stage, a unit's (ms): " + ", ".join(
            f"{k.removeprefix('kfac_')} {' '.join(f'{v:.2f}' for v in costs.extra[k])}" for k in sorted(costs.extra))]
          if kfac else []),
        *memory,
        "  the simulator's prediction for other schedules with these costs"
        + (" (a step each, without K-FAC's pieces):" if kfac else ":"),
    ]
    full = full_stage_costs(costs, schedule)
    for name in FAMILIES:
        if name == schedule.family:
            continue
        options = {"costs": full} if name == "zb-auto" else {}
        if schedule.vocab_parallel:
            options["vocab_parallel"] = schedule.vocab_parallel
        try:
            other = build(name, schedule.pp, schedule.microbatches, **options)
        except PipeloomError as err:
            lines.append(f"    {name:<18} cannot run here: {err}")
            continue
        if full.w == 0 and any(a.kind == "W" for actions in other.ranks for a in actions):
            lines.append(f"    {name:<18} needs T_W: train with a split-backward schedule (zb-h1) to measure it")
            continue
        result = simulate(other, full)
        lines.append(f"    {name:<18} {result.makespan / other.steps:9.2f} ms   bubble {result.bubble_rate:.1%}"
                     + (f"   (a step of {other.steps} without a flush)" if other.steps > 1 else ""))
    return "\n".join(lines)


def memory_lines(above_start: list[int], peaks: list[int] | None, simulated: dict) -> list[str]:
    """Measured memory per pipeline rank (the largest of its replicas) beside ``simulated``
    (``simulate --json``'s facts of the run): ``above_start``, the most a rank held above the start
    of the last call (:meth:`~pipeloom.runtime.memory.PeakMemory.stretch`), beside the simulated
    peak less what is held between steps (``peak_memory_bytes`` less ``held_memory_bytes``); on a
    GPU ``peaks`` (``torch.cuda.max_memory_allocated`` since the model was built; None on a CPU)
    beside ``peak_memory_bytes``."""
    from ..techniques import size_text

    if "peak_memory_bytes" not in simulated:
        return []
    predicted = simulated["peak_memory_bytes"]

    def line(what: str, measured: list, expected: list, how: str) -> str:
        ratios = " ".join(f"{m / e:.3f}" if e else "-" for m, e in zip(measured, expected))
        return (f"  {what}: measured {' '.join(size_text(x) for x in measured)} ({how}), simulated "
                f"{' '.join(size_text(x) for x in expected)}; measured / simulated {ratios}")

    how = ("allocated bytes" if peaks is not None else "resident set" + (
        "" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else
        ", which keeps what glibc keeps after a free: start with MALLOC_MMAP_THRESHOLD_=65536 to follow the tensors"))
    lines = [line("memory per rank above a step's start", above_start,
                  [p - h for p, h in zip(predicted, simulated["held_memory_bytes"])], how)]
    if peaks is not None:
        lines.append(line("peak memory per rank", peaks, predicted, "torch.cuda.max_memory_allocated"))
    return lines
