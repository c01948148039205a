"""Candidates costed ahead of the search, on worker processes.

The search (:func:`~pipeloom.plan.search.search`) asks two dear things of a
candidate: its activation memory bound and its plan (a simulation). With
``jobs`` > 1, :class:`Ahead` answers both from ``jobs`` worker processes,
forked with the search's :class:`~pipeloom.plan.evaluate.Costing` (nothing is
copied to them), that work on the candidates the search names as likely next
(:meth:`Ahead.expect`) while it waits for the one it needs. The search decides
exactly as it would alone, in the same order, on the same figures: workers
only compute sooner what it would compute itself, so the plans are the same;
what it named and then did not need is wasted work on a worker, never a
changed answer. A critical path a worker's simulation gives comes back with
its plan and bounds the search as its own would. Each layout's candidates go
to one worker, whose costing keeps the schedules they share (a layout's
variants build on its bare schedule).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import traceback
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Iterable, Iterator

from ..errors import PipeloomError
from .evaluate import Costing, Plan
from .space import Candidate


#: The most workers by default: each keeps its own caches (~0.5 GB on the largest bench requests).
MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """The CPUs this process may run on, at most :data:`MAX_DEFAULT_JOBS`: the default number of jobs."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cpus = os.cpu_count() or 1
    return min(cpus, MAX_DEFAULT_JOBS)


def can_fork() -> bool:
    """Whether workers can be forked here (they inherit the costing rather than receive a copy)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _work(costing: Costing, memory: float, c: Candidate, bound_first: bool) -> tuple:
    """(``c``'s memory bound if ``bound_first``, else None; whether it was costed; its plan without
    its simulation (large); the critical path its simulation gave). ``c`` is costed unless its
    bound, asked first, is over the memory."""
    bound = costing.activation_memory_bound(c, memory) if bound_first else None
    if bound is not None and bound > memory:
        return bound, False, None, None
    plan = costing.attempt(c)
    return bound, True, plan if plan is None else replace(plan, result=None), costing.path(c)


def _serve(conn, costing: Costing, memory: float) -> None:
    """A worker: answer each (candidate, bound first) received with (True, :func:`_work`'s) or
    (False, the error raised), until the parent closes the pipe. Ctrl-C is the parent's to
    handle (it stops its workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            c, bound_first = conn.recv()
        except EOFError:
            return
        try:
            answer = True, _work(costing, memory, c, bound_first)
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
        self._likely: Iterator[tuple[Candidate, bool]] = iter(())
        self._workers: list[_Worker] = []
        self._of: dict[Candidate, int] = {}  # each layout's worker
        if self.jobs > 1:
            context = multiprocessing.get_context("fork")
            self._workers = [_Worker(context, costing, memory) for _ in range(self.jobs)]

    def __enter__(self) -> Ahead:
        return self

    def __exit__(self, *exc) -> None:
        for worker in self._workers:  # what they are working on is not wanted
            worker.process.terminate()
            worker.process.join()
            worker.conn.close()
        self._workers = []

    def expect(self, likely: Iterable[tuple[Candidate, bool]]) -> None:
        """Work ahead on ``likely`` ((candidate, whether its memory bound comes first), in the order the
        search may ask them): each worker, when free, takes the next of its layouts not yet taken,
        until the next call."""
        self._likely = iter(likely)
        self._fill()

    def memory_bound(self, c: Candidate) -> float:
        """:meth:`Costing.activation_memory_bound` of ``c`` under the memory."""
        if self._workers:
            return self._result(c, True)[0]
        return self.costing.activation_memory_bound(c, self.memory)

    def plan(self, c: Candidate) -> Plan | None:
        """:meth:`Costing.attempt` of ``c``; its critical path, where a worker's simulation gave one,
        added to the costing."""
        if not self._workers:
            return self.costing.attempt(c)
        _, _, plan, path = self._result(c, False)
        if path is not None:
            self.costing.add_path(c, path)
        return plan

    def _worker(self, c: Candidate) -> _Worker:
        """The worker of ``c``'s layout (of the candidate costed for it: :meth:`Costing.same`): the
        next in turn for a layout not seen before."""
        n = self._of.setdefault(self.costing.same(c).base, len(self._of) % len(self._workers))
        return self._workers[n]

    def _busy(self, c: Candidate) -> bool:
        return any(worker.on == c for worker in self._workers)

    def _fill(self) -> None:
        """Start the next likely candidates whose workers are free."""
        if not any(worker.on is None for worker in self._workers):
            return
        for c, bound_first in self._likely:
            worker = self._worker(c)
            if worker.on is None and c not in self._done and not self._busy(c):
                self._start(worker, c, bound_first)
                if all(worker.on is not None for worker in self._workers):
                    return

    def _result(self, c: Candidate, bound_first: bool) -> tuple:
        """What a worker gave for ``c`` holding what is asked (its memory bound with ``bound_first``,
        else its plan), started now (once its worker is free) where no worker has given or is giving
        it, and again where what it gave lacks that (a plan not costed as its bound was over the
        memory; a bound not asked first)."""
        while True:
            if c not in self._done and not self._busy(c):
                worker = self._worker(c)
                while worker.on is not None:
                    self._take()
                self._start(worker, c, bound_first)
            while c not in self._done:
                self._take()
            found = self._done[c]
            if found[0] is not None if bound_first else found[1]:
                return found
            del self._done[c]

    def _start(self, worker: _Worker, c: Candidate, bound_first: bool) -> None:
        worker.conn.send((c, bound_first))
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
