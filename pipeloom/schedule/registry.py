"""Schedule families by name, and :func:`build`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Callable

from ..errors import PipeloomError
from .ir import Schedule
from .validate import validate
from .vocab import ALGORITHMS, HEAD_DELAY, add_vocab_passes, check_mode


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


def get_family(name: str) -> Family:
    """The family registered as ``name``; an unknown name raises, listing the valid ones."""
    if name not in FAMILIES:
        raise PipeloomError(f"unknown schedule {name!r}; valid schedules: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def build(
    name: str,
    pp: int,
    microbatches: int,
    chunks: int | None = None,
    *,
    check: bool = True,
    vocab_parallel: str | None = None,
    **options,
) -> Schedule:
    """Build the schedule of family ``name`` for ``pp`` ranks and ``microbatches``
    microbatches per step, validated unless ``check`` is false.

    ``chunks`` is the number of stages per rank (interleaved 1F1B: any >= 2,
    default 2; V families: 2). Family options (``steps`` for 2bw; ``costs``
    and ``memory_limit`` for zb-auto; ``head_delay``, the intervals by which
    the last stage's backward follows its forward, for the families that can
    delay it) go in ``options``.

    ``vocab_parallel`` (one of :data:`~.vocab.MODES`) is stored in
    ``options["vocab_parallel"]``; naive, vocab-1 and vocab-2 build the
    family with :data:`~.vocab.HEAD_DELAY` (unless ``head_delay`` is given)
    and add their passes with :func:`~.vocab.add_vocab_passes`.
    """
    family = get_family(name)
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
    if vocab_parallel is not None:
        check_mode(vocab_parallel)
    delay = options.get("head_delay", 0)
    if not isinstance(delay, int) or isinstance(delay, bool) or delay < 0:
        raise PipeloomError(f"{name}: head_delay={delay!r} must be a whole number >= 0")
    if vocab_parallel in ALGORITHMS:
        if "head_delay" not in family.options:
            can = ", ".join(n for n, f in FAMILIES.items() if "head_delay" in f.options)
            raise PipeloomError(
                f"{name} cannot take vocabulary passes ({vocab_parallel}): it cannot delay the last stage's "
                f"backward to make room for them; families that can: {can}"
            )
        options.setdefault("head_delay", HEAD_DELAY[vocab_parallel])
    schedule = family.generate(pp, microbatches, chunks, **options)
    if vocab_parallel in ALGORITHMS:
        schedule = add_vocab_passes(schedule, vocab_parallel)
    elif vocab_parallel is not None:
        schedule = replace(schedule, options={**schedule.options, "vocab_parallel": vocab_parallel})
    return validate(schedule) if check else schedule
