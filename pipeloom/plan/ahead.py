"""Candidates costed ahead of the search, on worker processes.

The search (:func:`~pipeloom.plan.search.search`) asks dear things of a
candidate: its activation memory bound, its plan (a simulation), and in the
infeasible hunt the next bound of its list. With ``jobs`` > 1, :class:`Ahead`
answers them from ``jobs`` worker processes, forked with the search's
:class:`~pipeloom.plan.evaluate.Costing` (nothing is copied to them), that
work on what the search names as likely next (:meth:`Ahead.expect`) while it
waits for the one it needs. The search decides exactly as it would alone, in
the same order, on the same figures: workers only compute sooner what it
would compute itself, so the plans are the same; what it named and then did
not need is wasted work on a worker, never a changed answer. A critical path
a worker's simulation gives comes back with its plan and bounds the search as
its own would. The candidates of one schedule without its added axes
(:meth:`Costing.bare` of :meth:`Costing.same`: a layout with its recomputation,
offload's policies added to it) stay on the worker that took the first of
them, whose costing keeps what they share (the schedule, offload's sweeps,
the plan of a candidate costed as another, a candidate's bounds so far).
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Iterable, Iterator

from ..errors import PipeloomError
from ..host import usable_cpus
from .evaluate import Costing, Plan
from .space import Candidate


#: The most workers by default: each keeps its own caches (~0.5 GB on the largest bench requests).
MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """The CPUs this process may run on, at most :data:`MAX_DEFAULT_JOBS`: the default number of jobs."""
    return min(usable_cpus(), MAX_DEFAULT_JOBS)


def can_fork() -> bool:
    """Whether workers can be forked here (they inherit the costing rather than receive a copy)."""
    return "fork" in multiprocessing.get_all_start_methods()


#: What the search asks of a candidate: its memory bound, then its plan unless the bound is over
#: the memory; its plan; (:data:`BOUNDS`, k): the k-th of its bounds (the infeasible hunt's).
BOUND, PLAN, BOUNDS = "bound", "plan", "bounds"
Ask = str | tuple[str, int]


class _Bounds:
    """Each candidate's memory bounds (:meth:`Costing.memory_bounds`), worked out as far as asked."""

    def __init__(self, costing: Costing):
        self.costing = costing
        self.taken: dict[Candidate, tuple[Iterator[float], list[float]]] = {}

    def at(self, c: Candidate, k: int) -> float | None:
        """The ``k``-th bound of ``c`` (from 0), or None past its last."""
        bounds, values = self.taken.setdefault(c, (self.costing.memory_bounds(c), []))
        while len(values) <= k:
            value = next(bounds, None)
            if value is None:
                return None
            values.append(value)
        return values[k]


def _work(costing: Costing, memory: float, bounds: _Bounds, c: Candidate, ask: Ask) -> tuple:
    """(``c``'s memory bound (:data:`BOUND`), or (:data:`BOUNDS`, k, its k-th bound), else None;
    whether it was costed; its plan without its simulation (large); the critical path its
    simulation gave). ``c`` is costed unless its bound, asked first, is over the memory, or a bound
    of its list was asked."""
    if isinstance(ask, tuple):
        return (*ask, bounds.at(c, ask[1])), False, None, None
    bound = costing.activation_memory_bound(c, memory) if ask == BOUND else None
    if bound is not None and bound > memory:
        return bound, False, None, None
    plan = costing.attempt(c)
    return bound, True, plan if plan is None else replace(plan, result=None), costing.path(c)


def _holds(found: tuple, ask: Ask) -> bool:
    """Whether :func:`_work`'s ``found`` answers ``ask``."""
    if isinstance(ask, tuple):
        return isinstance(found[0], tuple) and found[0][:2] == ask
    return found[0] is not None and not isinstance(found[0], tuple) if ask == BOUND else found[1]


def _serve(conn, costing: Costing, memory: float) -> None:
    """A worker: answer each (candidate, what is asked) received with (True, :func:`_work`'s) or
    (False, the error raised), until the parent closes the pipe. Ctrl-C is the parent's to
    handle (it stops its workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    bounds = _Bounds(costing)
    while True:
        try:
            c, ask = conn.recv()
        except EOFError:
            return
        try:
            answer = True, _work(costing, memory, bounds, c, ask)
        except Exception as err:  # the parent raises it, as the search alone would have
            try:
                answer = False, pickle.loads(pickle.dumps(err))
            except Exception:
                answer = False, RuntimeError(traceback.format_exc())
        conn.send(answer)


class _Worker:
    """One forked worker: its pipe, its process, and the candidate it is on (None when free)."""

    def __init__(self, context, costing: Costing, memory: float):
        self.conn, there = context.Pipe()
        self.process = context.Process(target=_serve, args=(there, costing, memory), daemon=True)
        self.process.start()
        there.close()
        self.on: Candidate | None = None


class Ahead:
    """``costing``'s memory bounds (under ``memory``) and plans, asked by the search: computed when
    asked with ``jobs`` 1, else on ``jobs`` forked workers that work ahead (use it in a ``with``:
    leaving stops the workers, whatever they are doing)."""

    def __init__(self, costing: Costing, memory: float, jobs: int = 1):
        self.costing, self.memory = costing, memory
        self.jobs = jobs if jobs > 1 and can_fork() else 1
        self._done: dict[Candidate, tuple] = {}  # what _work gave
        self._bounds = _Bounds(costing)  # without workers
        self._likely: Iterator[tuple[Candidate, Ask]] = iter(())
        self._skipped: list[tuple[Candidate, Ask]] = []  # likely, their worker busy when their turn came
        self._workers: list[_Worker] = []
        self._of: dict[Candidate, _Worker] = {}  # the worker of each schedule (:meth:`_key`)
        self._awaited: Candidate | None = None  # the candidate the search waits for a worker to take
        if self.jobs > 1:
            context = multiprocessing.get_context("fork")
            self._workers = [_Worker(context, costing, memory) for _ in range(self.jobs)]

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        # the search's likely candidates: a generator whose frame holds the search's state, this
        # object among it (a cycle that would keep it all until the collector ran)
        self._likely, self._skipped = iter(()), []
        for worker in self._workers:  # what they are working on is not wanted
            worker.process.terminate()
            worker.process.join()
            worker.conn.close()
        self._workers = []

    def expect(self, likely: Iterable[tuple[Candidate, Ask]]) -> None:
        """Work ahead on ``likely`` ((candidate, what will be asked of it: :data:`BOUND`, :data:`PLAN`
        or (:data:`BOUNDS`, k)), in the order the search may ask them): each free worker takes the next
        not yet taken, until the next call (one whose schedule's worker is busy waits for it: :meth:`_free`)."""
        self._likely, self._skipped = iter(likely), []
        self._fill()

    def memory_bound(self, c: Candidate) -> float:
        """:meth:`Costing.activation_memory_bound` of ``c`` under the memory."""
        if self._workers:
            return self._result(c, BOUND)[0]
        return self.costing.activation_memory_bound(c, self.memory)

    def memory_bound_at(self, c: Candidate, k: int) -> float | None:
        """The ``k``-th of :meth:`Costing.memory_bounds` of ``c`` (from 0), or None past its last."""
        if self._workers:
            return self._result(c, (BOUNDS, k))[0][2]
        return self._bounds.at(c, k)

    def plan(self, c: Candidate) -> Plan | None:
        """:meth:`Costing.attempt` of ``c``; its critical path, where a worker's simulation gave one,
        added to the costing."""
        if not self._workers:
            return self.costing.attempt(c)
        _, _, plan, path = self._result(c, PLAN)
        if path is not None:
            self.costing.add_path(c, path)
        return plan

    def _key(self, c: Candidate) -> Candidate:
        """``c``'s schedule: :meth:`Costing.bare` of the candidate costed for it (:meth:`Costing.same`)."""
        return self.costing.bare(self.costing.same(c))

    def _free(self, c: Candidate) -> _Worker | None:
        """The worker for ``c`` if it is free, else None: the one that took the first candidate of its
        schedule, whose caches hold what they share (the whole plan, for a candidate costed as another),
        else any; the worker of the candidate the search waits for is kept for that one."""
        held = self._of.get(self._key(self._awaited)) if self._awaited not in (None, c) else None
        key = self._key(c)
        worker = self._of.get(key)
        if worker is None:
            worker = next((w for w in self._workers if w.on is None and w is not held), None)
        if worker is None or worker.on is not None or worker is held:
            return None
        self._of[key] = worker
        return worker

    def _busy(self, c: Candidate) -> bool:
        return any(worker.on == c for worker in self._workers)

    def _fill(self) -> None:
        """Start the likely candidates, in turn, on the free workers; those whose schedule's worker
        is busy wait for their next turn."""
        waiting, self._skipped = self._skipped, []
        for n, (c, ask) in enumerate(waiting):
            if all(worker.on is not None for worker in self._workers):
                self._skipped += waiting[n:]
                return
            self._offer(c, ask)
        while any(worker.on is None for worker in self._workers):
            item = next(self._likely, None)
            if item is None:
                return
            self._offer(*item)

    def _offer(self, c: Candidate, ask: Ask) -> None:
        if self._busy(c) or c in self._done and _holds(self._done[c], ask):
            return
        worker = self._free(c)
        if worker is None:
            self._skipped.append((c, ask))
        else:
            self._start(worker, c, ask)

    def _result(self, c: Candidate, ask: Ask) -> tuple:
        """What a worker gave for ``c`` holding what is asked (:func:`_holds`), started now (once its
        worker is free) where no worker has given or is giving it, and again where what it gave lacks
        that (a plan not costed as its bound was over the memory; a bound not asked first)."""
        while True:
            while self._busy(c):
                self._take()
            found = self._done.get(c)
            if found is not None and _holds(found, ask):
                return found
            self._awaited = c
            while not self._busy(c) and (worker := self._free(c)) is None:
                self._take()
            self._awaited = None
            if not self._busy(c):
                self._start(worker, c, ask)

    def _start(self, worker: _Worker, c: Candidate, ask: Ask) -> None:
        worker.conn.send((c, ask))
        worker.on = c

    def _take(self) -> None:
        """Wait for the next worker to finish, then start what is likely next; its error raised,
        a worker's death said in one line."""
        busy = [worker for worker in self._workers if worker.on is not None]
        ready = wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
        for worker in busy:
            if worker.conn in ready:
                try:
                    ok, answer = worker.conn.recv()
                except EOFError:
                    ok = None
            elif worker.process.sentinel in ready:
                ok = None
            else:
                continue
            c, worker.on = worker.on, None
            if ok is None:
                worker.process.join(5)
                raise PipeloomError(f"a planner worker died while costing {c} (exit code {worker.process.exitcode}: "
                                    f"killed, or out of memory?): run the search with one job "
                                    f"(pipeloom plan --jobs 1)")
            if not ok:
                raise answer
            self._done[c] = answer
        self._fill()
