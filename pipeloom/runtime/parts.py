"""Techniques' runtime parts: what each technique adds to a :class:`~pipeloom.runtime.Pipeline`.

A technique (:mod:`pipeloom.techniques`) names its part's class with
:meth:`~pipeloom.techniques.Technique.runtime_part`; every pipeline makes one
part of each registered technique, which takes its own keywords out of the
pipeline's, and calls the hooks of :class:`Part` on every part, in the
techniques' order, so that the pipeline names none of them. The built-in parts
live beside their handlers: recomputation in :mod:`.handlers.compute`,
vocabulary parallelism in :mod:`.handlers.vocab`, sequence parallelism in
:mod:`.batches`, weight versions in :mod:`.versions`, offload in
:mod:`.handlers.offload` and K-FAC in :mod:`.handlers.kfac`.
"""

from __future__ import annotations

from ..errors import PipeloomError
from ..techniques import ordered


class Part:
    """One technique's side of one pipeline: the keywords it takes (:attr:`keywords`, their
    values in :attr:`given`) and hooks, listed in the order the pipeline calls them, each
    doing nothing unless overridden. ``pipe`` is the pipeline being made."""

    #: The pipeline keywords the part takes, with their defaults.
    keywords: dict = {}
    #: What :meth:`~pipeloom.runtime.Pipeline.from_stages` refuses: (keyword, whether a value is refused, why).
    not_for_stages: tuple = ()
    #: The part's attributes the pipeline gives as its own (``pipe.vocab``).
    exposes: tuple[str, ...] = ()

    def __init__(self, options: dict):
        #: its keywords' values, taken out of ``options``
        self.given = {name: options.pop(name, default) for name, default in self.keywords.items()}

    @classmethod
    def refuse_for_stages(cls, schedule, options: dict) -> None:
        """Refuse, in one line each, the ``options`` of :meth:`~pipeloom.runtime.Pipeline.from_stages`
        in :attr:`not_for_stages`."""
        for name, refused, why in cls.not_for_stages:
            if name in options and refused(options[name]):
                raise PipeloomError(f"{name}={options[name]!r} with your own stages: {why}")

    def check(self) -> None:
        """Refuse, in one line each, bad values of its keywords (before any schedule)."""

    def check_schedule(self, schedule) -> None:
        """Refuse what does not fit a given :class:`~pipeloom.schedule.Schedule`."""

    def build(self, options: dict) -> None:
        """Add to ``options``, the keywords of :func:`~pipeloom.schedule.build` of a family name."""

    def configure(self, pipe) -> None:
        """Settle, or refuse in one line, what depends on ``pipe.schedule`` and ``pipe.layout``,
        before any process group is made."""

    def computes_loss(self, schedule) -> bool:
        """Whether the last stage's output goes to the technique, which computes the loss."""
        return False

    def groups(self, schedule) -> tuple[str, ...]:
        """Names of the process groups over each pipeline it needs (:attr:`~.mesh.Mesh.line_groups`)."""
        return ()

    def layers(self, model, schedule) -> tuple[int, ...] | None:
        """The model's layers per stage the technique places, where the pipeline was given none
        (``layers_per_stage``); None: it has no say."""
        return None

    def stage_options(self, schedule) -> dict:
        """Keywords of the model's ``build_stages`` it sets."""
        return {}

    def context_options(self, pipe) -> dict:
        """Fields of the :class:`~.context.Context` it sets (``pipe.stages`` are built)."""
        return {}

    def setup(self, pipe, model) -> None:
        """Once ``pipe.context`` exists: make its state (in ``context.extras``, or in the part)."""

    def calls(self, pipe, calls: list) -> tuple:
        """The schedule and this rank's action lists the pipeline runs in turn, one per call:
        ``(pipe.schedule, calls)``, or what the technique makes of them."""
        return pipe.schedule, calls

    def in_cycle(self, action, call: int):
        """``action`` as it ran in call ``call`` of the cycle the technique's calls make, as the
        schedule (the whole cycle) numbers it (:meth:`calls` renumbers each call's)."""
        return action

    def finals(self, actions) -> dict | None:
        """When each stage's gradient of each step is final in ``actions`` (the form of
        :func:`~.grads.finals`), where the technique decides it; else None."""
        return None

    def batch(self, tokens, targets) -> tuple:
        """This rank's share of its replica's ``tokens`` and ``targets`` (a step's rows, on the device)."""
        return tokens, targets

    def updates(self, pipe, finals: dict, optimizer) -> dict | None:
        """The calls after each action (by index; ``finals`` of the call) that apply each step's update
        with ``optimizer`` (``run_steps``; None: ``step``), where the technique steps the optimizer
        itself; else None. Refuses, in one line, the call that does not fit the pipeline."""
        return None

    def weights(self) -> dict:
        """Weights it holds outside the stages, whole, by their names in the unsplit model (CPU
        tensors; :meth:`~pipeloom.runtime.Pipeline.gather_weights`: every rank calls it)."""
        return {}


def part_classes() -> list[type[Part]]:
    """Every registered technique's part class, in the techniques' order."""
    return [cls for cls in (technique.runtime_part() for technique in ordered()) if cls is not None]
