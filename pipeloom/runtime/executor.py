"""The executor: one rank's action list, each action run by the handler of its kind and timed.

Nothing here names a kind: :mod:`.handlers` maps each kind to its work, and
the context managers a technique wraps around another kind's work
(:func:`~.handlers.around`) are entered around ``run``. A handler's ``prepare`` (waiting for the action's inputs) runs before the
action's start mark, so waiting for a peer does not count as the action's time.
A compound action (DualPipeV's overlapped F and B) runs its parts one after
the other, each by its own kind's handler and wrappers, as one timed action:
in order they are correct; overlapping them would need a second stream or
thread.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Callable, Mapping

from .context import Context, Step
from ..schedule.ir import parts
from ..schedule.kinds import COMPOUND
from .handlers import AROUND, Handler, handler_of


class Executor:
    """Runs ``actions`` (one rank's list of a lowered schedule) on ``context``. Every
    action's kind must have a handler: one without stops here, before any work.
    ``wrapped=False`` runs no wrappers: a forward-only list's (evaluation), since
    techniques wrap what a forward keeps for its backward (offload, K-FAC's captures)."""

    def __init__(self, context: Context, actions, wrapped: bool = True):
        self.context, self.actions = context, tuple(actions)
        self.plan = [_planned(action, wrapped) for action in self.actions]

    def run(self, step: Step, after: Mapping[int, list[Callable[[], None]]]) -> None:
        """Run the actions in order for ``step``; after action ``k``, the calls ``after[k]``."""
        context = self.context
        context.step = step
        clock, marks, heartbeat = step.clock, step.marks, context.channel.heartbeat
        levels = step.levels if clock.memory else None
        for k, (action, handler, wrappers) in enumerate(self.plan):
            if handler.prepare:
                handler.prepare(action, context)  # waiting for a peer is not the action's time
            heartbeat.running(action)  # for peers that wait for this rank meanwhile
            start = clock.mark() if handler.timed else None
            own = _run_wrapped(handler, action, context, wrappers) if wrappers else handler.run(action, context)
            if handler.timed:  # a side stream's work: its own marks on that stream (see handlers)
                marks.append((action, *own) if isinstance(own, tuple) else (action, start, clock.mark()))
                if levels is not None:
                    levels.append(clock.level())
            for call in after.get(k, ()):
                call()


def _planned(action, wrapped: bool = True) -> tuple:
    """(action, its handler, the wrappers of its run, if ``wrapped``); a compound action's
    handler prepares, then runs, its parts in order."""
    if action.kind not in COMPOUND:
        return action, handler_of(action), tuple(AROUND.get(action.kind, ()) if wrapped else ())
    steps = [_planned(part, wrapped) for part in parts(action)]

    def prepare(_, context) -> None:
        for part, handler, _wrappers in steps:
            if handler.prepare:
                handler.prepare(part, context)

    def run(_, context) -> None:
        for part, handler, wrappers in steps:
            _run_wrapped(handler, part, context, wrappers)

    return action, Handler(run, prepare), ()


def _run_wrapped(handler, action, context: Context, wrappers):
    """``handler.run`` inside the context managers the ``wrappers`` give for ``action``; what it returns."""
    with ExitStack() as stack:
        for factory in wrappers:
            manager = factory(action, context)
            if manager is not None:
                stack.enter_context(manager)
        return handler.run(action, context)
