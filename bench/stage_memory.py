"""Each rank builds only its own stages: peak resident memory per rank against the whole model's weights.

    python bench/stage_memory.py [--model gpt-1.3b] [--pp 4] [--out FILE]

``pp`` gloo processes on the CPU (one thread each) cut a GPT preset into
``pp`` stages, one per rank, three ways, each in fresh processes:

- ``build_stages``: the model described on the meta device
  (``GPT(config, device="meta")``), then ``GPT.build_stages`` materialises
  this rank's stage only;
- ``pipeline``: the same meta model given to ``pipeloom.Pipeline`` (1F1B),
  which builds this rank's stages the same way;
- ``full_model_every_rank``: the way before, every rank building the whole
  model (same seed) and keeping its stage (``split``, the other stages'
  weights released). The ranks build in turn, so that ``pp`` whole models
  need not fit in memory at once; each rank's peak is its own all the same.

Per rank it records the peak resident memory (``ru_maxrss`` of
``resource.getrusage``), the one before building (torch and the process
group), the peak and what building added as fractions of the whole model's
parameter bytes (fp32), and the seconds its own building took (on the meta
device: describing the model and materialising the stage; before: building
the whole model and cutting it). Every rank's stage must hold the same
weights whichever way it was built (else exit 1). Writes
bench/results/stage_memory.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

WAYS = ("build_stages", "pipeline", "full_model_every_rank")


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank, way, model_name, pp):
    import torch
    import torch.distributed as dist

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset(model_name)
    GPT(GPTConfig.preset("tiny"), device="meta")  # the first model on meta loads torch's meta kernels: not timed
    before = _peak_rss()
    torch.manual_seed(0)
    if way == "full_model_every_rank":
        for turn in range(pp):
            if turn == rank:
                start = time.perf_counter()
                model = GPT(config)
                stage = model.split(pp)[rank]
                kept = {id(p) for p in stage.parameters()}
                for p in model.parameters():
                    if id(p) not in kept:
                        p.data = torch.empty(0)
                params, seconds = list(stage.parameters()), time.perf_counter() - start
            dist.barrier()
    else:
        start = time.perf_counter()
        if way == "build_stages":
            (stage,) = GPT(config, device="meta").build_stages(pp, [rank]).values()
            params = list(stage.parameters())
        else:
            pipe = pipeloom.Pipeline(GPT(config, device="meta"), schedule="1f1b", pp=pp, microbatches=pp)
            params = pipe.parameters()
        seconds = time.perf_counter() - start
    peak = _peak_rss()
    return {"baseline_rss_bytes": before, "peak_rss_bytes": peak, "build_s": seconds,
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
            "checksum": sum(p.detach().sum(dtype=torch.float64).item() for p in params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-1.3b")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--out")
    args = parser.parse_args()
    from pipeloom.nn import GPT, GPTConfig

    full = sum(p.numel() * p.element_size() for p in GPT(GPTConfig.preset(args.model), device="meta").parameters())
    # glibc: every block above 64 KiB gets its own mapping, returned to the system when freed, so
    # that the released stages leave resident memory (the workers inherit it)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    mb = 2**20
    runs = {}
    for way in WAYS:
        ranks = spawn(args.pp, _worker, way, args.model, args.pp, timeout=3600, group_timeout=1800)
        runs[way] = {
            "peak_rss_mb": [round(r["peak_rss_bytes"] / mb, 1) for r in ranks],
            "baseline_rss_mb": [round(r["baseline_rss_bytes"] / mb, 1) for r in ranks],
            "peak_rss_over_full_model": [round(r["peak_rss_bytes"] / full, 3) for r in ranks],
            "added_rss_over_full_model": [round((r["peak_rss_bytes"] - r["baseline_rss_bytes"]) / full, 3)
                                          for r in ranks],
            "parameter_mb": [round(r["parameter_bytes"] / mb, 1) for r in ranks],
            "build_s": [round(r["build_s"], 1) for r in ranks],
            "checksums": [r["checksum"] for r in ranks],
        }
        row = runs[way]
        print(f"{way:<22} peak RSS per rank {row['peak_rss_mb']} MB (before building {row['baseline_rss_mb']} MB; "
              f"added x{row['added_rss_over_full_model']} of the whole model's {full / mb:.0f} MB), weights held "
              f"{row['parameter_mb']} MB, built in {row['build_s']} s", flush=True)
    sums = {way: runs[way].pop("checksums") for way in WAYS}
    if any(sums[way] != sums[WAYS[-1]] for way in WAYS):
        print(f"the ways built different weights (checksums per rank): {sums}")
        sys.exit(1)
    out = write_results("stage_memory", {
        "config": {"model": args.model, "pp": args.pp, "processes": args.pp, "threads": 1, "backend": "gloo",
                   "device": "cpu", "dtype": "float32", "schedule": "1f1b (pipeline)"},
        "full_model_parameter_mb": round(full / mb, 1),
        "runs": runs,
    }, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
