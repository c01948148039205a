"""A rank's microbatches of a global batch: its replica's rows, with sequence parallelism its share of each sequence."""

from __future__ import annotations

import torch

from ..errors import PipeloomError
from ..nn.decoder import SequenceParallel, set_sequence_parallel
from ..nn.ring_attention import sequence_layout
from ..schedule import Schedule
from .mesh import Mesh


class Batches:
    """Splits global batches for one rank of ``mesh`` running ``schedule``; with
    ``attention`` (sequence parallelism) sets each new sequence length's layout on ``stages``.
    Targets have the tokens' shape, or with ``any_input`` (a user's stages: the input may be token
    ids, features, ...) their number of rows."""

    def __init__(self, schedule: Schedule, mesh: Mesh, stages, device: torch.device, attention: str | None,
                 any_input: bool = False):
        self.schedule, self.mesh, self.stages, self.device, self.attention = schedule, mesh, stages, device, attention
        self.any_input = any_input
        self.layouts: dict[int, object] = {}  # sequence-parallel layout by sequence length

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
        if self.attention:  # this rank's share of every sequence
            layout = self._sequence_layout(tokens.shape[1])
            tokens, targets = layout.local(tokens, 1), layout.local(targets, 1)
        return tokens.chunk(steps * m), targets.chunk(steps * m)

    def _sequence_layout(self, seq_len: int):
        """The sequence-parallel layout of ``seq_len`` tokens (balanced for causal
        attention), set on this rank's stages."""
        if seq_len not in self.layouts:
            self.layouts[seq_len] = sequence_layout(seq_len, self.mesh.layout.sp, self.mesh.sp_rank, balanced=True)
        layout = self.layouts[seq_len]
        set_sequence_parallel(self.stages.values(), SequenceParallel(self.mesh.sp_group, layout, self.attention))
        return layout
