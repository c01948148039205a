"""The search: every layout bounded cheaply, the promising ones simulated, best first.

Each candidate gets two bounds that need no simulation: the model state of its
busiest rank (it cannot fit in less) and :meth:`Costing.lower_bound_ms` (it
cannot step faster). Candidates whose state alone overflows the GPU are
dropped. A plan is a layout (:attr:`Candidate.base`) with its best memory
savers (:attr:`~pipeloom.techniques.PlanAxis.saver`), so the layouts are taken in the order of
their time bound until the next bound is slower than the ``top``-th plan
found. A layout whose schedule has not been simulated yet is simulated bare
first, fitting or not: the critical path that gives raises the bound of every
candidate running that schedule, with added work or not, and the layout goes back
in line on it. Within a layout its variants are simulated until one's bound is
slower than its best so far, or the bare layout fits (it is then the layout's
plan: :func:`taken`), skipping those whose bound is slower than the ``top``-th
plan (but for the bare layout: where it fits, the layout cannot make the list,
however fast a saver's variant models) and those whose list shows they cannot fit
(:meth:`Costing.activation_memory_bound`): the plans returned are those an
exhaustive search (:func:`exhaustive`) ranks first.
"""

from __future__ import annotations

import gc
import heapq
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from ..errors import PipeloomError
from .ahead import BOUND, BOUNDS, PLAN, Ahead
from .evaluate import Costing, Plan
from .space import Candidate, PlanRequest, candidates, saver_ranks, savers, saving_ranks, settings_text, usable_gpus

_GiB = 2**30


@dataclass(frozen=True)
class Search:
    """The ranked plans, and how the search went: layouts considered, simulated, seconds taken, on
    how many worker processes (1: none, the search's own)."""

    plans: list[Plan]
    candidates: int
    simulated: int
    seconds: float
    jobs: int = 1


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while searching: the search allocates millions of
    small tuples, and each collection they trigger walks every schedule the search keeps (a third
    of a search's time). What the search drops, reference counting frees, and its costing's caches
    as it returns: none of what it keeps may be tied in a cycle (a collection after the search would
    walk it all: seconds, on the largest requests)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def search(request: PlanRequest, progress=None, every: float = 5.0, jobs: int = 1) -> Search:
    """The ``request.top`` fastest layouts that fit, each with its best memory savers (raises one
    line saying what would fit when none does). ``progress(text)``, if given, hears how far the
    search is every ``every`` seconds. ``jobs`` > 1: candidates are costed ahead on that many
    worker processes (:mod:`~pipeloom.plan.ahead`; the same plans, sooner)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise PipeloomError(f"jobs={jobs!r}: the search needs a whole number >= 1 of worker processes")
    started = said = time.perf_counter()
    costing = Costing(request)
    pool = _pool(request)
    memory = request.cluster.gpu_memory
    order = _variant_order(savers())
    bases: dict[Candidate, list[Candidate]] = defaultdict(list)
    for c in pool:
        if costing.memory_lower_bound(c) <= memory:
            bases[c.base].append(c)
    # best first on the layouts' bounds, a bound raised (and the layout put back) once a
    # simulation of its schedule gives a critical path
    queue = [(min(costing.lower_bound_ms(c) for c in variants), n, base) for n, (base, variants) in
             enumerate(bases.items())]
    heapq.heapify(queue)
    kept: list[tuple] = []  # the best plans so far, a heap whose first entry is the worst
    tried: dict[Candidate, Plan | None] = {}  # simulated: the plan where it fits, without its result (large)
    simulated = 0

    def attempt(c: Candidate) -> Plan | None:
        nonlocal simulated, said
        if c not in tried:
            plan = ahead.plan(c)
            simulated += plan is not None
            tried[c] = replace(plan, result=None) if plan is not None and plan.fits else None  # as workers give it
            if progress is not None and time.perf_counter() - said >= every:
                said = time.perf_counter()
                best = f"; the best so far {min(p.step_ms for _, p in kept):.1f} ms a step" if kept else ""
                progress(f"{simulated} of {len(pool)} layouts simulated after {said - started:.0f} s{best}")
        return tried[c]

    def beaten(bound: float) -> bool:
        """Whether a plan of step ``bound`` would not make the list."""
        return len(kept) == request.top and kept[0][1].beats(bound)

    def bare_first(base: Candidate) -> bool:
        """Whether ``base`` is simulated bare first: its schedule has given no critical path yet."""
        return not costing.steady(base) and base not in tried and not costing.has_path(base)

    def variants_of(base: Candidate) -> list[tuple[float, Candidate]]:
        return sorted(((costing.bound_ms(c), c) for c in bases[base]), key=order)

    def unfit(base: Candidate) -> bool:
        """Whether ``base`` bare surely does not fit (so its variants will be asked)."""
        return base not in bases[base] or (base in tried and tried[base] is None) or (
            costing.first_memory_bound(base) > memory)

    def rest(base: Candidate, after: Candidate | None = None) -> Iterator[tuple[Candidate, str]]:
        """``base``'s variants the loop surely asks once at them, bound first: after ``after``, else
        after the bare layout where it surely does not fit; those of the same bound (no plan of a
        variant before them can beat them) that no plan on the list beats."""
        if (after is None or after == base) and not unfit(base):
            return
        variants = [(bound, c) for bound, c in variants_of(base) if c is not base]
        at = next((k for k, (_, c) in enumerate(variants) if c == after), None)
        start = 0 if at is None else at + 1
        for bound, c in variants[start:]:
            if bound > variants[max(start - 1, 0)][0]:
                return
            if c not in tried and not beaten(bound):
                yield c, BOUND

    def likely(now: tuple[Candidate, str], more: Iterator = iter(())) -> Iterator[tuple[Candidate, str]]:
        """What the loop may ask next, each with what it will ask (:mod:`~pipeloom.plan.ahead`):
        ``now``, then ``more`` (the rest of its layout's variants), then the next layouts bare and,
        where the bare layout surely does not fit, their variants."""
        yield now
        yield from more
        for bound, _, base in heapq.nsmallest(4 * ahead.jobs, queue):
            if beaten(bound):
                break
            if base not in tried and base in bases[base] and not beaten(costing.bound_ms(base)):
                yield base, PLAN if bare_first(base) else BOUND
            yield from rest(base)

    with Ahead(costing, memory, jobs) as ahead:
        while queue:
            bound, n, base = heapq.heappop(queue)
            if beaten(bound):
                break
            if bare_first(base):
                ahead.expect(likely((base, PLAN), rest(base)))
                attempt(base)  # fitting or not, its critical path bounds every variant: put it back on that
            variants = variants_of(base)
            least = min(b for b, _ in variants)
            if least > bound:
                heapq.heappush(queue, (least, n, base))
                continue
            best = None
            for variant_bound, c in variants:
                if best is not None and (best.beats(variant_bound) or best.candidate == base):
                    break  # the bare layout is taken where it fits; no other variant beats ``best``
                if beaten(variant_bound) and c != base:
                    continue  # it would not make the list (the bare layout is asked anyway: where it
                    # fits, it is the layout's plan, and no faster variant of a saver is)
                ahead.expect(likely((c, BOUND), rest(base, c)))
                if c not in tried and ahead.memory_bound(c) > memory:
                    continue  # cannot fit: not worth simulating
                plan = attempt(c)
                if plan is not None and (best is None or taken(plan, best)):
                    best = plan
            if best is not None:
                heapq.heappush(kept, (_Reverse(best.key), best))
                if len(kept) > request.top:
                    heapq.heappop(kept)
        if not kept:
            raise PipeloomError(_smallest_memory(request, costing, ahead, pool, progress, every))
    plans = sorted((entry[1] for entry in kept), key=lambda p: p.key)
    return Search(plans, len(pool), simulated, time.perf_counter() - started, ahead.jobs)


@_collector_paused()
def exhaustive(request: PlanRequest) -> list[Plan]:
    """Every candidate simulated; per layout the bare layout where it fits, else its best variant that
    fits (:func:`taken`); the ``request.top`` fastest layouts (what :func:`search` must return)."""
    costing = Costing(request)
    best: dict[Candidate, Plan] = {}
    for plan in (costing.attempt(c) for c in _pool(request)):
        if plan is not None and plan.fits:
            base = plan.candidate.base
            if base not in best or taken(plan, best[base]):
                best[base] = plan
    return sorted(best.values(), key=lambda p: p.key)[:request.top]


def taken(plan: Plan, over: Plan) -> bool:
    """Whether a layout's ``plan`` is taken over its ``over`` (both fit): the bare layout over any
    variant, else the better key. A memory saver only adds work; where the costs still step a
    saver's variant faster, the saver's order without its work would run no slower: zb-auto orders
    the work by the costs, and its memory limit (ZB-H2's peak under them) can admit a shorter order
    with a saver's smaller activations; 2bw's steady step, two steps' time less one's, can come out
    shorter with added work where the timeline has not settled into its period."""
    bare, over_bare = plan.candidate == plan.candidate.base, over.candidate == over.candidate.base
    return bare if bare != over_bare else plan.key < over.key


def _variant_order(saving: list):
    """The order of a layout's variants, (bound, candidate): the bare layout first, then by bound,
    then the least saving first."""
    def order(entry: tuple[float, Candidate]) -> tuple:
        bound, c = entry
        return c != c.base, bound, *saver_ranks(c, saving)
    return order


class _Reverse:
    """Order a key backwards, so that a min-heap pops the worst plan first."""

    def __init__(self, key):
        self.key = key

    def __lt__(self, other):
        return self.key > other.key


def _pool(request: PlanRequest) -> list[Candidate]:
    pool = list(candidates(request))
    if not pool:
        raise PipeloomError(_most_gpus(request))
    return pool


def _most_gpus(request: PlanRequest) -> str:
    gpus, model = request.cluster.gpus, request.model
    fewer = max((n for n in usable_gpus(request) if n < gpus), default=None)
    what = (f"{model.name} ({model.layers} layers) at seq {request.seq} and global batch {request.global_batch} "
            f"cannot use {gpus} GPUs (pipeline stages at most the layers, data-parallel width dividing the batch, "
            f"seq split into 2 x sp chunks)")
    return f"{what}; at most {fewer} GPUs would" if fewer else what


def _smallest_memory(request: PlanRequest, costing: Costing, ahead: Ahead, pool: list[Candidate], progress=None,
                     every: float = 5.0) -> str:
    """One line: the GPU memory the least demanding layout needs, found best first on each
    candidate's memory bound, tightened a step at a time (:meth:`Costing.memory_bounds`, from
    ``ahead``: on its workers, the next candidates' ahead) as it comes first, so that only
    candidates whose tightest bound is under the least found are simulated. Among equals, those
    that save the most (each saver's most saving value first:
    :attr:`~pipeloom.techniques.PlanAxis.saving`, the smallest microbatch) come first.
    ``progress(text)``, if given, hears how far the hunt is every ``every`` seconds."""
    saving = savers()
    started = said = time.perf_counter()
    tightened = simulated = 0

    def tell():
        nonlocal said
        if progress is not None and time.perf_counter() - said >= every:
            said = time.perf_counter()
            least = f"; the least so far {best[0] / _GiB:.1f} GiB" if best is not None else ""
            progress(f"no layout fits: looking for the least memory one needs, {tightened} memory "
                     f"bound{'s' * (tightened != 1)} tightened and {simulated} layout{'s' * (simulated != 1)} "
                     f"simulated after {said - started:.0f} s{least}")

    def order(c: Candidate) -> tuple:
        return costing.microbatch_memory_bound(c), *saving_ranks(c, saving), c.microbatch_size, c

    def likely(now: tuple[Candidate, tuple]) -> Iterator[tuple[Candidate, tuple]]:
        """The next bounds the hunt asks: ``now``, then of the candidates that come first, each one further."""
        yield now
        for bound, n, c, k in heapq.nsmallest(4 * ahead.jobs, queue):
            if best is not None and (bound, n) >= best[:2]:
                return
            yield c, (BOUNDS, k + 1)

    # (bound, rank in order, candidate, which of its bounds: the first (cheap), then further ones as it comes first)
    queue = [(costing.first_memory_bound(c), n, c, 0) for n, c in enumerate(sorted(pool, key=order))]
    heapq.heapify(queue)
    best: tuple | None = None  # (peak, rank in order, plan)
    while queue:
        bound, n, c, k = heapq.heappop(queue)
        if best is not None and (bound, n) >= best[:2]:
            break
        ahead.expect(likely((c, (BOUNDS, k + 1))))
        tighter = ahead.memory_bound_at(c, k + 1)
        if tighter is not None:
            heapq.heappush(queue, (tighter, n, c, k + 1))
            tightened += 1
            tell()
            continue
        plan = ahead.plan(c)
        simulated += plan is not None
        if plan is not None and (best is None or (max(plan.peak_memory_bytes), n) < best[:2]):
            best = max(plan.peak_memory_bytes), n, plan
        tell()
    have = request.cluster.gpu_memory / _GiB
    head = f"no layout of {request.model.name} on {request.cluster.gpus} GPUs fits {have:.1f} GiB per GPU"
    if best is None:
        return f"{head}: none of the candidate schedules can be built for this batch"
    least, _, plan = best
    c = plan.candidate
    return (f"{head}; the smallest needs {least / _GiB:.1f} GiB (pp {c.pp}, dp {c.dp}, sp {c.sp}, {c.schedule}, "
            f"chunks {c.chunks}, microbatch size {c.microbatch_size}, {settings_text(c)})")
