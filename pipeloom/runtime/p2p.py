"""Point-to-point transfers between pipeline ranks, with timeouts that name who waited for what.

Each direction of each link between two ranks has a process group of its
own, so its messages are matched in the order they are sent, on every backend
(NCCL matches in posting order; gloo does for one tag). Sends are
non-blocking (``isend``). A receive is posted ahead (``post``, non-blocking)
in its link's send order and collected when needed (``recv``), which blocks
until its data arrives. A sent tensor is held while its send is in flight
(:meth:`Channel.send_work`). A link whose peer is gone fails when a transfer is
started on it as well as when one is waited for; both raise :class:`PeerTimeout`
naming the action.

A wait that lasts ``timeout`` seconds on gloo is watched through the peers'
heartbeats (:mod:`.heartbeat`): one that died, hangs or stalls ends it with a
:class:`PeerTimeout`; while one is alive and busy it goes on (a line on stderr each
``timeout``), up to the process group's own timeout. On NCCL, which aborts the
communicator of a wait that times out, the step stops at ``timeout`` as before.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import PipeloomError
from . import heartbeat

class PeerTimeout(PipeloomError):
    """A peer did not deliver in time: it died, stalled, or runs another schedule."""


class Channel:
    """Sends and receives of one rank (global rank ``rank``) to and from its pipeline
    peers; ``groups[(src, dst)]`` is the process group of the link ``src -> dst``."""

    def __init__(self, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup], timeout: float):
        self.rank, self.groups, self.timeout = rank, groups, timeout
        #: sends in flight: (work, tensor, group, (peer, the position of its consumer in the peer's list) or None)
        self.pending: list[tuple[dist.Work, torch.Tensor, dist.ProcessGroup, tuple[int, int] | None]] = []
        #: the running call's :func:`~pipeloom.schedule.lower.proofs`, None where its sends wait for :meth:`flush`
        self.proofs: tuple[dict, dict] | None = None
        self.posted: dict = {}  # a posted receive's key -> (buffer, peer, work, what it receives)
        self.heartbeat = heartbeat.start(rank, _close)
        self.watched = self.heartbeat.store is not None and dist.get_backend() == "gloo"

    def open(self, device: torch.device) -> None:
        """Pass a first message over each of this rank's links, in the order of ``groups``
        (the same on every rank, so this cannot deadlock), so that no backend sets a
        link up lazily, blocking, in the middle of a step."""
        for (src, dst), group in self.groups.items():
            hello = torch.zeros(1, device=device)
            work = dist.isend(hello, dst, group=group) if self.rank == src else dist.irecv(hello, src, group=group)
            self.wait(work, f"opening the link from rank {src} to rank {dst}", group)

    def send(self, tensor: torch.Tensor, peer: int, action, what: str) -> None:
        """Start sending ``what`` (``tensor``), which ``action`` hands on, to ``peer``."""
        tensor = tensor.contiguous()
        group = self.groups[(self.rank, peer)]
        try:
            work = dist.isend(tensor, dst=peer, group=group)
        except RuntimeError as err:
            raise self._failed(f"action {action} sent {what} to rank {peer}", err) from None
        self.send_work(work, tensor, group, self.proofs and self.proofs[0].get(action))

    def send_work(self, work: dist.Work, tensor: torch.Tensor, group: dist.ProcessGroup,
                  consumer: tuple[int, int] | None = None) -> None:
        """Count ``work`` (a send of ``tensor`` over ``group``, or a collective this rank only
        gives to) among the sends in flight, keeping ``tensor`` alive until it completes, so that a
        step holds a message only while it is in flight, not until :meth:`flush` at its end (a
        stage's outputs or input gradients of every microbatch). The oldest ones that report complete
        are let go first (waited for, which raises where one failed): NCCL reports a send complete
        once its kernel ran; gloo only once waited for, so there a send is let go once a message
        proves it received (``consumer``: its peer's pipeline rank and the position of the action
        that consumes it, :meth:`recv`), else at :meth:`flush`."""
        done = 0
        while done < len(self.pending) and self.pending[done][0].is_completed():
            done += 1
        if done:
            finished, self.pending = self.pending[:done], self.pending[done:]
            for sent, _, link, _ in finished:
                self.wait(sent, "a send of the step, found complete,", link)
        self.pending.append((work, tensor, group, consumer))

    def post(self, buffer: torch.Tensor, peer: int, receive, what: str) -> None:
        """Start receiving ``what`` from ``peer`` into ``buffer`` (the action ``receive``);
        post in the link's send order."""
        try:
            work = dist.irecv(buffer, src=peer, group=self.groups[(peer, self.rank)])
        except RuntimeError as err:
            raise self._failed(f"action {receive} posted the receive of {what} from rank {peer}", err) from None
        self.posted[receive] = (buffer, peer, work, what)

    def recv(self, receive, action) -> torch.Tensor:
        """Wait for the receive :meth:`post` started as ``receive``, which ``action`` needs; its buffer."""
        buffer, peer, work, what = self.posted.pop(receive)
        self.wait(work, f"action {action} waited for {what} from rank {peer}", self.groups[(peer, self.rank)])
        sent = self.proofs and self.proofs[1].get(receive)
        if sent and self.pending:  # the peer got every send its list consumed before it sent this
            kept, proved = [], []
            for entry in self.pending:
                consumer = entry[3]
                (proved if consumer and consumer[0] == sent[0] and consumer[1] < sent[1] else kept).append(entry)
            if proved:
                self.pending = kept
                for done, _, link, _ in proved:
                    self.wait(done, "a send of the step, received by its peer,", link)
        return buffer

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup, what: str,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, watch: bool = True) -> None:
        """Reduce ``tensor`` over ``group`` by ``op`` (a sum by default), waited for as
        :meth:`wait` does, saying ``what`` waited."""
        if dist.get_world_size(group) > 1:
            self.wait(dist.all_reduce(tensor, op=op, group=group, async_op=True), what, group, watch)

    def all_gather(self, tensor: torch.Tensor, group: dist.ProcessGroup, what: str,
                   watch: bool = True) -> list[torch.Tensor]:
        """Every rank's ``tensor`` over ``group``, by rank in the group, waited for as :meth:`all_reduce`."""
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        self.wait(dist.all_gather(parts, tensor, group=group, async_op=True), what, group, watch)
        return parts

    def flush(self) -> None:
        """Wait for every send posted so far to complete."""
        for work, _, group, _ in self.pending:
            self.wait(work, "the end of the step waited for its sends to be received", group)
        self.pending.clear()

    def wait(self, work: dist.Work, what: str, group: dist.ProcessGroup, watch: bool = True) -> None:
        """Wait for ``work`` on ``group``; a failed, dead or stalled peer raises :class:`PeerTimeout`
        saying ``what`` waited, a busy one is waited for (see the module's docstring). Unless ``watch``,
        only the group's own timeout bounds the wait: for the collectives between steps, which a peer
        may reach late after work of its own outside a step (saving a checkpoint)."""
        watched = watch and self.watched
        previous = self.heartbeat.now
        state = self.heartbeat.waiting(what, group, self.timeout if watched else None)
        start = time.monotonic()
        try:
            # gloo's own timeout would close the link: watched, the wait is bounded by the group's
            timed = watch and not self.watched
            finished = work.wait(timeout=timedelta(seconds=self.timeout)) if timed else work.wait()
        except RuntimeError as err:
            others = [r for r in dist.get_process_group_ranks(group) if r != self.rank]
            if not all(re.search(rf"\brank {r}\b", what) for r in others):
                what += f" (from rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
            ended = self.heartbeat.why_ended(state)
            raise (PeerTimeout(ended) if ended else self._failed(
                what, err, f" after {time.monotonic() - start:.0f} s")) from None
        finally:
            self.heartbeat.now = previous
        if finished is False:
            raise PeerTimeout(f"rank {self.rank}: {what} for {self.timeout:g} s; is that rank alive?")

    def _failed(self, what: str, err: RuntimeError, when: str = "") -> PeerTimeout:
        """The error of a transfer that ``what`` describes, which failed (``when``) with ``err``."""
        return PeerTimeout(f"rank {self.rank}: {what}, and it failed{when}: {_reason(err)}")


def _close(group: dist.ProcessGroup) -> None:
    """Close this rank's gloo links of ``group`` as gloo does when a wait on one times out:
    every wait on them ends with an error, here and at the peers."""
    for peer in dist.get_process_group_ranks(group):
        if peer != dist.get_rank():
            try:
                dist.irecv(torch.empty(1), peer, group=group).wait(timeout=timedelta(milliseconds=1))
            except RuntimeError:
                pass  # the timeout that closes the link, or a link closed already


def _reason(err: RuntimeError) -> str:
    """The backend's reason without its source location and boilerplate advice."""
    text = re.sub(r"\[[^\]]*:\d+\] ", "", str(err).strip())
    return text.split(" This is typically caused")[0]

