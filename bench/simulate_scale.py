"""Seconds to build, validate and simulate every schedule family at scale.

    python bench/simulate_scale.py [--pp 64] [--microbatches 512] [--out FILE]

Writes bench/results/simulate_scale.json (goal: under 2 s per family for
p = 64, m = 512 on a 2-core machine). Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.schedule import FAMILIES, build, validate  # noqa: E402
from pipeloom.sim import simulate  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for name in FAMILIES:
        schedule, t_build = timed(lambda: build(name, args.pp, args.microbatches, check=False))
        _, t_validate = timed(lambda: validate(schedule))
        result, t_sim = timed(lambda: simulate(schedule))
        row = {
            "schedule": name, "stages": schedule.stages, "actions": schedule.num_actions(),
            "build_s": round(t_build, 3), "validate_s": round(t_validate, 3), "simulate_s": round(t_sim, 3),
            "total_s": round(t_build + t_validate + t_sim, 3),
            "makespan": result.makespan, "bubble_rate": result.bubble_rate,
        }
        rows.append(row)
        print(f"{name:<18} actions={row['actions']:>7}  build {t_build:6.2f}s  validate {t_validate:6.2f}s  "
              f"simulate {t_sim:6.2f}s  total {row['total_s']:6.2f}s", flush=True)
    out = write_results("simulate_scale", {"pp": args.pp, "microbatches": args.microbatches, "families": rows}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
