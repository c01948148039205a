"""When each action of a step ran: the host clock on the CPU, CUDA events on a GPU.

On a GPU the host only launches the work, so host times would measure
launches (a W of a dozen GEMMs would look instant). Events recorded on the
current stream around each action time the work itself, with no host sync:
they are read after the step's own sync, when its loss is read.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """Marks points in one step and turns them into seconds from its start."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wall_start = time.time()  # aligns the ranks' timelines (one clock per host)
        self.host_start = time.perf_counter()
        self.origin = self.mark() if self.cuda else None

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
