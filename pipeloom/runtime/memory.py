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
    """This process's peak memory on ``device`` from now on (see the module docstring).
    On a CPU without /proc (not Linux) it measures nothing: :meth:`bytes` is None."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0
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

    def bytes(self) -> int | None:
        """The peak since this was made, in bytes; None where it cannot be measured."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return None if self.base is None else _status("VmHWM") - self.base

    def reserved(self) -> int | None:
        """On a GPU, the caching allocator's peak of reserved bytes since this was made: what the
        device really held, with blocks a side stream still used after they were freed (offload's
        copies); None on a CPU."""
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else None

    def per_pipeline_rank(self, pp_rank: int, pp: int, channel: Channel) -> dict[str, list[int]]:
        """Every rank's :meth:`bytes` (``peak_memory_bytes``) and on a GPU :meth:`reserved`
        (``peak_reserved_bytes``), the largest over the ranks of each pipeline rank (its data- and
        sequence-parallel replicas), gathered through ``channel`` (not watched, as between steps);
        every rank calls this, where it is :attr:`measurable`."""
        reserved = self.reserved()
        mine = torch.tensor([pp_rank, self.bytes(), -1 if reserved is None else reserved], dtype=torch.int64,
                            device=self.device)
        every = channel.all_gather(mine, dist.group.WORLD, "the memory report waited for every rank's peak",
                                   watch=False)
        peaks, held = [0] * pp, [0] * pp
        for rank, peak, most in (t.tolist() for t in every):
            peaks[rank], held[rank] = max(peaks[rank], peak), max(held[rank], most)
        return {"peak_memory_bytes": peaks, **({"peak_reserved_bytes": held} if reserved is not None else {})}
