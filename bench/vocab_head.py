"""The vocabulary-parallel LM head on one rank against torch's cross-entropy: time and memory of forward+backward.

    python bench/vocab_head.py [--device cpu|cuda] [--full] [--tokens N] [--hidden H] [--vocab V ...]
                               [--dtypes fp32 bf16] [--tf32 on|off] [--repeats R] [--warmup W] [--out FILE]

For each vocabulary size V and dtype (inputs and weight both in it), one
rank, N tokens of hidden size H, forward and backward (∇x and ∇W) of:

- ``torch``: ``F.cross_entropy((x @ W.T).float(), y)``, the logits upcast;
- ``torch-lowp`` (bf16 only): ``F.cross_entropy(x @ W.T, y)`` on the bf16 logits;
- ``vocab-1``, ``vocab-2``: :class:`pipeloom.nn.VocabParallelLMHead`, no process group;
- ``gemms``: the three products alone (x·Wᵀ, then ∇Zᵀ·x and ∇Z·W with ∇Z
  the logits), the floor under all of them.

Time: the median over ``--repeats`` runs after ``--warmup``. Memory: the peak
a run adds over what was allocated before it (x, W, y), its gradients
included: on CUDA ``torch.cuda.max_memory_allocated`` minus
``memory_allocated`` before; on CPU the peak resident memory (``VmHWM``
after a reset through /proc/self/clear_refs) minus the resident memory
before, in a fresh process (one thread unless ``--threads``) where glibc maps
every block over 64 KiB on its own so that resident memory follows the live
tensors. Defaults: on CUDA the issue's sizes (N = H = 4096, V = 32k..256k),
on CPU small ones (N = 1024, H = 512, V = 32k, 64k; ``--full`` for the
others). Writes bench/results/vocab_head.json with the ratios pipeloom /
torch; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

ALGORITHMS = ("vocab-1", "vocab-2")
FULL = {"tokens": 4096, "hidden": 4096, "vocab": [32768, 65536, 131072, 262144]}
SMALL = {"tokens": 1024, "hidden": 512, "vocab": [32768, 65536]}


def _cases(dtype: str) -> list[str]:
    return ["torch"] + (["torch-lowp"] if dtype == "bf16" else []) + list(ALGORITHMS) + ["gemms"]


class _Memory:
    """The peak bytes one run adds, on CUDA from the caching allocator, on CPU from /proc/self/status."""

    def __init__(self, device):
        self.device = device

    def _status(self, field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1]) * 1024

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.before = self._status("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.before
        return self._status("VmHWM") - self.before


def _measure(args) -> list[dict]:
    """Every (V, dtype, case): its median milliseconds, peak added bytes and loss."""
    import gc

    import torch
    import torch.nn.functional as F
    from torch import nn

    from pipeloom.nn import VocabParallelLMHead

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32 == "on"
    memory = _Memory(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for vocab in args.vocab:
        for name in args.dtypes:
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            g = torch.Generator(device).manual_seed(0)
            x = torch.randn(args.tokens, args.hidden, generator=g, device=device, dtype=dtype).requires_grad_()
            weight = nn.Parameter(0.02 * torch.randn(vocab, args.hidden, generator=g, device=device, dtype=dtype))
            y = torch.randint(vocab, (args.tokens,), generator=g, device=device)
            heads = {a: VocabParallelLMHead(vocab, args.hidden, algorithm=a, weight=weight) for a in ALGORITHMS}

            def run(case):
                x.grad = weight.grad = None
                if case == "gemms":
                    with torch.no_grad():
                        logits = x @ weight.T
                        logits.T @ x, logits @ weight  # noqa: B018
                    return None
                if case in heads:
                    loss = heads[case](x, y)
                else:
                    logits = x @ weight.T
                    loss = F.cross_entropy(logits.float() if case == "torch" else logits, y)
                loss.backward()
                return loss.item()

            row = {"vocab": vocab, "dtype": name, "cases": {}}
            for case in _cases(name):
                for _ in range(args.warmup):
                    run(case)
                times = []
                for _ in range(args.repeats):
                    sync()
                    start = time.perf_counter()
                    run(case)
                    sync()
                    times.append(time.perf_counter() - start)
                x.grad = weight.grad = None
                gc.collect()
                memory.start()
                loss = run(case)
                row["cases"][case] = {"ms": round(1e3 * statistics.median(times), 2),
                                      "peak_mb": round(memory.peak() / 2**20, 1), "loss": loss}
                x.grad = weight.grad = None
                print(f"V={vocab:<7} {name}  {case:<10} {row['cases'][case]['ms']:9.2f} ms  "
                      f"peak +{row['cases'][case]['peak_mb']:8.1f} MB  loss {loss}", flush=True)
            rows.append(row)
            del x, weight, y, heads, run
            gc.collect()
    return rows


def _worker(rank, args):
    return _measure(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--full", action="store_true", help="the issue's sizes (the CUDA default)")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int, nargs="+")
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--tf32", choices=("on", "off"), default="off", help="torch.backends.cuda.matmul.allow_tf32")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, help="CPU threads (default: one)")
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = FULL if args.full or args.device == "cuda" else SMALL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.repeats = args.repeats or (5 if args.device == "cuda" else 3)
    if args.device == "cuda":
        rows = _measure(args)
    else:
        # glibc: every block above 64 KiB its own mapping, returned when freed, so that resident
        # memory follows the live tensors (the fresh worker process inherits it)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        rows = spawn(1, _worker, args, timeout=7200)[0]
    for row in rows:
        base = row["cases"]["torch"]
        row["ratios_vs_torch"] = {
            case: {"time": round(row["cases"][case]["ms"] / base["ms"], 3),
                   "memory": round(row["cases"][case]["peak_mb"] / base["peak_mb"], 3) if base["peak_mb"] else None,
                   "loss_rel_diff": abs(row["cases"][case]["loss"] - base["loss"]) / abs(base["loss"])}
            for case in ALGORITHMS}
        print(f"V={row['vocab']:<7} {row['dtype']}  pipeloom / torch: {row['ratios_vs_torch']}")
    cpu = args.device == "cpu"
    config = {"device": args.device, "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
              "dtypes": args.dtypes, "repeats": args.repeats, "warmup": args.warmup,
              "threads": (args.threads or 1) if cpu else None, "tf32": None if cpu else args.tf32 == "on",
              "memory": ("peak resident memory added (VmHWM − VmRSS before), fresh process, glibc "
                         "MALLOC_MMAP_THRESHOLD_=65536" if cpu else
                         "torch.cuda.max_memory_allocated − memory_allocated before")}
    note = ("a CPU run at small sizes: it checks that the benchmark runs and compares memory; the item's "
            "timing goal is for a GPU (run with --device cuda)" if cpu else "a CUDA run")
    out = write_results("vocab_head", {"note": note, "config": config, "rows": rows}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
