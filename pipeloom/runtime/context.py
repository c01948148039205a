"""What the handlers of one rank share: the pipeline's facts and the state of the step being run."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..nn.linear import WeightGradStore
from ..schedule import Action, Schedule
from .clock import StepClock
from .mesh import Mesh
from .p2p import Channel
from .versions import WeightVersions

#: What a stage hands on (``Step.mail`` keys): its output to the next stage, its input gradient to the previous.
ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass
class Slot:
    """What one (stage, microbatch) keeps between its passes."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None  # the stage output, or the loss on the last stage
    grad: torch.Tensor | None = None  # gradient of the output, once known
    weights: WeightGradStore | None = None
    rerun: Any = None  # a recomputing stage's F: what its backward runs again (handlers.compute.Rerun)


@dataclass
class TimedAction:
    """One executed action: seconds from the start of the step."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Step:
    """One call's state: its microbatches (``tokens``, ``targets``), the slots, the
    hand-offs in flight, the marks of the actions run and the loss of each step.
    ``training`` is False in a forward-only call (:meth:`~pipeloom.runtime.Pipeline.evaluate`):
    no autograd graph, the newest weights, nothing kept for a backward."""

    rank: int
    clock: StepClock
    tokens: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]
    loss: torch.Tensor  # per step: the sum of its microbatch losses / microbatches
    slots: dict[tuple[int, int], Slot] = field(default_factory=dict)
    #: (ACTIVATION or GRADIENT, producing stage, microbatch) -> the tensor, or a posted receive: ``wait(action)``
    mail: dict[tuple[str, int, int], torch.Tensor | Callable[[Action], torch.Tensor]] = field(default_factory=dict)
    marks: list = field(default_factory=list)  # (action, start mark, end mark) of each timed action
    #: with a clock that reads memory: its level (bytes above the step's start) after each timed action
    levels: list = field(default_factory=list)
    training: bool = True

    def slot(self, stage: int, microbatch: int) -> Slot:
        """What (stage, microbatch) keeps between its passes."""
        return self.slots.setdefault((stage, microbatch), Slot())

    def take(self, key: tuple[str, int, int], action: Action) -> torch.Tensor:
        """The hand-off ``key`` that ``action`` consumes; a posted receive is waited for."""
        mail = self.mail.pop(key)
        return mail if isinstance(mail, torch.Tensor) else mail(action)

    @property
    def wall_start(self) -> float:
        return self.clock.wall_start

    @functools.cached_property
    def timeline(self) -> list[TimedAction]:
        """The timed actions, in seconds from the start of the step (read once the step is over)."""
        seconds = self.clock.seconds
        return [TimedAction(self.rank, action, seconds(start), seconds(end)) for action, start, end in self.marks]


@dataclass
class Ends:
    """Where the first stage's input comes from and the last stage's output goes, when
    not from the tokens and into the loss: hooks a technique sets (the vocabulary passes).
    ``input(action)``: stage 0's input for its F; ``output(action, y)``: the last stage's
    output, instead of the loss; ``output_grad(action, output)``: the gradient of that
    output for its backward; ``input_grad(action, grad)``: stage 0's input gradient.
    ``input`` and ``output_grad`` run before their action's time starts (they may wait)."""

    input: Callable[[Action], torch.Tensor] | None = None
    output: Callable[[Action, torch.Tensor], None] | None = None
    output_grad: Callable[[Action, torch.Tensor], torch.Tensor] | None = None
    input_grad: Callable[[Action, torch.Tensor], None] | None = None


@dataclass
class Context:
    """What every handler of one rank reads: the schedule, the mesh, this rank's stages
    and channel, the numerics, and ``step``, the state of the call being run.
    ``extras`` holds what a technique keeps for the pipeline's life, by its name."""

    schedule: Schedule
    mesh: Mesh
    stages: dict[int, nn.Module]
    channel: Channel
    device: torch.device
    dtype: torch.dtype  # of the weights: hidden states travel in it
    autocast: torch.dtype | None
    recompute: frozenset[int]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    #: ``boundary(k, x)``: the shape of what stage ``k`` hands on (its output, and the gradient that
    #: comes back) for a microbatch whose stage-0 input is ``x``: the receive buffers' shape
    boundary: Callable[[int, torch.Tensor], tuple[int, ...]]
    versions: WeightVersions | None = None
    steps_done: int = 0  # steps run so far (multi-version schedules)
    calls: int = 0  # calls run so far (a K-FAC cycle's lists take turns)
    step: Step | None = None
    ends: Ends = field(default_factory=Ends)
    extras: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)  # warnings given once

    @property
    def last_stage(self) -> int:
        return self.schedule.stages - 1

    def versioned(self, key, i: int) -> Callable | None:
        """Stage ``key`` (or the vocabulary shards) as a function of the weights of microbatch
        ``i``'s step (:class:`~.versions.WeightVersions`), or None where the call runs no
        versions (synchronous schedules, evaluation)."""
        if self.versions and self.step.training:
            return self.versions.module(key, self.steps_done + i // self.schedule.microbatches)
        return None

    def recomputes(self, stage: int) -> bool:
        """Whether the call being run recomputes ``stage``: its F keeps only its input, its backward
        runs the forward again (training calls of the stages in :attr:`recompute`)."""
        return stage in self.recompute and self.step.training

    def autocasting(self) -> torch.autocast:
        """The mixed-precision region of the stages' forwards and the LM head's S passes
        (disabled without ``autocast``)."""
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)
