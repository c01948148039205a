"""The vocabulary modes side by side in the simulator, on the Vocabulary Parallelism paper's 8-GPU 1F1B setting.

    python bench/vocab_parallel_sim.py [--schedule 1f1b] [--pp 8] [--microbatches 128] [--out FILE]

For the 4B model (32 layers, h = 3072), seq 2048, microbatch size 1, on
A100 costs, and V = 32k, 64k, 128k, 256k: makespan, throughput relative to
``none``, per-rank compute spread ((max - min) / mean of ``busy``) and the
largest per-rank peak memory, for none, redis, naive, vocab-1 and vocab-2.
Writes bench/results/vocab_parallel_sim.json. Simulated, not measured.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.schedule import build  # noqa: E402
from pipeloom.schedule.transforms.vocab import MODES  # noqa: E402
from pipeloom.sim import MODELS, costs_from_model, peak_memory_bytes, simulate  # noqa: E402

MODEL, SEQ, DEVICE = "4b", 2048, "a100"
VOCABS = (32_000, 64_000, 128_000, 256_000)


def row(schedule_name: str, pp: int, microbatches: int, vocab: int, mode: str) -> dict:
    spec = replace(MODELS[MODEL], vocab=vocab)
    schedule = build(schedule_name, pp, microbatches, vocab_parallel=mode)
    costs = costs_from_model(spec, pp, SEQ, 1, DEVICE, chunks=schedule.chunks, vocab_parallel=mode)
    result = simulate(schedule, costs)
    busy = [r.busy for r in result.ranks]
    mean = sum(busy) / len(busy)
    memory = peak_memory_bytes(spec, result, SEQ)
    return {
        "vocab": vocab, "mode": mode, "makespan_ms": round(result.makespan, 1),
        "busy_ms": {"max": round(max(busy), 1), "min": round(min(busy), 1), "mean": round(mean, 1)},
        "busy_spread": round((max(busy) - min(busy)) / mean, 4),
        "peak_memory_gb": [round(m / 1e9, 2) for m in memory],
        "max_peak_memory_gb": round(max(memory) / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    print(f"{'V':>7} {'mode':<8} {'makespan ms':>12} {'throughput':>10} {'busy spread':>11} {'max mem GB':>10}")
    for vocab in VOCABS:
        group = [row(args.schedule, args.pp, args.microbatches, vocab, mode) for mode in MODES]
        for r in group:
            r["throughput_vs_none"] = round(group[0]["makespan_ms"] / r["makespan_ms"], 3)
            print(f"{vocab:>7} {r['mode']:<8} {r['makespan_ms']:>12.1f} {r['throughput_vs_none']:>9.3f}x "
                  f"{r['busy_spread']:>11.1%} {r['max_peak_memory_gb']:>10.1f}", flush=True)
        rows += group
    setting = {"schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches, "model": MODEL,
               "seq": SEQ, "microbatch_size": 1, "device": DEVICE}
    out = write_results("vocab_parallel_sim", {"setting": setting, "rows": rows}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
