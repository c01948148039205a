"""Predicted peak memory per rank, from a profile, against what ``pipeloom train`` holds on this CPU.

    python bench/plan_memory.py [--model gpt-125m] [--seq 128] [--profile FILE] [--steps 3] [--out FILE]

For each layout of :data:`LAYOUTS` (schedule families, pp, dp, sp,
microbatch size and count, recomputation, vocabulary parallelism), runs
``pipeloom train --model MODEL --seq SEQ`` with ``--metrics`` on gloo ranks
(one thread each) and reads each pipeline rank's measured peak
(``peak_memory_bytes``: the peak resident set above the one before the model
was built, the largest over the steps), and asks the planner
(``pipeloom.plan.Costing(...).evaluate``) for the layout's predicted peak
with the costs of a ``pipeloom profile`` of the model on this machine (made
unless ``--profile`` names one; bytes per parameter from it: 16). The workers
start with ``MALLOC_MMAP_THRESHOLD_=65536``, so that resident memory follows
the live tensors (glibc otherwise keeps freed blocks). A resident set also
holds the pages of torch's code and buffers that a training step first
touches, whatever the model: the ``floor``, measured as the same peak of the
``tiny`` model (about 0.1% of gpt-125m's parameters) under the first layout.
Per layout and pipeline rank: measured, predicted, and predicted / (measured
- floor), the figure that the planner's memory model is checked on (goal:
within 10%); and the same from the formulas alone (no profile: fp32 on the
cpu preset, as the runs train). Writes bench/results/plan_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, profile_train_model, train_model, write_results  # noqa: E402

from pipeloom.cli import _parser  # noqa: E402
from pipeloom.cli.flags import spec_of  # noqa: E402
from pipeloom.plan import Cluster, Costing, PlanRequest  # noqa: E402
from pipeloom.plan.command import candidate_of  # noqa: E402
from pipeloom.sim.profile import load_profile  # noqa: E402

_MiB = 2**20

#: ``pipeloom train`` flags of each layout measured (with --model, --seq, --steps).
LAYOUTS = (
    "--schedule 1f1b --pp 2 --microbatches 4 --microbatch-size 4",
    "--schedule gpipe --pp 1 --microbatches 4 --microbatch-size 4",
    "--schedule gpipe --pp 2 --microbatches 4 --microbatch-size 2",
    "--schedule zb-h1 --pp 2 --microbatches 4 --microbatch-size 4",
    "--schedule zb-v --pp 2 --microbatches 4 --microbatch-size 2",
    "--schedule interleaved-1f1b --pp 2 --chunks 2 --microbatches 4 --microbatch-size 2",
    "--schedule 2bw --pp 2 --microbatches 4 --microbatch-size 2",
    "--schedule 1f1b --pp 2 --microbatches 4 --microbatch-size 4 --recompute full",
    "--schedule 1f1b --pp 2 --microbatches 4 --microbatch-size 4 --recompute cheap",
    "--schedule 1f1b --pp 2 --dp 2 --microbatches 2 --microbatch-size 2",
    "--schedule 1f1b --pp 2 --microbatches 4 --microbatch-size 4 --vocab-parallel vocab-1",
    "--schedule 1f1b --pp 1 --sp 2 --microbatches 2 --microbatch-size 4",
)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}


def measured_peaks(model: str, seq: int, flags: str, steps: int, timeout: float) -> list[int]:
    """Each pipeline rank's measured peak (bytes) over ``steps`` steps of ``pipeloom train``."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        argv = [sys.executable, "-m", "pipeloom", "train", "--model", model, "--vocab", str(train_model(model).vocab),
                "--seq", str(seq), *shlex.split(flags),
                "--steps", str(steps), "--metrics", str(metrics)]
        done = subprocess.run(argv, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise SystemExit(f"{' '.join(argv[3:])} failed: {done.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [max(r["peak_memory_bytes"][k] for r in rows) for k in range(len(rows[0]["peak_memory_bytes"]))]


def predicted_peaks(model, seq: int, flags: str, profile) -> list[float]:
    """The planner's peak memory per pipeline rank for the layout ``pipeloom train`` runs with ``flags``."""
    c = candidate_of(spec_of(_parser().parse_args(["train", "--seq", str(seq), *shlex.split(flags)])))
    cluster = Cluster.of("cpu", c.pp * c.dp * c.sp, gpus_per_node=c.pp * c.dp * c.sp)
    request = PlanRequest(model, seq, c.microbatch_size * c.microbatches * c.dp, cluster, profile=profile)
    return Costing(request).evaluate(c).peak_memory_bytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-125m", help="a preset that pipeloom train accepts")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="steps per run (2bw: rounded up to whole calls)")
    parser.add_argument("--profile", default=None, help="use this profile instead of measuring one")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = train_model(args.model)
    profile_path = Path(args.profile) if args.profile else RESULTS / "plan_memory_profile.json"
    if not args.profile:
        profile_train_model(args.model, args.seq, profile_path, _env())
    profile = load_profile(profile_path)
    floor = max(measured_peaks("tiny", args.seq, LAYOUTS[0], args.steps, args.timeout))
    rows = []
    for flags in LAYOUTS:
        steps = max(args.steps, 4) if "2bw" in flags else args.steps  # 2bw runs 4 steps a call
        measured = measured_peaks(args.model, args.seq, flags, steps, args.timeout)
        predicted = predicted_peaks(model, args.seq, flags, profile)
        formulas = predicted_peaks(model, args.seq, flags, None)
        ratios = [round(p / (m - floor), 3) for p, m in zip(predicted, measured)]
        from_formulas = [round(p / (m - floor), 3) for p, m in zip(formulas, measured)]
        rows.append({"flags": flags, "measured_mib": [round(m / _MiB, 1) for m in measured],
                     "predicted_mib": [round(p / _MiB, 1) for p in predicted], "predicted_over_measured_less_floor":
                     ratios, "within_10_percent": all(abs(r - 1) <= 0.1 for r in ratios),
                     "formulas_mib": [round(p / _MiB, 1) for p in formulas],
                     "formulas_over_measured_less_floor": from_formulas,
                     "formulas_within_10_percent": all(abs(r - 1) <= 0.1 for r in from_formulas)})
        print(f"{flags}: measured {rows[-1]['measured_mib']} MiB, predicted {rows[-1]['predicted_mib']} MiB, "
              f"predicted / (measured - floor) {ratios}, from the formulas {from_formulas}", file=sys.stderr, flush=True)
    results = {
        "setting": {"model": args.model, "layers": model.layers, "hidden": model.hidden, "vocab": model.vocab,
                    "seq": args.seq, "steps": args.steps, "threads_per_rank": 1,
                    "malloc_mmap_threshold": 65536, "profile": str(profile_path.relative_to(ROOT))
                    if profile_path.is_relative_to(ROOT) else str(profile_path),
                    "bytes_per_param": profile.bytes_per_param},
        "floor_mib": round(floor / _MiB, 1),
        "layouts": rows,
        "all_within_10_percent": all(r["within_10_percent"] for r in rows),
        "formulas_all_within_10_percent": all(r["formulas_within_10_percent"] for r in rows),
        "seconds": round(time.perf_counter() - started, 1),
    }
    path = write_results("plan_memory", results, args.out)
    print(f"\n| layout | measured MiB | predicted MiB (profile) | / (measured - floor {results['floor_mib']}) "
          "| from the formulas MiB | / (measured - floor) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['flags']} | {r['measured_mib']} | {r['predicted_mib']} | {r['predicted_over_measured_less_floor']} "
              f"| {r['formulas_mib']} | {r['formulas_over_measured_less_floor']} |")
    print(f"\nwrote {path} in {results['seconds']} s")


if __name__ == "__main__":
    main()
