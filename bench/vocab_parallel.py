"""Vocabulary Parallelism measured: step time and per-rank memory of none / redis / naive / vocab-1 / vocab-2.

    python bench/vocab_parallel.py [--vocab 65536] [--hidden 64] [--layers 4] [--seq 64] [--steps 6] [--out FILE]

A GPT whose vocabulary layers dominate (V = 64k, small hidden) trains with
1F1B on 2 gloo processes (one thread each) in five layouts, in one run:
``none`` (embedding on the first stage, LM head on the last), ``redis``
(transformer layers moved off the last stage by the simulator's
``balanced_layers``), and the three vocabulary-parallel algorithms. All start
from the same weights and batch: the first step's loss must agree (else exit
1). Per rank it records the median step time and the peak resident memory
during the timed steps (``VmHWM`` of /proc/self/status after resetting it
through /proc/self/clear_refs; weights, gradients, AdamW state, activations
and buffers alike). Writes bench/results/vocab_parallel.json with ratios to
``none``. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from pipeloom.modes import VocabMode  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

MODES = [m.value for m in VocabMode]


def _peak_rss_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _worker(rank, args):
    import gc

    import torch
    import torch.distributed as dist

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.partition import balanced_layers
    from pipeloom.sim.model import ModelSpec

    config = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=args.vocab, block_size=args.seq)
    spec = ModelSpec("bench", args.layers, args.hidden, 4, args.vocab)
    data = torch.randint(0, args.vocab, (args.microbatches * args.microbatch_size, args.seq + 1),
                         generator=torch.Generator().manual_seed(1))
    tokens, targets = data[:, :-1], data[:, 1:]
    rows = {}
    for mode in MODES:
        torch.manual_seed(0)
        layers = balanced_layers(spec, 2, args.seq) if mode == "redis" else None
        pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=args.microbatches,
                                 layers_per_stage=layers, vocab_parallel=None if mode == "none" else mode)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        first = pipe.step(tokens, targets)
        pipe.optimizer_step(optimizer)
        gc.collect()
        _peak_rss_reset()
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            pipe.step(tokens, targets)
            pipe.optimizer_step(optimizer)
            times.append(time.perf_counter() - start)
        rows[mode] = {"first_loss": first, "layers_per_stage": list(layers) if layers else None,
                      "step_ms": 1e3 * statistics.median(times), "peak_rss_bytes": _status("VmHWM"),
                      "parameters": sum(p.numel() for p in pipe.parameters())}
        del pipe, optimizer
        gc.collect()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    ranks = spawn(2, _worker, args, timeout=1200)
    losses = [r[m]["first_loss"] for r in ranks for m in MODES]
    if max(losses) - min(losses) > 1e-4 * abs(losses[0]):
        print(f"the layouts disagree on the first loss: {losses}")
        sys.exit(1)
    base = {r: ranks[r]["none"] for r in range(2)}
    table = {}
    for mode in MODES:
        per_rank = [ranks[r][mode] for r in range(2)]
        step = max(row["step_ms"] for row in per_rank)
        table[mode] = {
            "step_ms": round(step, 2),
            "step_ratio": round(step / max(b["step_ms"] for b in base.values()), 3),
            "peak_rss_mb": [round(row["peak_rss_bytes"] / 2**20, 1) for row in per_rank],
            "peak_rss_ratio": [round(row["peak_rss_bytes"] / base[r]["peak_rss_bytes"], 3)
                               for r, row in enumerate(per_rank)],
            "parameters": [row["parameters"] for row in per_rank],
            "layers_per_stage": per_rank[0]["layers_per_stage"],
        }
        row = table[mode]
        print(f"{mode:<8} step {row['step_ms']:8.1f} ms (x{row['step_ratio']:.3f})  peak RSS per rank "
              f"{row['peak_rss_mb']} MB (x{row['peak_rss_ratio']})  parameters {row['parameters']}", flush=True)
    config = {k: getattr(args, k) for k in ("vocab", "hidden", "layers", "seq", "microbatches", "microbatch_size",
                                            "steps")}
    out = write_results("vocab_parallel", {"config": {**config, "pp": 2, "schedule": "1f1b", "processes": 2,
                                                      "threads": 1, "first_loss": losses[0]},
                                           "modes": table}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
