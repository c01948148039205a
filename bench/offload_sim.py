"""PipeOffload in the simulator, against the paper's claims.

    python bench/offload_sim.py [--pp 8] [--microbatches 32] [--out FILE]

The 6.2B model (30 layers, h = 4096) on A100 costs, microbatch size 1,
blockwise attention (no s² scores): for seq 4096, 16384 and 32768, with and
without cheap recomputation (norms and activation functions, 34 -> 20 bsh a
layer), PipeOffload's k, and per schedule (1f1b, interleaved-1f1b, v-half,
zb-v) the largest per-rank peak activation memory and the makespan under
none, selective 0.5 and full, as ratios to none, with the copy time not
hidden, and the bytes moved per step (what F keeps and, in split-backward
schedules, what B keeps for W). Then the selective curve of 1f1b and v-half at the setting where k
is lowest: for r = 0.1 ... 1, the share of the bytes full offload moves that
selective moves, against the share of full's saving it reaches (above the
diagonal: better than linear). Writes bench/results/offload_sim.json.
Simulated, not measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.schedule import Offload, build  # noqa: E402
from pipeloom.sim import costs_from_model, simulate  # noqa: E402
from pipeloom.sim.model import offload_time_ratio  # noqa: E402

MODEL, DEVICE = "6.2b", "a100"
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("v-half", 2), ("zb-v", 2))
POLICIES = (("none",), ("selective", 0.5), ("full",))


def run(name, chunks, pp, microbatches, seq, recompute, policy):
    costs = costs_from_model(MODEL, pp, seq, 1, DEVICE, chunks=chunks, attention="ring", recompute=recompute)
    schedule = build(name, pp, microbatches, chunks, transforms=[Offload(*policy)], costs=costs)
    result = simulate(schedule, costs)
    moved = sum(max(result.costs.host_delta(a), 0.0) for actions in schedule.ranks for a in actions)
    return result, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows, best = [], None
    print(f"{'seq':>6} {'recompute':<9} {'k':>5} {'schedule':<17} {'policy':<13} {'peak cut':>8} {'time':>7} "
          f"{'exposed ms':>10}")
    for seq in (4096, 16384, 32768):
        for recompute in (False, "cheap"):
            k = offload_time_ratio(MODEL, seq, 1, DEVICE, attention="ring", recompute=recompute)
            if best is None or k < best[0]:
                best = (k, seq, recompute)
            for name, chunks in SCHEDULES:
                base = None
                for policy in POLICIES:
                    result, moved = run(name, chunks, args.pp, args.microbatches, seq, recompute, policy)
                    base = base or result
                    row = {
                        "seq": seq, "recompute": recompute or "none", "k": round(k, 3), "schedule": name,
                        "policy": " ".join(map(str, policy)),
                        "peak_activation_gb": round(max(result.peak_activation) / 1e9, 2),
                        "peak_cut": round(max(base.peak_activation) / max(result.peak_activation), 3),
                        "makespan_ms": round(result.makespan, 1),
                        "time_vs_none": round(result.makespan / base.makespan, 4),
                        "exposed_ms": round(max(result.exposed), 1),
                        "offloaded_gb_per_step": round(moved / 1e9, 1),
                    }
                    rows.append(row)
                    print(f"{seq:>6} {row['recompute']:<9} {k:>5.2f} {name:<17} {row['policy']:<13} "
                          f"{row['peak_cut']:>7.2f}x {row['time_vs_none']:>6.3f}x {row['exposed_ms']:>10.1f}")
    k, seq, recompute = best
    curves = {}
    for name, chunks in (("1f1b", 1), ("v-half", 2)):
        none, _ = run(name, chunks, args.pp, args.microbatches, seq, recompute, ("none",))
        full, full_moved = run(name, chunks, args.pp, args.microbatches, seq, recompute, ("full",))
        saving = max(none.peak_activation) - max(full.peak_activation)
        curve = []
        for r in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
            result, moved = run(name, chunks, args.pp, args.microbatches, seq, recompute, ("selective", r))
            curve.append({"ratio": r, "moved_share": round(moved / full_moved, 3),
                          "saving_share": round((max(none.peak_activation) - max(result.peak_activation)) / saving, 3)})
        curves[name] = curve
        print(f"{name} selective at seq {seq}, recompute {recompute or 'none'} (k = {k:.2f}): "
              + ", ".join(f"r={c['ratio']}: moves {c['moved_share']:.0%}, saves {c['saving_share']:.0%}" for c in curve))
    path = write_results("offload_sim", {
        "model": MODEL, "device": DEVICE, "pp": args.pp, "microbatches": args.microbatches, "microbatch_size": 1,
        "attention": "ring (blockwise)", "rows": rows,
        "selective_curve": {"seq": seq, "recompute": recompute or "none", "k": round(k, 3), **curves},
    }, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
