"""``pipeloom simulate``: build a run's schedule, simulate it, print its facts and draw it."""

from __future__ import annotations

import json
import re

from ..errors import PipeloomError, comma_list
from .flags import add_run_flags, spec_of
from .output import wrote
from .report import compare_table, memory_unit, rank_table, report, setting_table, title


def add_parser(sub) -> None:
    from ..schedule import TORCH_SCHEDULES

    p = sub.add_parser(
        "simulate",
        help="predict time, bubbles and memory of a run's schedule and draw it",
        description="Build a run's schedule (the one pipeloom train would run with the same flags), validate it, "
                    "simulate it and print a table and a text picture.",
    )
    add_run_flags(p, model_default=None, lists=True)
    g = p.add_argument_group("simulate's own")
    g.add_argument("--torch-schedule", metavar="CLASS|FILE.csv",
                   help="the order of a torch.distributed.pipelining schedule: one of "
                        f"{', '.join(TORCH_SCHEDULES)}, or a CSV its _dump_csv wrote (the same as --schedule "
                        "torch:CLASS)")
    g.add_argument("--compare", metavar="A,B,...",
                   help="simulate several schedules on the same costs, side by side (torch's as torch:CLASS or "
                        "torch:FILE.csv); --plot draws them in one picture, --trace and --torch-csv FILE write one "
                        "file per schedule, STEM-NAME.SUFFIX")
    g.add_argument("--costs", default="", metavar="f=1,b=1,w=1,comm=0",
                   help="without --model: per full stage, f, b, w, comm times; m_b, m_w activation memory (defaults "
                        "1,1,1,0,1,0); offload, the time to copy m_b to or from the host (default 0); per rank, the "
                        "vocabulary passes: s, t, c, r, e_f, e_b, e_comm times, m_v memory (default 0); K-FAC's "
                        "kfac_a, kfac_g, kfac_sync_a, kfac_sync_g, kfac_inv, kfac_pre")
    g.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    g.add_argument("--plot", metavar="FILE.png|.svg", help="draw the schedule and its memory with matplotlib")
    g.add_argument("--torch-csv", metavar="FILE", help="export for torch.distributed.pipelining's runtime schedule")
    g.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    """Check the inputs and output paths, then simulate, write the files and print."""
    from ..paths import prepare_output
    from ..sim.plot import SUFFIXES

    flag, values = _setting(args)  # a comma list: its first value until the comparison
    names = _schedules(args)
    compare = args.compare is not None
    specs = [spec_of(args, schedule=name, costs=args.costs, **(_compared(name, args) if compare else {}))
             for name in names]
    plot = None if args.plot is None else prepare_output("--plot", args.plot, SUFFIXES)
    files = _output_files(args, names)
    if len(values) > 1:
        return _compare_setting(args, specs[0], flag, values, plot)
    runs = [simulate_spec(spec) for spec in specs]
    reports, results = [r for r, _ in runs], [result for _, result in runs]
    _write(results, files, plot, compare=args.compare is not None, unit=memory_unit(reports[0]))
    if args.compare is not None:
        print(json.dumps({"compare": reports}, indent=2) if args.json else compare_table(reports))
    elif args.json:
        print(json.dumps(reports[0], indent=2))
    else:
        from ..sim.grid import text_grid
        print(rank_table(reports[0]))
        print()
        print(text_grid(results[0]))
    return 0


def _schedules(args) -> list[str]:
    """The schedules to simulate, checked: --schedule, or the names of --compare."""
    from ..schedule import FAMILIES, get_family
    from ..schedule.torch_csv import TORCH_PREFIX

    schedule = args.schedule
    if args.torch_schedule is not None:
        if args.compare is not None:
            raise PipeloomError(f"--compare takes torch's schedules in its list: name it there as "
                                f"{TORCH_PREFIX}{args.torch_schedule}, without --torch-schedule")
        if schedule is not None:
            raise PipeloomError("give either --schedule or --torch-schedule, not both")
        schedule = TORCH_PREFIX + args.torch_schedule
    names = [schedule or "1f1b"] if args.compare is None else comma_list("--compare", args.compare)
    families = [get_family(name) for name in names]
    if args.compare is not None and args.chunks is not None and all(_chunks(n, args.chunks) is None for n in names):
        takes = ", ".join(f"{f.name} {'>= 2' if f.chunks is None else ' or '.join(map(str, f.chunks))}" for f in families)
        raise PipeloomError(f"--chunks {args.chunks} fits none of the schedules compared; they take chunks {takes}")
    steppers = [name for name, family in FAMILIES.items() if "steps" in family.options]
    if args.compare is not None and args.schedule_steps is not None and not set(names) & set(steppers):
        raise PipeloomError(f"--schedule-steps sets how many steps {', '.join(steppers)} builds; {', '.join(names)} "
                            "build one step")
    return names


def _output_files(args, names: list[str]) -> dict:
    """--torch-csv and --trace, checked and ready: a file per schedule, with --compare
    STEM-NAME.SUFFIX beside the FILE given (a run of characters other than letters, digits,
    dots and dashes in NAME becomes one dash)."""
    from pathlib import Path

    from ..paths import prepare_output

    files, labels = {}, [re.sub(r"[^\w.-]+", "-", name) for name in names]  # torch:a/b.csv: torch-a-b.csv
    for flag, given in (("--torch-csv", args.torch_csv), ("--trace", args.trace)):
        if given is not None:
            path = Path(given)
            each = [given] if args.compare is None else [
                str(path.parent / f"{path.stem}-{label}{path.suffix}") for label in labels]
            files[flag] = [prepare_output(flag, p) for p in each]
    return files


def _write(results, files, plot, compare: bool, unit: str) -> None:
    """Write the files asked for, each followed by ``wrote FILE`` on stderr: the torch CSVs
    first, since a schedule with vocabulary passes has none and stops the run; memory in ``unit``
    (:func:`~pipeloom.cli.report.memory_unit`)."""
    from ..schedule.torch_csv import write_torch_csv
    from ..sim.plot import plot_schedule, plot_schedules
    from ..sim.trace import write_chrome_trace

    for result, path in zip(results, files.get("--torch-csv", ())):
        write_torch_csv(result.schedule, path)
        wrote(path)
    for result, path in zip(results, files.get("--trace", ())):
        write_chrome_trace(result, path, memory_unit=unit)
        wrote(path)
    if plot is not None:
        if compare:
            plot_schedules(results, plot)
        else:
            plot_schedule(results[0], plot, unit)
        wrote(plot)


def simulate_spec(spec):
    """Build and simulate the run ``spec`` describes, with the one builder; (report dict, Result)."""
    from ..builder import Priced, build_run
    from ..sim import simulate

    priced = Priced(spec)
    result = simulate(build_run(spec, priced.costs), priced.costs)
    return report(result, priced), result


def _compared(name: str, args) -> dict:
    """The flags a schedule of a comparison takes differently: --chunks where its family has
    other fixed chunks, --schedule-steps where it builds one step, are dropped."""
    from ..schedule import get_family

    steps = args.schedule_steps if "steps" in get_family(name).options else None
    return {"chunks": _chunks(name, args.chunks), "schedule_steps": steps}


def _chunks(name: str, chunks: int | None) -> int | None:
    """--chunks for schedule ``name`` in a comparison: dropped (None) where the family has other fixed chunks."""
    from ..schedule import get_family

    family = get_family(name)
    return None if chunks is not None and family.chunks is not None and chunks not in family.chunks else chunks


def _setting(args):
    """The technique flags that take a comma list (:attr:`~pipeloom.techniques.Flag.compared`), each
    parsed: (the flag given several values, its values), else (None, [None]); at most one such flag,
    and only without --compare, --trace or --torch-csv."""
    from ..techniques import flags

    given = [(flag, flag.values(getattr(args, flag.name))) for flag in flags()
             if flag.compared and getattr(args, flag.name) is not None]
    for flag, values in given:
        setattr(args, flag.name, values[0])
    listed = [(flag, values) for flag, values in given if len(values) > 1]
    if len(listed) > 1:
        raise PipeloomError(f"compare one setting at a time: {listed[0][0].flag} and {listed[1][0].flag} both list "
                            "several values")
    if not listed:
        return None, [None]
    flag, values = listed[0]
    for other, value in (("--compare", args.compare), ("--trace", args.trace), ("--torch-csv", args.torch_csv)):
        if value is not None:
            raise PipeloomError(f"{other} takes one {flag.flag} value; got {len(values)} ({', '.join(map(str, values))})")
    return flag, values


def _compare_setting(args, spec, flag, values: list, plot) -> int:
    """One schedule under each value of a technique's ``flag``: a table (or a JSON list) and, with
    --plot, per-rank bars; throughput relative to the value "none" where listed, else the first."""
    reports = []
    for value in values:
        setattr(args, flag.name, value)
        reports.append(simulate_spec(spec_of(args, schedule=spec.schedule, costs=spec.costs))[0])
    first = values.index("none") if "none" in values else 0
    base = reports[first]
    for value, r in zip(values, reports):
        busy = [row["busy"] for row in r["ranks"]]
        r.update(setting=value, relative_throughput=base["makespan"] / r["makespan"], relative_to=values[first],
                 busy_max=max(busy), busy_min=min(busy), busy_mean=sum(busy) / len(busy))
    if plot is not None:
        from ..sim.plot import plot_rank_comparison

        memory = "peak_memory_bytes" in base
        plot_rank_comparison(
            plot, [str(value) for value in values], [[row["busy"] for row in r["ranks"]] for r in reports],
            [[x / 2**30 for x in r["peak_memory_bytes"]] if memory else r["peak_activation"] for r in reports],
            busy_label=f"busy ({base.get('time_unit', 'units')})",
            memory_label="peak memory (GiB)" if memory else "peak activation (M_B)",
            title=f"{title(base)}, by {flag.flag}",
        )
        wrote(plot)
    print(json.dumps(reports, indent=2) if args.json else setting_table(flag.flag, reports))
    return 0
