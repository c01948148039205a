"""Whether a run fits the memory where it runs: the simulator's peak per rank (what ``--dry-run``
shows) against the host's available memory (CPU: the ranks share it) or each GPU's free memory,
checked before any worker starts."""

from __future__ import annotations

from ..errors import PipeloomError
from ..spec import RunSpec

#: What a CPU worker holds beside its model: Python, torch, gloo's buffers (about 0.25 GiB measured
#: after importing torch, rounded up).
PROCESS_BYTES = 2**29
_GiB = 2**30


def check_fits(spec: RunSpec, available: int | None, predicted: dict | None = None) -> None:
    """Refuse ``spec`` in one line when its predicted memory exceeds ``available`` bytes (host
    memory for every rank on ``cpu``; the smallest GPU's free memory, per rank, on ``cuda``),
    naming the prediction and the nearest run that would fit."""
    if available is None:
        return
    need, detail = _need(spec, predicted)
    if need <= available:
        return
    where = "this machine has" if spec.device == "cpu" else "the GPU with the least free memory has"
    needs = ((changes, _need(spec.replace(**changes).check())[0]) for changes in _alternatives(spec))
    fits, less = next(((changes, need) for changes, need in needs if need <= available), (None, None))
    if fits:
        hint = "; " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in fits.items()) + \
            f" would need {less / _GiB:.3g} GiB"
    else:
        hint = "; neither recomputation nor a smaller microbatch fits: " + (
            "the ranks share this machine's memory, so use a smaller --model" if spec.device == "cpu" else
            "use more stages (--pp) or a smaller --model")
    raise PipeloomError(f"the run needs about {need / _GiB:.3g} GiB ({detail}); {where} {available / _GiB:.3g} GiB "
                        f"available{hint}; --no-memory-check starts it anyway")


def _need(spec: RunSpec, predicted: dict | None = None) -> tuple[float, str]:
    """(bytes the run needs where it is checked, how they add up), from ``spec``'s simulated report
    (``predicted``, else simulated here)."""
    from ..cli.simulate import simulate_spec

    peaks = (predicted or simulate_spec(spec)[0])["peak_memory_bytes"]
    shown = ", ".join(f"{p / _GiB:.3g}" for p in peaks)
    if spec.device == "cuda":
        return max(peaks), f"predicted peak per pipeline rank {shown} GiB"
    replicas = spec.world // len(peaks)
    need = replicas * (sum(peaks) + len(peaks) * PROCESS_BYTES)
    return need, (f"predicted peak per pipeline rank {shown} GiB, and {PROCESS_BYTES / _GiB:.2g} GiB per process"
                  + (f", for {replicas} replicas" if replicas > 1 else ""))


def _alternatives(spec: RunSpec):
    """Runs nearby that need less, the least change first: recomputation, then smaller microbatches."""
    recompute = {} if spec.recompute == "full" else {"recompute": "full"}
    if recompute:
        yield recompute
    size = spec.microbatch_size // 2
    while size >= 1:
        yield {**recompute, "microbatch_size": size}
        size //= 2


def available_memory(device: str, ranks: int) -> int | None:
    """The memory the check compares with: the host's available memory (``cpu``, read without
    torch), or the least free memory of the first ``ranks`` GPUs (``cuda``); None if unknown."""
    from .. import host

    if device == "cpu":
        return host.available_memory()
    import torch

    from ..runtime.device import free_memory

    return min(free_memory(torch.device("cuda", i)) for i in range(min(ranks, torch.cuda.device_count())))
