"""``pipeloom plan``: the ranked layouts for a model on a cluster, as a table or JSON."""

from __future__ import annotations

import json
import sys

from ..errors import PipeloomError, comma_list

_GiB = 2**30


def add_parser(sub) -> None:
    from ..plan.space import axes
    from ..schedule import FAMILIES
    from ..sim.specs import DEVICES
    from ..techniques import flags

    p = sub.add_parser(
        "plan",
        help="choose the layout (pp, dp, sp, microbatches, schedule, recomputation, offload, optimizer) under a memory "
             "limit",
        description="Search every layout of a model on a cluster with the simulator and print the fastest that fit, "
                    "each with the torchrun command that trains it.",
    )
    p.add_argument("--model", default="gpt-1.3b", metavar="PRESET", help="model preset (default gpt-1.3b)")
    p.add_argument("--seq", type=int,
                   help="tokens per sequence (default: the profile's, else the preset's context length, else 2048)")
    p.add_argument("--global-batch", type=int, default=512, metavar="N", help="sequences per step (default 512)")
    p.add_argument("--gpus", type=int, default=8, metavar="N", help="GPUs in all (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs per node (default 8)")
    p.add_argument("--hardware", metavar="PRESET",
                   help=f"the GPUs' cost preset: {', '.join(DEVICES)}: FLOP rate, memory, links (default a100, or cpu "
                        "with a CPU profile)")
    p.add_argument("--gpu-memory", type=float, metavar="GiB", help="memory per GPU (default: the device's)")
    p.add_argument("--intra-node-bandwidth", type=float, metavar="GB/s",
                   help="point-to-point bandwidth inside a node (default: the device's link)")
    p.add_argument("--inter-node-bandwidth", type=float, default=25.0, metavar="GB/s",
                   help="bandwidth per GPU between nodes (default 25)")
    p.add_argument("--profile", metavar="FILE.json",
                   help="measured costs (pipeloom profile) instead of the FLOP formulas and the device's efficiency")
    p.add_argument("--schedules", metavar="A,B,...", help=f"families to search (default all: {', '.join(FAMILIES)})")
    for _, axis in axes():  # each technique's values, narrowed
        p.add_argument(axis.flag, metavar="A,B,...", help=axis.help.format(default=",".join(axis.values)))
    next(flag for flag in flags() if flag.name == "kfac_every").add(p)  # train's flag: the refresh planned
    p.add_argument("--microbatch-sizes", metavar="1,2,...", help="microbatch sizes to search (default: every divisor)")
    p.add_argument("--top", type=int, default=10, help="plans to print (default 10)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="worker processes that simulate candidates ahead of the search (the same plans, sooner; "
                        "default: the CPUs this process may use, at most 8)")
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.set_defaults(run=run)


def _progress(text: str) -> None:
    print(f"pipeloom plan: {text}", file=sys.stderr, flush=True)


def run(args) -> int:
    from ..plan import search
    from ..plan.ahead import default_jobs
    from ..plan.command import command

    request, costs = request_of(args)
    jobs = default_jobs() if args.jobs is None else args.jobs
    found = search(request, progress=_progress if sys.stderr.isatty() else None, jobs=jobs)
    if args.json:
        print(json.dumps(_report(request, costs, found, command), indent=2))
    else:
        print(_table(request, costs, found, command))
    return 0


def request_of(args):
    """The :class:`~pipeloom.plan.PlanRequest` the arguments ask for, and where its costs come from."""
    from ..plan import Cluster, PlanRequest
    from ..presets import SIZES
    from ..plan.space import axes
    from ..schedule import FAMILIES
    from ..sim.specs import get_model

    profile = None
    if args.profile is not None:
        from ..sim.profile import load_profile

        profile = load_profile(args.profile)
    block = SIZES[args.model].block_size if args.model in SIZES else None
    seq = args.seq if args.seq is not None else (profile.seq if profile else block or 2048)
    if block is not None and seq > block:
        raise PipeloomError(f"--seq {seq} is longer than the {block} positions {args.model} learns (pipeloom train "
                            f"would refuse it); use --seq {block} or less")
    device = args.hardware or ("cpu" if profile and profile.machine["device"] == "cpu" else "a100")
    for flag in ("gpu_memory", "intra_node_bandwidth", "inter_node_bandwidth"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise PipeloomError(f"--{flag.replace('_', '-')} must be positive, got {value:g}")
    cluster = Cluster.of(device, args.gpus, gpus_per_node=args.gpus_per_node,
                         memory=None if args.gpu_memory is None else args.gpu_memory * _GiB,
                         intra_bandwidth=None if args.intra_node_bandwidth is None else args.intra_node_bandwidth * 1e9,
                         inter_bandwidth=args.inter_node_bandwidth * 1e9)
    model = get_model(args.model)
    if profile is not None:
        profile.check(model, seq)
    request = PlanRequest(
        model, seq, args.global_batch, cluster, profile=profile,
        schedules=_listed("--schedules", args.schedules, tuple(FAMILIES)),
        **{axis.name: _listed(axis.flag, getattr(args, axis.name), axis.values, axis.every) for _, axis in axes()},
        kfac_every=args.kfac_every,
        microbatch_sizes=None if args.microbatch_sizes is None else tuple(
            _number("--microbatch-sizes", x) for x in _listed("--microbatch-sizes", args.microbatch_sizes, ())),
        top=args.top)
    costs = f"profile {args.profile}" if profile else f"formulas, device preset {cluster.device.name}"
    return request, costs


def _listed(flag: str, text: str | None, default: tuple, every: tuple | None = None) -> tuple:
    """The values of a comma list ``text`` (None: ``default``; ``any``: ``every``, where given)."""
    if text is None:
        return default
    if every is not None and text.strip() == "any":
        return every
    return tuple(comma_list(flag, text))


def _number(flag: str, text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise PipeloomError(f"{flag}: {text!r} is not a positive whole number")
    return int(text)


def _fields(plan, request, command) -> dict:
    from ..plan.command import run_spec
    from ..plan.space import axes

    c = plan.candidate
    settings = {}
    for technique, axis in axes():  # each axis's value, then the fields the technique derives from it
        settings.update({axis.name: getattr(c, axis.name), **technique.plan_fields(request, c)})
    return {
        "pp": c.pp, "dp": c.dp, "sp": c.sp, "schedule": c.schedule, "chunks": c.chunks,
        "microbatch_size": c.microbatch_size, "microbatches": c.microbatches, **settings,
        "step_ms": plan.step_ms, "tokens_per_s": plan.tokens_per_s, "samples_per_s": plan.samples_per_s,
        "mfu": plan.mfu, "peak_memory_bytes": plan.peak_memory_bytes, "bubble_rate": plan.bubble_rate,
        "allreduce_ms": plan.allreduce_ms, "optimizer_ms": plan.optimizer_ms, "command": command(request, c),
        "spec": run_spec(request, c).to_dict(),
    }


def _report(request, costs, found, command) -> dict:
    cluster, model = request.cluster, request.model
    return {
        "model": model.name, "seq": request.seq, "global_batch": request.global_batch,
        "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node, "device": cluster.device.name,
                    "gpu_memory_bytes": cluster.gpu_memory, "intra_node_bandwidth": cluster.intra,
                    "inter_node_bandwidth": cluster.inter_bandwidth},
        "costs": costs,
        "search": {"candidates": found.candidates, "simulated": found.simulated, "seconds": found.seconds,
                   "jobs": found.jobs},
        "plans": [_fields(plan, request, command) for plan in found.plans],
    }


def _shown(x: float, decimals: int) -> str:
    """``x`` with ``decimals`` decimals, but small values (a tiny model's sub-millisecond step, its few
    MiB) to 2 significant digits and large ones (its millions of samples a second) whole, with commas."""
    if x >= 1e4:
        return f"{x:,.0f}"
    return f"{x:.{decimals}f}" if x >= 10 ** (1 - decimals) or x == 0 else f"{x:.2g}"


def _table(request, costs, found, command) -> str:
    from ..plan.space import axes

    cluster = request.cluster
    columns = [axis for _, axis in axes()]
    lines = [
        f"{request.model.name}, seq {request.seq}, global batch {request.global_batch} on {cluster.gpus} x "
        f"{cluster.device.name} ({cluster.gpu_memory / _GiB:.0f} GiB, {cluster.gpus_per_node} per node); "
        f"costs: {costs}",
        f"searched {found.candidates} layouts, simulated {found.simulated}, in {found.seconds:.1f} s",
        "",
        f"{'#':>2} {'pp':>3} {'dp':>4} {'sp':>3} {'schedule':<20} {'b':>3} {'m':>4} "
        + "".join(f"{axis.column:<{axis.width}} " for axis in columns)
        + f"{'step ms':>9} {'tokens/s':>11} {'samples/s':>9} {'MFU':>5} {'peak GiB':>8} "
        f"{'bubble':>6}",
    ]
    for n, plan in enumerate(found.plans, 1):
        c = plan.candidate
        name = c.schedule if c.chunks == 1 else f"{c.schedule} x{c.chunks}"
        lines.append(
            f"{n:>2} {c.pp:>3} {c.dp:>4} {c.sp:>3} {name:<20} {c.microbatch_size:>3} {c.microbatches:>4} "
            + "".join(f"{getattr(c, axis.name):<{axis.width}} " for axis in columns)
            + f"{_shown(plan.step_ms, 1):>9} {plan.tokens_per_s:>11,.0f} "
            f"{_shown(plan.samples_per_s, 2):>9} {plan.mfu:>5.1%} {_shown(max(plan.peak_memory_bytes) / _GiB, 1):>8} "
            f"{plan.bubble_rate:>6.1%}")
    lines += ["", "run the first with:", "  " + command(request, found.plans[0].candidate)]
    return "\n".join(lines)
