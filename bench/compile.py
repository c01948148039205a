"""Compiled stages against eager ones: tokens/s of ``Pipeline(compile=True)`` and of the same pipeline eager.

    python bench/compile.py                                   # the CPU: tiny and llama-tiny at n_embd 128
    python bench/compile.py --device cuda                     # a GPU: gpt-125m (seq 1024) and llama-1b (seq 2048)
    python bench/compile.py --models gpt-125m --families zb-h1 --steps 30

One rank at pp 1 (a process group of one: NCCL on a GPU, gloo on the CPU),
``--microbatches`` microbatches per step. For each model and family, an
eager and a compiled pipeline of the same weights train side by side with
AdamW, alternating step by step after a warm-up (the first compiled steps
compile: their time is reported apart), so a drifting machine affects both
alike; zb-h1 runs the B/W split, 1f1b the fused backward. On CUDA: bf16
autocast, fused AdamW, TF32 allowed; on the CPU: fp32, AdamW, one thread.
Writes bench/results/compile.json (``compile_cuda.json`` on a GPU, or
``--out``) with the median step times, tokens/s and speed-up = eager time /
compiled time per model and family (goal on a GPU: >= 1.2). Asserts nothing
about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pipeloom
from pipeloom.nn import preset_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import one_rank_group, write_results  # noqa: E402

#: Per device: the models measured by default and each one's sequence length, and the width the CPU's run at.
DEFAULTS = {"cuda": {"gpt-125m": 1024, "llama-1b": 2048}, "cpu": {"tiny": 128, "llama-tiny": 128}}
CPU_WIDTH = 128


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, family: str, seq: int, args, device, autocast) -> dict:
    """An eager and a compiled pipeline of model ``name`` and ``family`` trained side by side."""
    overrides = {"n_embd": args.n_embd} if args.n_embd else {}
    config = preset_config(name, **overrides)
    sides = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(config.build("meta"), family, pp=1, microbatches=args.microbatches,
                                 autocast=autocast, device=device, compile=compiled)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4, fused=device.type == "cuda")
        sides["compiled" if compiled else "eager"] = pipe, optimizer
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (args.microbatches * args.microbatch_size, seq + 1), generator=g)
    tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    times = {label: [] for label in sides}
    for k in range(args.warmup + args.steps):
        for label, (pipe, optimizer) in sides.items():
            _sync(device)
            start = time.perf_counter()
            pipe.step(tokens, targets)
            pipe.optimizer_step(optimizer, max_norm=None)
            _sync(device)
            times[label].append(time.perf_counter() - start)
    eager, compiled = (statistics.median(times[label][args.warmup:]) for label in ("eager", "compiled"))
    return {
        "model": name, "family": family, "seq": seq, "n_embd": config.n_embd, "tokens_per_step": tokens.numel(),
        "eager_ms": round(1e3 * eager, 3), "compiled_ms": round(1e3 * compiled, 3),
        "eager_tokens_per_s": round(tokens.numel() / eager), "compiled_tokens_per_s": round(tokens.numel() / compiled),
        "speedup": round(eager / compiled, 4),
        "first_compiled_step_s": round(times["compiled"][0], 2),
        "step_times_ms": {label: [round(1e3 * t, 3) for t in ts[args.warmup:]] for label, ts in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", nargs="+", help="presets (default: gpt-125m llama-1b on cuda, tiny llama-tiny on cpu)")
    parser.add_argument("--families", nargs="+", default=["1f1b", "zb-h1"])
    parser.add_argument("--n-embd", type=int, help=f"the models' width (default: the presets'; on cpu {CPU_WIDTH})")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default: per model, see DEFAULTS)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, help="sequences per microbatch (default 4 on cuda, 8 on cpu)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="where to write the JSON (default bench/results/compile[_cuda].json)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.microbatch_size = args.microbatch_size or (4 if cuda else 8)
    if not cuda and args.n_embd is None and args.models is None:
        args.n_embd = CPU_WIDTH
    models = {name: args.seq or DEFAULTS[args.device].get(name, 128) for name in args.models or DEFAULTS[args.device]}

    device, autocast = one_rank_group(cuda)
    results = []
    try:
        for name, seq in models.items():
            for family in args.families:
                r = measure(name, family, seq, args, device, autocast)
                print(f"{name} {family} seq {seq}: eager {r['eager_tokens_per_s']} tokens/s, compiled "
                      f"{r['compiled_tokens_per_s']} ({r['speedup']:.3f}x; first compiled step "
                      f"{r['first_compiled_step_s']} s)", flush=True)
                results.append(r)
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    settings = {k: getattr(args, k) for k in ("microbatches", "microbatch_size", "steps", "warmup")}
    precision = "bf16 autocast, fused AdamW, TF32 allowed" if cuda else "fp32, AdamW, 1 thread"
    path = write_results("compile", {"device": str(device), "backend": "nccl" if cuda else "gloo", "precision": precision,
                                     "settings": settings, "results": results},
                         args.out or (Path(__file__).resolve().parent / "results" / "compile_cuda.json" if cuda else None))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
