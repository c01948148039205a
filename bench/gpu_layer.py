"""One GPT layer's F, B and W on a CUDA device: times, achieved TFLOP/s, and the B/W split at work.

    python bench/gpu_layer.py [--dtype bf16] [--repeats 20]
    python bench/gpu_layer.py --device cpu --shapes tiny   # a check that the script runs, on the CPU

For the zero-bubble paper's 1.5B (h 2304, 24 heads, s 1024, b 6) and 6.2B
(h 4096, 32 heads, s 1024, b 3) layers and the ``gpt-1.3b`` preset's layer
(h 2048, 16 heads, s 1024, b 4): the forward of pipeloom's ``Block`` (F),
its backward under ``defer_weight_grads`` (B: input gradients, the weight
gradients queued), the queued work (W), and the fused backward (BW) for
comparison; median of CUDA-event times over ``--repeats``. Achieved TFLOP/s
use the simulator's FLOP formulas (:func:`pipeloom.sim.layer_flops`), and
``preset_ratio`` is measured / predicted by the device preset named by
``--preset`` (``h100`` by default). With the B/W split working, B is close to
BW − W and W is far from zero. Without a CUDA device (and without
``--device cpu``) it says so and exits 0, writing nothing. Writes
bench/results/gpu_layer.json (or ``--out``). Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from pipeloom.nn import GPTConfig, WeightGradStore, defer_weight_grads
from pipeloom.nn.gpt import Block
from pipeloom.runtime.profile import Timer
from pipeloom.sim import ModelSpec, get_device, layer_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

#: name -> (hidden, heads, seq, microbatch size)
SHAPES = {
    "zb-1.5b": (2304, 24, 1024, 6),
    "zb-6.2b": (4096, 32, 1024, 3),
    "gpt-1.3b": (2048, 16, 1024, 4),
    "tiny": (64, 4, 32, 2),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure(name: str, args, device, dtype) -> dict:
    hidden, heads, seq, batch = SHAPES[name]
    config = GPTConfig(n_layer=1, n_embd=hidden, n_head=heads, vocab_size=8, block_size=seq)
    torch.manual_seed(0)
    block = Block(config).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    timer = Timer(device)
    times = {"f": [], "b": [], "w": [], "bw": []}
    queued = 0
    for k in range(args.warmup + args.repeats):
        out = {}
        f = timer(lambda: out.setdefault("y", block(x)))
        store = WeightGradStore()

        def backward():
            with defer_weight_grads(store):
                out["y"].backward(grad)

        b = timer(backward)
        queued = len(store.work)
        w = timer(store.run)
        y = block(x)
        bw = timer(lambda: y.backward(grad))
        block.zero_grad(set_to_none=True)
        x.grad = None
        if k >= args.warmup:
            for key, value in zip("f b w bw".split(), (f, b, w, bw)):
                times[key].append(value)
    ms = {key: statistics.median(values) for key, values in times.items()}
    spec = ModelSpec(name, 1, hidden, heads, 8)
    flops = dict(zip("fbw", layer_flops(spec, seq, batch)))
    flops["bw"] = flops["b"] + flops["w"]
    preset = get_device(args.preset)
    return {
        "shape": {"hidden": hidden, "heads": heads, "seq": seq, "microbatch_size": batch},
        "ms": {key: round(value, 4) for key, value in ms.items()},
        "tflops": {key: round(flops[key] / ms[key] / 1e9, 1) for key in ms},
        "preset_ratio": {key: round(ms[key] / preset.ms(flops[key]), 3) for key in "fbw"},
        "weight_grads_queued_by_b": queued,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["zb-1.5b", "zb-6.2b", "gpt-1.3b"], choices=list(SHAPES))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (only to check the script)")
    parser.add_argument("--preset", help="the device preset to compare with (default h100; cpu with --device cpu)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (for --dtype fp32)")
    parser.add_argument("--out", help="where to write the JSON (default bench/results/gpu_layer.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.preset = args.preset or ("h100" if device.type == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_layer: no CUDA device here; skipped (nothing written)")
        return
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    results = {}
    for name in args.shapes:
        r = results[name] = measure(name, args, device, DTYPES[args.dtype])
        print(f"{name:9} F {r['ms']['f']:7.3f}  B {r['ms']['b']:7.3f}  W {r['ms']['w']:7.3f}  BW {r['ms']['bw']:7.3f} ms"
              f"   TFLOP/s F {r['tflops']['f']:6.1f}  B {r['tflops']['b']:6.1f}  W {r['tflops']['w']:6.1f}"
              f"   / {args.preset} preset: F {r['preset_ratio']['f']:.2f}  B {r['preset_ratio']['b']:.2f}"
              f"  W {r['preset_ratio']['w']:.2f}   ({r['weight_grads_queued_by_b']} weight grads queued by B)")
    if device.type == "cpu" and not args.out:
        print("(a CPU check: nothing written; give --out to keep it)")
        return
    path = write_results("gpu_layer", {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                       "dtype": args.dtype, "tf32": args.tf32, "repeats": args.repeats,
                                       "preset": args.preset, "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
