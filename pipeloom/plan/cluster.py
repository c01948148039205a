"""The machines a plan runs on: GPUs, their memory, and two tiers of links.

Ranks are numbered as the runtime's device mesh lays them out, ``(dp, pp, sp)``
row-major (:mod:`pipeloom.runtime.mesh`): the ``sp`` ranks of a stage are
neighbours, a pipeline's ranks ``sp`` apart, replicas ``pp * sp`` apart; a
node holds ``gpus_per_node`` consecutive ranks. A group of ranks talks at the
intra-node bandwidth when it lies in one node, else at the inter-node one (a
ring is as fast as its slowest hop).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..errors import PipeloomError
from ..sim.specs import Device, get_device
from ..spec import device_of


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices like ``device`` (its FLOP rate, efficiency and host link), ``gpus_per_node``
    to a node, ``memory`` bytes each; links in bytes/s inside a node and between nodes."""

    gpus: int
    device: Device
    gpus_per_node: int = 8
    memory: float | None = None
    intra_bandwidth: float | None = None
    inter_bandwidth: float = 25e9

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PipeloomError(f"cluster: {name} must be a positive integer, got {value!r}")
        for name in ("memory", "intra_bandwidth", "inter_bandwidth"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PipeloomError(f"cluster: {name} must be positive, got {value!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PipeloomError(f"cluster: {self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; "
                                f"use a multiple of {self.gpus_per_node}")

    @classmethod
    def of(cls, device: Device | str, gpus: int, **overrides) -> Cluster:
        """A cluster of ``gpus`` of the device preset ``device``, its fields overridden (None: the device's)."""
        return cls(gpus, get_device(device), **{k: v for k, v in overrides.items() if v is not None})

    @property
    def runtime_device(self) -> str:
        """Where ``pipeloom train`` runs on this cluster (:func:`~pipeloom.spec.device_of` its preset)."""
        return device_of(self.device.name)

    @property
    def gpu_memory(self) -> float:
        return self.device.memory if self.memory is None else self.memory

    @property
    def intra(self) -> float:
        return self.device.link_bandwidth if self.intra_bandwidth is None else self.intra_bandwidth

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def bandwidth(self, pp: int, dp: int, sp: int, group: str) -> float:
        """Bytes/s of the slowest link in any of the layout's ``group`` groups: ``pp`` (a pipeline's
        neighbours), ``dp`` (the gradient all-reduce over the dp x sp replicas of a stage) or ``sp``."""
        crosses = _crosses(pp, dp, sp, self.gpus_per_node)[group]
        return self.inter_bandwidth if crosses else self.intra

    def device_for(self, pp: int, dp: int, sp: int) -> Device:
        """The device whose link is the slower of the pipeline's and the SP rings' (what the cost model
        uses for pipeline transfers, rings and vocabulary collectives)."""
        link = min(self.bandwidth(pp, dp, sp, "pp"), self.bandwidth(pp, dp, sp, "sp") if sp > 1 else float("inf"))
        return replace(self.device, link_bandwidth=link, memory=self.gpu_memory)


@lru_cache(maxsize=4096)
def _crosses(pp: int, dp: int, sp: int, per_node: int) -> dict[str, bool]:
    """Whether some group of each kind spans two nodes, ranks laid out ``(dp, pp, sp)`` row-major."""
    def node(d: int, p: int, s: int) -> int:
        return ((d * pp + p) * sp + s) // per_node

    # ranks grow along each group: a group spans nodes when its first and last rank do
    return {
        "sp": any(node(d, p, 0) != node(d, p, sp - 1) for d in range(dp) for p in range(pp)),
        "pp": any(node(d, 0, s) != node(d, pp - 1, s) for d in range(dp) for s in range(sp)),
        "dp": any(node(0, p, 0) != node(dp - 1, p, sp - 1) for p in range(pp)),
    }
