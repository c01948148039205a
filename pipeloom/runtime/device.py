"""Which device a rank's stages run on: it follows the process group's backend.

NCCL sends CUDA tensors only and gloo's point-to-point sends host tensors
only, so the device is the backend's unless asked for explicitly: a GPU for
NCCL (torchrun's ``LOCAL_RANK`` picks it, as torchrun's own examples do), the
CPU for gloo, whatever else the machine has. A device the backend cannot
serve is refused in one line, and so are more NCCL ranks on a machine than it
has GPUs (NCCL refuses two ranks on one GPU with an "invalid usage" error that
reads like a dead peer).
"""

from __future__ import annotations

import os

import torch

from ..errors import PipeloomError
from ..host import available_memory

#: The device type each backend sends tensors of.
BACKEND_DEVICE = {"nccl": "cuda", "gloo": "cpu"}


def check_gpus(ranks: int) -> None:
    """NCCL needs a GPU of its own per rank: refuse ``ranks`` ranks on this machine
    when torch sees no GPU, or fewer GPUs than ranks."""
    if not torch.cuda.is_available():
        raise PipeloomError("device cuda: torch sees no CUDA device on this machine; use the CPU (gloo)")
    count = torch.cuda.device_count()
    if ranks > count:
        raise PipeloomError(f"device cuda: {ranks} ranks on this machine but {count} GPU{'s' * (count != 1)} "
                            f"visible; NCCL needs one GPU per rank: run at most {count} rank"
                            f"{'s' * (count != 1)} per machine, or use the CPU (gloo)")


def pipeline_device(device: str | torch.device | None, backend: str) -> torch.device:
    """The device of this rank's stages for a process group of ``backend``: ``device``
    if given (a CUDA device without an index is ``LOCAL_RANK``'s), else the backend's.
    Selects the GPU as the current CUDA device."""
    want = BACKEND_DEVICE.get(backend)
    try:
        device = torch.device(device if device is not None else want or "cpu")
    except (RuntimeError, TypeError):
        raise PipeloomError(f"device={device!r} is no device: give e.g. 'cpu', 'cuda' or 'cuda:0'") from None
    if want and device.type != want:
        raise PipeloomError(f"device {device.type} with the {backend} backend, which sends {want} tensors only; "
                            f"use the {'nccl' if device.type == 'cuda' else 'gloo'} backend for {device.type}, "
                            f"or device {want}")
    if device.type == "cuda":
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        check_gpus(local_ranks)
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        check_gpus(max(local_ranks, device.index + 1))
        torch.cuda.set_device(device)
    return device


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: a GPU's free memory, or the host's available memory; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()
