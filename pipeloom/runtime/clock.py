"""When each action of a step ran: the host clock on the CPU, CUDA events on a GPU.

On a GPU the host only launches the work, so host times would measure
launches (a W of a dozen GEMMs would look instant). Events recorded on the
current stream around each action time the work itself, with no host sync:
they are read after the step's own sync, when its loss is read. Memory levels,
where asked, are read on the host after each action is launched.
"""

from __future__ import annotations

import time

import torch

from .memory import allocated_bytes


class StepClock:
    """Marks points in one step and turns them into seconds from its start; with ``memory``, also
    reads the memory the process holds above its level at the start (:meth:`level`)."""

    def __init__(self, device: torch.device, memory: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.base = allocated_bytes(device) if memory else None
        self.wall_start = time.time()  # aligns the ranks' timelines (one clock per host)
        self.host_start = time.perf_counter()
        self.origin = self.mark() if self.cuda else None

    @property
    def memory(self) -> bool:
        """Whether :meth:`level` reads anything (asked, and readable here)."""
        return self.base is not None

    def level(self) -> int:
        """Bytes held now above the step's start (:func:`~.memory.allocated_bytes`): on a GPU those of
        the work launched so far, which the allocator counts in launch order."""
        return allocated_bytes(self.device) - self.base

    def mark(self):
        """Now: a host time, or an event recorded on the current CUDA stream."""
        if not self.cuda:
            return time.perf_counter() - self.host_start
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """Seconds from the start of the step to ``mark`` (a GPU mark: once its work is done)."""
        if not self.cuda:
            return mark
        mark.synchronize()
        return self.origin.elapsed_time(mark) / 1e3
