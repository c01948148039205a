"""What one GPU measures beside what the planner predicts, in one call: the GPU truth the CPU tests keep.

    PYTHONPATH=. python bench/gpu_truth.py [--out bench/results/gpu/NAME.json] [--steps 6] [--quick]

On the current GPU: ``pipeloom profile --device cuda`` of gpt-350m at seq 1024 (vocabulary 256, the
built-in corpus's bytes, as ``pipeloom train --vocab 256`` builds it; microbatch sizes 1 to 8), then
``pipeloom train --device cuda --pp 1`` of each layout in :data:`LAYOUTS` for ``--steps`` steps with
``--metrics``: the peak memory (``torch.cuda.max_memory_allocated``, and ``max_memory_reserved``) and the
median step time after
the first two steps. Beside each run, the planner's prediction for it
(:class:`~pipeloom.plan.Costing`: peak per rank and step time) from the new profile, and the peak from
the formulas (no profile). Writes ``bench/results/gpu/<gpu>.json`` (with the profile, the commit and
the machine), which ``tests/test_gpu_truth.py`` checks the simulator against on every CPU run. Estimated at
5 minutes on an H100 or H200 (not yet run on one). ``--quick`` runs the same on this CPU with the tiny model at seq 64 and
two layouts, to check the script (CPU memory is the process's resident set: not comparable).
"""

from __future__ import annotations

import argparse
import json
import os
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
    "--pp 1 --schedule 2bw --microbatches 4 --microbatch-size 4",
    "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4 --recompute full",
    "--pp 1 --schedule 1f1b --microbatches 4 --microbatch-size 4 --recompute cheap",
    "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload full",
    "--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2 --offload selective --offload-ratio 0.5",
)
MODEL, SEQ, VOCAB, SIZES = "gpt-350m", 1024, 256, "1,2,4,8"
QUICK = ("tiny", 64, (LAYOUTS[0], LAYOUTS[-2]), "1,4")


def _pipeloom(*args: str, cwd: Path, timeout: int = 600) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeloom", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"pipeloom {shlex.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def measure(flags: str, model: str, seq: int, device: str, steps: int, work: Path) -> dict:
    """One ``pipeloom train`` run of ``flags``: its peak memory (GiB) and median step time (ms) after warm-up."""
    metrics = work / "m.jsonl"
    metrics.unlink(missing_ok=True)
    began = time.perf_counter()
    _pipeloom("train", "--model", model, "--vocab", str(VOCAB), "--seq", str(seq), "--device", device,
              "--steps", str(steps), "--metrics", str(metrics), *shlex.split(flags), cwd=work)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    reserved = [r["peak_reserved_bytes"][0] for r in rows if "peak_reserved_bytes" in r]
    return {"measured_peak_gib": max(r["peak_memory_bytes"][0] for r in rows) / 2**30,
            **({"measured_reserved_gib": max(reserved) / 2**30} if reserved else {}),
            "measured_step_ms": 1e3 * statistics.median(r["step_time"] for r in rows[2:] or rows),
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
    for name, given in (("predicted", profile), ("formulas", None)):
        request = PlanRequest(spec, seq, c.microbatch_size * c.microbatches, cluster, profile=given)
        plan = Costing(request).evaluate(c)
        out[f"{name}_peak_gib"] = plan.peak_memory_bytes[0] / 2**30
        out[f"{name}_step_ms"] = plan.step_ms
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where to write (default bench/results/gpu/<gpu>.json)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="the tiny model on this CPU: checks the script")
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
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        began = time.perf_counter()
        _pipeloom("profile", "--model", model, "--vocab", str(VOCAB), "--seq", str(seq), "--microbatch-sizes", sizes,
                  "--device", device, "--out", "profile.json", cwd=work)
        profile_s = time.perf_counter() - began
        profile = load_profile(work / "profile.json")
        rows = []
        for flags in layouts:
            row = {"flags": flags, "model": model, **measure(flags, model, seq, device, args.steps, work),
                   **predict(flags, model, seq, profile, device)}
            for key in ("peak", "step"):
                unit = "gib" if key == "peak" else "ms"
                row[f"{key}_ratio"] = row[f"predicted_{key}_{unit}"] / row[f"measured_{key}_{unit}"]
            rows.append(row)
            print(f"{flags}: peak {row['measured_peak_gib']:.3f} GiB (predicted x{row['peak_ratio']:.3f}), "
                  f"step {row['measured_step_ms']:.1f} ms (predicted x{row['step_ratio']:.3f})", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    slug = "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")
    out = write_results("gpu_truth", {
        "gpu": name, "commit": commit.strip(), "model": model, "seq": seq, "vocab": VOCAB, "steps": args.steps,
        "profile_s": round(profile_s, 1), "profile": profile.to_dict(), "rows": rows,
    }, args.out or str(RESULTS / "gpu" / f"{slug}.json"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
