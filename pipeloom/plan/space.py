"""What the planner searches: a request, and every layout the runtime would accept for it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from ..errors import PipeloomError
from ..modes import RECOMPUTE, VocabMode
from ..schedule import FAMILIES, get_family
from ..schedule.transforms.vocab import ALGORITHMS, versioned_microbatches
from ..sim.profile import Profile
from ..sim.specs import ModelSpec, get_model
from .cluster import Cluster

#: The choices searched by default for each dimension that is not a number.
RECOMPUTES = tuple(RECOMPUTE)
VOCAB_MODES = ("none", "redis", "vocab-1", "vocab-2")
OFFLOADS = ("none", "full", "selective")
#: The share of each rank's activation peak that selective offload moves, in the plans it makes.
SELECTIVE_RATIO = 0.5
#: Chunks per rank that interleaved 1F1B is tried with.
INTERLEAVED_CHUNKS = (2, 3, 4)


@dataclass(frozen=True)
class PlanRequest:
    """Train ``model`` on ``seq``-token sequences, ``global_batch`` of them a step, on ``cluster``;
    costs from ``profile`` when given (else FLOP formulas and the cluster's device preset);
    ``schedules``, ``recompute``, ``vocab_parallel``, ``offload`` narrow the search; ``top`` plans kept."""

    model: ModelSpec
    seq: int
    global_batch: int
    cluster: Cluster
    profile: Profile | None = None
    schedules: tuple[str, ...] = tuple(FAMILIES)
    recompute: tuple[str, ...] = RECOMPUTES
    vocab_parallel: tuple[str, ...] = VOCAB_MODES
    offload: tuple[str, ...] = OFFLOADS
    microbatch_sizes: tuple[int, ...] | None = None
    top: int = 10
    bytes_per_param: float = field(default=None)

    def __post_init__(self):
        object.__setattr__(self, "model", get_model(self.model))
        for name in ("seq", "global_batch", "top"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PipeloomError(f"plan: {name} must be a positive integer, got {value!r}")
        for name in self.schedules:
            get_family(name)
        _choices("recompute", self.recompute, RECOMPUTES)
        _choices("offload", self.offload, OFFLOADS)
        for mode in self.vocab_parallel:
            VocabMode.of(mode)
        if self.bytes_per_param is None:
            object.__setattr__(self, "bytes_per_param", self.profile.bytes_per_param if self.profile else 18.0)


def _choices(what: str, given, allowed) -> None:
    for value in given:
        if value not in allowed:
            raise PipeloomError(f"plan: unknown {what} {value!r}; choose from {', '.join(allowed)}")


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
    recompute: str
    vocab_parallel: str
    offload: str
    options: tuple = ()  # plug-in techniques' settings, (name, value) pairs

    @property
    def offload_ratio(self) -> float | None:
        return SELECTIVE_RATIO if self.offload == "selective" else None

    @property
    def base(self) -> Candidate:
        """The layout without its memory savers (recomputation, offload): plans are ranked one per base."""
        return replace(self, recompute="none", offload="none")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(request: PlanRequest, gpus: int) -> Iterator[tuple[int, int, int]]:
    """(pp, dp, sp) with pp * dp * sp = ``gpus`` that the model, sequence and batch allow:
    stages no more than layers, ``seq`` split into 2 * sp equal chunks, dp dividing the batch."""
    for pp in divisors(gpus):
        if pp > request.model.layers:
            continue
        for sp in divisors(gpus // pp):
            dp = gpus // (pp * sp)
            if request.seq % (2 * sp) == 0 and request.global_batch % dp == 0:
                yield pp, dp, sp


def candidates(request: PlanRequest) -> Iterator[Candidate]:
    """Every layout of ``request`` on all its GPUs that the runtime accepts (its refusals mirrored:
    vocabulary parallelism only with pp > 1, with 2bw only with enough microbatches
    (:func:`~pipeloom.schedule.transforms.vocab.versioned_microbatches`, which the planner's builds of
    1 and 2 steps do not reach); offload only on an accelerator)."""
    layers = request.model.layers
    plugged = _plugged(request)
    for pp, dp, sp in layouts(request, request.cluster.gpus):
        per_replica = request.global_batch // dp
        sizes = [b for b in divisors(per_replica) if request.microbatch_sizes is None or b in request.microbatch_sizes]
        for name in request.schedules:
            family = get_family(name)
            chunk_options = INTERLEAVED_CHUNKS if family.chunks is None else family.chunks
            for chunks in chunk_options:
                if pp * chunks > layers or (family.chunks is None and pp == 1):
                    continue
                multi_step = "steps" in family.options
                for b in sizes:
                    for recompute in request.recompute:
                        for mode in request.vocab_parallel:
                            if mode != "none" and pp == 1 or multi_step and mode in ALGORITHMS and \
                                    per_replica // b < versioned_microbatches(pp, mode):
                                continue
                            for offload in request.offload:
                                if offload != "none" and request.cluster.device.name == "cpu":
                                    continue
                                for options in plugged:
                                    yield Candidate(pp, dp, sp, name, chunks, b, per_replica // b, recompute, mode,
                                                    offload, options)


def _plugged(request: PlanRequest) -> list[tuple]:
    """Every combination of the plug-in techniques' dimensions, as candidates' ``options``."""
    from ..techniques import TECHNIQUES

    combos: list[tuple] = [()]
    for technique in TECHNIQUES.values():
        dimension = technique.plan_dimension(request)
        if dimension is not None:
            name, values = dimension
            combos = [(*combo, (name, value)) for combo in combos for value in values]
    return combos
