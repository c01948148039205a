"""Sequence parallelism measured on CPU: memory per rank of ring and RSA attention for N = 1, 2, 4.

    python bench/sequence_parallel.py [--seq 4096] [--heads 8] [--head-dim 32] [--budget-mb 256] [--out FILE]

For N = 1, 2, 4 gloo processes (one thread each), at a fixed total sequence:
- one causal attention layer (batch 1), forward and backward: the peak
  resident memory it adds on each rank (``VmHWM`` of /proc/self/status after
  resetting it through /proc/self/clear_refs, minus the resident memory
  before; glibc is told to map every block over 64 KiB on its own, so that
  resident memory follows the live tensors) and its time, for ``ring`` and ``rsa``;
- a whole training step of a small GPT (2 layers) through ``Pipeline(pp=1,
  sp=N, attention=kind)`` (N = 1 runs the same algorithm on one rank): the
  memory it adds on each rank and the step time;
- the longest sequence whose attention layer fits ``--budget-mb`` per rank
  (doubling, then bisection over multiples of 2N).
Writes bench/results/sequence_parallel.json; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import added_peak, write_results  # noqa: E402
from pipeloom.modes import Attention  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

KINDS = [a.value for a in Attention]


def _attention(seq: int, args, kind: str, group, rank: int, n: int):
    import torch

    from pipeloom.nn import sequence_layout, sequence_parallel_attention

    layout = sequence_layout(seq, n, rank, balanced=True)
    shape = (1, args.heads, layout.local_len, args.head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))

    def run():
        out = sequence_parallel_attention(q, k, v, group if n > 1 else None, layout, causal=True, kind=kind)
        out.backward(torch.ones_like(out))

    return added_peak(run)


def _step(seq: int, args, kind: str, n: int):
    import torch

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig(n_layer=2, n_embd=args.heads * args.head_dim, n_head=args.heads, vocab_size=256,
                       block_size=seq)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=1, microbatches=1, sp=n, attention=kind)
    data = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    pipe.step(data[:, :-1], data[:, 1:])  # warm up
    pipe.zero_grad()
    return added_peak(lambda: pipe.step(data[:, :-1], data[:, 1:]))


def _fits(seq, args, kind, group, rank, n) -> bool:
    import torch
    import torch.distributed as dist

    peak = torch.tensor([float(_attention(seq, args, kind, group, rank, n)[0])])
    if n > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return peak.item() <= args.budget_mb * 2**20


def _longest(args, kind, group, rank, n) -> int:
    """The longest sequence (a multiple of 2n) whose attention layer fits the budget on every rank."""
    unit = 2 * n
    low, high = 0, unit * 32
    while _fits(high, args, kind, group, rank, n):
        low, high = high, high * 2
    while high - low > unit:
        mid = (low + high) // 2 // unit * unit
        low, high = (mid, high) if _fits(mid, args, kind, group, rank, n) else (low, mid)
    return low


def _worker(rank, n, args):
    import torch.distributed as dist

    group = dist.group.WORLD if n > 1 else None
    out = {}
    for kind in KINDS:
        layer = [_attention(args.seq, args, kind, group, rank, n) for _ in range(args.repeats)]
        step = [_step(args.seq, args, kind, n) for _ in range(args.repeats)]
        out[kind] = {
            "layer_peak_bytes": min(p for p, _ in layer), "layer_s": statistics.median(t for _, t in layer),
            "step_peak_bytes": min(p for p, _ in step), "step_s": statistics.median(t for _, t in step),
            "longest_seq": _longest(args, kind, group, rank, n),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--budget-mb", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    # glibc: every block above 64 KiB gets its own mapping, returned to the system when freed (no
    # adaptive threshold), so that resident memory follows the live tensors (the workers inherit it)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    rows = {}
    for n in (1, 2, 4):
        ranks = spawn(n, _worker, n, args, timeout=1800)
        for kind in KINDS:
            per = [r[kind] for r in ranks]
            rows.setdefault(kind, {})[n] = {
                "layer_peak_mb": [round(p["layer_peak_bytes"] / 2**20, 1) for p in per],
                "layer_ms": round(1e3 * max(p["layer_s"] for p in per), 1),
                "step_peak_mb": [round(p["step_peak_bytes"] / 2**20, 1) for p in per],
                "step_ms": round(1e3 * max(p["step_s"] for p in per), 1),
                "longest_seq": per[0]["longest_seq"],
            }
            r = rows[kind][n]
            print(f"{kind:<5} N={n}  layer peak per rank {r['layer_peak_mb']} MB, {r['layer_ms']} ms; step peak "
                  f"{r['step_peak_mb']} MB, {r['step_ms']} ms; longest sequence in {args.budget_mb:g} MB: "
                  f"{r['longest_seq']}", flush=True)
    summary = {}
    for kind in KINDS:
        runs = rows[kind]
        summary[kind] = {n: {f"{part}_peak_vs_1_over_n": round(max(runs[n][f"{part}_peak_mb"]) * n
                                                               / max(runs[1][f"{part}_peak_mb"]), 3)
                             for part in ("layer", "step")} | {
                             "longest_vs_n1": round(runs[n]["longest_seq"] / runs[1]["longest_seq"], 3)}
                         for n in (1, 2, 4)}
    summary["ring_over_rsa_step_time"] = {n: round(rows["ring"][n]["step_ms"] / rows["rsa"][n]["step_ms"], 3)
                                          for n in (1, 2, 4)}
    print(summary)
    config = {k: getattr(args, k) for k in ("seq", "heads", "head_dim", "budget_mb", "repeats")}
    out = write_results("sequence_parallel", {"config": {**config, "batch": 1, "causal": True, "balanced": True,
                                                         "threads": 1, "step_model": "GPT 2 layers, pp=1"},
                                              "attention": rows, "summary": summary}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
