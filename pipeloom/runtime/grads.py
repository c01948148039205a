"""Gradients after the backward passes: averaged over replicas, summed over tied copies, clipped, gathered.

A stage's gradients are final after its last backward on the rank (and the
send of that backward's input gradient: the critical path first); the
average over the data-parallel replicas starts then, overlapped with the rest
of the step, and is waited for at its end (:meth:`Gradients.finish`).
Tied input/output embeddings (:class:`~pipeloom.nn.gpt.GPTStage`'s ``tied``)
wait for the end: each copy gets the sum of both gradients first, as
Megatron's embedding group does. Every wait says which rank and what waited.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PipeloomError
from ..schedule import BW, B, W
from ..schedule.ir import parts
from ..schedule.lower import SEND_B
from .context import Context
from .handlers.vocab import GRADIENT_PASSES, NAME, SHARDS

_AVERAGE = "averaging gradients over the data-parallel replicas"
_TIED = "summing the tied embedding's gradients"


def finals(actions, microbatches: int) -> dict[int, list[tuple]]:
    """After which action (index in ``actions``) each stage's gradient of each step is
    final: index -> [(stage, step of the call)]; the vocabulary shards' as stage ``SHARDS``."""
    last = {}
    for k, action in enumerate(actions):
        for part in parts(action):
            if part.kind in (B, W, BW, SEND_B):
                last[part.stage, part.microbatch // microbatches] = k
            elif part.kind in GRADIENT_PASSES:
                last[SHARDS, part.microbatch // microbatches] = k
    plan: dict[int, list[tuple]] = {}
    for (s, t), k in last.items():
        plan.setdefault(k, []).append((s, t))
    return plan


class Gradients:
    """The gradients of one rank's stages and vocabulary shards (the context's vocabulary passes, if any)."""

    def __init__(self, context: Context):
        self.mesh, self.channel, self.device = context.mesh, context.channel, context.device
        self.stages, self.vocab = context.stages, context.extras.get(NAME)
        named = [(stage, n, p) for stage in self.stages.values() for n, p in stage.named_parameters()]
        self.params = [p for _, _, p in named] + (self.vocab.parameters() if self.vocab else [])
        #: the unsplit model's name of each stage parameter, by id
        self.names = {id(p): stage.param_names[n] for stage, n, p in named}
        self.tied = [p for stage, n, p in named if n in stage.tied]
        # a tied copy (the last stage's LM head) counts once in the gradient norm, as in the unsplit model
        self.copies = {id(p) for stage, n, p in named if stage.param_names[n] != n}
        self.pending: list[tuple[nn.Parameter, dist.Work]] = []  # averages in flight

    def averaging(self, final: dict[int, list[tuple]]) -> dict[int, list]:
        """For a synchronous step whose gradients are ``final`` (see :func:`finals`): the calls
        that start averaging each stage's gradients, by the index of the action they follow
        (the vocabulary shards' wait for :meth:`finish`)."""
        tied = {id(p) for p in self.tied}
        return {k: [partial(self.start, [p for p in self.stages[s].parameters() if p.requires_grad and id(p) not in tied])
                    for s, _ in done if s in self.stages] for k, done in final.items()}

    def start(self, params) -> None:
        """Start averaging the gradients of ``params`` over the replicas."""
        for p in params:
            if p.grad is not None:
                self.pending.append((p, dist.all_reduce(p.grad, group=self.mesh.replica_group, async_op=True)))

    def finish(self) -> None:
        """After a synchronous step: sum the tied copies, wait for the averages, average the rest."""
        self._sum_tied()
        if self.mesh.layout.replicas == 1:
            return
        dp = self.mesh.layout.dp
        for p, work in self.pending:
            self.channel.wait(work, _AVERAGE, self.mesh.replica_group)
            p.grad /= dp
        self.pending.clear()
        for p in self.tied + (self.vocab.parameters() if self.vocab else []):
            if p.grad is not None:
                self.channel.all_reduce(p.grad, self.mesh.replica_group, _AVERAGE)
                p.grad /= dp

    def _sum_tied(self) -> None:
        """Tied input/output embeddings: each copy gets the sum of both gradients."""
        if not self.tied:
            return
        if self.mesh.tied_group is None:
            total = sum(p.grad for p in self.tied if p.grad is not None)
            for p in self.tied:
                p.grad = total.clone()
        else:
            for p in self.tied:
                self.channel.all_reduce(p.grad, self.mesh.tied_group, _TIED)

    def reduce_version(self, s: int, grads: dict[str, torch.Tensor]) -> None:
        """A multi-version update's reduction of stage ``s``'s gradients (by local name):
        tied copies summed across their ranks, then the average over replicas."""
        tied = self.stages[s].tied if s in self.stages else ()  # the vocabulary shards tie within a shard
        for name, grad in grads.items():
            if name in tied and self.mesh.tied_group is not None:
                self.channel.all_reduce(grad, self.mesh.tied_group, _TIED)
            if self.mesh.layout.replicas > 1:
                self.channel.all_reduce(grad, self.mesh.replica_group, _AVERAGE)
                grad /= self.mesh.layout.dp

    def clip(self, max_norm: float) -> float:
        """Clip by the global gradient norm over every stage; the norm before clipping. A
        non-finite norm zeroes the gradients and raises :class:`PipeloomError`."""
        with_grad = [p for p in self.params if p.grad is not None]
        own = [p.grad for p in with_grad if id(p) not in self.copies]
        square = nn.utils.get_total_norm(own, foreach=True).float().square() if own \
            else torch.zeros((), device=self.device)
        self.channel.all_reduce(square, self.mesh.pp_group,
                                "the optimizer step waited for the gradient norm of the other stages")
        total = square.sqrt()
        norm = total.item()
        if not math.isfinite(norm):
            self.zero()
            raise PipeloomError(f"the gradient norm is {norm}; the optimizer step was skipped")
        nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
        return norm

    def zero(self) -> None:
        for p in self.params:
            p.grad = None

    def gather(self) -> dict[str, torch.Tensor]:
        """Every gradient of the unsplit model by parameter name, on every rank (CPU tensors)."""
        own = {self.names[id(p)]: p.grad.detach().cpu().clone()
               for stage in self.stages.values() for p in stage.parameters() if p.grad is not None}
        parts: list = [None] * self.mesh.layout.pp
        dist.all_gather_object(parts, own, group=self.mesh.pp_group)
        grads = {name: grad for part in parts for name, grad in part.items()}
        return {**grads, **self.vocab.gather_grads()} if self.vocab else grads
