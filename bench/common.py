"""Shared by the benchmarks: where results go and which machine made them."""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent


def machine() -> dict:
    """Facts about the machine a benchmark ran on."""
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_results(name: str, results: dict, path: str | None = None) -> Path:
    """Write ``results`` with the machine facts and a timestamp as JSON; return the path."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **results}
    out.write_text(json.dumps(payload, indent=2) + "\n")
    return out


def added_peak(fn) -> tuple[int, float]:
    """(bytes of resident memory ``fn()`` added at its peak, seconds it took), by
    :class:`pipeloom.runtime.memory.PeakMemory` on the CPU. Set ``MALLOC_MMAP_THRESHOLD_=65536``
    before the process starts so that resident memory follows the live tensors."""
    import torch

    from pipeloom.runtime.memory import PeakMemory

    gc.collect()
    peak = PeakMemory(torch.device("cpu"))
    start = time.perf_counter()
    fn()
    return peak.bytes(), time.perf_counter() - start


def one_rank_group(cuda: bool):
    """A process group of this process alone (NCCL on the GPU, gloo and one thread on the CPU), TF32 on
    for the GPU: ``(device, autocast dtype or None)`` for a pp 1 pipeline."""
    import torch
    import torch.distributed as dist

    if not cuda:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not cuda:
        return torch.device("cpu"), None
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return torch.device("cuda", 0), torch.bfloat16


def train_model(name: str):
    """The preset ``name`` with the vocabulary of ``pipeloom train``'s default data (the Python standard
    library's sources, bytes): the model ``pipeloom train --model NAME --vocab 256`` builds."""
    from dataclasses import replace

    from pipeloom.data import load_data
    from pipeloom.sim.model import get_model

    return replace(get_model(name), vocab=load_data(None).vocab_size)


def profile_train_model(name: str, seq: int, path: Path, env: dict) -> None:
    """Write ``pipeloom profile`` of :func:`train_model` ``name`` on this CPU at microbatches of 1, 2 and 4."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "pipeloom", "profile", "--model", name, "--vocab",
                    str(train_model(name).vocab), "--seq", str(seq), "--microbatch-sizes", "1,2,4", "--device", "cpu",
                    "--out", str(path)], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
