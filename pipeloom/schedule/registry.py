"""Schedule families by name, and :func:`build`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from ..errors import PipeloomError
from .ir import Schedule
from .validate import validate


@dataclass(frozen=True)
class Family:
    """A schedule generator and the facts :func:`build` checks before calling it."""

    name: str
    summary: str
    generate: Callable[..., Schedule]
    chunks: tuple[int, ...] | None = (1,)  # allowed chunk counts; None: any >= 2
    default_chunks: int = 1

    @property
    def options(self) -> list[str]:
        """Names of the family's own options (beyond pp, microbatches, chunks)."""
        return list(inspect.signature(self.generate).parameters)[3:]


FAMILIES: dict[str, Family] = {}


def register(name: str, summary: str, chunks: tuple[int, ...] | None = (1,), default_chunks: int = 1):
    """Decorator: register ``generate(pp, microbatches, chunks, **options)`` under ``name``."""
    def wrap(generate):
        FAMILIES[name] = Family(name, summary, generate, chunks, default_chunks)
        return generate
    return wrap


def build(
    name: str,
    pp: int,
    microbatches: int,
    chunks: int | None = None,
    *,
    check: bool = True,
    **options,
) -> Schedule:
    """Build the schedule of family ``name`` for ``pp`` ranks and ``microbatches``
    microbatches per step, validated unless ``check`` is false.

    ``chunks`` is the number of stages per rank (interleaved 1F1B: any >= 2,
    default 2; V families: 2). Family options (``steps`` for 2bw; ``costs``
    and ``memory_limit`` for zb-auto) go in ``options``.
    """
    family = FAMILIES.get(name)
    if family is None:
        raise PipeloomError(f"unknown schedule {name!r}; valid schedules: {', '.join(FAMILIES)}")
    for label, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PipeloomError(f"{label}={value!r}: must be a whole number >= 1")
    if chunks is None:
        chunks = family.default_chunks
    if family.chunks is None:
        if not isinstance(chunks, int) or chunks < 2:
            raise PipeloomError(f"{name} needs chunks >= 2 stages per rank; got chunks={chunks!r}")
    elif chunks not in family.chunks:
        allowed = " or ".join(map(str, family.chunks))
        raise PipeloomError(f"{name} uses chunks={allowed} stages per rank; got chunks={chunks!r}")
    unknown = sorted(set(options) - set(family.options))
    if unknown:
        takes = ", ".join(family.options) or "no options"
        raise PipeloomError(f"{name} does not take option {unknown[0]!r}; it takes: {takes}")
    schedule = family.generate(pp, microbatches, chunks, **options)
    return validate(schedule) if check else schedule
