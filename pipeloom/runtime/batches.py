"""A rank's microbatches of a global batch: its replica's rows, with sequence parallelism
(:class:`SequencePart`) its share of each sequence."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..errors import PipeloomError
from ..modes import Attention
from ..nn.decoder import SequenceParallel, set_sequence_parallel
from ..nn.ring_attention import sequence_layout
from ..schedule import Schedule
from .mesh import Mesh
from .parts import Part


class Batches:
    """Splits global batches for one rank of ``mesh`` running ``schedule``: its replica's rows, then
    each of ``shares`` (``share(tokens, targets)``, a technique's :meth:`~.parts.Part.batch`) in turn.
    Targets have the tokens' shape, or with ``any_input`` (a user's stages: the input may be token
    ids, features, ...) their number of rows."""

    def __init__(self, schedule: Schedule, mesh: Mesh, device: torch.device, shares: Sequence[Callable] = (),
                 any_input: bool = False):
        self.schedule, self.mesh, self.device, self.shares = schedule, mesh, device, tuple(shares)
        self.any_input = any_input

    def split(self, tokens: torch.Tensor, targets: torch.Tensor, steps: int | None = None):
        """This replica's microbatches of every step (the schedule's ``steps``, or ``steps``
        given), in the schedule's numbering."""
        m, dp = self.schedule.microbatches, self.mesh.layout.dp
        steps = self.schedule.steps if steps is None else steps
        if not (tokens.shape[0] == targets.shape[0] if self.any_input else tokens.shape == targets.shape):
            what = "number of rows" if self.any_input else "shape"
            raise PipeloomError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} differ in {what}")
        whole = steps * dp * m
        if tokens.shape[0] % whole:
            what = f"{steps} steps x " if steps > 1 else ""
            raise PipeloomError(
                f"a batch of {tokens.shape[0]} sequences does not divide into {what}dp={dp} x "
                f"microbatches={m}; use a multiple of {whole}"
            )
        # step t's rows of this replica: [(t * dp + dp_rank) * share, ... + share), as views (no index tensor)
        tokens, targets = (x.unflatten(0, (steps, dp, -1))[:, self.mesh.dp_rank].flatten(0, 1).to(self.device)
                           for x in (tokens, targets))
        for share in self.shares:
            tokens, targets = share(tokens, targets)
        return tokens.chunk(steps * m), targets.chunk(steps * m)


class SequencePart(Part):
    """Sequence parallelism in a pipeline: ``attention`` ("ring" or "rsa"; by default "ring" where
    ``sp > 1``, :attr:`attention`) runs over the sp ranks of a stage, each holding a balanced share
    of every sequence (with ``sp=1``, the algorithm on one rank)."""

    keywords = {"attention": None}
    exposes = ("attention",)
    not_for_stages = (
        ("sp", lambda v: v != 1, "sequence parallelism needs attention over the sp group and each token's "
         "global position, which pipeloom's GPT has and your stages do not; use sp=1"),
        ("attention", lambda v: v is not None, "it swaps the attention of pipeloom's GPT; leave it out"),
    )
    #: the attention algorithm run over the sp ranks, or None: torch's scaled_dot_product_attention
    attention = None

    def configure(self, pipe) -> None:
        attention = self.given["attention"]
        self.attention = str(Attention.of(attention)) if attention is not None else "ring" if pipe.sp > 1 else None

    def setup(self, pipe, model) -> None:
        self.mesh, self.stages = pipe.mesh, pipe.stages
        self.layouts: dict[int, object] = {}  # sequence-parallel layout by sequence length

    def batch(self, tokens, targets) -> tuple:
        if not self.attention:
            return tokens, targets
        layout = self._sequence_layout(tokens.shape[1])
        return layout.local(tokens, 1), layout.local(targets, 1)

    def _sequence_layout(self, seq_len: int):
        """The sequence-parallel layout of ``seq_len`` tokens (balanced for causal
        attention), set on this rank's stages."""
        if seq_len not in self.layouts:
            self.layouts[seq_len] = sequence_layout(seq_len, self.mesh.layout.sp, self.mesh.sp_rank, balanced=True)
        layout = self.layouts[seq_len]
        set_sequence_parallel(self.stages.values(), SequenceParallel(self.mesh.sp_group, layout, self.attention))
        return layout
