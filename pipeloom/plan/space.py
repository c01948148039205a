"""What the planner searches: a request, and every layout the runtime would accept for it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from itertools import product
from typing import Iterator

from ..errors import PipeloomError, whole
from ..schedule import FAMILIES, get_family
from ..sim.memory import STATE_BYTES_PER_PARAM
from ..sim.profile import Profile
from ..sim.specs import ModelSpec, get_model
from ..spec import PRECISION_OF
from ..techniques import TECHNIQUES, PlanAxis, Technique
from .cluster import Cluster

#: Chunks per rank that interleaved 1F1B is tried with.
INTERLEAVED_CHUNKS = (2, 3, 4)


@dataclass(frozen=True)
class PlanRequest:
    """Train ``model`` on ``seq``-token sequences, ``global_batch`` of them a step, on ``cluster``;
    costs from ``profile`` when given (else FLOP formulas and the cluster's device preset);
    ``schedules`` and each technique's axis (:func:`axes`; None: its values) narrow the search;
    ``kfac_every``: K-FAC's refresh interval (None: as ``train`` chooses it); ``top`` plans kept."""

    model: ModelSpec
    seq: int
    global_batch: int
    cluster: Cluster
    profile: Profile | None = None
    schedules: tuple[str, ...] = tuple(FAMILIES)
    # the techniques' axes (:func:`axes`), one field each
    recompute: tuple[str, ...] | None = None
    vocab_parallel: tuple[str, ...] | None = None
    offload: tuple[str, ...] | None = None
    optimizer: tuple[str, ...] | None = None
    kfac_every: int | None = None
    microbatch_sizes: tuple[int, ...] | None = None
    top: int = 10
    bytes_per_param: float = field(default=None)
    cast_bytes_per_param: float = field(default=None)

    def __post_init__(self):
        object.__setattr__(self, "model", get_model(self.model))
        for name in ("seq", "global_batch", "top"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PipeloomError(f"plan: {name} must be a positive integer, got {value!r}")
        for name in self.schedules:
            get_family(name)
        for _, axis in axes():
            if getattr(self, axis.name) is None:
                object.__setattr__(self, axis.name, axis.values)
            axis.check(getattr(self, axis.name))
        if self.kfac_every is not None:
            whole("kfac_every", self.kfac_every)
            if "kfac" not in self.optimizer:
                raise PipeloomError(f"plan: --kfac-every {self.kfac_every} goes with --optimizer kfac or any")
        if self.bytes_per_param is None:  # the profile's, else the formulas' at the cluster's precision
            state = STATE_BYTES_PER_PARAM[PRECISION_OF[self.cluster.runtime_device]]
            object.__setattr__(self, "bytes_per_param", self.profile.bytes_per_param if self.profile else float(state))
        if self.cast_bytes_per_param is None:
            object.__setattr__(self, "cast_bytes_per_param", self.profile.cast_bytes_per_param if self.profile else 0.0)


@dataclass(frozen=True, order=True)
class Candidate:
    """One layout: the settings of one ``pipeloom train`` run."""

    pp: int
    dp: int
    sp: int
    schedule: str
    chunks: int
    microbatch_size: int
    microbatches: int
    # the built-in techniques' settings, one field per axis (:func:`axes`, in this order)
    recompute: str
    vocab_parallel: str
    offload: str
    optimizer: str
    options: tuple = ()  # plug-in techniques' settings, (name, value) pairs

    @property
    def base(self) -> Candidate:
        """The layout without its memory savers (:attr:`PlanAxis.saver`): plans are ranked one per base."""
        return replace(self, **_bare_savers())


#: The candidate's fields that fix its layout; the others but ``options`` are the techniques' axes.
LAYOUT = ("pp", "dp", "sp", "schedule", "chunks", "microbatch_size", "microbatches")
#: The techniques' axes, in the candidate's order.
SETTINGS = tuple(f.name for f in fields(Candidate) if f.name not in LAYOUT and f.name != "options")


def axes() -> list[tuple[Technique, PlanAxis]]:
    """Each technique that declares an axis (:meth:`~pipeloom.techniques.Technique.plan_axis`) and its
    axis, in the candidate's order of fields."""
    found = {axis.name: (t, axis) for t in TECHNIQUES.values() if (axis := t.plan_axis()) is not None}
    if set(found) != set(SETTINGS):
        raise PipeloomError(f"the planner's candidates hold {', '.join(SETTINGS)}; the techniques declare axes "
                            f"{', '.join(found) or 'none'}")
    return [found[name] for name in SETTINGS]


def hooked(hook: str) -> list[Technique]:
    """The techniques that implement the planner's hook ``hook`` (the others' does nothing)."""
    default = getattr(Technique, hook)
    return [t for t in TECHNIQUES.values() if getattr(type(t), hook) is not default]


def savers() -> list[PlanAxis]:
    """The memory savers' axes, in the order they rank equal plans."""
    return sorted((axis for _, axis in axes() if axis.saver is not None), key=lambda axis: axis.saver)


def saver_ranks(c: Candidate, savers: list[PlanAxis]) -> tuple:
    """Where ``c``'s savers come among equal plans: the least saving first."""
    return tuple(axis.values.index(getattr(c, axis.name)) for axis in savers)


def saving_ranks(c: Candidate, savers: list[PlanAxis]) -> tuple:
    """Where ``c``'s savers come when memory is short: the most saving first."""
    return tuple(axis.most_saving.index(getattr(c, axis.name)) for axis in savers)


def settings_text(c: Candidate) -> str:
    """``c``'s settings of the techniques' axes as ``pipeloom plan`` names them ("NAME VALUE, ...")."""
    return ", ".join(f"{axis.flag[2:]} {getattr(c, axis.name)}" for _, axis in axes())


_BARE: dict = {}


def _bare_savers() -> dict:
    if not _BARE:
        _BARE.update({axis.name: axis.values[0] for axis in savers()})
    return _BARE


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _widths(request: PlanRequest) -> tuple[set[int], set[int]]:
    """The data-parallel widths (dividing the batch) and sequence-parallel widths (``seq`` split into
    2 * sp equal chunks) ``request`` allows; pipeline depths are 1 to the model's layers."""
    return set(divisors(request.global_batch)), set(divisors(request.seq // 2)) if request.seq % 2 == 0 else set()


def layouts(request: PlanRequest, gpus: int) -> Iterator[tuple[int, int, int]]:
    """(pp, dp, sp) with pp * dp * sp = ``gpus`` that the model, sequence and batch allow:
    stages no more than layers, ``seq`` split into 2 * sp equal chunks, dp dividing the batch."""
    dps, sps = _widths(request)
    for pp in divisors(gpus):
        if pp > request.model.layers:
            continue
        for sp in divisors(gpus // pp):
            dp = gpus // (pp * sp)
            if sp in sps and dp in dps:
                yield pp, dp, sp


def usable_gpus(request: PlanRequest) -> set[int]:
    """The GPU counts some layout of ``request`` fills (those :func:`layouts` finds one for)."""
    dps, sps = _widths(request)
    return {pp * dp * sp for pp in range(1, request.model.layers + 1) for dp in dps for sp in sps}


def candidates(request: PlanRequest) -> Iterator[Candidate]:
    """Every layout of ``request`` on all its GPUs that the runtime accepts (its refusals mirrored by
    each technique's :meth:`~pipeloom.techniques.Technique.plan_allows`)."""
    layers = request.model.layers
    plugged = _plugged(request)
    settings = list(product(*(getattr(request, axis.name) for _, axis in axes())))  # in the candidate's order
    allows = hooked("plan_allows")
    for pp, dp, sp in layouts(request, request.cluster.gpus):
        per_replica = request.global_batch // dp
        sizes = [b for b in divisors(per_replica) if request.microbatch_sizes is None or b in request.microbatch_sizes]
        for name in request.schedules:
            family = get_family(name)
            chunk_options = INTERLEAVED_CHUNKS if family.chunks is None else family.chunks
            for chunks in chunk_options:
                if pp * chunks > layers or (family.chunks is None and pp == 1):
                    continue
                for b in sizes:
                    for setting in settings:
                        for options in plugged:
                            c = Candidate(pp, dp, sp, name, chunks, b, per_replica // b, *setting, options)
                            for technique in allows:
                                if not technique.plan_allows(request, c):
                                    break
                            else:
                                yield c


def _plugged(request: PlanRequest) -> list[tuple]:
    """Every combination of the plug-in techniques' dimensions, as candidates' ``options``."""
    combos: list[tuple] = [()]
    for technique in TECHNIQUES.values():
        dimension = technique.plan_dimension(request)
        if dimension is not None:
            name, values = dimension
            combos = [(*combo, (name, value)) for combo in combos for value in values]
    return combos
