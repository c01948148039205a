"""Settings for the whole suite.

Under pytest-xdist ``-n auto`` starts one test process more than the cores this process may use
(:func:`pytest_xdist_auto_num_workers`), and each computes with one thread, as each worker of its
multi-process runs does: more threads would only contend for the cores.

The multi-process runs start each worker by a fork of one server per test process
(:func:`pipeloom.runtime.local.worker_context`); the server imports what those workers need once,
rather than every worker on its own: the models, and for the ranks of ``pipeloom train`` its
command's modules. Then it freezes
its heap (tests/frozen_heap.py): a worker's garbage collections (``pipeloom train`` runs one
before it destroys its process group) no longer walk all of it, 0.4 s a rank.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

try:
    from pipeloom.runtime import local
except ImportError:  # no torch: the tests that need it skip themselves
    pass
else:
    local.PRELOAD += [module for module in ("pytest", "pipeloom.nn", "pipeloom.cli", "pipeloom.train",
                                            "frozen_heap") if module not in local.PRELOAD]


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the usable cores and one more (``PYTEST_XDIST_AUTO_NUM_WORKERS`` still rules).
    About a quarter of the suite's time is waiting (timeouts, heartbeats, signals, a launch), in
    which a test process per core leaves its core idle; one more takes it up. On 2 cores, run
    after run: 5:18 and 5:25 with 3 test processes, 5:46 and 5:50 with 2 (4 was slower than 2)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    from pipeloom.host import usable_cpus

    return usable_cpus() + 1
