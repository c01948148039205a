"""What a rank's run holds at its peak, measured, to set beside the simulator's ``peak_memory_bytes``.

On a GPU it is the caching allocator's peak of allocated bytes
(``torch.cuda.max_memory_allocated``), which is what the memory model
predicts; on the CPU (Linux), the process's peak resident set (``VmHWM``,
reset through ``/proc/self/clear_refs`` when measuring begins) above its
resident set then, so that the interpreter, torch and the process group are
left out. The CPU figure also holds what the C allocator keeps after a free,
and the pages of torch's own code and buffers a run first touches (about 90
MiB for a training step of any model): start the process with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc maps every larger block on its
own and gives it back when freed, and resident memory follows the live tensors.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from .p2p import Channel

_STATUS = Path("/proc/self/status")
_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status(field: str) -> int:
    """A memory field of /proc/self/status, in bytes."""
    line = next(x for x in _STATUS.read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def allocated_bytes(device: torch.device) -> int | None:
    """What this process holds now, as :class:`PeakMemory` counts it: on a GPU the caching allocator's
    allocated bytes, on a CPU (Linux) the resident set; None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        return int(_STATM.read_text().split()[1]) * _PAGE
    except OSError:
        return None


class PeakMemory:
    """This process's peak memory on ``device`` from now on (see the module docstring), and the
    peak of a stretch of it (:meth:`restart`, :meth:`stretch`: one step's, above its start).
    On a CPU without /proc (not Linux) it measures nothing: :meth:`bytes` is None."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0
        self._before = self._held_before = 0  # the peaks before the latest restart
        self._start = 0  # what was held at the latest restart
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = _status("VmRSS")
        except OSError:
            self.base = None

    @property
    def measurable(self) -> bool:
        return self.base is not None

    def _peak(self) -> int:
        """The peak since the latest reset, as :meth:`bytes` counts it."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _status("VmHWM") - self.base

    def bytes(self) -> int | None:
        """The peak since this was made, in bytes; None where it cannot be measured."""
        return None if self.base is None else max(self._before, self._peak())

    def reserved(self) -> int | None:
        """On a GPU, the caching allocator's peak of reserved bytes since this was made: what the
        device really held, with blocks a side stream still used after they were freed (offload's
        copies); None on a CPU."""
        if self.device.type != "cuda":
            return None
        return max(self._held_before, torch.cuda.max_memory_reserved(self.device))

    def restart(self) -> None:
        """Begin a stretch (:meth:`stretch`): the peaks reset from what is held now, the run's kept
        for :meth:`bytes` and :meth:`reserved`. Where :attr:`measurable`."""
        self._before, self._held_before = self.bytes(), self.reserved() or 0
        if self.device.type == "cuda":
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._start = _status("VmRSS") - self.base

    def stretch(self) -> int:
        """The most held above the stretch's start since :meth:`restart`, in bytes."""
        return self._peak() - self._start

    def per_pipeline_rank(self, pp_rank: int, pp: int, channel: Channel, stretch: bool = False) -> dict[str, list[int]]:
        """Every rank's :meth:`bytes` (``peak_memory_bytes``), on a GPU :meth:`reserved`
        (``peak_reserved_bytes``) and with ``stretch`` :meth:`stretch` (``stretch_bytes``), the
        largest over the ranks of each pipeline rank (its data- and sequence-parallel replicas),
        gathered through ``channel`` (not watched, as between steps); every rank calls this, where
        it is :attr:`measurable`."""
        reserved = self.reserved()
        figures = {"peak_memory_bytes": self.bytes(), "peak_reserved_bytes": reserved,
                   "stretch_bytes": self.stretch() if stretch else None}
        names = [name for name, value in figures.items() if value is not None]
        mine = torch.tensor([pp_rank, *(figures[name] for name in names)], dtype=torch.int64, device=self.device)
        every = channel.all_gather(mine, dist.group.WORLD, "the memory report waited for every rank's peak",
                                   watch=False)
        most = {name: [0] * pp for name in names}
        for rank, *values in (t.tolist() for t in every):
            for name, value in zip(names, values):
                most[name][rank] = max(most[name][rank], value)
        return most
