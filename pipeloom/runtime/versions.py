"""Weight versions of schedules that run several steps without a flush (PipeDream-2BW).

With ``V`` weight versions, step ``t``'s microbatches use version ``t`` on
every stage, and the gradient of step ``t`` is applied once the stage has
finished it, to the newest version, giving the version of step ``t + V``:

    W(t + V) = W(t + V - 1) - lr * grad f(W(t))

For V = 2 this is 2BW's delayed update ``W(t+1) = W(t) - lr * grad f(W(t-1))``
(and W(1) = W(0)). Each version in use is a set of detached leaves that the
forward runs with (``torch.func.functional_call``) and whose ``.grad``
collects that step's gradient, so a backward always sees the weights of its
own forward. A stage keeps V buffers of its weights, no more: the newest
version shares its storage with the module's parameters, which carry the
optimizer's state, and the update of step ``t`` (whose backwards are all done)
reuses version ``t``'s buffer for the new weights. A stage's backwards run in
step order, so one gradient exists at a time. Weights a rank holds outside its
stages (the vocabulary shards) are versioned the same way, as one more module
(:meth:`WeightVersions.add`).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from ..errors import PipeloomError
from .parts import Part


class WeightVersions:
    """The versions of one rank's stages (and of the modules :meth:`add` gives), by step."""

    def __init__(self, stages: dict[int, nn.Module], versions: int):
        self.stages, self.count = dict(stages), versions
        self.weights: dict[tuple, dict[str, torch.Tensor]] = {}
        self.restart(0)

    def add(self, key, module: nn.Module) -> None:
        """Version ``module`` (weights outside the stages) as the stages are, under ``key``."""
        self.stages[key] = module
        self._start(key, sorted({t for _, t in self.weights}))

    def restart(self, step: int) -> None:
        """Make the versions of steps ``step`` .. ``step + V - 1`` the newest weights."""
        self.weights = {}
        for s in self.stages:
            self._start(s, range(step, step + self.count))

    def _start(self, s, steps) -> None:
        """Stage ``s``'s versions of ``steps`` as its weights now: the last one the module's own
        storage, the others copies."""
        *older, newest = steps
        for t in older:
            self.weights[s, t] = self._leaves(s, copy=True)
        self.weights[s, newest] = self._leaves(s, copy=False)

    def _leaves(self, s, copy: bool) -> dict[str, torch.Tensor]:
        """The stage's weights as fresh leaves by local name, copies or sharing the parameters'
        storage (``.data``: not their version counter, which the optimizer's step bumps while
        autograd still holds this version; shared tensors stay shared)."""
        leaves: dict[int, torch.Tensor] = {}
        return {name: leaves.setdefault(id(p), (p.detach().clone() if copy else p.data)
                                        .requires_grad_(p.requires_grad))
                for name, p in self.stages[s].named_parameters(remove_duplicate=False)}

    def module(self, s, t: int) -> Callable:
        """Stage ``s`` (or an added module) as a function that runs with step ``t``'s weights."""
        weights = self.weights[s, t]
        return lambda *args: functional_call(self.stages[s], weights, args, tie_weights=False)

    def update(self, s: int, t: int, optimizer: torch.optim.Optimizer,
               reduce: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """Apply step ``t``'s gradient on stage ``s`` (after ``reduce`` sums it, by local
        name, over replicas and tied copies) to the newest weights, in version ``t``'s
        buffer, which becomes the version of step ``t + V`` (and the parameters' storage)."""
        buffer = self.weights.pop((s, t))
        params = dict(self.stages[s].named_parameters())
        grads = {name: buffer[name].grad for name in params if buffer[name].grad is not None}
        reduce(grads)
        everything = [p for group in optimizer.param_groups for p in group["params"]]
        for p in everything:
            p.grad = None
        with torch.no_grad():
            for name, p in params.items():
                buffer[name].grad = None
                buffer[name].copy_(p)
                p.data = buffer[name]
                p.grad = grads.get(name)
        optimizer.step()  # parameters without a gradient (other stages) are left alone
        for p in everything:
            p.grad = None
        self.weights[s, t + self.count] = buffer


class VersionsPart(Part):
    """Weight versions in a pipeline: a schedule of several steps per call, or of several versions,
    runs with :attr:`versions` (:class:`WeightVersions`), by
    :meth:`~pipeloom.runtime.Pipeline.run_steps`, each stage updating as it finishes a step's gradient."""

    exposes = ("versions",)
    #: the rank's :class:`WeightVersions`, where the schedule runs several, else None
    versions = None

    def context_options(self, pipe) -> dict:
        schedule = pipe.schedule
        if schedule.steps > 1 or schedule.weight_versions > 1:
            self.versions = WeightVersions(pipe.stages, schedule.weight_versions)
        return {"versions": self.versions}

    def updates(self, pipe, finals: dict, optimizer) -> dict | None:
        schedule = pipe.schedule
        if optimizer is None:
            if self.versions:
                raise PipeloomError(f"{schedule.family} runs {schedule.steps} steps per call with "
                                    f"{schedule.weight_versions} weight versions: use run_steps(tokens, targets, "
                                    "optimizer)")
            return None
        if not self.versions:
            raise PipeloomError(f"{schedule.family} is synchronous: use step() and optimizer_step()")
        done = pipe.steps_done
        return {k: [partial(self.versions.update, s, done + t, optimizer, partial(pipe.grads.reduce_version, s))
                    for s, t in pairs] for k, pairs in finals.items()}
