"""Run a function on N gloo processes on this machine: for tests, benchmarks and notebooks.

Each worker gets one thread (``OMP_NUM_THREADS=1``), a process group with a
timeout on a store the caller hosts, and returns ``fn(rank, *args)``; a
worker's failure comes back with its traceback, and a group that outlives
its timeout is killed rather than left hanging. Workers are forked from a
server that has imported torch once (a start takes ~0.05 s, not the ~2 s of
a fresh interpreter), with the caller's environment and directory.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def host_store(timeout: float = 120.0) -> dist.TCPStore:
    """A TCP store hosted by this process on a localhost port the OS picks as it binds it: unlike a port
    looked up first and bound later, no other process can take it in between. Workers join it as
    clients (``dist.TCPStore("127.0.0.1", store.port, is_master=False)``, or torchrun's
    ``TORCHELASTIC_USE_AGENT_STORE``); it lives as long as this object."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)


#: What the fork server imports once, before it forks any worker.
PRELOAD = ["torch", "torch.distributed", "pipeloom.runtime"]


def worker_context():
    """Forks from a server that has imported :data:`PRELOAD`; spawn where there is no fork."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank, world, port, fn, args, results, group_timeout, env, cwd):
    os.environ.clear()  # the caller's, as of now: the server's is that of when it started
    os.environ.update(env, OMP_NUM_THREADS="1")
    os.chdir(cwd)
    import torch

    torch.set_num_threads(1)
    timeout = timedelta(seconds=group_timeout)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        # plain pickle: tensors travel as bytes, not as shared memory that dies with the worker
        value = pickle.dumps(fn(rank, *args))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    else:
        results.put((rank, None, value))
        try:
            dist.barrier()  # no rank tears the group down while a peer still talks to it
        except RuntimeError:
            pass  # a group that a failure test broke on purpose cannot synchronise any more
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: float = 600.0, group_timeout: float = 120.0) -> list:
    """Run ``fn(rank, *args)`` (a picklable, module-level function) on ``world``
    processes; return what each returned, by rank.

    Raises ``RuntimeError`` with the worker's traceback if one fails, as soon as a
    worker exits without returning (it died: a signal, or a start-up that failed),
    or if the workers outlive ``timeout`` seconds (they are killed).
    """
    ctx = worker_context()
    results, store = ctx.Queue(), host_store(group_timeout)
    procs = [ctx.Process(target=_entry, args=(r, world, store.port, fn, args, results, group_timeout, dict(os.environ),
                                              os.getcwd()), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline, gone = time.monotonic() + timeout, None
    try:
        while len(out) < world:
            try:
                rank, error, value = results.get(timeout=0.5 if gone is None else 2.0)
            except queue.Empty:
                if gone is not None:  # its result, had it sent one, would have come by now
                    raise RuntimeError(f"worker {gone} exited with code {procs[gone].exitcode} before it returned "
                                       "(its output above says why)") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"workers {sorted(set(range(world)) - set(out))} did not finish in "
                                       f"{timeout:g} s") from None
                gone = next((r for r, p in enumerate(procs) if r not in out and p.exitcode is not None), None)
                continue
            if error:
                raise RuntimeError(f"worker {rank} failed:\n{error}")
            out[rank] = pickle.loads(value)
            gone = None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
