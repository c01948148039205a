"""Each rank's heartbeat in the process group's store: tells a peer that is alive but busy
from one that died or stalled.

A daemon thread writes ``pipeloom/heartbeat/<global rank>`` every ``INTERVAL`` seconds:
a beat count and what the rank does now (runs an action, waits for peers, or is outside
a pipeline step) and for how long, by its own clock. Another watches this rank's waits:
one that has lasted its timeout makes it read the keys of the ranks waited for, and of
the ranks those wait for in turn, and watch whether their counts advance (no clock is
compared across hosts). It ends the wait if they died or stalled, and says once per
timeout that it goes on while one of them is busy.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

INTERVAL = 1.0  # seconds between beats
SILENT = 3 * INTERVAL  # a rank whose count does not advance for this long died or hangs
PREFIX = "pipeloom/heartbeat/"
STORE_TIMEOUT = 10.0  # seconds a store operation of the beat or the watch may take before it fails


@dataclass
class Beat:
    """What a rank last wrote: ``kind`` is busy, waiting (for ``peers``) or idle, for ``seconds``."""

    count: int
    kind: str
    seconds: int
    peers: tuple[int, ...]
    what: str

    @classmethod
    def parse(cls, text: str) -> Beat:
        count, kind, seconds, peers, what = text.split(" ", 4)
        return cls(int(count), kind, int(seconds), tuple(int(p) for p in peers.split(",") if p != "-"), what)


class Heartbeat:
    """This process's beat (global rank ``rank``) in ``store``, what it reads of its peers',
    and the watch on its waits, which calls ``close(group)`` to end one on ``group``.
    Without a store it only keeps the state, and :meth:`diagnose` says nothing."""

    def __init__(self, store: dist.Store | None, rank: int, close):
        self.store, self.rank, self.close = store, rank, close
        #: (kind, what, since, group waited on, timeout of a watched wait); set by the main thread
        self.now: tuple = ("busy", "setting up the pipeline", time.monotonic(), None, None)
        self.ended: tuple | None = None  # (a wait's state, why the watch ended it)
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=run, daemon=True, name=f"pipeloom{run.__name__}")
                        for run in ((self._beat, self._watch) if store is not None else ())]
        for thread in self.threads:
            thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the threads and wait until they have: one still in the store's C++ code (which runs
        without the GIL) when Python finalizes is ended by pthread_exit, whose unwinding through
        that code aborts the process ("terminate called without an active exception"). A store
        operation ends within :data:`STORE_TIMEOUT`."""
        self.stopped.set()
        for thread in self.threads:
            thread.join(STORE_TIMEOUT + INTERVAL)

    def running(self, action) -> None:
        self.now = ("busy", action, time.monotonic(), None, None)

    def waiting(self, what: str, group: dist.ProcessGroup, timeout: float | None) -> tuple:
        """Waiting for the other ranks of ``group``: ``what`` waited; watched after ``timeout``
        seconds unless None. Returns the state, for :meth:`why_ended`."""
        self.now = ("waiting", what, time.monotonic(), group, timeout)
        return self.now

    def idle(self) -> None:
        self.now = ("idle", "outside a pipeline step", time.monotonic(), None, None)

    def why_ended(self, state: tuple) -> str | None:
        """Why the watch ended the wait of ``state``, if it did."""
        return self.ended[1] if self.ended is not None and self.ended[0] is state else None

    def _beat(self) -> None:
        count = 0
        while dist.is_initialized() and not self.stopped.is_set():
            kind, what, since, group, _ = self.now
            what = what if isinstance(what, str) else f"running action {what}"
            try:
                self.store.set(PREFIX + str(self.rank),
                               f"{count} {kind} {time.monotonic() - since:.0f} {_peers(group, self.rank)} {what}")
            except (RuntimeError, KeyError):
                return  # the store or the group is gone (shutting down)
            count += 1
            self.stopped.wait(INTERVAL)

    def _watch(self) -> None:
        due = None  # (a wait's state, when to look at its peers next)
        while not self.stopped.wait(INTERVAL / 4):
            state = self.now
            kind, what, since, group, timeout = state
            if kind != "waiting" or timeout is None:
                continue
            if due is None or due[0] is not state:
                due = (state, since + timeout)
            if time.monotonic() < due[1]:
                continue
            verdict = self.diagnose(dist.get_process_group_ranks(group), timeout / 2)
            if self.now is not state or self.stopped.is_set():
                continue  # the wait ended while we looked, or the process is shutting down
            stop, why = verdict or (True, "is that rank alive?")
            message = f"rank {self.rank}: {what} for {time.monotonic() - since:.0f} s; {why}"
            if stop:
                self.ended = (state, message)
                self.close(group)
            else:
                print(f"pipeloom: {message}; still waiting", file=sys.stderr, flush=True)
            due = (state, time.monotonic() + timeout)

    def read(self, rank: int) -> Beat | None:
        key = PREFIX + str(rank)
        return Beat.parse(self.store.get(key).decode()) if self.store.check([key]) else None

    def diagnose(self, ranks, patience: float) -> tuple[bool, str] | None:
        """Whether to stop waiting for ``ranks`` (global), and why or why not in a clause such as
        ``rank 1 is alive and busy running action 1F0 (for 5 s)``, from their beats and those of
        the ranks they wait for in turn, watched for up to ``SILENT`` seconds. It stops at a rank
        that went silent; goes on while a rank is busy, or has waited or idled for less than
        ``patience`` seconds (it may be on its way: what it waits for may be in flight); else
        stops: all wait or idle. None without a store, or if it cannot be read."""
        ranks = [r for r in ranks if r != self.rank]
        if self.store is None or not ranks:
            return None
        try:
            first = self._wait_graph(ranks)
            last = dict(first)
            deadline = time.monotonic() + SILENT
            while time.monotonic() < deadline:
                quiet = [r for r in first if not _advanced(first[r], last[r])]
                if not quiet:
                    break
                if self.stopped.wait(INTERVAL / 4):
                    return None  # shutting down
                last.update((r, self.read(r)) for r in quiet)
        except RuntimeError:
            return None
        for r in first:
            if not _advanced(first[r], last[r]):
                heard = "has never been heard from" if last[r] is None else f"has not been heard from for {SILENT:g} s"
                return True, f"rank {r} {heard}: it died or hangs"
        for r in first:
            if last[r].kind == "busy":
                return False, f"rank {r} is alive and busy {last[r].what} (for {last[r].seconds} s)"
        for r in first:
            if last[r].seconds < patience:
                return False, f"rank {r} is alive and has just moved on: {last[r].what} for {last[r].seconds} s"
        # all have waited or idled a while: name a rank waited for, one that idles or waits for another first
        r = min(ranks, key=lambda r: (last[r].kind != "idle", self.rank in last[r].peers))
        beat = last[r]
        if beat.kind == "idle":
            return True, f"rank {r} is alive but not running a pipeline step (for {beat.seconds} s)"
        return True, f"rank {r} is alive but stalled: {beat.what} for {beat.seconds} s"

    def _wait_graph(self, ranks) -> dict[int, Beat | None]:
        """The beats of ``ranks`` and of the ranks they wait for, in turn (this rank excluded)."""
        beats: dict[int, Beat | None] = {}
        todo = list(ranks)
        while todo:
            r = todo.pop()
            if r in beats or r == self.rank:
                continue
            beats[r] = self.read(r)
            if beats[r] is not None and beats[r].kind == "waiting":
                todo.extend(beats[r].peers)
        return beats


def _peers(group: dist.ProcessGroup | None, rank: int) -> str:
    """The other ranks of ``group`` as written in a beat (raises KeyError once it is destroyed)."""
    return ",".join(str(r) for r in dist.get_process_group_ranks(group) if r != rank) if group is not None else "-"


def _advanced(first: Beat | None, last: Beat | None) -> bool:
    return last is not None and (first is None or last.count != first.count)


_current: Heartbeat | None = None
_current_store = None


def start(rank: int, close) -> Heartbeat:
    """This process's heartbeat in the default process group's store, started on first use
    (again after the group is re-created), its state "setting up the pipeline"; ``close(group)``
    ends a wait on ``group`` (see :class:`Heartbeat`)."""
    global _current, _current_store
    store = dist.distributed_c10d._get_default_store()
    if _current is None or store is not _current_store:
        if _current is not None:
            _current.stop()
        try:
            own = store.clone()  # a connection of its own: the group's blocking waits never delay a beat
            own.set_timeout(timedelta(seconds=STORE_TIMEOUT))  # a stopped store server makes a read fail, not hang
        except (RuntimeError, NotImplementedError):
            own = None  # a store that cannot be shared with a thread: waits time out as plain timeouts
        _current, _current_store = Heartbeat(own, rank, close), store
    _current.now = ("busy", "setting up the pipeline", time.monotonic(), None, None)
    return _current


def stop() -> None:
    """Stop this process's heartbeat, if it has one (the run is over)."""
    if _current is not None:
        _current.stop()


FAILED = "pipeloom/failed"  # the store key naming the first rank that failed, and why


def _store() -> dist.Store | None:
    """A connection of this thread's own to the default group's store, or None."""
    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(timedelta(seconds=5))
        return store
    except (RuntimeError, ValueError, NotImplementedError, dist.DistError):
        return None


def record_failure(rank: int, cause: str) -> None:
    """Say in the store that ``rank`` failed with ``cause``, unless another rank failed first."""
    store = _store()
    try:
        if store is not None:
            store.compare_set(FAILED, "", f"{rank} {cause}")
    except (RuntimeError, dist.DistError):
        pass  # the store is gone: the peers learn of the failure from their links


def first_failure() -> tuple[int, str] | None:
    """(rank, cause) of the first rank that recorded a failure, or None."""
    store = _store()
    try:
        if store is None or not store.check([FAILED]):
            return None
        rank, cause = store.get(FAILED).decode().split(" ", 1)
        return int(rank), cause
    except (RuntimeError, dist.DistError, ValueError):
        return None
