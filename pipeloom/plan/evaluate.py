"""What one layout costs: its schedule simulated, the gradient all-reduce added, its memory.

The step of a synchronous schedule is the simulated step, each rank then
all-reducing its stages' fp32 gradients over its ``dp x sp`` replicas (a
ring, at the slower tier the group spans) from the end of its last action,
then taking its optimizer step (:func:`~pipeloom.sim.model.optimizer_ms`):
``step = max over ranks (end + all-reduce + optimizer)``. A family that never
flushes (:meth:`~pipeloom.techniques.Technique.plan_steady`) steps at its
steady state: the simulated time of 2 steps less that of 1 (and no less than
any rank's work in a step), plus the longest all-reduce and optimizer step.
A schedule that is a cycle of steps (K-FAC's refresh:
:meth:`~pipeloom.techniques.Technique.plan_cycle`) is simulated once, as
``train`` builds it, and costed per step: each rank's end over its steps.
Memory per rank is :func:`~pipeloom.sim.memory.peak_memory_bytes` (model
state with its weight versions, gradients from a stage's first backward,
simulated activations, the transients of attention and recomputation, K-FAC's
factors and inverses).

What the techniques change here comes through the planner's hooks of
:class:`~pipeloom.techniques.Technique` (``plan_*``) and their axes'
declarations (:class:`~pipeloom.techniques.PlanAxis`); nothing here names one.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from operator import attrgetter
from typing import Iterator

from ..builder import build_run, model_costs
from ..errors import PipeloomError
from ..schedule import Schedule, get_family
from ..schedule.costs import Costs, StageCosts
from ..schedule.deps import ListPeaks
from ..schedule.ir import BW, B, F, Action, looped_placement, v_placement
from ..sim import Result, simulate
from ..sim.formulas import layer_flops
from ..sim.memory import GRAD_BYTES_PER_PARAM, backward_transient, peak_memory_bytes, state_bytes_per_param
from ..sim.model import optimizer_ms as sim_optimizer_ms
from ..sim.stages import stage_layers, stage_parameters
from .bounds import CriticalPath, critical_path
from .command import run_spec
from .space import Candidate, PlanRequest, axes, hooked, saver_ranks, savers

#: The steps a family without a flush is simulated for: its steady step is the difference.
STEADY_STEPS = (1, 2)


@dataclass(frozen=True)
class Plan:
    """A candidate costed: step time (ms), throughput, MFU, peak memory per rank (bytes) and the
    bubble rate of its simulated schedule (a family without a flush: of its steady step); ``fits`` when
    every rank's peak is within the GPU memory. A family without a flush that does not fit is not
    timed (:func:`evaluate`): its step is infinite, its throughput, MFU and bubble rate 0."""

    candidate: Candidate
    step_ms: float
    tokens_per_s: float
    samples_per_s: float
    mfu: float
    peak_memory_bytes: list[float]
    bubble_rate: float
    allreduce_ms: float
    optimizer_ms: float
    fits: bool
    #: the simulation (None where the plan is another candidate's: :meth:`Costing.evaluate`)
    result: Result = field(repr=False, compare=False, default=None)

    @property
    def key(self) -> tuple:
        """The order of plans: fastest first; at equal speed (:func:`_tied`) the one with the least memory savers
        (each costs more than the cost model counts: :func:`~pipeloom.plan.space.saver_ranks`), then
        the least memory."""
        c = self.candidate
        return _tied(self.step_ms), *saver_ranks(c, _savers()), max(self.peak_memory_bytes), c

    def beats(self, bound_ms: float) -> bool:
        """Whether no candidate whose step is at least ``bound_ms`` can come before this plan."""
        return _tied(bound_ms * (1 - 2 * _NOISE)) > self.key[0]


#: Relative float noise of a step or a bound (sums of the same costs in another order).
_NOISE = 1e-9
#: Significant digits to which two steps must agree to count as equal speed.
_DIGITS = 6


@lru_cache(maxsize=1)
def _savers() -> list:
    return savers()


def _tied(ms: float) -> float:
    """``ms`` to :data:`_DIGITS` significant digits: steps that differ by less than about one part in a
    million (float noise, or a per-microbatch overhead of nanoseconds in a step of seconds: far below
    what any cost model or GPU can tell apart) are equal speed, so the tie-breaks apply (fewer savers,
    less memory). Rounding is monotone, so a bound that rounds above a plan's step is surely slower."""
    return float(f"{ms:.{_DIGITS}g}")


class Costing:
    """The costs of a request's candidates, those that many candidates share computed once."""

    def __init__(self, request: PlanRequest):
        self.request = request
        self._costs: dict[tuple, tuple[Costs, StageCosts]] = {}
        self._schedules: dict[tuple, Schedule | PipeloomError] = {}
        self._paths: dict[tuple, CriticalPath] = {}
        self._tail: dict[tuple, list[float]] = {}
        self._bounds: dict[tuple, float] = {}
        self._states: dict[tuple, float] = {}
        self._microbatch: dict[tuple, float] = {}
        self._peaks: dict[tuple, ListPeaks | None] = {}
        self._families: dict[str, tuple] = {}
        self._layer_bytes: dict[tuple, float] = {}
        # what fixes each cache's entry: the layout, and the axes whose values change what it holds
        named = axes()
        priced, placed, shaped, added = ([axis.name for _, axis in named if getattr(axis, what)]
                                         for what in ("priced", "placed", "shaped", "added"))
        self._costs_key = attrgetter("pp", "dp", "sp", "chunks", "microbatch_size", *priced, "options")
        self._placed = attrgetter("pp", "chunks", *placed)
        self._tail_key = attrgetter("pp", "dp", "sp", "chunks", *placed)
        self._shape = attrgetter("schedule", "pp", "microbatches", "chunks", *shaped, "options", *added)
        self._bare = {axis.name: axis.values[0] for _, axis in named if axis.added}
        self._adders = [t for t, axis in named if axis.added]
        self._passers, self._listers = hooked("plan_passes"), hooked("plan_memory_lists")
        self._steppers, self._layer_states = hooked("plan_step_passes"), hooked("plan_layer_state_bytes")
        self._samers = hooked("plan_same")
        self._plans: dict[Candidate, Plan] = {}  # costed, without their results (large)

    def family(self, c: Candidate) -> tuple:
        """Facts of ``c``'s family the bounds read, once per family: (V-shaped, fused, ``costs`` among
        its options, steady (:meth:`~pipeloom.techniques.Technique.plan_steady`), weight versions)."""
        facts = self._families.get(c.schedule)
        if facts is None:
            family, name = get_family(c.schedule), c.schedule
            facts = self._families[name] = (
                family.chunks == (2,), family.fused, "costs" in family.options,
                any(t.plan_steady(name) for t in hooked("plan_steady")),
                max([1, *(t.plan_weight_versions(name) for t in hooked("plan_weight_versions"))]))
        return facts

    def steady(self, c: Candidate) -> bool:
        """Whether ``c``'s family never flushes (its step the steady one, no critical path kept)."""
        return self.family(c)[3]

    def bare(self, c: Candidate) -> Candidate:
        """``c`` without the axes whose work is added to its schedule (:attr:`PlanAxis.added`)."""
        if all(getattr(c, name) == value for name, value in self._bare.items()):
            return c
        return replace(c, **self._bare)

    def costs(self, c: Candidate) -> Costs:
        """The per-stage costs of ``c`` on the request's cluster (profile or formulas)."""
        return self._both(c)[0]

    def _both(self, c: Candidate) -> tuple[Costs, StageCosts]:
        key = self._costs_key(c)
        if key not in self._costs:
            r = self.request
            costs = model_costs(run_spec(r, c), r.model, r.cluster.device_for(c.pp, c.dp, c.sp), r.profile)
            self._costs[key] = costs, costs.per_stage(c.pp * c.chunks, c.chunks)
        return self._costs[key]

    def evaluate(self, c: Candidate) -> Plan:
        """Simulate ``c`` and cost it (raises :class:`~pipeloom.errors.PipeloomError` when its
        schedule cannot be built); its critical path then bounds every candidate of its schedule,
        with its added axes or not (their work only adds inputs to the compute, so never makes it faster).
        A candidate that costs as another does (:meth:`same`) gets that one's plan, renamed (without
        its result where that one was costed before)."""
        same = self.same(c)
        known = self._plans.get(same) if same is not c else None
        if known is None:
            plan = evaluate(self.request, same, self.costs(same), self.schedule, self.steady(same))
            key = self._path_key(same)
            if key not in self._paths and not self.steady(same) and self.bare(same) is same:
                self._paths[key] = critical_path(plan.result)
            self._plans[same] = replace(plan, result=None)
            return plan if same is c else replace(plan, candidate=c)
        return replace(known, candidate=c)

    def attempt(self, c: Candidate) -> Plan | None:
        """:meth:`evaluate`, or None where ``c``'s schedule cannot be built (a family's own limits, e.g. m < p)."""
        try:
            return self.evaluate(c)
        except PipeloomError:
            return None

    def same(self, c: Candidate) -> Candidate:
        """The candidate costed for ``c``: one whose plan is ``c``'s but for its settings' names
        (:meth:`~pipeloom.techniques.Technique.plan_same`), or ``c``."""
        for technique in self._samers:
            c = technique.plan_same(self.request, c)
        return c

    def has_path(self, c: Candidate) -> bool:
        """Whether a simulation has given ``c``'s schedule (:meth:`same`'s) its critical path."""
        return self.path(c) is not None

    def path(self, c: Candidate) -> CriticalPath | None:
        """The critical path of ``c``'s schedule without its added axes, once a simulation gave it."""
        return self._paths.get(self._path_key(self.same(c)))

    def add_path(self, c: Candidate, path: CriticalPath) -> None:
        """Take ``path`` as :meth:`path` of ``c`` (one a simulation elsewhere gave: :mod:`~pipeloom.plan.ahead`)."""
        self._paths.setdefault(self._path_key(self.same(c)), path)

    def bound_ms(self, c: Candidate) -> float:
        """:meth:`lower_bound_ms`, raised by the critical path of ``c``'s schedule without its added axes
        once one candidate of that schedule has been simulated (:mod:`pipeloom.plan.bounds`)."""
        bound = self.lower_bound_ms(c)
        path = self.path(c)
        if path is not None:
            bound = max(bound, path.length(self._both(c)[1]) + self.tail_ms(c)[path.rank])
        return bound

    def schedule(self, c: Candidate, steps: int | None = None) -> Schedule:
        """:func:`schedule_of` under ``c``'s costs, built once for every candidate that runs the same
        one (with added axes: their work added to the one built without, placed by the costs)."""
        key = self._schedule_key(c), steps
        if key not in self._schedules:
            try:
                bare = self.bare(c)
                if bare is c:
                    self._schedules[key] = schedule_of(self.request, c, self.costs(c), steps)
                else:
                    schedule = self.schedule(bare, steps)
                    for technique in self._adders:
                        schedule = technique.plan_add(self.request, c, schedule, self.costs(c))
                    self._schedules[key] = schedule
            except PipeloomError as err:
                self._schedules[key] = copy.copy(err)  # without its traceback (see below)
        found = self._schedules[key]
        if isinstance(found, PipeloomError):
            # a copy each time: raised itself, the error kept would hold the traceback, whose frames
            # hold this costing, a cycle that keeps every cache alive until the collector runs
            raise copy.copy(found)
        return found

    def _schedule_key(self, c: Candidate) -> tuple:
        """What fixes ``c``'s schedule: its shape (its added axes last), and its costs where they
        place the work (the added axes' work, zb-auto's order)."""
        costly = self.bare(c) is not c or self.family(c)[2]
        return self._shape(c), self._costs_key(c) if costly else None

    def _path_key(self, c: Candidate) -> tuple:
        """What fixes the critical path that bounds ``c``: its schedule without its added axes."""
        return self._schedule_key(self.bare(c))

    def tail_ms(self, c: Candidate) -> list[float]:
        """Per rank, what follows its last action: :func:`allreduce_ms` plus :func:`optimizer_ms`,
        once per layout."""
        key = self._tail_key(c), self.family(c)[0]
        if key not in self._tail:
            self._tail[key] = [a + o for a, o in zip(allreduce_ms(self.request, c), optimizer_ms(self.request, c))]
        return self._tail[key]

    def lower_bound_ms(self, c: Candidate) -> float:
        """A step time no schedule of ``c`` can beat (once per costs and schedule shape), the larger of:

        - busy: each rank's compute (F, B and W of its stages and the techniques' passes
          (:meth:`~pipeloom.techniques.Technique.plan_passes`), for every microbatch, and each
          stage's passes of the step, :meth:`~pipeloom.techniques.Technique.plan_step_passes`) after the
          first microbatch's forwards reach it, then its all-reduce and optimizer step (a steady
          family: no wait, as its steady step has none, and the longest tail);
        - chain (not for a steady family), ending on stage 0's rank: a rank's last backward of one of its
          stages ``s`` ends after the forwards reach the rank and all its forwards and its
          backwards of stages ``s`` and later ran, as each precedes that microbatch's backward of
          ``s``; that microbatch's backward then runs down stages ``s - 1`` to 0, each waiting for
          its input to cross between ranks, then stage 0's W and passes of the step and its rank's
          all-reduce and optimizer step. A backward counts its W too in the families that never split it
          (``fused``).
        """
        v_shape, fused, _, steady, _ = self.family(c)
        key = self._costs_key(c), self._placed(c), v_shape, fused, steady
        if key not in self._bounds:
            self._bounds[key] = max(self._busy_ms(c, steady), 0.0 if steady else self._chain_ms(c, fused))
        return self._bounds[key]

    def _busy_ms(self, c: Candidate, steady: bool) -> float:
        costs, tail = self._both(c)[1], self.tail_ms(c)
        passes = [kind for t in self._passers for kind in t.plan_passes(c)]
        bound = 0.0
        for rank, stages in enumerate(stages_of_ranks(c)):
            busy = c.microbatches * (sum(costs.f[s] + costs.b[s] + costs.w[s] for s in stages)
                                     + sum(costs.duration(Action(kind, rank, 0)) for kind in passes))
            busy += sum(self._step_passes_ms(c, s) for s in stages)
            wait = 0.0 if steady else sum(costs.f[:min(stages)])
            bound = max(bound, wait + busy + (max(tail) if steady else tail[rank]))
        return bound

    def _chain_ms(self, c: Candidate, fused: bool) -> float:
        costs = self._both(c)[1]
        f, w = costs.f, costs.w
        back = [b + x for b, x in zip(costs.b, w)] if fused else costs.b
        ranks = stages_of_ranks(c)
        rank_of = {s: r for r, stages in enumerate(ranks) for s in stages}
        reach = [0.0]  # reach[s]: when stage s's first forward can start
        down = [0.0]  # down[s]: from the end of stage s's backward of a microbatch to the start of its stage 0's
        for s in range(1, len(f)):
            cross = rank_of[s] != rank_of[s - 1]
            reach.append(reach[-1] + f[s - 1] + (costs.transfer(Action(F, s - 1, 0)) if cross else 0.0))
            down.append(down[-1] + back[s - 1] + (min(costs.transfer(Action(kind, s, 0)) for kind in (B, BW))
                                                  if cross else 0.0))
        last_w = (0.0 if fused else w[0]) + self._step_passes_ms(c, 0)
        bound = 0.0
        for stages in ranks:
            before = reach[min(stages)] + c.microbatches * sum(f[s] for s in stages)
            for s in stages:
                backwards = c.microbatches * sum(back[t] for t in stages if t >= s)
                bound = max(bound, before + backwards + down[s] + last_w)
        return bound + self.tail_ms(c)[0]

    def _step_passes_ms(self, c: Candidate, stage: int) -> float:
        """Stage ``stage``'s passes of a step (:meth:`~pipeloom.techniques.Technique.plan_step_passes`)."""
        costs = self._both(c)[1]
        return sum(costs.duration(Action(kind, stage, 0)) for t in self._steppers for kind in t.plan_step_passes(c))

    def activation_memory_bound(self, c: Candidate, limit: float = math.inf) -> float:
        """Bytes the busiest rank needs at least once its costs are known: the model state but the
        gradients plus its activations and the gradients that exist by then at their peak
        (a stage's rerun too, where it reruns), or the whole state. Each step below is taken only while
        the bound is within ``limit``: first one microbatch's activations of a stage (every list
        holds its F), then the peak of its list, which depends on the order only
        (:class:`~pipeloom.schedule.deps.ListPeaks`); with a technique that moves activations
        away, the lists as its steps count them, cheapest first
        (:meth:`~pipeloom.techniques.Technique.plan_memory_lists`)."""
        for bound in self.memory_bounds(c):
            if bound > limit:
                break
        return bound

    def memory_bounds(self, c: Candidate) -> Iterator[float]:
        """The bounds :meth:`activation_memory_bound` takes in turn, each at least the one before and
        dearer to work out: :meth:`microbatch_memory_bound`, then the peaks of each list: with added
        axes whose work moves no activations (no technique lists its own steps: K-FAC's pieces) in a
        family that flushes, first the lists without their work (whose cycle of steps repeats a
        step's lists: those of one step bound it from below, and are built once for every added axis)."""
        bound = self.first_memory_bound(c)
        yield bound
        c = self.same(c)
        lists = [(t, *step) for t in self._listers for step in t.plan_memory_lists(c)]
        if not lists:
            lists = [(None, None, True), None] if self.bare(c) is not c and not self.steady(c) else [None]
        for away in lists:
            bound = max(bound, self._state_and_peaks(c, self._list_peaks(c, away)))
            yield bound

    def first_memory_bound(self, c: Candidate) -> float:
        """The first of :meth:`memory_bounds` (cheap): :meth:`microbatch_memory_bound` of the
        candidate costed for ``c`` (:meth:`same`)."""
        return self.microbatch_memory_bound(self.same(c))

    def microbatch_memory_bound(self, c: Candidate) -> float:
        """Bytes the busiest rank needs at least without reading its list: the model state but the
        gradients plus one microbatch's activations of a stage (every list holds each stage's F)
        and its rerun, or the whole state (once per costs and placement)."""
        v_shape, _, _, _, versions = self.family(c)
        key = self._costs_key(c), self._placed(c), v_shape, versions, self._layer_state(c)
        bound = self._microbatch.get(key)
        if bound is None:
            bound = self._microbatch[key] = self._state_and_peaks(c, None)
        return bound

    def _list_peaks(self, c: Candidate, away: tuple | None) -> list[float] | None:
        """Per rank, the peak of the activations and the stages' gradients (each from the stage's
        first backward in the list on: :class:`~pipeloom.schedule.deps.ListPeaks`) of the list
        ``c`` runs (``away``: (technique, step, bare): the list, of ``c`` or of ``c`` without its
        added axes, as the technique's step counts it:
        :meth:`~pipeloom.techniques.Technique.plan_memory_list`), or None where the schedule cannot
        be built. The lists are read once per schedule and ``away``."""
        technique, step, bare = away if away is not None else (None, None, False)
        listed = self.bare(c) if bare else c
        key = self._schedule_key(listed), step
        if key not in self._peaks:
            try:
                steps = STEADY_STEPS[-1] if self.steady(c) and not cycled(c) else None
                schedule = self.schedule(listed, steps)  # as evaluated
            except PipeloomError:
                self._peaks[key] = None
            else:
                self._peaks[key] = ListPeaks(technique.plan_memory_list(step, actions) if technique else actions
                                             for actions in schedule.ranks)
        peaks = self._peaks[key]
        if peaks is None:
            return None
        grad = self._state_bytes(c)[1]
        grads = {s: grad * n for s, n in enumerate(_parameters(self.request, c)[1])}
        return peaks(self._both(c)[1].memory_delta, grads)

    def _state_and_peaks(self, c: Candidate, peaks: list[float] | None) -> float:
        """The busiest rank's state but gradients plus its ``peaks`` of activations and gradients
        (None: one microbatch's activations) and reruns, or its whole state; and what its layers hold
        besides their parameters' state (:meth:`_extra_state`)."""
        costs = self._both(c)[1]
        held, grad = self._state_bytes(c)
        shard, params = _parameters(self.request, c)
        extra = self._extra_state(c)
        bound = 0.0
        for rank, stages in enumerate(stages_of_ranks(c)):
            state = sum(params[s] for s in stages)
            peak = peaks[rank] if peaks is not None else max(costs.m_b[s] for s in stages)
            first = max(held * state + peak, (held + grad) * state)
            bound = max(bound, (held + grad) * shard + extra[rank] + first + backward_transient(costs, stages))
        return bound

    def _layer_state(self, c: Candidate) -> float:
        """Bytes each layer of ``c`` holds besides its parameters' state
        (:meth:`~pipeloom.techniques.Technique.plan_layer_state_bytes`), once per costs (every
        candidate's bounds ask it)."""
        key = self._costs_key(c)
        found = self._layer_bytes.get(key)
        if found is None:
            found = self._layer_bytes[key] = sum(t.plan_layer_state_bytes(self.request, c) for t in self._layer_states)
        return found

    def _extra_state(self, c: Candidate) -> list[float]:
        """Per rank, the bytes its stages' layers hold besides their parameters' state (:meth:`_layer_state`)."""
        per_layer = self._layer_state(c)
        if not per_layer:
            return [0.0] * c.pp
        r = self.request
        layers = stage_layers(r.model, c.pp * c.chunks, r.seq, **_model_options(c))
        return [per_layer * sum(layers[s] for s in stages) for stages in stages_of_ranks(c)]

    def _state_bytes(self, c: Candidate) -> tuple[float, float]:
        """:func:`~pipeloom.sim.memory.state_bytes_per_param` of ``c`` with its weight versions
        (:meth:`~pipeloom.techniques.Technique.plan_weight_versions`)."""
        return state_bytes_per_param(self.request.bytes_per_param, self.family(c)[4])

    def memory_lower_bound(self, c: Candidate) -> float:
        """Bytes the busiest rank needs at least: its model state (with its weight versions) and what
        its layers hold besides (:meth:`_layer_state`: K-FAC's factors), once per placement of the stages."""
        v_shape, _, _, _, versions = self.family(c)
        key = self._placed(c), v_shape, versions, self._layer_state(c)
        if key not in self._states:
            per_param = sum(self._state_bytes(c))
            shard, params = _parameters(self.request, c)
            self._states[key] = max(per_param * (shard + sum(params[s] for s in stages)) + extra
                                    for stages, extra in zip(stages_of_ranks(c), self._extra_state(c)))
        return self._states[key]


def _model_options(c: Candidate) -> dict:
    """Keywords of ``stage_parameters`` and ``peak_memory_bytes`` the techniques set for ``c``."""
    return {name: value for t in hooked("plan_model_options") for name, value in t.plan_model_options(c).items()}


def _parameters(request: PlanRequest, c: Candidate) -> tuple[int, list[int]]:
    """Parameters each rank holds besides its stages' (:meth:`~pipeloom.techniques.Technique.plan_shard_params`), and of each stage."""
    shard = sum(t.plan_shard_params(request, c) for t in hooked("plan_shard_params"))
    return shard, stage_parameters(request.model, c.pp * c.chunks, request.seq, **_model_options(c))


def stages_of_ranks(c: Candidate) -> tuple[tuple[int, ...], ...]:
    """The stages of each rank: the V placement for the two-chunk families, else looped."""
    return _placements(get_family(c.schedule).chunks == (2,), c.pp, c.chunks)


@lru_cache(maxsize=1024)
def _placements(v_shape: bool, pp: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    placement = v_placement(pp) if v_shape else looped_placement(pp, pp * chunks)
    return tuple(tuple(s for s, r in enumerate(placement) if r == rank) for rank in range(pp))


def cycled(c: Candidate) -> bool:
    """Whether ``c``'s schedule is a cycle of steps that runs whole
    (:meth:`~pipeloom.techniques.Technique.plan_cycle`)."""
    return any(t.plan_cycle(c) for t in hooked("plan_cycle"))


def schedule_of(request: PlanRequest, c: Candidate, costs: Costs, steps: int | None = None) -> Schedule:
    """The schedule ``pipeloom train`` builds for ``c``'s command (``steps`` consecutive steps of a family without a flush),
    with the one builder (:func:`~pipeloom.builder.build_run`) under ``costs``."""
    return build_run(run_spec(request, c, steps), costs)


def optimizer_ms(request: PlanRequest, c: Candidate) -> list[float]:
    """Per rank: the optimizer step over its parameters (its stages' and its shard's)."""
    shard, params = _parameters(request, c)
    device = request.cluster.device
    return [sim_optimizer_ms(shard + sum(params[s] for s in stages), device, request.profile)
            for stages in stages_of_ranks(c)]


def allreduce_ms(request: PlanRequest, c: Candidate) -> list[float]:
    """Per rank: the ring all-reduce of its gradients (its stages' and its shard's) over dp x sp."""
    replicas = c.dp * c.sp
    if replicas == 1:
        return [0.0] * c.pp
    bandwidth = request.cluster.bandwidth(c.pp, c.dp, c.sp, "dp")
    shard, params = _parameters(request, c)
    return [1e3 * 2 * (replicas - 1) / replicas * GRAD_BYTES_PER_PARAM * (shard + sum(params[s] for s in stages)) / bandwidth
            for stages in stages_of_ranks(c)]


def evaluate(request: PlanRequest, c: Candidate, stage_costs: Costs, build_schedule=None,
             steady: bool | None = None) -> Plan:
    """Simulate ``c`` under ``stage_costs`` and cost it (raises :class:`~pipeloom.errors.PipeloomError`
    when its schedule cannot be built); ``build_schedule(c, steps)`` gives its schedule (by default
    :func:`schedule_of`); ``steady``: whether its family never flushes (by default as the techniques
    say: :meth:`~pipeloom.techniques.Technique.plan_steady`). A cycle of steps (:func:`cycled`) is
    built once, as ``train`` builds it, and its step is its mean: each rank's end over its steps, then
    its tail (a family that never flushes: the last end, then the longest tail). A family that never
    flushes is simulated for 2 steps first, which give its memory; where that does not fit, its 1 step
    is neither built nor simulated (with offload, building it is most of the time) and the plan is
    not timed (:class:`Plan`)."""
    if build_schedule is None:
        def build_schedule(c, steps=None):
            return schedule_of(request, c, stage_costs, steps)
    if steady is None:
        steady = any(t.plan_steady(c.schedule) for t in hooked("plan_steady"))

    reduce, update = allreduce_ms(request, c), optimizer_ms(request, c)
    tail = [a + o for a, o in zip(reduce, update)]
    if steady and not cycled(c):
        result = simulate(build_schedule(c, STEADY_STEPS[-1]), stage_costs)
        memory = _peaks(request, c, result)
        if max(memory) > request.cluster.gpu_memory:  # not timed: no plan takes its step
            return Plan(c, math.inf, 0.0, 0.0, 0.0, memory, 0.0, max(reduce), max(update), False, result)
        one = simulate(build_schedule(c, STEADY_STEPS[0]), stage_costs)
        # the steady step: two steps' time less one's, and no less than a rank's work in a step
        work = [two.busy - first.busy for two, first in zip(result.ranks, one.ranks)]
        steady = max(result.makespan - one.makespan, *work)
        step = steady + max(tail)
        bubble = max(1 - busy / steady for busy in work)
    else:
        result = simulate(build_schedule(c), stage_costs)
        memory = _peaks(request, c, result)
        # per step of the steps built (a cycle's: its makespan over them, as pipeloom simulate says)
        ends = [max(ends, default=0.0) / result.schedule.steps for ends in result.ends]
        step = max(ends) + max(tail) if steady else max(end + t for end, t in zip(ends, tail))
        bubble = result.bubble_rate
    seconds = step / 1e3
    return Plan(c, step, request.global_batch * request.seq / seconds, request.global_batch / seconds,
                model_flops(request) / seconds / (request.cluster.gpus * request.cluster.device.peak_flops), memory,
                bubble, max(reduce), max(update), max(memory) <= request.cluster.gpu_memory, result)


def _peaks(request: PlanRequest, c: Candidate, result: Result) -> list[float]:
    """:func:`~pipeloom.sim.memory.peak_memory_bytes` of ``c``'s simulated ``result``."""
    return peak_memory_bytes(request.model, result, request.seq, microbatch_size=c.microbatch_size, sp=c.sp,
                             bytes_per_param=request.bytes_per_param,
                             cast_bytes_per_param=request.cast_bytes_per_param, **_model_options(c))


def model_flops(request: PlanRequest) -> float:
    """FLOPs of one step of the model itself (no recomputation): every layer's F, B and W and the
    output layer's, for every sequence of the global batch."""
    model, s = request.model, request.seq
    return request.global_batch * (model.layers * sum(layer_flops(model, s, 1)) + 6 * s * model.hidden * model.vocab)
