"""Point-to-point transfers between pipeline ranks, with timeouts that name who waited for what.

Each direction of each link between two ranks has a process group of its
own, so its messages are matched in the order they are sent, on every backend
(NCCL matches in posting order; gloo does for one tag). Sends are
non-blocking (``isend``). A receive is posted ahead (``post``, non-blocking)
in its link's send order and collected when needed (``recv``), which blocks
until its data arrives or the timeout passes.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import PipeloomError
from ..schedule.links import Message

class PeerTimeout(PipeloomError):
    """A peer did not deliver in time: it died, stalled, or runs another schedule."""


class Channel:
    """Sends and receives of one rank (global rank ``rank``) to and from its pipeline
    peers; ``groups[(src, dst)]`` is the process group of the link ``src -> dst``."""

    def __init__(self, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup], timeout: float):
        self.rank, self.groups, self.timeout = rank, groups, timeout
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.posted: dict[Message, tuple[torch.Tensor, int, dist.Work]] = {}

    def open(self, device: torch.device) -> None:
        """Pass a first message over each of this rank's links, in the order of ``groups``
        (the same on every rank, so this cannot deadlock), so that no backend sets a
        link up lazily, blocking, in the middle of a step."""
        for (src, dst), group in self.groups.items():
            hello = torch.zeros(1, device=device)
            work = dist.isend(hello, dst, group=group) if self.rank == src else dist.irecv(hello, src, group=group)
            self.wait(work, f"opening the link from rank {src} to rank {dst}")

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.contiguous()
        self.send_work(dist.isend(tensor, dst=peer, group=self.groups[(self.rank, peer)]), tensor)

    def send_work(self, work: dist.Work, tensor: torch.Tensor) -> None:
        """Count ``work`` (a send of ``tensor``, or a collective this rank only gives to)
        among the sends :meth:`flush` waits for, keeping ``tensor`` alive until then."""
        self.pending.append((work, tensor))

    def post(self, buffer: torch.Tensor, peer: int, message: Message) -> None:
        """Start receiving ``message`` from ``peer`` into ``buffer``; post in the link's send order."""
        work = dist.irecv(buffer, src=peer, group=self.groups[(peer, self.rank)])
        self.posted[message] = (buffer, peer, work)

    def recv(self, message: Message, action) -> torch.Tensor:
        """Wait for the receive :meth:`post` started; return its buffer."""
        buffer, peer, work = self.posted.pop(message)
        self.wait(work, f"action {action} waited for the {message.kind} of stage {message.stage} "
                        f"microbatch {message.microbatch} from rank {peer}")
        return buffer

    def flush(self) -> None:
        """Wait for every send posted so far to complete."""
        for work, _ in self.pending:
            self.wait(work, "the end of the step waited for its sends to be received")
        self.pending.clear()

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``; a timeout or a failed peer raises :class:`PeerTimeout` saying ``what`` waited."""
        try:
            finished = work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise PeerTimeout(f"rank {self.rank}: {what}, and it failed after up to {self.timeout:g} s: "
                              f"{_reason(err)}") from None
        if finished is False:
            raise PeerTimeout(f"rank {self.rank}: {what} for {self.timeout:g} s; is that rank alive?")


def _reason(err: RuntimeError) -> str:
    """The backend's reason without its source location and boilerplate advice."""
    text = re.sub(r"\[[^\]]*:\d+\] ", "", str(err).strip())
    return text.split(" This is typically caused")[0]

