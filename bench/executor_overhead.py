"""The executor's own overhead: pipeloom at pp = 1 against a plain training loop.

    python bench/executor_overhead.py [--models tiny] [--microbatch-size 8] [--seq 256] [--steps 20]
    python bench/executor_overhead.py --profile gpipe     # torch.profiler table of pipeloom's step
    python bench/executor_overhead.py --options '{"offload": "full"}' --profile gpipe --profiler python

One rank (a process group of one: NCCL on a GPU, gloo on the CPU), the same
GPT class and weights, ``--microbatches`` microbatches per step. The plain
loop runs forward, ``loss / m`` and backward per microbatch, then
``optimizer.step()`` and ``zero_grad()``; pipeloom runs
``Pipeline(model, family, pp=1, microbatches=m).step`` and
``optimizer_step(opt, max_norm=None)``: the same math. On CUDA: bf16
autocast, fused AdamW, TF32 allowed; on the CPU: fp32, AdamW. The two sides
alternate step by step after a warm-up, so a drifting machine affects both
alike. ``--options`` adds Pipeline keyword arguments (JSON) to pipeloom's
side, such as a recomputation or offload, whose cost the ratio then shows.
Writes bench/results/executor_overhead.json (or ``--out``) with the
median step times and ratio = pipeloom / plain per model and family (goal:
<= 1.03). Asserts nothing about time. ``--profile FAMILY`` prints
torch.profiler's table of a few steps (``--profiler python``: cProfile's,
the host's Python functions) instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pipeloom
from pipeloom.nn import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import one_rank_group, write_results  # noqa: E402

FAMILIES = ("1f1b", "zb-h1", "gpipe")


class _Plain:
    """The loop a user writes without a pipeline."""

    def __init__(self, model, optimizer, microbatches, autocast):
        self.model, self.optimizer, self.m, self.autocast = model, optimizer, microbatches, autocast

    def step(self, tokens, targets) -> None:
        for x, y in zip(tokens.chunk(self.m), targets.chunk(self.m)):
            with torch.autocast(x.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                loss = self.model(x, y) / self.m
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class _Pipeloom:
    def __init__(self, pipe, optimizer):
        self.pipe, self.optimizer = pipe, optimizer

    def step(self, tokens, targets) -> None:
        self.pipe.step(tokens, targets)
        self.pipe.optimizer_step(self.optimizer, max_norm=None)


def _optimizer(params, device):
    return torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def _sides(name: str, args, device, autocast) -> dict:
    config = GPTConfig.preset(name, block_size=max(args.seq, GPTConfig.preset(name).block_size))
    torch.manual_seed(0)
    model = GPT(config).to(device)
    sides = {"plain": _Plain(model, _optimizer(model.parameters(), device), args.microbatches, autocast)}
    for family in args.families:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), family, pp=1, microbatches=args.microbatches, autocast=autocast,
                                 device=device, **args.options)
        sides[family] = _Pipeloom(pipe, _optimizer(pipe.parameters(), device))
    return sides, config


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, args, device, autocast) -> dict:
    sides, config = _sides(name, args, device, autocast)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (args.microbatches * args.microbatch_size, args.seq + 1), generator=g)
    tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    times = {label: [] for label in sides}
    for k in range(args.warmup + args.steps):
        for label, side in sides.items():
            _sync(device)
            start = time.perf_counter()
            side.step(tokens, targets)
            _sync(device)
            if k >= args.warmup:
                times[label].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    return {
        "model": name, "tokens_per_step": tokens.numel(),
        "plain_ms": round(1e3 * plain, 3),
        "families": {family: {"ms": round(1e3 * statistics.median(times[family]), 3),
                              "ratio": round(statistics.median(times[family]) / plain, 4),
                              "ratio_fastest": round(min(times[family]) / min(times["plain"]), 4)}
                     for family in args.families},
        "step_times_ms": {label: [round(1e3 * t, 3) for t in ts] for label, ts in times.items()},
    }


def profile(family: str, args, device, autocast) -> None:
    """Print torch.profiler's table of a few of pipeloom's steps (host and device time), or cProfile's."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    sides, config = _sides(args.models[0], argparse.Namespace(**{**vars(args), "families": [family]}), device, autocast)
    side = sides[family]
    data = torch.randint(0, config.vocab_size, (args.microbatches * args.microbatch_size, args.seq + 1))
    tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    for _ in range(args.warmup):
        side.step(tokens, targets)
    if args.profiler == "python":
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(3):
                side.step(tokens, targets)
            _sync(device)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(3):
            side.step(tokens, targets)
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=40))


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-125m", "gpt-350m"] if cuda else ["tiny"])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024 if cuda else 256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--options", type=json.loads, default={}, metavar="JSON",
                        help='Pipeline keyword arguments for pipeloom\'s side, e.g. \'{"recompute": true}\'')
    parser.add_argument("--profile", metavar="FAMILY", help="print torch.profiler's table for this family instead")
    parser.add_argument("--profiler", choices=("torch", "python"), default="torch",
                        help="with --profile: torch.profiler's table, or cProfile's of the host's Python")
    parser.add_argument("--out", help="where to write the JSON (default bench/results/executor_overhead.json)")
    args = parser.parse_args()

    device, autocast = one_rank_group(cuda)
    try:
        if args.profile:
            profile(args.profile, args, device, autocast)
            return
        results = [measure(name, args, device, autocast) for name in args.models]
    finally:
        dist.destroy_process_group()
    for r in results:
        print(f"{r['model']}: plain {r['plain_ms']:.2f} ms; " + ", ".join(
            f"{f} {v['ms']:.2f} ms ({v['ratio']:.3f}x)" for f, v in r["families"].items()))
    settings = {k: getattr(args, k) for k in ("microbatches", "microbatch_size", "seq", "steps", "warmup", "options")}
    precision = "bf16 autocast, fused AdamW, TF32 allowed" if cuda else "fp32, AdamW, 1 thread"
    path = write_results("executor_overhead", {"device": str(device), "backend": "nccl" if cuda else "gloo", "precision": precision,
                                               "settings": settings, "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
