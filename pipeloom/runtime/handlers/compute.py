"""The stages' own work: F (forward), B (input gradient), W (weight gradient), BW (both).

F keeps what backward needs; B queues the linear layers' weight gradients
(:mod:`pipeloom.nn.linear`) for W, BW accumulates them at once; the other
parameters' gradients come in B, and the first B of each stage notes their
module types (:data:`WEIGHTS_IN_B`, written into the measured trace). What a stage
hands on goes into the step's mail (:attr:`~pipeloom.runtime.context.Step.mail`):
a stage on this rank takes it from there, a send (:mod:`.comm`) takes it to
another rank. The first stage reads the tokens and the last computes the loss
with the model's loss function, unless a technique set the context's
:class:`~pipeloom.runtime.context.Ends`. In a forward-only call (``step.training``
False: evaluation, under ``torch.no_grad``) F runs with the newest weights
(2bw's stage parameters, not a step's version), recomputes nothing and keeps
nothing once it has handed its output on. Which stages recompute is the
pipeline's ``recompute`` (:class:`RecomputePart`).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils.checkpoint import checkpoint

from ...errors import PipeloomError
from ...nn.linear import WeightGradStore, defer_weight_grads
from ...nn.recompute import mark_modules
from ...nn.stages import Stages
from ...schedule import BW, B, F, W
from ..context import ACTIVATION, GRADIENT
from ..parts import Part
from . import register
from .offload import offloader_of

#: ``context.extras`` key: stage -> the module types whose weight gradients its B computes (not deferred to W)
WEIGHTS_IN_B = "weights in B"


def _forward_input(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    if s > 0:
        x = step.take((ACTIVATION, s - 1, i), action)
    elif context.ends.input:
        x = context.ends.input(action)
    else:
        x = step.tokens[i]
    wanted = s > 0 or context.ends.input_grad is not None  # stage 0's input gradient goes nowhere otherwise
    step.slot(s, i).input = x.requires_grad_() if wanted and x.is_floating_point() and step.training else x


def _forward(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    slot, m, training = step.slots[s, i], context.schedule.microbatches, step.training
    stage = context.versioned(s, i) or context.stages[s]
    if not training:
        del step.slots[s, i]  # nothing to keep for a backward
    loss_here = s == context.last_stage and not context.ends.output
    with context.autocasting():
        if s in context.recompute and training:
            y = checkpoint(stage, slot.input, use_reentrant=False)
        else:
            y = stage(slot.input)
        if loss_here:
            # as the unsplit model: under autocast, the loss reads the low-precision logits and computes
            # in fp32 (no fp32 copy of them); without it, in fp32 at least. The mean over the step's
            # tokens: this rank holds 1/sp of each sequence
            loss = context.loss_fn(y if context.autocast else y.float(), step.targets[i]) / (
                m * context.mesh.layout.sp)
    if loss_here:
        step.loss[i // m] += loss.detach()
        slot.output = loss
        return
    slot.output = y.to(context.dtype)
    if s == context.last_stage:
        context.ends.output(action, slot.output.detach())
    else:
        step.mail[ACTIVATION, s, i] = slot.output.detach()


def _backward_input(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    slot = step.slots[s, i]
    if s < context.last_stage:
        slot.grad = step.take((GRADIENT, s + 1, i), action)
    elif context.ends.output_grad:
        slot.grad = context.ends.output_grad(action, slot.output)


def _backward(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    slot = step.slots[s, i]
    # B queues the linear layers' weight gradients for W; BW accumulates each at once, in one GEMM
    slot.weights = WeightGradStore(eager=action.kind == BW)
    with defer_weight_grads(slot.weights):
        torch.autograd.backward(slot.output, slot.grad)
    if action.kind == B and ("first B", s) not in context.warned:
        context.warned.add(("first B", s))
        _note_weights_in_b(context, s, slot.weights)
    if s > 0:
        step.mail[GRADIENT, s, i] = slot.input.grad
    elif context.ends.input_grad:
        context.ends.input_grad(action, slot.input.grad)
    slot.input = slot.output = slot.grad = None
    if action.kind == BW:
        del step.slots[s, i]


def _note_weights_in_b(context, s: int, store: WeightGradStore) -> None:
    """At a stage's first B: note in ``context.extras[WEIGHTS_IN_B]`` the module types whose
    weight gradients B computed, not W (the measured trace shows them); warn if W gets nothing."""
    stage = context.stages[s]
    context.extras.setdefault(WEIGHTS_IN_B, {})[s] = sorted({
        type(module).__name__ for module in stage.modules()
        if any(p.requires_grad and id(p) not in store.deferred for p in module.parameters(recurse=False))})
    if not store.work:
        warnings.warn(f"rank {context.mesh.rank}: B of stage {s} deferred no weight gradient: its W actions do no "
                      f"work (the stage has no nn.Linear layer run by its forward, or the B/W split failed)",
                      stacklevel=3)


def _weights(action, context) -> None:
    key = action.stage, action.microbatch
    context.step.slots.pop(key).weights.run()


def recomputed(recompute, stages) -> frozenset[int]:
    """The stages whose forward reruns in backward (none for "cheap")."""
    if isinstance(recompute, str):
        if recompute != "cheap":
            raise PipeloomError(f"recompute={recompute!r}: give True, the stages, or 'cheap'")
        return frozenset()
    return frozenset(stages if recompute is True else recompute or ())


class RecomputePart(Part):
    """Recomputation in a pipeline: ``recompute`` (True, the stages, or "cheap") sets the stages
    whose forward reruns in backward (:attr:`~..context.Context.recompute`); "cheap" keeps the
    recipes of what the model marks instead, through the offloader's hooks (:mod:`.offload`):
    pipeloom's models mark their norms and activations, your own stages' torch.nn ones are marked
    for them (:func:`~pipeloom.nn.recompute.mark_modules`)."""

    keywords = {"recompute": False}

    def context_options(self, pipe) -> dict:
        return {"recompute": recomputed(self.given["recompute"], pipe.stages)}

    def setup(self, pipe, model) -> None:
        if self.given["recompute"] == "cheap":
            offloader_of(pipe.context).cheap = True
            if isinstance(model, Stages):  # your own stages mark nothing: their torch.nn norms and activations
                for stage in pipe.stages.values():
                    mark_modules(stage)


register(F, _forward, prepare=_forward_input)
register(B, _backward, prepare=_backward_input)
register(BW, _backward, prepare=_backward_input)
register(W, _weights)
