"""Stopping a training run cleanly: SIGINT, SIGTERM, SIGHUP and the launcher's death.

Each becomes a request that :class:`StopRequest` holds; the ranks agree on it at a
step boundary (one all-reduce), so every rank stops after the same step and
nothing is left mid-step: no traceback, and the peers are never left waiting. A
worker whose parent (the launcher, or torchrun's agent) died stops at the next
step boundary as well, and exits regardless after :data:`ORPHAN_GRACE` seconds.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from .p2p import Channel

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ORPHAN = 256  # the request made when the parent died: above every signal number
ORPHAN_GRACE = 10.0  # seconds an orphaned worker has to stop at a step boundary
POLL = 1.0  # seconds between looks at the parent


class StopRequest:
    """This process's request to stop: the number of a signal received, or :data:`ORPHAN`."""

    def __init__(self):
        self.code = 0
        self.parent = os.getppid()
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        self._stopped = threading.Event()
        threading.Thread(target=self._watch_parent, daemon=True, name="pipeloom-parent-watch").start()

    def _on_signal(self, signum, frame) -> None:
        self.code = max(self.code, signum)

    def _watch_parent(self) -> None:
        while not self._stopped.wait(POLL):
            if os.getppid() != self.parent:
                self.code = ORPHAN
                if not self._stopped.wait(ORPHAN_GRACE):
                    os._exit(128 + signal.SIGHUP)
                return

    def agreed(self, device: torch.device, channel: Channel, step: int) -> int:
        """What every rank requested before ``step`` (1-based), combined (the highest: SIGTERM over
        SIGINT, the launcher's death over both); 0 to go on. A collective over every rank, waited
        for through ``channel`` (not watched: see :meth:`~.p2p.Channel.wait`)."""
        code = torch.tensor([self.code], dtype=torch.int32, device=device)
        channel.all_reduce(code, dist.group.WORLD, f"the start of step {step} waited for the stop requests",
                           op=dist.ReduceOp.MAX, watch=False)
        return int(code.item())

    def close(self) -> None:
        """Stop watching the parent (the run is over)."""
        self._stopped.set()

    @staticmethod
    def describe(code: int) -> str:
        """Why the run stopped, to follow "stopped": "by SIGINT", "because the launcher died"."""
        return "because the launcher died" if code == ORPHAN else f"by {signal.Signals(code).name}"

    @staticmethod
    def exit_code(code: int) -> int:
        """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (signal.SIGHUP if code == ORPHAN else code)
