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
pipeline's ``recompute`` (:class:`RecomputePart`): their F runs without
autograd and keeps the stage input (:class:`Rerun`), and their backward first
runs the forward again, recording, with the random number generators as F
had them (dropout draws the same masks). Unlike ``torch.utils.checkpoint``,
nothing runs per saved tensor (on a host-bound GPU model its hooks made the
step 2.5x, not the 1.4x of one more forward), and the input is kept as a
saved tensor (:class:`_Kept`), so that offload's hooks around F move it.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

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


class _Kept(torch.autograd.Function):
    """Saves ``tensors`` as a layer saves its own: the saved-tensor hooks around F (offload's) see them,
    and ``output.grad_fn.saved_tensors`` hands them back (through their unpack: after a reload)."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.inputs = 1 + len(tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # nothing reads the output: never runs
        return (None,) * ctx.inputs


@dataclass
class Rerun:
    """What a recomputing stage's F keeps for its backward: the stage as F ran it (2bw: the weights'
    version), the states of the random number generators (the CPU's, and ``device``'s if a GPU) before
    it, and the input as saved (:class:`_Kept`)."""

    stage: Callable
    device: torch.device
    random: tuple
    kept: torch.Tensor

    @classmethod
    def of(cls, stage: Callable, x: torch.Tensor, device: torch.device) -> "Rerun":
        random = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        with torch.enable_grad():
            kept = _Kept.apply(torch.empty(0, requires_grad=True), x)
        return cls(stage, device, random, kept)

    def input(self, slot) -> torch.Tensor:
        """The stage input again: the slot's leaf when its gradient is wanted (a reload restored its data),
        else the saved copy."""
        (saved,) = self.kept.grad_fn.saved_tensors  # waits for the reload of an offloaded input
        return slot.input if slot.input.requires_grad else saved

    @contextmanager
    def same_random(self):
        """The generators as F had them; after the block, as they were before it."""
        cpu, gpu = self.random
        with torch.random.fork_rng(devices=[self.device] if gpu is not None else []):
            torch.set_rng_state(cpu)
            if gpu is not None:
                torch.cuda.set_rng_state(gpu, self.device)
            yield


def _ends_in_loss(context, s: int) -> bool:
    """Whether stage ``s`` computes the loss: the last stage, unless a technique takes its output."""
    return s == context.last_stage and not context.ends.output


def _loss(context, y: torch.Tensor, i: int) -> torch.Tensor:
    """Microbatch ``i``'s loss from the last stage's output ``y``. As the unsplit model: under autocast
    the loss reads the low-precision logits and computes in fp32 (no fp32 copy of them); without it, in
    fp32 at least. The mean over the step's tokens: this rank holds 1/sp of each sequence."""
    return context.loss_fn(y if context.autocast else y.float(), context.step.targets[i]) / (
        context.schedule.microbatches * context.mesh.layout.sp)


def _forward(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    slot, training = step.slots[s, i], step.training
    stage = context.versioned(s, i) or context.stages[s]
    if not training:
        del step.slots[s, i]  # nothing to keep for a backward
    loss_here = _ends_in_loss(context, s)
    recompute = context.recomputes(s)
    if recompute:
        slot.rerun = Rerun.of(stage, slot.input, context.device)
    with context.autocasting(), torch.no_grad() if recompute else nullcontext():
        y = stage(slot.input)
        loss = _loss(context, y, i) if loss_here else None
    if loss_here:
        step.loss[i // context.schedule.microbatches] += loss.detach()
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


def _recompute(action, context, slot) -> None:
    """A recomputing stage's forward again, recorded: the output (or loss) its backward starts from."""
    rerun, slot.rerun = slot.rerun, None
    x = rerun.input(slot)
    with rerun.same_random(), torch.enable_grad(), context.autocasting():
        y = rerun.stage(x)
        if _ends_in_loss(context, action.stage):
            slot.output = _loss(context, y, action.microbatch)
        else:
            slot.output = y.to(context.dtype)


def _backward(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    slot = step.slots[s, i]
    if slot.rerun is not None:
        _recompute(action, context, slot)
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
