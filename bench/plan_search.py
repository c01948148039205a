"""Seconds `pipeloom plan` takes to search, on requests from 8 to 1,024 GPUs.

    python bench/plan_search.py [--jobs N] [--out FILE]

Writes bench/results/plan_search.json: per request its `pipeloom plan`
arguments, the seconds the search took on `--jobs` worker processes (as
`pipeloom plan` runs it: default, the CPUs it may use, at most 8) and on one process in
the same run, whether the two gave the same plans, the layouts searched and
simulated, and the best plan, or the one line an infeasible request gets. The goal is
seconds for 1,024 GPUs; long schedules (few GPUs, large batches: hundreds of
microbatches a schedule) and tight memory are where the time goes. Asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.cli import _parser  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.plan import search  # noqa: E402
from pipeloom.plan.ahead import default_jobs  # noqa: E402
from pipeloom.cli.plan import request_of  # noqa: E402

#: `pipeloom plan` arguments of each request timed: the default, then by GPUs.
REQUESTS = (
    (),
    ("--model", "6.2b", "--gpus", "8", "--seq", "1024"),
    ("--model", "28.3b", "--gpus", "8"),
    ("--model", "llama-70b", "--gpus", "8"),
    ("--model", "gpt-1.3b", "--gpus", "8", "--global-batch", "2048"),
    ("--model", "28.3b", "--gpus", "64", "--seq", "1024"),
    ("--model", "llama-70b", "--gpus", "256"),
    ("--model", "gpt-1.3b", "--gpus", "1024"),
    ("--model", "6.2b", "--gpus", "1024", "--seq", "1024"),
    ("--model", "28.3b", "--gpus", "1024", "--seq", "1024"),
    ("--model", "llama-8b", "--gpus", "1024"),
    ("--model", "llama-70b", "--gpus", "1024", "--seq", "4096", "--global-batch", "1024"),
    ("--model", "llama-70b", "--gpus", "1024", "--global-batch", "1024"),
)


def timed(words: tuple[str, ...], jobs: int) -> dict:
    """One request searched on one process and on ``jobs`` worker processes: its facts, the seconds
    of each, whether their plans are the same, its best plan or why none fits."""
    args = _parser().parse_args(["plan", *words])
    request, _ = request_of(args)
    row = {"args": " ".join(words), "model": request.model.name, "gpus": request.cluster.gpus, "seq": request.seq,
           "global_batch": request.global_batch, "jobs": jobs}
    found = {}
    for n in (1, jobs):
        started = time.perf_counter()
        try:
            found[n] = search(request, jobs=n)
        except PipeloomError as err:
            found[n] = str(err)
        row["seconds_one_job" if n == 1 else "seconds"] = round(time.perf_counter() - started, 2)
    one, many = found[1], found[jobs]
    if isinstance(many, str):
        return {**row, "same_plans": one == many, "infeasible": many}
    best = many.plans[0]
    c = best.candidate
    return {**row, "same_plans": not isinstance(one, str) and one.plans == many.plans, "candidates": many.candidates,
            "simulated": many.simulated, "best": {
                "pp": c.pp, "dp": c.dp, "sp": c.sp, "schedule": c.schedule, "chunks": c.chunks,
                "microbatch_size": c.microbatch_size, "microbatches": c.microbatches, "recompute": c.recompute,
                "vocab_parallel": c.vocab_parallel, "offload": c.offload, "step_ms": round(best.step_ms, 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--jobs", type=int, default=default_jobs(),
                        help="worker processes of the timed search (default: as pipeloom plan's)")
    args = parser.parse_args()
    rows = []
    for words in REQUESTS:
        row = timed(words, args.jobs)
        rows.append(row)
        what = row.get("infeasible") or f"{row['candidates']} layouts, {row['simulated']} simulated"
        what = (f"{row['seconds']} s on {args.jobs} jobs, {row['seconds_one_job']} s on one; "
                f"{'the same plans' if row['same_plans'] else 'PLANS DIFFER'}: {what}")
        print(f"pipeloom plan {row['args'] or '(defaults)'}: {what}", flush=True)
    print(f"wrote {write_results('plan_search', {'requests': rows}, args.out)}")


if __name__ == "__main__":
    main()
