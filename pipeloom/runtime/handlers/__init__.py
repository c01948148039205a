"""What the executor does for each action kind: a handler per kind, registered by technique.

A handler is ``run(action, context)`` (:class:`~pipeloom.runtime.context.Context`),
timed by the executor; ``prepare(action, context)``, if given, runs just before
the action's time starts: waiting for its inputs does not count as its work.
The built-in handlers live in modules by technique: :mod:`.compute` (F, B, W,
BW), :mod:`.comm` (the sends and receives of :mod:`pipeloom.schedule.lower`)
and :mod:`.vocab` (the vocabulary passes). A technique from outside the package
adds its kind with :func:`register`::

    @pipeloom.runtime.handlers.register("NOOP")
    def noop(action, context): ...
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


def handler_of(action) -> Handler:
    """The handler of ``action``'s kind; an unregistered kind raises, naming the registered ones."""
    handler = HANDLERS.get(action.kind)
    if handler is None:
        raise PipeloomError(f"action {action}: no runtime handler for kind {action.kind!r}; registered kinds: "
                            f"{', '.join(sorted(HANDLERS))} (add one with pipeloom.runtime.handlers.register)")
    return handler


from . import comm, compute, vocab  # noqa: E402,F401  (register the built-in kinds)
