"""PipeOffload measured: activation memory per rank with no, selective (0.5) and full offload.

    python bench/offload.py [--pp 2] [--schedules 1f1b,zb-v,v-half] [--microbatches 8] [--layers 4] [--hidden 768]
                            [--heads 12] [--vocab 8192] [--seq 256] [--steps 2] [--out FILE]

For each schedule and policy, ``pp`` gloo processes (one thread each) train a GPT through
``Pipeline(offload=policy)``, the schedule built with the model's simulated
costs on the ``cpu`` device preset (so the copies' placement is the one the
simulator predicts). After a warm-up step, per rank and step: the peak bytes
of saved activations held on the device (the offload handler's counter) and on
the host, the bytes copied out, the peak resident memory the step added
(``VmHWM``, as bench/sequence_parallel.py measures it; on the CPU the "host"
pool is the same memory, so it cannot fall) and the step time; with CUDA,
``torch.cuda.max_memory_allocated``. Beside them, the simulator's
``peak_activation`` and ``peak_host`` per rank for the same schedule and
model (it counts 16-bit activations: ``sim_fp32`` doubles them for this fp32
run). Ratios against "none". Writes bench/results/offload.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import added_peak, write_results  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

POLICIES = {"none": None, "selective 0.5": 0.5, "full": None}


def _costs(args, family):
    from pipeloom.schedule import get_family
    from pipeloom.sim.model import ModelSpec, costs_from_model

    spec = ModelSpec("bench", args.layers, args.hidden, args.heads, args.vocab)
    return costs_from_model(spec, args.pp, args.seq, 1, "cpu", chunks=get_family(family).default_chunks or 1)


def _worker(rank, family, policy, args):
    import time

    import torch

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                       block_size=args.seq)
    torch.manual_seed(0)
    name, ratio = policy.split()[0], POLICIES[policy]
    pipe = pipeloom.Pipeline(GPT(config), schedule=family, pp=args.pp, microbatches=args.microbatches,
                             offload=name, offload_ratio=ratio, costs=_costs(args, family), timeout=600)
    data = torch.randint(0, args.vocab, (args.microbatches, args.seq + 1), generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1], data[:, 1:]
    cuda = pipe.device.type == "cuda"
    pipe.step(tokens, targets)  # warm up: the host pool fills
    pipe.zero_grad()
    steps = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(pipe.device)
        start = time.perf_counter()
        rss, _ = added_peak(lambda: pipe.step(tokens, targets))
        seconds = time.perf_counter() - start
        pipe.zero_grad()
        stats = pipe.offload_stats()
        steps.append({"device_peak": stats["device_peak"], "host_peak": stats["host_peak"],
                      "offloaded": stats["offloaded"], "host_allocations": stats["host_allocations"],
                      "rss_peak": rss, "step_s": seconds,
                      **({"cuda_max_allocated": torch.cuda.max_memory_allocated(pipe.device)} if cuda else {})})
    return {"schedule": pipe.schedule.text() if rank == 0 else None,
            **{key: (statistics.median if key == "step_s" else max)(s[key] for s in steps) for key in steps[0]}}


def _simulated(schedule_text, args, family, policy):
    from pipeloom.schedule import Offload, build
    from pipeloom.sim import simulate

    costs = _costs(args, family)
    name, ratio = policy.split()[0], POLICIES[policy]
    schedule = build(family, args.pp, args.microbatches, transforms=[Offload(name, ratio)], costs=costs)
    assert schedule.text() == schedule_text  # the schedule the pipeline ran
    result = simulate(schedule, costs)
    return {"peak_activation": [int(x) for x in result.peak_activation], "peak_host": [int(x) for x in result.peak_host],
            "makespan_ms": round(result.makespan, 1)}


def _family(family, args) -> dict:
    """Every policy's measured and simulated figures for one schedule family."""
    rows = {}
    for policy in POLICIES:
        ranks = spawn(args.pp, _worker, family, policy, args, timeout=3600)
        sim = _simulated(ranks[0]["schedule"], args, family, policy)
        rows[policy] = {
            "measured": {key: [r[key] for r in ranks] for key in ranks[0] if key != "schedule"},
            "simulated": sim,
            "sim_fp32_peak_activation": [2 * x for x in sim["peak_activation"]],
            "schedule": ranks[0]["schedule"],
        }
        m = rows[policy]["measured"]
        print(f"{family} {policy:<14} device peak MB {[round(x / 2**20, 1) for x in m['device_peak']]} (sim fp32 "
              f"{[round(x / 2**20, 1) for x in rows[policy]['sim_fp32_peak_activation']]}), host peak MB "
              f"{[round(x / 2**20, 1) for x in m['host_peak']]}, RSS peak MB {[round(x / 2**20, 1) for x in m['rss_peak']]}"
              f", step {max(m['step_s']):.2f} s", flush=True)
    base = rows["none"]
    for policy, row in rows.items():
        m, b = row["measured"], base["measured"]
        row["vs_none"] = {
            "device_peak": [round(x / y, 3) for x, y in zip(m["device_peak"], b["device_peak"])],
            "sim_peak_activation": [round(x / y, 3) for x, y in zip(row["simulated"]["peak_activation"],
                                                                   base["simulated"]["peak_activation"])],
            "rss_peak": [round(x / y, 3) for x, y in zip(m["rss_peak"], b["rss_peak"])],
            "step_s": round(max(m["step_s"]) / max(b["step_s"]), 3),
        }
        print(f"{family} {policy:<14} vs none: {row['vs_none']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b,zb-v,v-half")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # resident memory follows the live tensors (the workers inherit it)
    results = {family: _family(family, args) for family in args.schedules.split(",")}
    config = {k: getattr(args, k) for k in ("pp", "schedules", "microbatches", "layers", "hidden", "heads", "vocab",
                                            "seq", "steps")}
    out = write_results("offload", {"config": {**config, "microbatch_size": 1, "dtype": "float32", "threads": 1,
                                               "sim_device": "cpu"}, "schedules": results}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
