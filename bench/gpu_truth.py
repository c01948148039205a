"""What one GPU measures beside what the planner predicts, in one call: the GPU truth the CPU tests keep.

    PYTHONPATH=. python bench/gpu_truth.py [--out bench/results/gpu/NAME.json] [--steps 10] [--deadline 420]
                                           [--traces DIR] [--quick] [--only REGEX ...]

On the current GPU: the pinned host<->device copy bandwidth (each way alone and both at once), then
``pipeloom profile --device cuda`` of gpt-350m at seq 1024 (vocabulary 256, the built-in corpus's bytes,
as ``pipeloom train --vocab 256`` builds it; microbatch sizes 1 to 8), then ``pipeloom train --device cuda
--pp 1 --profile <it>`` of each layout in :data:`LAYOUTS` and :data:`LATER` for ``--steps`` steps with
``--metrics``: the peak memory (``torch.cuda.max_memory_allocated``, and ``max_memory_reserved``), the
median step time over the second half of the steps and the mean after the first. Beside each run, the
planner's prediction for it (:class:`~pipeloom.plan.Costing`: peak per rank and step time) from the new
profile, and from the formulas (no profile). No run starts after ``--deadline`` seconds (they are listed
as skipped; ``--only`` keeps the runs whose model and flags match one of its regular expressions); the file is rewritten
after each run, so a killed call keeps what it measured. Writes
``bench/results/gpu/<gpu>.json`` (with the profile, the commit and the machine), which
``tests/test_gpu_truth.py`` checks the simulator against on every CPU run: 441 s on an H100 (2026-11-27).
``--quick`` runs the same on this CPU with the tiny model at seq 64 and two layouts, to check the script
(CPU memory is the process's resident set: not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, write_results  # noqa: E402

#: pp 1 layouts of the same model: every family that runs on one rank, microbatches of 1 to 8
#: sequences, recomputation and offload.
LAYOUTS = (
    "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4",
    "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2",
    "--pp 1 --schedule 1f1b --microbatches 8 --microbatch-size 1",
    "--pp 1 --schedule gpipe --microbatches 2 --microbatch-size 8",
    "--pp 1 --schedule zb-h1 --microbatches 4 --microbatch-size 4",
    "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload full",
    "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload selective --offload-ratio 0.5",
    "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4 --recompute full",
    "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4 --recompute cheap",
    "--pp 1 --schedule 2bw --microbatches 4 --microbatch-size 4 --steps 12",
)
#: K-FAC's default refresh against AdamW (the step's mean over whole refreshes), then offload where its
#: copies outweigh the compute (issue 32's gpt-1.3b runs): (model, flags), after the layouts.
LATER = (("gpt-350m", "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4 --optimizer kfac --steps 100"),
         *(("gpt-1.3b", f"--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2{extra}")
           for extra in ("", " --offload full", " --offload selective --offload-ratio 0.5")))
MODEL, SEQ, VOCAB, SIZES = "gpt-350m", 1024, 256, "1,2,4,8"
QUICK = ("tiny", 64, (LAYOUTS[0], LAYOUTS[5]), "1,4")


def _pipeloom(*args: str, cwd: Path, timeout: int = 600) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeloom", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"pipeloom {shlex.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def host_copy_gbps(mib: int = 512, repeats: int = 5) -> dict:
    """Pinned host<->device copy bandwidth (GB/s): each direction alone, then both at once on two streams."""
    import torch

    host = [torch.empty(mib << 20, dtype=torch.uint8).pin_memory() for _ in range(2)]
    device = [torch.empty(mib << 20, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def timed(copies) -> float:
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for stream, (dst, src) in zip(streams, copies):
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return (mib << 20) * len(copies) / best / 1e9

    return {"mib": mib, "d2h": timed([(host[0], device[0])]), "h2d": timed([(device[0], host[0])]),
            "both_total": timed([(host[0], device[0]), (device[1], host[1])])}


def measure(flags: str, model: str, seq: int, device: str, steps: int, work: Path, trace: Path | None = None,
            profile: Path | None = None) -> dict:
    """One ``pipeloom train`` run of ``flags`` (with ``profile``'s costs): its peak memory (GiB), the median
    step time (ms) over its second half and the mean after the first step (over K-FAC's refresh)."""
    metrics = work / "m.jsonl"
    metrics.unlink(missing_ok=True)
    began = time.perf_counter()
    _pipeloom("train", "--model", model, "--vocab", str(VOCAB), "--seq", str(seq), "--device", device,
              "--steps", str(steps), "--metrics", str(metrics), *shlex.split(flags),
              *(("--trace", str(trace)) if trace and "kfac" not in flags else ()),
              *(("--profile", str(profile)) if profile else ()), cwd=work)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    reserved = [r["peak_reserved_bytes"][0] for r in rows if "peak_reserved_bytes" in r]
    return {"measured_peak_gib": max(r["peak_memory_bytes"][0] for r in rows) / 2**30,
            **({"measured_reserved_gib": max(reserved) / 2**30} if reserved else {}),
            "measured_step_ms": 1e3 * statistics.median(r["step_time"] for r in rows[len(rows) // 2:]),
            "measured_mean_step_ms": 1e3 * statistics.mean(r["step_time"] for r in rows[1:] or rows),
            "wall_s": round(time.perf_counter() - began, 1)}


def predict(flags: str, model: str, seq: int, profile, device: str) -> dict:
    """The planner's peak (GiB) and step time (ms) of ``flags`` from ``profile``, and its peak from the formulas."""
    from pipeloom.cli import _parser
    from pipeloom.cli.flags import spec_of
    from pipeloom.plan import Cluster, Costing, PlanRequest
    from pipeloom.plan.command import candidate_of
    from pipeloom.sim.model import get_model

    c = candidate_of(spec_of(_parser().parse_args(["train", "--seq", str(seq), *shlex.split(flags)])))
    spec = replace(get_model(model), vocab=VOCAB)
    cluster = Cluster.of("h100" if device == "cuda" else "cpu", 1)
    out = {}
    for name, given in (("predicted", profile), ("formulas", None)) if profile else (("predicted", None),):
        request = PlanRequest(spec, seq, c.microbatch_size * c.microbatches, cluster, profile=given)
        plan = Costing(request).evaluate(c)
        out[f"{name}_peak_gib"] = plan.peak_memory_bytes[0] / 2**30
        out[f"{name}_step_ms"] = plan.step_ms
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write (default bench/results/gpu/<gpu>.json)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="the tiny model on this CPU: checks the script")
    parser.add_argument("--deadline", type=float, default=420,
                        help="seconds after which no further run starts (the file holds the rows done; default 420)")
    parser.add_argument("--traces", help="a folder for each run's measured timeline (pipeloom train --trace)")
    parser.add_argument("--commit", help="the commit measured (default: git's HEAD here; a lent GPU machine's copy "
                                         "of the tree can hold a stale one)")
    parser.add_argument("--only", nargs="+", metavar="REGEX",
                        help="only the runs whose model and flags match one of these (re.search: 'recompute', "
                             "'size 4$')")
    args = parser.parse_args(argv)
    from pipeloom.sim.profile import load_profile

    model, seq, layouts, sizes = QUICK if args.quick else (MODEL, SEQ, LAYOUTS, SIZES)
    device = "cpu" if args.quick else "cuda"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu_truth.py measures a GPU and this machine has none (--quick runs it on the CPU)")
        name = torch.cuda.get_device_name(0)
    else:
        name = "cpu"
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    began = time.perf_counter()
    head = {"gpu": name, "commit": commit.strip(), "model": model, "seq": seq, "vocab": VOCAB, "steps": args.steps,
            **({"host_copy_gbps": host_copy_gbps()} if device == "cuda" else {})}
    extra = () if args.quick else LATER
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _pipeloom("profile", "--model", model, "--vocab", str(VOCAB), "--seq", str(seq), "--microbatch-sizes", sizes,
                  "--device", device, "--out", "profile.json", cwd=work)
        head["profile_s"] = round(time.perf_counter() - began, 1)
        profile = load_profile(work / "profile.json")
        rows, skipped = [], []
        where = args.out or str(RESULTS / "gpu" / f"{slug}.json")

        def write() -> Path:
            return write_results("gpu_truth", {**head, "profile": profile.to_dict(), "rows": rows,
                                               "skipped": skipped}, where)

        runs = [(model, flags) for flags in layouts] + list(extra)
        for run_model, flags in [(m, f) for m, f in runs if not args.only or any(re.search(t, f"{m} {f}") for t in args.only)]:
            if time.perf_counter() - began > args.deadline:
                skipped.append(f"{run_model} {flags}")
                continue
            trace = Path(args.traces) / f"{len(rows) + len(skipped):02d}.json" if args.traces else None
            row = {"flags": flags, "model": run_model,
                   **measure(flags, run_model, seq, device, args.steps, work, trace,
                             work / "profile.json" if run_model == model else None),
                   **predict(flags, run_model, seq, profile if run_model == model else None, device)}
            for key in ("peak", "step"):
                unit = "gib" if key == "peak" else "ms"
                row[f"{key}_ratio"] = row[f"predicted_{key}_{unit}"] / row[f"measured_{key}_{unit}"]
            rows.append(row)
            print(f"{run_model} {flags}: peak {row['measured_peak_gib']:.3f} GiB (predicted x{row['peak_ratio']:.3f}), "
                  f"step {row['measured_step_ms']:.1f} ms (predicted x{row['step_ratio']:.3f})", flush=True)
            write()
    print(f"wrote {write()}")


if __name__ == "__main__":
    main()
