"""Start ``pipeloom train``'s worker processes on this machine with torchrun's launcher API.

Each worker runs ``python -m pipeloom train`` with the same arguments under
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so a
self-launched run and one started by hand with torchrun take the same path.
Workers share this terminal. If one fails, the launcher stops the others and
this returns the failing worker's exit code, after the workers' own messages.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .runtime.local import free_port

#: Seconds between the launcher's looks at its workers: the time a survivor has
#: to say what it waited for after a peer died, before the launcher stops it.
MONITOR_INTERVAL = 2.0


def launch(argv: list[str], nproc: int) -> int:
    """Run ``pipeloom train argv`` on ``nproc`` local worker processes; the exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipeloom-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=MONITOR_INTERVAL, start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "pipeloom", "train", *argv)
    except ChildFailedError as err:
        failed = sorted(err.failures.items())
        said = "; ".join(f"rank {rank} " + (f"died of {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}")
                         for rank, f in failed)
        print(f"pipeloom train: stopped: {said}", file=sys.stderr)
        return max(1, max(f.exitcode for _, f in failed))
    return 0
