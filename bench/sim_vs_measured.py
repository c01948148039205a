"""Measured step time against the simulator's prediction from measured costs.

    python bench/sim_vs_measured.py [--steps 8] [--microbatches 8] [--out FILE]

Two gloo processes (one thread each) train a small GPT with each schedule.
From every timed step's measured timeline it takes per-stage T_F, T_B, T_W
and T_comm (their medians over the steps), simulates the same schedule with
them, and compares the prediction with the measured step (median wall time
of a step, and median span from the first action's start to the last one's
end). zb-auto is built from the costs measured under zb-h1.
Writes bench/results/sim_vs_measured.json; the goal is agreement within 10%.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "zb-auto"]


def _worker(rank, args):
    import torch
    import torch.distributed as dist

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime.timeline import gather_timeline, measured_costs, median_costs
    from pipeloom.sim import simulate

    config = GPTConfig.preset("tiny", n_layer=args.layers, n_embd=args.hidden, n_head=8, block_size=args.seq)
    batch = torch.randint(0, config.vocab_size, (args.microbatches * 2, args.seq + 1),
                          generator=torch.Generator().manual_seed(1))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    rows, zb_costs = {}, None
    for name in SCHEDULES:
        torch.manual_seed(0)
        options = {"costs": zb_costs} if name == "zb-auto" else {}
        pipe = pipeloom.Pipeline(GPT(config), schedule=name, pp=2, microbatches=args.microbatches, **options)
        times, spans, measured = [], [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(tokens, targets)
            times.append(time.perf_counter() - start)
            pipe.zero_grad()
            if step >= args.warmup:
                events = gather_timeline(pipe)
                measured.append(measured_costs(events, pipe.schedule))
                spans.append(max(e.end for evs in events for e in evs) - min(e.start for evs in events for e in evs))
        costs = median_costs(measured)
        if name == "zb-h1":
            zb_costs = costs
        predicted = simulate(pipe.schedule, costs).makespan
        step_ms = 1e3 * median(times[args.warmup:])
        span_ms = median(spans)
        rows[name] = {
            "measured_step_ms": round(step_ms, 3), "measured_span_ms": round(span_ms, 3),
            "predicted_ms": round(predicted, 3),
            "predicted_over_step": round(predicted / step_ms, 4), "predicted_over_span": round(predicted / span_ms, 4),
            "costs_ms": {k: [round(v, 4) for v in getattr(costs, k)] for k in ("f", "b", "w", "comm")},
        }
        if rank == 0:
            r = rows[name]
            print(f"{name:<18} step {r['measured_step_ms']:8.2f} ms  span {r['measured_span_ms']:8.2f} ms  "
                  f"predicted {r['predicted_ms']:8.2f} ms  pred/step {r['predicted_over_step']:.3f}  "
                  f"pred/span {r['predicted_over_span']:.3f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = spawn(2, _worker, args)[0]
    config = {k: getattr(args, k) for k in ("layers", "hidden", "seq", "microbatches", "steps", "warmup")}
    out = write_results("sim_vs_measured", {"config": {**config, "pp": 2, "processes": 2, "threads": 1},
                                            "schedules": rows}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
