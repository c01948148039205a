"""Point-to-point transfers between pipeline ranks, with timeouts that name who waited for what.

Sends are non-blocking (``isend``). A receive is posted ahead (``post``,
non-blocking) and collected when needed (``recv``), which blocks until its
data arrives or the timeout passes. Every message carries a tag made from its kind,
stage and microbatch, so a receive can only match the message it expects.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import PipeloomError

_KINDS = ("activation", "gradient")


class PeerTimeout(PipeloomError):
    """A peer did not deliver in time: it died, stalled, or runs another schedule."""


def tag(kind: str, stage: int, microbatch: int, stages: int) -> int:
    return (microbatch * stages + stage) * len(_KINDS) + _KINDS.index(kind)


class Channel:
    """Sends and receives of one rank to and from its pipeline peers (global ranks)."""

    def __init__(self, rank: int, stages: int, timeout: float):
        self.rank, self.stages, self.timeout = rank, stages, timeout
        self.pending: list[dist.Work] = []
        self.posted: dict[tuple[str, int, int], tuple[torch.Tensor, int, dist.Work]] = {}

    def send(self, tensor: torch.Tensor, peer: int, kind: str, stage: int, microbatch: int) -> None:
        self.pending.append(dist.isend(tensor.contiguous(), dst=peer, tag=tag(kind, stage, microbatch, self.stages)))

    def post(self, buffer: torch.Tensor, peer: int, kind: str, stage: int, microbatch: int) -> None:
        """Start receiving into ``buffer`` the ``kind`` that ``stage`` on ``peer`` makes for ``microbatch``."""
        work = dist.irecv(buffer, src=peer, tag=tag(kind, stage, microbatch, self.stages))
        self.posted[(kind, stage, microbatch)] = (buffer, peer, work)

    def recv(self, kind: str, stage: int, microbatch: int, action) -> torch.Tensor:
        """Wait for the receive :meth:`post` started; return its buffer."""
        buffer, peer, work = self.posted.pop((kind, stage, microbatch))
        self.wait(work, f"action {action} waited for the {kind} of stage {stage} microbatch {microbatch} from rank {peer}")
        return buffer

    def flush(self) -> None:
        """Wait for every send posted so far to complete."""
        for work in self.pending:
            self.wait(work, "the end of the step waited for its sends to be received")
        self.pending.clear()

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work``; a timeout or a failed peer raises :class:`PeerTimeout` saying ``what`` waited."""
        try:
            finished = work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise PeerTimeout(f"rank {self.rank}: {what}, and it failed after up to {self.timeout:g} s: {err}") from None
        if finished is False:
            raise PeerTimeout(f"rank {self.rank}: {what} for {self.timeout:g} s; is that rank alive?")
