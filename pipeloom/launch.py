"""Start ``pipeloom train``'s worker processes on this machine with torchrun's launcher API.

Each worker runs ``python -m pipeloom train`` with the same arguments under
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), so a
self-launched run and one started by hand with torchrun take the same path.
Workers share this terminal. If one fails, the launcher stops the others and
this returns the failing worker's exit code (128 + the signal that killed it; a
worker the launcher stopped is not counted as failing), after the workers' own
messages (each worker says why it stopped; the launcher speaks only for one
that died of a signal). SIGINT, SIGTERM and SIGHUP reach the launcher, which passes
them on: the workers stop after the same step
(:mod:`pipeloom.runtime.interrupt`) within :data:`SHUTDOWN_TIMEOUT` seconds,
and this returns 128 + the signal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import uuid

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

#: Seconds between the launcher's looks at its workers: the time a survivor has
#: to say what it waited for after a peer died, before the launcher stops it.
MONITOR_INTERVAL = 2.0
#: Seconds the workers have, after a signal, to finish their step (and on SIGTERM save a
#: checkpoint) before the launcher kills them.
SHUTDOWN_TIMEOUT = 120
#: Exit codes a worker uses after saying why itself: an error, or 128 + a signal it honoured.
SAID = {1, 2, 129, 130, 143}


def launch(argv: list[str], nproc: int) -> int:
    """Run ``pipeloom train argv`` on ``nproc`` local worker processes; the exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT))  # torch < 2.10: 30 s, fixed
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # each has a level of its own: set them all
    with tempfile.TemporaryDirectory(prefix="pipeloom-launch-") as logs:  # torchelastic's, removed after
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"pipeloom-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,  # as torchrun --standalone
            monitor_interval=MONITOR_INTERVAL, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        try:
            elastic_launch(config, sys.executable)("-m", "pipeloom", "train", *argv)
        except SignalException as err:  # the workers got the signal too, and said where they stopped
            return 128 + int(err.sigval)
        except ChildFailedError as err:
            return exit_code(err.failures)
    return 0


def exit_code(failures: dict) -> int:
    """The run's exit code from the failed workers (rank -> torchelastic's ``ProcessFailure``), after
    a line for those that did not say why they stopped. A worker that died of SIGTERM while another
    failed otherwise (exited with an error, died of another signal) was the launcher stopping the
    rest: neither counted nor reported; one killed first gives 128 + its signal (SIGKILL: 137)."""
    failed = sorted(failures.items())
    if any(f.exitcode != -signal.SIGTERM for _, f in failed):
        failed = [(rank, f) for rank, f in failed if f.exitcode != -signal.SIGTERM]
    unsaid = [(rank, f) for rank, f in failed if f.exitcode not in SAID]
    if unsaid:
        said = "; ".join(f"rank {rank} " + (f"died of {f.signal_name()}" if f.exitcode < 0
                                            else f"exited with code {f.exitcode}") for rank, f in unsaid)
        print(f"pipeloom train: stopped: {said}", file=sys.stderr)
    return max(f.exitcode if f.exitcode > 0 else 128 - f.exitcode for _, f in failed)
