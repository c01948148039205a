"""``pipeloom train``, and scripts run under torchrun, for the tests whose subject is the training
or the script, not the launcher.

:func:`train_forked` runs the command's own code as the self-launched run does:
its checks before launch in this process, then one worker per rank as torchrun
starts them (its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...),
each ``pipeloom train`` with the same arguments. Only the launcher differs: the
workers are forked from a server that imported torch once
(:func:`pipeloom.runtime.local.worker_context`), not started by torchelastic as
fresh interpreters, which saves some 4 s a run. The launcher's own behaviour
(signals, a dead worker, exit codes) is tested through the real command.
:func:`script_forked` runs a script as ``torchrun --nproc-per-node N script`` would, its ranks
forked the same way.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from pipeloom.cli import main
from pipeloom.runtime.local import host_store, worker_context


def train_forked(*args, cwd, env=None, timeout=240) -> subprocess.CompletedProcess:
    """``pipeloom train args`` run in ``cwd``: its exit code, stdout and stderr (every rank's
    output after what came before launch, in rank order)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with (tempfile.TemporaryDirectory(prefix="pipeloom-test-") as logs,
          mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", **(env or {})}),
          mock.patch("pipeloom.launch.launch", launch := _Launch(Path(cwd), Path(logs), timeout, _train)),
          contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
        os.chdir(cwd)  # contextlib.chdir needs Python 3.11
        try:
            code = main(["train", *args])
        except SystemExit as stop:  # argparse's mistakes
            code = stop.code
        finally:
            os.chdir(here)
        for rank in range(launch.world):
            out.write((Path(logs) / f"{rank}.out").read_text())
            err.write((Path(logs) / f"{rank}.err").read_text())
    return subprocess.CompletedProcess(["pipeloom", "train", *args], code, out.getvalue(), err.getvalue())


def script_forked(script, nproc, *, cwd, env=None, timeout=120) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script`` run in ``cwd``: the first failing rank's exit
    code, and every rank's stdout and stderr, in rank order."""
    with (tempfile.TemporaryDirectory(prefix="pipeloom-test-") as logs,
          mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", **(env or {})})):
        code = _Launch(Path(cwd), Path(logs), timeout, _script)([str(script)], nproc)
        out, err = ("".join((Path(logs) / f"{rank}.{stream}").read_text() for rank in range(nproc))
                    for stream in ("out", "err"))
    return subprocess.CompletedProcess(["torchrun", "--nproc-per-node", str(nproc), str(script)], code, out, err)


def _train(argv: list[str]) -> int:
    return main(["train", *argv])


def _script(argv: list[str]) -> int:
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


class _Launch:
    """Stands in for :func:`pipeloom.launch.launch`: forks the ranks, each running
    ``entry(argv)`` as its exit code, and returns the first failing rank's exit code (0 if none
    failed); each rank's stdout and stderr go to files under ``logs``. Ranks still running after
    ``timeout`` seconds are killed."""

    def __init__(self, cwd: Path, logs: Path, timeout: float, entry):
        self.cwd, self.logs, self.timeout, self.entry, self.world = cwd, logs, timeout, entry, 0

    def __call__(self, argv: list[str], nproc: int) -> int:
        self.world = nproc
        ctx, store = worker_context(), host_store()  # torchrun's agent hosts it too
        procs = [ctx.Process(target=_rank, args=(rank, nproc, store.port, self.entry, argv, str(self.cwd), str(self.logs),
                                                dict(os.environ)))
                 for rank in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + self.timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return next((p.exitcode if p.exitcode > 0 else 128 - p.exitcode for p in procs if p.exitcode), 0)


def _rank(rank: int, world: int, port: int, entry, argv: list[str], cwd: str, logs: str, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    os.chdir(cwd)
    for fd, stream in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{logs}/{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    sys.exit(entry(argv))  # multiprocessing flushes both streams
