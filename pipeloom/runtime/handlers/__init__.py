"""What the executor does for each action kind: a handler per kind, registered by technique.

A handler is ``run(action, context)`` (:class:`~pipeloom.runtime.context.Context`),
timed by the executor with marks on the current stream; a handler that puts its
work on a side stream of its own returns that work's (start, end) marks instead
(timed CUDA events recorded on that stream: offload's copies), else None.
``prepare(action, context)``, if given, runs just before the action's time
starts: waiting for its inputs does not count as its work.
The built-in handlers live in modules by technique: :mod:`.compute` (F, B, W,
BW), :mod:`.comm` (the sends and receives of :mod:`pipeloom.schedule.lower`)
and :mod:`.vocab` (the vocabulary passes). A technique from outside the package
adds its kind with :func:`register`::

    @pipeloom.runtime.handlers.register("NOOP")
    def noop(action, context): ...

A technique can also wrap the actions of another kind with :func:`around`:
``factory(action, context)`` returns a context manager, or None to leave that
action alone; the executor enters it around the action's ``run`` (inside its
time). :mod:`.offload` captures what F saves for backward this way. Kinds
without a factory pay nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...errors import PipeloomError


@dataclass(frozen=True)
class Handler:
    """The work of one kind: ``run``, timed; ``prepare`` before it, untimed; ``timed``
    False leaves the kind's actions out of the step's timeline (sends and receives)."""

    run: Callable
    prepare: Callable | None = None
    timed: bool = True


#: The handler of each kind, by kind.
HANDLERS: dict[str, Handler] = {}


def register(kind: str, run: Callable | None = None, *, prepare: Callable | None = None, timed: bool = True):
    """Make ``run(action, context)`` the handler of actions of ``kind`` (replacing any),
    with ``prepare`` and ``timed`` as in :class:`Handler`; returns ``run``. Without ``run``,
    a decorator: ``@register("NOOP")``."""
    if run is None:
        return lambda function: register(kind, function, prepare=prepare, timed=timed)
    HANDLERS[kind] = Handler(run, prepare, timed)
    return run


#: Factories of the context managers wrapped around the run of each kind's actions, by kind.
AROUND: dict[str, list[Callable]] = {}


def around(kind: str, factory: Callable) -> Callable:
    """Wrap every ``run`` of an action of ``kind`` in ``factory(action, context)``, a
    context manager, or None for none; factories of one kind nest in the order added
    (the first outermost). Returns ``factory``."""
    AROUND.setdefault(kind, []).append(factory)
    return factory


def handler_of(action) -> Handler:
    """The handler of ``action``'s kind; an unregistered kind raises, naming the registered ones."""
    handler = HANDLERS.get(action.kind)
    if handler is None:
        raise PipeloomError(f"action {action}: no runtime handler for kind {action.kind!r}; registered kinds: "
                            f"{', '.join(sorted(HANDLERS))} (add one with pipeloom.runtime.handlers.register)")
    return handler


from . import comm, compute, kfac, offload, vocab  # noqa: E402,F401  (register the built-in kinds)
