"""How ranks are laid out (dp x pp x sp) and one rank's process groups, made once.

:class:`Layout` is plain data: the degrees, checked against each other and a
world size (the launcher checks before it starts any process).
:class:`Mesh` is one rank's place in it under torch.distributed: the DeviceMesh
("dp", "pp", "sp") and every process group the runtime uses, each made once,
every rank making every group in one order (``dist.new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import PipeloomError
from ..schedule import Schedule
from ..schedule.lower import links


@dataclass(frozen=True)
class Layout:
    """``dp`` data-parallel replicas of a pipeline of ``pp`` ranks, each stage on ``sp``
    sequence-parallel ranks: ``dp * pp * sp`` ranks in all."""

    dp: int = 1
    pp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipeloomError(f"{name}={value!r}: must be a whole number >= 1")

    @classmethod
    def of(cls, world: int, pp: int, sp: int = 1, dp: int | None = None) -> Layout:
        """The layout of ``world`` ranks; ``dp`` by default what ``pp`` and ``sp`` leave."""
        if dp is None:
            per_replica = cls(1, pp, sp).world
            if world % per_replica:
                raise PipeloomError(f"world size {world} does not split into replicas of pp={pp} x sp={sp} = "
                                    f"{per_replica} ranks; choose pp and sp whose product divides {world}")
            dp = world // per_replica
        return cls(dp, pp, sp).check(world)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.sp

    @property
    def replicas(self) -> int:
        """The ranks holding the same stages (their gradients are summed)."""
        return self.dp * self.sp

    def check(self, world: int) -> Layout:
        """This layout, if it fills ``world`` ranks exactly."""
        if world != self.world:
            raise PipeloomError(
                f"world size {world} does not match dp={self.dp} x pp={self.pp} x sp={self.sp} = {self.world}; "
                f"launch {self.world} processes or choose dp, pp and sp whose product is {world}")
        return self


class Mesh:
    """One rank's place in ``layout`` and its process groups, for ``schedule``.

    ``peers[q]``: the global rank of pipeline rank ``q`` in this rank's pipeline;
    ``pp_group``, ``sp_group``: this rank's pipeline and sequence-parallel groups;
    ``replica_group``: the ranks holding its stages (dp x sp); ``tied_group``: its
    pipeline's ranks of the first and last stage (tied embeddings; None where one
    rank holds both, or this rank holds neither); ``links[(src, dst)]``: a group for each direction of each of
    its links (global ranks), so every backend matches a link's messages in send
    order; ``line_groups[name]``: a group over its pipeline's ranks per name in
    ``line_groups`` (a technique's collectives, each on its own group).
    """

    def __init__(self, layout: Layout, device: torch.device, schedule: Schedule, line_groups=()):
        dp, pp, sp = layout.dp, layout.pp, layout.sp
        self.layout = layout
        mesh = init_device_mesh(device.type, (dp, pp, sp), mesh_dim_names=("dp", "pp", "sp"))
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.sp_rank = (mesh.get_local_rank(d) for d in ("pp", "dp", "sp"))
        self.pp_group, self.sp_group = mesh.get_group("pp"), mesh.get_group("sp")
        #: every pipeline (its global ranks by pipeline rank), one per (dp, sp) replica; this rank's is ``line``
        self.lines = mesh.mesh.transpose(1, 2).reshape(-1, pp).tolist()
        self.line = self.dp_rank * sp + self.sp_rank
        self.peers = self.lines[self.line]
        self.replica_group = mesh.get_group("dp") if sp == 1 else \
            self._one([[line[q] for line in self.lines] for q in range(pp)])
        first, last = schedule.placement[0], schedule.placement[-1]
        self.tied_group = self._one([[line[first], line[last]] for line in self.lines]) if first != last else None
        self.links = self._made([[line[src], line[dst]] for line in self.lines for src, dst in links(schedule)])
        self.line_groups = {name: self._one(self.lines) for name in line_groups}

    def _made(self, every: list[list[int]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """Make a group of each list of global ranks in ``every`` (every rank makes them
        all, in this order); those this rank is in, by their ranks."""
        mine = {}
        for ranks in every:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine[tuple(ranks)] = group
        return mine

    def _one(self, every: list[list[int]]) -> dist.ProcessGroup | None:
        """:meth:`_made` where this rank is in one of the groups at most: that group, or None."""
        return next(iter(self._made(every).values()), None)
