"""Run a function on N gloo processes on localhost and collect what each returns."""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results.put((rank, True, fn(rank, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: float = 120.0) -> list:
    """Run ``fn(rank, *args)`` on ``world`` processes; return their results by rank.

    Raises if a worker fails (with its traceback) or the group outlives ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"worker {rank} failed:\n{value}")
            out[rank] = value
    except queue_module.Empty:
        raise AssertionError(f"workers {sorted(set(range(world)) - set(out))} did not finish in {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
