"""Run a function on N gloo processes on localhost, one thread each, for the benchmarks."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        results.put((rank, None, fn(rank, *args)))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: float = 1800.0) -> list:
    """Run ``fn(rank, *args)`` on ``world`` processes; return their results by rank.

    Raises RuntimeError with the worker's traceback if one fails, or if they outlive ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world):
            rank, error, value = results.get(timeout=timeout)
            if error:
                raise RuntimeError(f"worker {rank} failed:\n{error}")
            out[rank] = value
    except queue.Empty:
        raise RuntimeError(f"workers {sorted(set(range(world)) - set(out))} did not finish in {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
