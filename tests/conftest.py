"""Settings for the whole suite.

Under pytest-xdist (``-n auto``: a test process per core) each test process computes with one
thread, as each worker of its multi-process runs does: more would only contend for the cores.

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
