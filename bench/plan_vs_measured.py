"""The planner's ranking of layouts against measured ``pipeloom train`` runs on this CPU.

    python bench/plan_vs_measured.py [--model gpt-125m] [--seq 128] [--global-batch 8] [--gpus 2 4]
                                     [--layouts 5] [--steps 6] [--warmup 2] [--profile FILE] [--out FILE]

Profiles the model on this machine with ``pipeloom profile`` (one thread,
microbatches of 1, 2 and 4; written to
bench/results/plan_vs_measured_profile.json unless ``--profile`` names one),
then for each GPU count asks the planner (``Cluster.of("cpu", gpus)``, one
node, memory that does not bind, costs from the profile, no vocabulary
parallelism; every schedule family, pp, dp, sp, microbatch size and
recomputation searched) for its ranking, and picks ``--layouts`` plans spread
over it: the best, then plans nearest to predicted step times evenly spaced
(in log) up to ``--spread`` times the best, at least ``--gap`` apart, other
schedule families and (pp, dp, sp) preferred. Each runs as its plan's
``pipeloom train`` command (the planner's own ``command()``, without the
torchrun prefix: train starts its pp x dp x sp gloo workers, one thread each)
for ``--steps`` steps; the measured step is the median ``step_time`` of the
steps after ``--warmup`` (2bw runs 4 steps per call, one flush per call: its
first call is the warm-up and each later call gives one step time). Per layout:
predicted and measured step, measured / predicted; per GPU count the Kendall
tau-b of the two rankings.

The model is the preset's shape with the vocabulary of train's default data
(the Python standard library's sources, byte-level: 256 tokens), which is
what ``pipeloom train --model PRESET`` builds; the profile and the planner
use the same. The planner counts the optimizer step (the profile's time per
parameter) but not the time a
rank's process waits for a core: with more ranks than this machine's cores
(``--gpus 4`` on 2 cores) the measured steps carry that contention. Other
work on the machine skews the timings: each run waits (up to ``--wait`` s)
for other processes to use under ``--busy`` of the CPU, records the share
they took while it ran (``other_cpu_share``, from /proc/stat less this run's
own), and is run again once when that exceeds ``--busy`` (the less disturbed
run is kept). Writes bench/results/plan_vs_measured.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, profile_train_model, train_model, write_results  # noqa: E402

from pipeloom.plan import Cluster, Costing, PlanRequest, command, search  # noqa: E402
from pipeloom.sim import simulate  # noqa: E402
from pipeloom.sim.profile import load_profile  # noqa: E402

_GiB = 2**30
REPORT = re.compile(r"measured step\s+([\d.]+) ms.*?actions span ([\d.]+) ms.*?simulated\s+([\d.]+) ms", re.S)


def profile_model(args, path: Path) -> dict:
    """Run ``pipeloom profile`` for the model with train's vocabulary: its seconds, others' CPU share."""
    busy, ours, started = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()
    profile_train_model(args.model, args.seq, path, _env())
    wall = time.perf_counter() - started
    others = _busy_cpu_s() - busy - (_children_cpu_s() - ours)
    return {"seconds": round(wall, 1), "other_cpu_share": round(max(0.0, others) / (wall * os.cpu_count()), 3)}


def profile_summary(path: Path) -> dict:
    """The profile's headline numbers: one layer's F, B, W (ms) per microbatch size, the link."""
    data = json.loads(path.read_text())
    return {
        "path": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
        "machine": data["machine"], "model": data["model"], "seq": data["seq"],
        "bytes_per_param": data["bytes_per_param"], "link": data["link"],
        "layer_ms": {b: {k: round(v, 3) for k, v in sample["layer"].items()}
                     for b, sample in data["microbatch_sizes"].items()},
        "head_ms": {b: {k: round(v, 3) for k, v in sample["head"].items()}
                    for b, sample in data["microbatch_sizes"].items()},
    }


def pick(plans: list, count: int, spread: float, gap: float) -> list:
    """``count`` plans spread over the ranking (see the module docstring), fastest first."""
    pool = [p for p in plans if p.step_ms <= spread * plans[0].step_ms]
    chosen = [pool[0]]
    low, high = math.log(pool[0].step_ms), math.log(pool[-1].step_ms)
    for i in range(1, count):
        target = low + (high - low) * i / (count - 1)
        families = {p.candidate.schedule for p in chosen}
        grids = {(p.candidate.pp, p.candidate.dp, p.candidate.sp) for p in chosen}

        def score(p):
            c = p.candidate
            return (abs(math.log(p.step_ms) - target) + 0.05 * (c.schedule in families)
                    + 0.03 * ((c.pp, c.dp, c.sp) in grids))
        apart = [p for p in pool if all(abs(math.log(p.step_ms / q.step_ms)) >= math.log1p(gap) for q in chosen)]
        if apart:
            chosen.append(min(apart, key=score))
    return sorted(chosen, key=lambda p: p.key)


def train(request, plan, steps: int, warmup: int, timeout: float) -> dict:
    """Run the plan's command for ``steps`` steps; the median step after the warm-up."""
    c = plan.candidate
    per_call = Costing(request).schedule(c).steps
    if per_call > 1:  # whole calls: the first is the warm-up
        warmup = per_call * max(1, -(-warmup // per_call))
        steps = max(warmup + per_call, per_call * -(-steps // per_call))
    words = shlex.split(command(request, c))
    argv = [sys.executable, *words[words.index("-m"):]]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv += ["--steps", str(steps), "--metrics", str(metrics), "--report"]
        load, busy, ours = os.getloadavg()[0], _busy_cpu_s(), _children_cpu_s()
        started = time.perf_counter()
        try:
            done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess(argv, 124, "", f"timed out after {timeout:g} s")
        wall = time.perf_counter() - started
        others = _busy_cpu_s() - busy - (_children_cpu_s() - ours)
        out = {"argv": " ".join(shlex.quote(a) for a in argv[1:]), "steps": steps, "warmup_steps": warmup,
               "wall_s": round(wall, 1), "load_before": round(load, 2),
               "other_cpu_share": round(max(0.0, others) / (wall * os.cpu_count()), 3)}
        if done.returncode:
            return {**out, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [1e3 * r["step_time"] for r in records if r["step"] > warmup]
    out.update(step_ms=[round(t, 1) for t in times], measured_ms=round(median(times), 1))
    report = REPORT.search(done.stdout + done.stderr)
    if report:
        out.update(report_step_ms=float(report[1]), report_actions_span_ms=float(report[2]),
                   report_simulated_from_measured_ms=float(report[3]))
    return out


def measure(request, plan, args) -> dict:
    """:func:`train` once the machine is quiet (others below ``--busy`` of its CPU, waiting at most
    ``--wait`` seconds); run again once when others took more than that while it ran, keeping the
    run they disturbed less (the other is kept under ``"discarded"``)."""
    runs = []
    for _ in range(2):
        waited = _wait_quiet(args.busy, args.wait)
        runs.append({**train(request, plan, args.steps, args.warmup, args.timeout), "waited_s": waited})
        if runs[-1]["other_cpu_share"] <= args.busy:
            break
    kept = min(runs, key=lambda r: ("measured_ms" not in r, r["other_cpu_share"]))
    return {**kept, **({"discarded": [r for r in runs if r is not kept]} if len(runs) > 1 else {})}


def _wait_quiet(busy: float, wait: float) -> float:
    """Seconds spent waiting (at most ``wait``) until other processes use under ``busy`` of the CPU."""
    started = time.perf_counter()
    while True:
        before = _busy_cpu_s()
        time.sleep(2.0)
        share = (_busy_cpu_s() - before) / (2.0 * os.cpu_count())
        if share < busy or time.perf_counter() - started >= wait:
            return round(time.perf_counter() - started, 1)


def per_call_ms(request, plan) -> float | None:
    """For a schedule that runs several steps a call (2bw), the planner's cost model on the call that
    train runs (its fill and drain shared by the call's steps) per step; else None."""
    c = plan.candidate
    costing = Costing(request)
    per_call = costing.schedule(c).steps
    if per_call == 1:
        return None
    result = simulate(costing.schedule(c, per_call), costing.costs(c))
    return round(result.makespan / per_call + plan.allreduce_ms + plan.optimizer_ms, 2)


def kendall_tau(x: list[float], y: list[float]) -> float | None:
    """Kendall's tau-b (ties counted as neither agreeing nor disagreeing)."""
    agree = disagree = tied_x = tied_y = 0
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            dx, dy = (x[i] > x[j]) - (x[i] < x[j]), (y[i] > y[j]) - (y[i] < y[j])
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tied_x += 1
            elif dy == 0:
                tied_y += 1
            elif dx == dy:
                agree += 1
            else:
                disagree += 1
    denominator = math.sqrt((agree + disagree + tied_x) * (agree + disagree + tied_y))
    return round((agree - disagree) / denominator, 4) if denominator else None


def _busy_cpu_s() -> float:
    """Seconds all this machine's cores have been busy (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def table(gpus: int, rows: list[dict], tau) -> str:
    lines = [f"{gpus} ranks (Kendall tau {tau}):", "",
             "| rank | layout (pp x dp x sp) | schedule | b x m | recompute | predicted ms | measured ms | "
             "measured / predicted | others' CPU |", "|---" * 9 + "|"]
    for r in rows:
        measured = r.get("measured_ms", "failed")
        ratio = r.get("measured_over_predicted", "")
        lines.append(f"| {r['rank']} | {r['pp']} x {r['dp']} x {r['sp']} | {r['schedule']}"
                     f"{' x' + str(r['chunks']) if r['chunks'] > 1 else ''} | {r['microbatch_size']} x "
                     f"{r['microbatches']} | {r['recompute']} | {r['predicted_ms']:.0f}"
                     f"{' (call: %.0f)' % r['predicted_per_call_ms'] if r['predicted_per_call_ms'] else ''} | "
                     f"{measured} | {ratio} | {r['other_cpu_share']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m", help="a preset that pipeloom train accepts")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--gpus", type=int, nargs="+", default=[2, 4], help="ranks of the planned cluster")
    parser.add_argument("--memory", type=float, default=16, help="GiB per rank (generous: does not bind)")
    parser.add_argument("--layouts", type=int, default=5)
    parser.add_argument("--spread", type=float, default=2.0, help="slowest picked / best predicted step")
    parser.add_argument("--gap", type=float, default=0.05, help="least relative gap between picked predictions")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take")
    parser.add_argument("--busy", type=float, default=0.1,
                        help="others' share of the CPU above which a run waits, or is run again once")
    parser.add_argument("--wait", type=float, default=30, help="seconds to wait for a quiet machine before a run")
    parser.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = train_model(args.model)
    vocab = model.vocab
    profile_path = Path(args.profile) if args.profile else RESULTS / "plan_vs_measured_profile.json"
    measured = {} if args.profile else {"waited_s": _wait_quiet(args.busy, args.wait),
                                         **profile_model(args, profile_path)}
    profile = load_profile(profile_path)
    results = {
        "setting": {"model": args.model, "layers": model.layers, "hidden": model.hidden, "heads": model.heads,
                    "vocab": vocab, "seq": args.seq, "global_batch": args.global_batch, "memory_gib": args.memory,
                    "steps": args.steps, "warmup": args.warmup, "threads_per_rank": 1,
                    "searched": "every schedule family, pp, dp, sp, microbatch size, recompute; vocab_parallel none"},
        "profile": {**profile_summary(profile_path), **measured},
        "clusters": [],
    }
    for gpus in args.gpus:
        cluster = Cluster.of("cpu", gpus, gpus_per_node=gpus, memory=args.memory * _GiB)
        request = PlanRequest(model=model, seq=args.seq, global_batch=args.global_batch, cluster=cluster,
                              profile=profile, vocab_parallel=("none",), top=1000)
        found = search(request)
        ranking = {p.candidate: n for n, p in enumerate(found.plans)}  # 0-based
        rows = []
        for plan in pick(found.plans, args.layouts, args.spread, args.gap):
            c = plan.candidate
            row = {"rank": ranking[c] + 1, "pp": c.pp, "dp": c.dp, "sp": c.sp, "schedule": c.schedule,
                   "chunks": c.chunks, "microbatch_size": c.microbatch_size, "microbatches": c.microbatches,
                   "recompute": c.recompute,
                   "predicted_ms": round(plan.step_ms, 2), "predicted_per_call_ms": per_call_ms(request, plan),
                   "predicted_bubble_rate": round(plan.bubble_rate, 4),
                   "predicted_peak_memory_mib": round(max(plan.peak_memory_bytes) / 2**20, 1),
                   "command": command(request, c)}
            print(f"{gpus} ranks, plan {ranking[c] + 1}/{len(found.plans)}: {c.schedule} pp {c.pp} dp {c.dp} "
                  f"sp {c.sp} b {c.microbatch_size} x {c.microbatches}, predicted {plan.step_ms:.0f} ms ...",
                  file=sys.stderr, flush=True)
            row.update(measure(request, plan, args))
            if "measured_ms" in row:
                row["measured_over_predicted"] = round(row["measured_ms"] / row["predicted_ms"], 3)
            print(f"    measured {row.get('measured_ms', row.get('error'))}", file=sys.stderr, flush=True)
            rows.append(row)
        ran = [r for r in rows if "measured_ms" in r]
        measured = [r["measured_ms"] for r in ran]
        calls = [r["predicted_per_call_ms"] or r["predicted_ms"] for r in ran]
        results["clusters"].append({
            "gpus": gpus, "cores": os.cpu_count(), "plans_ranked": len(found.plans), "candidates": found.candidates,
            "simulated": found.simulated, "search_s": round(found.seconds, 3), "layouts": rows,
            "kendall_tau": kendall_tau([r["predicted_ms"] for r in ran], measured),
            "kendall_tau_per_call": kendall_tau(calls, measured),
            "ratio_median": round(median(r["measured_over_predicted"] for r in ran), 3) if ran else None,
        })
    results["seconds"] = round(time.perf_counter() - started, 1)
    path = write_results("plan_vs_measured", results, args.out)
    print(f"{args.model} (vocab {vocab}), seq {args.seq}, global batch {args.global_batch}; profile "
          f"{results['profile']['path']}")
    for entry in results["clusters"]:
        print()
        print(table(entry["gpus"], entry["layouts"], entry["kendall_tau"]))
        print(f"\nsearch {entry['search_s']} s over {entry['candidates']} candidates; "
              f"tau with 2bw's per-call prediction {entry['kendall_tau_per_call']}")
    print(f"\nwrote {path} in {results['seconds']} s")


if __name__ == "__main__":
    main()
