"""The ``pipeloom`` command line."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from . import plan_cli
from .errors import PipeloomError


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at exit
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left for the exit to flush
        return 141  # 128 + SIGPIPE, as for any command whose reader stopped
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    args.argv = argv[argv.index(args.command) + 1:]  # what a subcommand was given, to pass on
    try:
        return args.run(args)
    except PipeloomError as err:
        print(f"pipeloom {args.command}: error: {err}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake said in one line (not the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipeloom", description="Plan, simulate, draw and run pipeline-parallel training.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_simulate(sub)
    _add_profile(sub)
    plan_cli.add_parser(sub)
    _add_train(sub)
    _add_generate(sub)
    return parser


# -- simulate ----------------------------------------------------------------

def _add_simulate(sub) -> None:
    from .schedule import FAMILIES, TORCH_SCHEDULES

    p = sub.add_parser(
        "simulate",
        help="predict time, bubbles and memory of a schedule and draw it",
        description="Build a schedule, validate it, simulate it and print a table and a text picture.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--schedule", default="1f1b", metavar="NAME",
                       help=f"one of: {', '.join(FAMILIES)} (default 1f1b); or torch:CLASS, torch:FILE.csv")
    which.add_argument("--torch-schedule", metavar="CLASS|FILE.csv",
                       help="the order of a torch.distributed.pipelining schedule: one of "
                            f"{', '.join(TORCH_SCHEDULES)}, or a CSV its _dump_csv wrote (the same as --schedule "
                            "torch:CLASS)")
    p.add_argument("--compare", metavar="A,B,...",
                   help="simulate several schedules on the same costs, side by side (torch's as torch:CLASS or "
                        "torch:FILE.csv); --plot draws them in one picture, --trace and --torch-csv FILE write one "
                        "file per schedule, STEM-NAME.SUFFIX")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (default 8)")
    p.add_argument("--chunks", type=int, help="stages per rank (interleaved-1f1b: >= 2, default 2)")
    p.add_argument("--steps", type=int, help="consecutive steps to build (2bw)")
    p.add_argument("--costs", default="", metavar="f=1,b=1,w=1,comm=0",
                   help="per full stage: f, b, w, comm times; m_b, m_w activation memory (defaults 1,1,1,0,1,0); "
                        "offload, the time to copy m_b to or from the host (default 0); "
                        "per rank, the vocabulary passes: s, t, c, r, e_f, e_b, e_comm times, m_v memory (default 0)")
    p.add_argument("--memory-limit", type=float, metavar="X",
                   help="activation memory limit per rank in units of a full stage's M_B (zb-auto searches under it; "
                        "other schedules are checked against it)")
    p.add_argument("--model", metavar="PRESET", help="derive costs from a model preset instead of --costs")
    p.add_argument("--seq", type=int, help="sequence length, with --model only (default 2048)")
    p.add_argument("--microbatch-size", type=int, help="sequences per microbatch, with --model only (default 1)")
    p.add_argument("--device", help="device preset, with --model only: a100, h100, v100, cpu (default a100; with "
                                    "--profile cpu for a CPU profile, h100 for a GPU one)")
    p.add_argument("--profile", metavar="FILE.json",
                   help="with --model: take the layers' and ends' times, activation bytes and the stage-to-stage "
                        "transfer from this profile (pipeloom profile) instead of the formulas and the device preset; "
                        "--seq defaults to the profile's")
    p.add_argument("--vocab", type=int, metavar="V", help="vocabulary size with --model (default: the preset's)")
    p.add_argument("--sp", type=int, metavar="N",
                   help="sequence parallelism with --model: each stage on N ranks holding seq/N tokens each "
                        "(default 1; N must divide --seq)")
    p.add_argument("--attention", metavar="ring|rsa",
                   help="how SP ranks pass keys and values round their ring: ring (blockwise, overlapped; the "
                        "default) or rsa (Ring Self-Attention, scores kept); with --sp 1 the default is plain attention")
    p.add_argument("--recompute", choices=("none", "cheap", "full"),
                   help="with --model: recompute in B the norms and activation functions (cheap) or whole layers "
                        "(full) instead of keeping their activations (default none)")
    p.add_argument("--vocab-parallel", metavar="MODE[,MODE...]",
                   help="where the vocabulary layers go: none (first and last stage), redis (layers moved to balance "
                        "them), naive, vocab-1, vocab-2 (split over every rank, in extra passes); a comma list "
                        "compares the modes side by side")
    p.add_argument("--offload", choices=("none", "full", "selective"),
                   help="PipeOffload: copy activations to host memory after F and back before B, on one copy "
                        "stream per rank: every pair with room (full) or the longest-lived until the peak falls "
                        "by --offload-ratio (selective); default none")
    p.add_argument("--offload-ratio", type=float, metavar="R",
                   help="with --offload selective: the share of each rank's peak activation memory to remove, in (0, 1]")
    p.add_argument("--kfac", action="store_true",
                   help="PipeFisher: put K-FAC's curvature, sync and inversion pieces into the bubbles (one piece per "
                        "linear layer with --model, else one per stage: give kfac_a, kfac_g, kfac_sync_a, kfac_sync_g, "
                        "kfac_inv, kfac_pre in --costs); the steps the pieces need set the refresh interval")
    p.add_argument("--kfac-every", type=int, metavar="K",
                   help="with --kfac: force the refresh interval to K steps (what does not fit runs at its end)")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    p.add_argument("--plot", metavar="FILE.png|.svg", help="draw the schedule and its memory with matplotlib")
    p.add_argument("--torch-csv", metavar="FILE", help="export for torch.distributed.pipelining's runtime schedule")
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.set_defaults(run=_run_simulate)


#: The flags that only mean something with --model, and what they set.
MODEL_FLAGS = {"--seq": "the sequence length", "--microbatch-size": "the sequences per microbatch",
               "--device": "the device", "--vocab": "the vocabulary", "--sp": "the sequence parallelism",
               "--attention": "the sequence-parallel attention", "--recompute": "the recomputation",
               "--profile": "the measured costs"}
MODEL_DEFAULTS = {"seq": 2048, "microbatch_size": 1, "device": "a100"}


def _run_simulate(args) -> int:
    """Check the inputs and output paths, then simulate, write the files and print."""
    from .paths import prepare_output
    from .sim.plot import SUFFIXES

    modes = _vocab_modes(args)
    args.offload = _offload(args)
    if args.kfac_every is not None and not args.kfac:
        raise PipeloomError(f"--kfac-every {args.kfac_every} goes with --kfac")
    names = _schedules(args)
    _model_flags(args)
    if args.memory_limit is not None and not 0 < args.memory_limit < math.inf:
        raise PipeloomError(f"--memory-limit {args.memory_limit:g}: must be a positive number of M_B")
    plot = None if args.plot is None else prepare_output("--plot", args.plot, SUFFIXES)
    files = _output_files(args, names)
    if len(modes) > 1:
        return _compare_vocab(args, modes, plot)
    args.vocab_parallel = modes[0] if modes else None
    runs = [_simulate_one(args, name, compare=args.compare is not None) for name in names]
    reports, results = [report for report, _ in runs], [result for _, result in runs]
    _write(results, files, plot, compare=args.compare is not None)
    if args.compare is not None:
        print(json.dumps({"compare": reports}, indent=2) if args.json else _compare_table(reports))
    elif args.json:
        print(json.dumps(reports[0], indent=2))
    else:
        from .sim.grid import text_grid
        print(_rank_table(reports[0]))
        print()
        print(text_grid(results[0]))
    return 0


def _schedules(args) -> list[str]:
    """The schedules to simulate, checked: --schedule, or the names of --compare."""
    from .schedule import FAMILIES, get_family
    from .schedule.torch_csv import TORCH_PREFIX

    if args.torch_schedule is not None:
        if args.compare is not None:
            raise PipeloomError(f"--compare takes torch's schedules in its list: name it there as "
                                f"{TORCH_PREFIX}{args.torch_schedule}, without --torch-schedule")
        args.schedule = TORCH_PREFIX + args.torch_schedule
    names = [args.schedule] if args.compare is None else _names("--compare", args.compare)
    families = [get_family(name) for name in names]
    if args.compare is not None and args.chunks is not None and all(_chunks(f, args.chunks) is None for f in families):
        takes = ", ".join(f"{f.name} {'>= 2' if f.chunks is None else ' or '.join(map(str, f.chunks))}" for f in families)
        raise PipeloomError(f"--chunks {args.chunks} fits none of the schedules compared; they take chunks {takes}")
    steppers = [name for name, family in FAMILIES.items() if "steps" in family.options]
    if args.steps is not None and not set(names) & set(steppers):
        raise PipeloomError(f"--steps sets how many steps {', '.join(steppers)} builds; {', '.join(names)} "
                            f"{'builds' if len(names) == 1 else 'build'} one step")
    return names


def _names(flag: str, text: str) -> list[str]:
    """The names of a comma list: at least one, none twice."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise PipeloomError(f"{flag} {text!r}: give at least one name")
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice:
        raise PipeloomError(f"{flag} {text!r}: {twice} is named twice")
    return names


def _model_flags(args) -> None:
    """Refuse the flags that need --model when it is not given; give the rest their defaults when it is."""
    if not args.model:
        for flag, what in MODEL_FLAGS.items():
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise PipeloomError(f"{flag} sets {what} that --model derives costs for; give --model too")
        return
    if args.costs:
        raise PipeloomError("give either --costs or --model, not both")
    args.measured = _load_profile(args)
    for name, value in MODEL_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _load_profile(args):
    """The --profile, loaded and checked (None without one); it gives --seq and --device their defaults."""
    if args.profile is None:
        return None
    from .sim.profile import load_profile

    profile = load_profile(args.profile)
    if args.seq is None:
        args.seq = profile.seq
    if args.device is None:
        args.device = "h100" if profile.machine["device"] == "cuda" else "cpu"
    return profile


def _costs_source(args, device) -> str:
    """What the costs of a --model run come from, as the output says it."""
    return f"profile {args.profile}" if args.profile else f"formulas, device preset {device.name}"


def _output_files(args, names: list[str]) -> dict:
    """--torch-csv and --trace, checked and ready: a file per schedule, with --compare
    STEM-NAME.SUFFIX beside the FILE given (a run of characters other than letters, digits,
    dots and dashes in NAME becomes one dash)."""
    from pathlib import Path

    from .paths import prepare_output

    files, labels = {}, [re.sub(r"[^\w.-]+", "-", name) for name in names]  # torch:a/b.csv: torch-a-b.csv
    for flag, given in (("--torch-csv", args.torch_csv), ("--trace", args.trace)):
        if given is not None:
            path = Path(given)
            each = [given] if args.compare is None else [
                str(path.parent / f"{path.stem}-{label}{path.suffix}") for label in labels]
            files[flag] = [prepare_output(flag, p) for p in each]
    return files


def _write(results, files, plot, compare: bool) -> None:
    """Write the files asked for, each followed by ``wrote FILE`` on stderr: the torch CSVs
    first, since a schedule with vocabulary passes has none and stops the run."""
    from .schedule.torch_csv import write_torch_csv
    from .sim.plot import plot_schedule, plot_schedules
    from .sim.trace import write_chrome_trace

    for result, path in zip(results, files.get("--torch-csv", ())):
        write_torch_csv(result.schedule, path)
        _wrote(path)
    for result, path in zip(results, files.get("--trace", ())):
        write_chrome_trace(result, path)
        _wrote(path)
    if plot is not None:
        if compare:
            plot_schedules(results, plot)
        else:
            plot_schedule(results[0], plot)
        _wrote(plot)


def _wrote(path) -> None:
    print(f"wrote {path}", file=sys.stderr)


def _simulate_one(args, name: str, compare: bool):
    """Build, validate and simulate one schedule; return (report dict, Result)."""
    from .schedule import build, get_family, validate
    from .sim import simulate

    family = get_family(name)
    chunks = _chunks(family, args.chunks) if compare else args.chunks
    costs, model = _costs(args, family, chunks)
    options = {"memory_limit": args.memory_limit, "steps": args.steps}  # build gives the family the costs
    options = {k: v for k, v in options.items() if v is not None and k in family.options}
    transforms = [args.offload] if args.offload else []
    schedule = build(name, args.pp, args.microbatches, chunks, vocab_parallel=args.vocab_parallel,
                     transforms=transforms, costs=costs, **options)
    if args.memory_limit is not None and "memory_limit" not in options:
        validate(schedule, memory_limit=args.memory_limit, m_w=_m_w_fraction(costs))
    base = simulate(schedule, costs)
    if not args.kfac:
        return _report(base, model, args), base
    from .schedule import Kfac
    from .sim import kfac_report
    from .sim.formulas import KFAC_UNITS_PER_LAYER
    from .sim.stages import stage_layers

    units = 1 if model is None else [KFAC_UNITS_PER_LAYER * n for n in stage_layers(
        model[0], schedule.stages, args.seq, vocab_parallel=args.vocab_parallel)]
    schedule = build(name, args.pp, args.microbatches, chunks, vocab_parallel=args.vocab_parallel, costs=costs,
                     transforms=[*transforms, Kfac(units, args.kfac_every)], **options)
    result = simulate(schedule, costs)
    return {**_report(result, model, args), "kfac": kfac_report(base, result)}, result


def _offload(args):
    """The Offload transform of --offload and --offload-ratio (checked), or None."""
    from .schedule.transforms.offload import Offload

    if args.offload is None:
        if args.offload_ratio is not None:
            raise PipeloomError(f"--offload-ratio {args.offload_ratio:g} goes with --offload selective")
        return None
    return Offload(args.offload, args.offload_ratio)


def _chunks(family, chunks: int | None) -> int | None:
    """--chunks for ``family`` in a comparison: dropped (None) where the family has other fixed chunks."""
    return None if chunks is not None and family.chunks is not None and chunks not in family.chunks else chunks


def _costs(args, family, chunks):
    from .schedule import Costs

    if not args.model:
        return Costs.parse(args.costs), None
    from dataclasses import replace

    from .sim.model import costs_from_model
    from .sim.specs import get_device, get_model

    model, device = get_model(args.model), get_device(args.device)
    if args.vocab is not None:
        model = replace(model, vocab=args.vocab)
    costs = costs_from_model(model, args.pp, args.seq, args.microbatch_size, device,
                             chunks=chunks or family.default_chunks, vocab_parallel=args.vocab_parallel,
                             sp=_sp(args), attention=args.attention, recompute=_recompute(args), kfac=args.kfac,
                             profile=args.measured)
    return costs, (model, device)


def _recompute(args) -> bool | str:
    """--recompute as :func:`~pipeloom.sim.model.costs_from_model` takes it."""
    from .modes import RECOMPUTE

    return RECOMPUTE[args.recompute or "none"]


def _sp(args) -> int:
    """--sp, 1 when not given."""
    return 1 if args.sp is None else args.sp


def _m_w_fraction(costs) -> float:
    m_b, m_w = costs.m_b, costs.m_w
    if isinstance(m_b, (int, float)) and isinstance(m_w, (int, float)) and m_b:
        return m_w / m_b
    return 0.0


def _report(result, model, args) -> dict:
    schedule = result.schedule
    report = {
        "schedule": schedule.family,
        "pp": schedule.pp,
        "microbatches": schedule.microbatches,
        "chunks": schedule.chunks,
        "stages": schedule.stages,
        "steps": schedule.steps,
        "vocab_parallel": schedule.options.get("vocab_parallel"),
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
    if model is not None:
        from .sim.memory import peak_memory_bytes

        spec, device = model
        full_stage_m_b = sum(result.costs.m_b) / schedule.pp  # bytes of M_B for an average full stage
        state = {"bytes_per_param": args.measured.bytes_per_param} if args.measured else {}
        report.update(
            model=spec.name, vocab=spec.vocab, device=device.name, seq=args.seq, microbatch_size=args.microbatch_size,
            costs=_costs_source(args, device), time_unit="ms",
            peak_activation=[x / full_stage_m_b for x in result.peak_activation],
            peak_activation_bytes=result.peak_activation,
            peak_memory_bytes=peak_memory_bytes(spec, result, args.seq, microbatch_size=args.microbatch_size,
                                                sp=_sp(args), attention=args.attention, **state),
        )
        for row, value in zip(report["ranks"], report["peak_activation"]):
            row["peak_activation"] = value
        if args.sp is not None or args.attention is not None:
            report.update(_sp_report(spec, device, schedule, args))
    if args.offload is not None:
        report["offload"] = _offload_report(result, model, args)
    return report


def _offload_report(result, model, args) -> dict:
    """Policy and, per rank, peak host memory, what is offloaded per step and the copy time not
    hidden (bytes and ms with --model, else in the units of --costs), and with --model PipeOffload's k."""
    from .schedule.transforms.offload import OFFLOAD

    schedule, costs = result.schedule, result.costs
    offloaded = [sum(costs.m_b[a.stage] for a in actions if a.kind == OFFLOAD) for actions in schedule.ranks]
    report = {"policy": args.offload.policy, "ratio": args.offload.ratio if args.offload.policy == "selective" else None}
    if model is None:
        report["ranks"] = [{"rank": r, "host": h, "offloaded": o, "exposed": e}
                           for r, (h, o, e) in enumerate(zip(result.peak_host, offloaded, result.exposed))]
        return report
    from .sim.model import costs_from_model, offload_time_ratio

    spec, device = model
    if args.measured is None:
        report["k"] = offload_time_ratio(spec, args.seq, args.microbatch_size, device, sp=_sp(args),
                                         attention=args.attention, recompute=_recompute(args))
    else:  # as offload_time_ratio: a one-layer middle stage, its costs from the profile
        one = costs_from_model(spec, 3, args.seq, args.microbatch_size, device,
                               layers_per_stage=[0, 1, spec.layers - 1], recompute=_recompute(args), sp=_sp(args),
                               attention=args.attention, profile=args.measured)
        report["k"] = 2 * one.extra["offload"][1] / (one.f[1] + one.b[1] + one.w[1])
    report["ranks"] = [{"rank": r, "host_bytes": h, "offloaded_bytes": o, "exposed_ms": e}
                       for r, (h, o, e) in enumerate(zip(result.peak_host, offloaded, result.exposed))]
    return report


def _sp_report(spec, device, schedule, args) -> dict:
    """The sequence-parallel fields: the ring's transfers per stage, one layer's details, rsa's and ring's scores."""
    from dataclasses import asdict

    from .modes import Attention
    from .sim.formulas import sequence_parallel_costs
    from .sim.stages import stage_layers

    sp = _sp(args)
    layer = sequence_parallel_costs(spec, args.seq, args.microbatch_size, device, sp, args.attention)
    layers = stage_layers(spec, schedule.stages, args.seq, vocab_parallel=schedule.options.get("vocab_parallel"))
    scores = {}
    for name in Attention:
        other = sequence_parallel_costs(spec, args.seq, args.microbatch_size, device, sp, name)
        scores[name] = {"kept": other.kept_bytes, "transient": other.transient_bytes}
    return {
        "sp": sp,
        "attention": layer.attention,
        "sp_comm_ms": [n * layer.comm_ms for n in layers],
        "sp_exposed_ms": [n * (layer.exposed_forward_ms + layer.exposed_backward_ms) for n in layers],
        "sp_layer": {k: v for k, v in asdict(layer).items() if k not in ("sp", "attention")},
        "score_bytes": scores,
    }


def _rank_table(report: dict) -> str:
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
    if "sp" in report:
        lines += ["", *_sp_lines(report)]
    if "offload" in report:
        lines += ["", *_offload_lines(report)]
    if "kfac" in report:
        lines += ["", *_kfac_lines(report["kfac"])]
    return "\n".join(lines)


def _kfac_lines(kfac: dict) -> list[str]:
    forced = "forced" if kfac["forced"] else "the steps its pieces need"
    lines = [f"K-FAC: refresh every {kfac['every']} steps ({forced}); step {kfac['step_time_before']:.4g} -> "
             f"{kfac['step_time_after']:.4g} ({kfac['makespan_change']:+.1%}); {kfac['overflow_pieces']} pieces "
             "fitted no bubble",
             f"{'rank':>4} {'busy before':>12} {'busy after':>11} {'bubble filled':>14} {'K-FAC time':>11}"]
    for row in kfac["ranks"]:
        lines.append(f"{row['rank']:>4} {row['utilisation_before']:>12.1%} {row['utilisation_after']:>11.1%} "
                     f"{row['bubble_filled']:>14.1%} {row['kfac_time']:>11.4g}")
    return lines


def _offload_lines(report: dict) -> list[str]:
    offload = report["offload"]
    policy = offload["policy"] + (f" {offload['ratio']:g}" if offload["ratio"] is not None else "")
    bytes_ = "k" in offload
    lines = [f"offload {policy}:" + (f" k = T_offload / T_compute per layer = {offload['k']:.3g} "
                                     f"({'the copy stream keeps up' if offload['k'] <= 1 else 'copies outlast compute'})"
                                     if bytes_ else ""),
             f"{'rank':>4} {'offloaded/step':>15} {'peak host':>12} {'exposed':>10}"]
    for row in offload["ranks"]:
        if bytes_:
            lines.append(f"{row['rank']:>4} {_size(row['offloaded_bytes']):>15} {_size(row['host_bytes']):>12} "
                         f"{row['exposed_ms']:>7.4g} ms")
        else:
            lines.append(f"{row['rank']:>4} {row['offloaded']:>11.4g} M_B {row['host']:>8.4g} M_B {row['exposed']:>10.4g}")
    return lines


def _sp_lines(report: dict) -> list[str]:
    layer, scores = report["sp_layer"], report["score_bytes"]
    ring = report["attention"] == "ring"
    return [
        f"sp={report['sp']}, {report['attention']} attention: per layer and microbatch {layer['steps']} forward "
        f"steps of {_size(layer['step_bytes'])} ({'K and V' if ring else 'K, then V'}), {layer['step_ms']:.4g} ms each",
        f"  ring transfers of a microbatch's F and B: up to {max(report['sp_comm_ms']):.4g} ms per stage, "
        f"{max(report['sp_exposed_ms']):.4g} ms of it not hidden by compute",
        f"  attention scores per layer and microbatch: rsa keeps {_size(scores['rsa']['kept'])}; ring keeps "
        f"{_size(scores['ring']['kept'])} (log-sum-exp) and computes in one {_size(scores['ring']['transient'])} block",
    ]


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.4g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.4g} MiB"


def _vocab_modes(args) -> list[str]:
    """The --vocab-parallel modes, checked; only one with --compare, --trace or --torch-csv."""
    from .schedule.transforms.vocab import check_mode

    if args.vocab_parallel is None:
        return []
    modes = [check_mode(mode) for mode in _names("--vocab-parallel", args.vocab_parallel)]
    if len(modes) > 1:
        for flag, value in (("--compare", args.compare), ("--trace", args.trace), ("--torch-csv", args.torch_csv)):
            if value is not None:
                raise PipeloomError(f"{flag} takes one --vocab-parallel mode; got {len(modes)} ({', '.join(modes)})")
    return modes


def _compare_vocab(args, modes: list[str], plot) -> int:
    """One schedule under each vocabulary mode: a table (or a JSON list) and, with --plot, per-rank bars."""
    reports = []
    for mode in modes:
        args.vocab_parallel = mode
        reports.append(_simulate_one(args, args.schedule, compare=False)[0])
    base = next((r for r in reports if r["vocab_parallel"] == "none"), reports[0])
    for r in reports:
        busy = [row["busy"] for row in r["ranks"]]
        r.update(relative_throughput=base["makespan"] / r["makespan"], relative_to=base["vocab_parallel"],
                 busy_max=max(busy), busy_min=min(busy), busy_mean=sum(busy) / len(busy))
    if plot is not None:
        from .sim.plot import plot_rank_comparison

        memory = "peak_memory_bytes" in base
        plot_rank_comparison(
            plot, [r["vocab_parallel"] for r in reports], [[row["busy"] for row in r["ranks"]] for r in reports],
            [[x / 2**30 for x in r["peak_memory_bytes"]] if memory else r["peak_activation"] for r in reports],
            busy_label=f"busy ({base.get('time_unit', 'units')})",
            memory_label="peak memory (GiB)" if memory else "peak activation (M_B)",
            title=_vocab_title(base),
        )
        _wrote(plot)
    print(json.dumps(reports, indent=2) if args.json else _vocab_table(reports))
    return 0


def _vocab_title(report: dict) -> str:
    title = f"{report['schedule']}: pp={report['pp']} microbatches={report['microbatches']}"
    if "model" in report:
        title += f", {report['model']} (V={report['vocab']}), seq {report['seq']}, {report['device']}"
    return title


def _vocab_table(reports: list[dict]) -> str:
    memory = "peak_memory_bytes" in reports[0]
    unit = f" ({reports[0]['time_unit']})" if "time_unit" in reports[0] else ""
    lines = [
        _vocab_title(reports[0]) + f"; times{unit}, throughput relative to {reports[0]['relative_to']}",
        *([f"costs: {reports[0]['costs']}"] if "costs" in reports[0] else []),
        "",
        f"{'mode':<9} {'makespan':>10} {'throughput':>10} {'busy max':>10} {'busy min':>10} {'busy mean':>10} "
        + ("max peak memory (GiB)" if memory else "max peak act (M_B)"),
    ]
    for r in reports:
        peak = max(r["peak_memory_bytes"]) / 2**30 if memory else max(r["peak_activation"])
        lines.append(f"{r['vocab_parallel']:<9} {r['makespan']:>10.5g} {r['relative_throughput']:>9.3f}x "
                     f"{r['busy_max']:>10.5g} {r['busy_min']:>10.5g} {r['busy_mean']:>10.5g} {peak:>21.4g}")
    return "\n".join(lines)


def _compare_table(reports: list[dict]) -> str:
    offload, kfac = "offload" in reports[0], "kfac" in reports[0]
    width = max(18, *(len(r["schedule"]) for r in reports))
    lines = [*([f"costs: {reports[0]['costs']}"] if "costs" in reports[0] else []),
             f"{'schedule':<{width}} {'stages':>6} {'makespan':>10}  {'span bubble':>11}  {'step bubble':>11} "
             f"{'max peak act':>13}" + (f" {'max host':>10} {'max exposed':>11}" if offload else "")
             + (f" {'K-FAC k':>7} {'step before':>11} {'step after':>10}" if kfac else "")]
    for r in reports:
        line = (f"{r['schedule']:<{width}} {r['stages']:>6} {r['makespan']:>10.4g}  {r['bubble_rate']:>11.1%}  "
                f"{r['step_bubble_rate']:>11.1%} {max(r['peak_activation']):>13.4g}")
        if offload:
            rows = r["offload"]["ranks"]
            host = max(row.get("host_bytes", row.get("host")) for row in rows)
            exposed = max(row.get("exposed_ms", row.get("exposed")) for row in rows)
            line += f" {_size(host) if 'k' in r['offload'] else f'{host:.4g}':>10} {exposed:>11.4g}"
        if kfac:
            line += f" {r['kfac']['every']:>7} {r['kfac']['step_time_before']:>11.4g} {r['kfac']['step_time_after']:>10.4g}"
        lines.append(line)
    return "\n".join(lines)


# -- profile -----------------------------------------------------------------

def _add_profile(sub) -> None:
    from .presets import SIZES

    p = sub.add_parser(
        "profile",
        help="measure a layer's, the embedding's and the output layer's costs on this machine",
        description="Time one transformer layer (F, B and W split, and BW), the embedding and the output layer "
                    "with pipeloom's own modules on this machine (a CPU, or one GPU), count the activation bytes "
                    "they keep, time a stage-to-stage transfer, and write a JSON profile that simulate --profile "
                    "uses instead of the formulas.",
    )
    p.add_argument("--model", default="tiny", metavar="PRESET", help=f"model sizes: {', '.join(SIZES)} (default tiny)")
    for flag, what in (("--layers", "layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--vocab", "vocabulary size")):
        p.add_argument(flag, type=int, metavar="N", help=f"override the preset's {what}")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's block size, else 1024)")
    p.add_argument("--microbatch-sizes", default="1,2,4", metavar="B,B,...",
                   help="sequences per microbatch to measure (default 1,2,4); the simulator scales the others by FLOPs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda (the current GPU)")
    p.add_argument("--precision", choices=("fp32", "bf16"),
                   help="fp32 (default on cpu) or bf16 autocast (default on cuda)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1, as each runtime worker uses)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each op; the median is kept (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    p.add_argument("--preset", metavar="DEVICE",
                   help="device preset to compare the achieved FLOP rate with (default cpu on cpu, h100 on cuda)")
    p.add_argument("--out", metavar="FILE.json", help="write the profile here (for simulate --profile)")
    p.add_argument("--json", action="store_true", help="print the profile's JSON instead of the table")
    p.set_defaults(run=_run_profile)


def _run_profile(args) -> int:
    """Check the inputs and --out, measure, write the profile and print it."""
    from .paths import prepare_output
    from .presets import SIZES
    from .sim.specs import ModelSpec, get_device

    if args.model not in SIZES:
        raise PipeloomError(f"--model {args.model!r}: choose one of {', '.join(SIZES)}")
    size = SIZES[args.model]
    if size.family != "gpt":
        raise PipeloomError(f"--model {args.model}: pipeloom profile measures GPT layers only so far; "
                            f"choose one of {', '.join(name for name, s in SIZES.items() if s.family == 'gpt')}")
    overrides = {key: getattr(args, key) for key in ("layers", "hidden", "heads", "vocab")
                 if getattr(args, key) is not None}
    name = args.model + "".join(f" {key}={value}" for key, value in overrides.items())
    sizes = {"layers": size.layers, "hidden": size.hidden, "heads": size.heads, "vocab": size.vocab, **overrides}
    spec = ModelSpec(name, **sizes, tied_embeddings=size.tied)  # a bad size stops here, in one line
    seq = args.seq if args.seq is not None else size.block_size or 1024
    batches = _microbatch_sizes(args.microbatch_sizes)
    preset = get_device(args.preset or ("h100" if args.device == "cuda" else "cpu"))
    out = prepare_output("--out", args.out, (".json",)) if args.out else None
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeloomError("pipeloom profile needs PyTorch, which is not installed: pip install torch") from None
    from .nn import GPTConfig
    from .runtime.profile import measure
    from .sim.profile import Profile

    config = GPTConfig(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, vocab_size=spec.vocab,
                       block_size=max(seq, size.block_size or 1), tie_embeddings=spec.tied_embeddings)
    data = measure(config, seq, batches, device=args.device, precision=args.precision, repeats=args.repeats,
                   warmup=args.warmup, threads=args.threads, name=name)
    profile = Profile.from_dict(data, str(out or ""))
    if out is not None:
        out.write_text(json.dumps(data, indent=2) + "\n")
        _wrote(out)
    print(json.dumps(data, indent=2) if args.json else _profile_table(profile, preset))
    return 0


def _microbatch_sizes(text: str) -> list[int]:
    """--microbatch-sizes: positive integers, each once."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise PipeloomError(f"--microbatch-sizes {text!r}: give positive integers, each once, such as 1,2,4")
    return sizes


def _profile_table(profile, preset) -> str:
    """The profile as tables: per microbatch size, the layer's times, FLOP rates and bytes; the ends; the links."""
    from .sim.formulas import layer_flops

    machine, model, seq = profile.machine, profile.model, profile.seq
    giga = machine["device"] == "cpu"
    unit, scale = ("GFLOP/s", 1e9) if giga else ("TFLOP/s", 1e12)
    rate = preset.peak_flops * preset.efficiency / scale
    lines = [
        f"{model.name}: hidden {model.hidden}, {model.heads} heads, vocab {model.vocab}; seq {seq}; "
        f"{machine['precision']} on {machine['name']}"
        + (f", {machine['threads']} thread{'s' if machine['threads'] != 1 else ''}" if giga else "")
        + f"; median of {profile.repeats}",
        "",
        f"one layer: times (ms), achieved {unit} ({preset.name} preset: {rate:.4g}), activation MiB kept "
        "(no recompute / cheap / B to W)",
        f"{'b':>4} {'F':>9} {'B':>9} {'W':>9} {'BW':>9}   {'F':>7} {'B':>7} {'W':>7}   {'none':>9} {'cheap':>9} "
        f"{'B to W':>9}",
    ]
    mib = 2**20
    for b, x in profile.samples.items():
        flops = layer_flops(model, seq, b)
        rates = [n / (1e-3 * ms) / scale for n, ms in zip(flops, (x.layer_f, x.layer_b, x.layer_w))]
        lines.append(f"{b:>4} {x.layer_f:>9.4g} {x.layer_b:>9.4g} {x.layer_w:>9.4g} {x.layer_bw:>9.4g}   "
                     + " ".join(f"{r:>7.4g}" for r in rates)
                     + f"   {x.layer_m_none / mib:>9.4g} {x.layer_m_cheap / mib:>9.4g} {x.layer_m_w / mib:>9.4g}")
    lines += ["", "embedding and output layer: times (ms), output layer's activation MiB (F to B / B to W)",
              f"{'b':>4} {'emb F':>9} {'emb B':>9} {'head F':>9} {'head B':>9} {'head W':>9}   {'F to B':>9} "
              f"{'B to W':>9}"]
    for b, x in profile.samples.items():
        lines.append(f"{b:>4} {x.embedding_f:>9.4g} {x.embedding_b:>9.4g} {x.head_f:>9.4g} {x.head_b:>9.4g} "
                     f"{x.head_w:>9.4g}   {x.head_m_b / mib:>9.4g} {x.head_m_w / mib:>9.4g}")
    if profile.link_bandwidth is not None:
        link = f"{profile.link_bandwidth / 1e9:.3g} GB/s, latency {profile.link_latency_ms:.3g} ms"
    else:
        link = f"not measured ({profile.link_reason}; simulate uses the device preset's)"
    host = f"{profile.host_bandwidth / 1e9:.3g} GB/s" if profile.host_bandwidth else "not measured (no device copies)"
    lines += ["", f"stage-to-stage transfer: {link}", f"host <-> device copies: {host}",
              f"model state: {profile.bytes_per_param:.4g} bytes per parameter"]
    if profile.optimizer_ns_per_param is not None:
        lines.append(f"optimizer step (clipping, AdamW): {profile.optimizer_ns_per_param:.3g} ns per parameter")
    return "\n".join(lines)


# -- train -------------------------------------------------------------------

def _add_train(sub) -> None:
    from .modes import Attention
    from .presets import SIZES
    from .schedule import FAMILIES

    p = sub.add_parser(
        "train",
        help="train a GPT through a pipeline (launches its own workers, or runs under torchrun)",
        description="Train a GPT with pipeline (and data and sequence) parallelism. Outside torchrun it starts "
                    "pp x dp x sp worker processes on this machine; under torchrun each process is one rank.",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--schedule", default="1f1b", metavar="NAME",
                   help=f"one of: {', '.join(FAMILIES)} (default 1f1b); or torch:CLASS, torch:FILE.csv: the order of a "
                        "torch.distributed.pipelining schedule")
    g.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    g.add_argument("--dp", type=int, help="data-parallel replicas (default 1; under torchrun: world size / (pp x sp))")
    g.add_argument("--chunks", type=int, help="stages per rank (interleaved-1f1b: >= 2, default 2; V schedules: 2)")
    g.add_argument("--microbatches", type=int, default=4, help="microbatches per step and replica (default 4)")
    g.add_argument("--microbatch-size", type=int, default=8, help="sequences per microbatch (default 8)")
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL); default cpu")
    g.add_argument("--sp", type=int, default=1,
                   help="sequence-parallel ranks per stage: each holds a share of every sequence (default 1)")
    g.add_argument("--attention", choices=[a.value for a in Attention],
                   help="sequence-parallel attention: blockwise ring (the default with --sp > 1) or Ring "
                        "Self-Attention; with --sp 1 the default is torch's scaled_dot_product_attention")
    g.add_argument("--vocab-parallel", choices=("none", "redis", "naive", "vocab-1", "vocab-2"), default="none",
                   help="split the token embedding and the LM head by vocabulary over the pipeline ranks with "
                        "this algorithm (default none: embedding on the first stage, head on the last; redis: "
                        "transformer layers moved off those stages instead)")
    g.add_argument("--offload", choices=("none", "full", "selective"), default="none",
                   help="PipeOffload: copy activations to host memory after each forward and back before its "
                        "backward, for every pair with room (full) or the longest-lived until each rank's peak "
                        "falls by --offload-ratio (selective); default none")
    g.add_argument("--offload-ratio", type=float, metavar="R",
                   help="with --offload selective: the share of each rank's activation peak to move, in (0, 1]")
    g.add_argument("--recompute", choices=("none", "cheap", "full"), default="none",
                   help="rerun in the backward whole stages (full) or only the norms and GELU, whose outputs are "
                        "then not kept (cheap); default none")
    g.add_argument("--precision", choices=("fp32", "bf16"), help="bf16 autocast (default on cuda) or fp32 (default on cpu)")
    g.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits for a peer before it checks the peer's heartbeat: it stops, naming "
                        "what it waited for, if the peer died or stalls, and waits on if it is busy (default 60)")
    g = p.add_argument_group("model and optimisation")
    g.add_argument("--model", default="tiny", metavar="PRESET",
                   help=f"model preset (GPT or Llama): {', '.join(SIZES)} (default tiny; those without a context "
                        "length learn --seq positions)")
    g.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    g.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    g.add_argument("--warmup", type=int, help="linear warmup steps, then cosine decay to lr/10 (default steps/10, at most 100)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices (default 0.1)")
    g.add_argument("--optimizer", choices=("adamw", "kfac"), default="adamw",
                   help="adamw, or kfac: PipeFisher, AdamW on gradients K-FAC preconditions, its curvature and "
                        "inversion work in the schedule's bubbles (default adamw)")
    g.add_argument("--kfac-every", type=int, metavar="K",
                   help="with --optimizer kfac: refresh the curvature every K steps (default: as the bubbles allow)")
    g.add_argument("--kfac-damping", type=float, default=1e-3, help="with --optimizer kfac: damping (default 1e-3)")
    g.add_argument("--clip", type=_clip, default=1.0, metavar="NORM",
                   help="clip gradients to this global norm; 0 or none: no clipping (default 1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH",
                   help="a text file, a directory of text files, or a token file (*.bin); "
                        "default: the Python standard library's sources, byte-level")
    g.add_argument("--token-dtype", choices=("uint16", "uint32"), help="read --data as a token file of this type (*.bin: uint16)")
    g.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe|FILE.json",
                   help="tokenize text by bytes (default), by a byte-level BPE trained on the data "
                        "(--vocab-size tokens, default 32000; cached), or by a saved tokenizers tokenizer.json")
    g.add_argument("--vocab-size", type=int,
                   help="the size of a BPE vocabulary to train, or the vocabulary of a token file (default: its largest id + 1)")
    g.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="hold out the last F of the token stream for validation; training never sees it (default 0.05)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="every N steps and at the end: the mean loss on --eval-batches validation batches, forward "
                        "only through the pipeline (metrics: val_loss; default: no validation)")
    g.add_argument("--eval-batches", type=int, default=10, metavar="K",
                   help="validation batches per evaluation, each the size of a step's, the same every time (default 10)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints (torch.distributed.checkpoint) under DIR")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="save every N steps (default: at the end only)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="resume from CHECKPOINT (a step_* directory), or the latest under --checkpoint-dir; "
                        "pp and dp may differ from the saving run")
    g.add_argument("--save", metavar="FILE.safetensors",
                   help="at the end, write the model's weights by their unsplit names (safetensors; "
                        "pipeloom generate --weights reads them)")
    g.add_argument("--metrics", metavar="FILE.jsonl",
                   help="one JSON object per step: step, loss, step_time, tokens_per_s, lr, grad_norm, val_loss")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="write the metrics' scalars (loss, lr, grad_norm, tokens_per_s, val_loss) for TensorBoard "
                        "under DIR (needs the tensorboard package)")
    g.add_argument("--trace", metavar="FILE.json", help="write the last step's measured timeline as a Chrome trace")
    g.add_argument("--plot", metavar="FILE.png|.svg", help="draw the last step's measured timeline with matplotlib")
    g.add_argument("--report", action="store_true",
                   help="at the end: measured step time beside the simulator's prediction from the measured costs")
    p.set_defaults(run=_run_train)


def _clip(text: str) -> float:
    """--clip: a number; none is 0 (no clipping)."""
    if text.strip().lower() == "none":
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or none") from None


def _run_train(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeloomError("pipeloom train needs PyTorch, which is not installed: "
                            "pip install 'pipeloom[torch]' (or pip install torch)") from None
    from .train import run

    return run(args)


# -- generate ----------------------------------------------------------------

def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a model pipeloom train trained (a checkpoint, or --save's weights)",
        description="Load a trained model on one process and continue a prompt with sampled tokens.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint (a step_* directory), or a --checkpoint-dir: its latest checkpoint")
    source.add_argument("--weights", metavar="FILE.safetensors", help="the weights pipeloom train --save wrote")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits; 0 takes the most likely token (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, metavar="K",
                   help="sample among the K most likely tokens (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--tokenizer", metavar="FILE.json",
                   help="a tokenizers tokenizer.json to encode with (default: the run's; needed for a run on a token file)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run the model (default cpu)")
    p.add_argument("--json", action="store_true", help="print the prompt, the sampled token ids and the text as JSON")
    p.set_defaults(run=_run_generate)


def _run_generate(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeloomError("pipeloom generate needs PyTorch, which is not installed: "
                            "pip install 'pipeloom[torch]' (or pip install torch)") from None
    from .generate import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
