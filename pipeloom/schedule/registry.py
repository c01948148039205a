"""Schedule families by name, and :func:`build`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from ..errors import PipeloomError
from ..modes import VocabMode
from .ir import Schedule
from .lower import lower
from .torch_csv import TORCH_PREFIX, from_torch, torch_chunks
from .transforms import Transform, apply_all
from .transforms.vocab import VocabPasses
from .validate import validate


@dataclass(frozen=True)
class Family:
    """A schedule generator and the facts :func:`build` checks before calling it."""

    name: str
    summary: str
    generate: Callable[..., Schedule]
    chunks: tuple[int, ...] | None = (1,)  # allowed chunk counts; None: any >= 2
    default_chunks: int = 1
    #: every backward is a fused BW (a W is never deferred): lets the planner bound its bubble tighter
    fused: bool = False

    @property
    def options(self) -> list[str]:
        """Names of the family's own options (beyond pp, microbatches, chunks, room)."""
        return [name for name in list(inspect.signature(self.generate).parameters)[3:] if name != "room"]

    def checked_chunks(self, chunks: int | None) -> int:
        """``chunks`` stages per rank (None: the family's default), or one line saying what it takes."""
        if chunks is None:
            return self.default_chunks
        if self.chunks is None:
            if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 2:
                raise PipeloomError(f"{self.name} needs chunks >= 2 stages per rank; got chunks={chunks!r}")
        elif chunks not in self.chunks:
            allowed = " or ".join(map(str, self.chunks))
            raise PipeloomError(f"{self.name} uses chunks={allowed} stages per rank; got chunks={chunks!r}")
        return chunks

    @property
    def makes_room(self) -> bool:
        """True if the family can leave room (whole intervals) between the last
        stage's forward and backward when a transform asks for it (``room=``)."""
        return "room" in inspect.signature(self.generate).parameters


FAMILIES: dict[str, Family] = {}


def register(name: str, summary: str, chunks: tuple[int, ...] | None = (1,), default_chunks: int = 1,
             fused: bool = False):
    """Decorator: register ``generate(pp, microbatches, chunks, **options)`` under ``name``
    (``fused``: its schedules run every backward as one BW)."""
    def wrap(generate):
        FAMILIES[name] = Family(name, summary, generate, chunks, default_chunks, fused)
        return generate
    return wrap


def get_family(name: str) -> Family:
    """The family registered as ``name``, or torch's schedule ``torch:SOURCE`` (a class name or a CSV,
    see :func:`~.torch_csv.from_torch`); an unknown name raises, listing the valid ones."""
    if name.startswith(TORCH_PREFIX):
        source = name[len(TORCH_PREFIX):]
        chunks = torch_chunks(source)
        return Family(name, f"torch.distributed.pipelining's {source}", partial(from_torch, source), chunks,
                      2 if chunks is None else chunks[0])
    if name not in FAMILIES:
        raise PipeloomError(f"unknown schedule {name!r}; valid schedules: {', '.join(FAMILIES)}; "
                            f"or {TORCH_PREFIX}NAME: one of torch's schedule classes, or a CSV torch wrote")
    return FAMILIES[name]


#: The most actions (F, B and W of every stage and microbatch) a schedule may have: about 1 GiB
#: and half a minute of simulation; a run of the same pp / microbatches ratio shows the same bubble.
MAX_ACTIONS = 2_000_000


def _check_size(name: str, pp: int, microbatches: int, chunks: int, steps: int) -> None:
    """Refuse, before building, a schedule of more than :data:`MAX_ACTIONS` actions."""
    actions = 3 * pp * chunks * microbatches * steps
    if actions > MAX_ACTIONS:
        raise PipeloomError(f"{name} with pp={pp}, chunks={chunks}, microbatches={microbatches}"
                            + (f", steps={steps}" if steps > 1 else "") + f" has about {actions:.3g} actions; "
                            f"pipeloom builds at most {MAX_ACTIONS:,} (about 1 GiB and 30 s to simulate): use fewer "
                            "ranks or microbatches (the same pp / microbatches ratio has the same bubble)")


def build(
    name: str,
    pp: int,
    microbatches: int,
    chunks: int | None = None,
    *,
    check: bool = True,
    vocab_parallel: str | None = None,
    transforms: tuple[Transform, ...] | list[Transform] = (),
    costs=None,
    lowered: bool = False,
    **options,
) -> Schedule:
    """Build the schedule of family ``name`` for ``pp`` ranks and ``microbatches``
    microbatches per step: generate the family's order, apply the transforms,
    lower communication if ``lowered`` (:func:`~.lower.lower`), validate
    (unless ``check`` is false).

    ``chunks`` is the number of stages per rank (interleaved 1F1B: any >= 2,
    default 2; V families: 2). Family options (``steps`` for 2bw; ``costs``
    and ``memory_limit`` for zb-auto) go in ``options``. ``costs`` (a
    :class:`~.costs.Costs`) reach the transforms, and the family when it
    takes them and ``options`` gives none.

    ``transforms`` (see :mod:`~.transforms`) are applied in order after the
    family's order; the family leaves the largest ``room`` they ask for
    between the last stage's forward and backward. ``vocab_parallel`` (a
    :class:`~pipeloom.modes.VocabMode`) is stored in ``options["vocab_parallel"]``;
    naive, vocab-1 and vocab-2 put :class:`~.transforms.vocab.VocabPasses` first.
    """
    family = get_family(name)
    for label, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PipeloomError(f"{label}={value!r}: must be a whole number >= 1")
    chunks = family.checked_chunks(chunks)
    _check_size(name, pp, microbatches, chunks, options.get("steps") or 1)
    unknown = sorted(set(options) - set(family.options))
    if unknown:
        takes = ", ".join(family.options) or "no options"
        raise PipeloomError(f"{name} does not take option {unknown[0]!r}; it takes: {takes}")
    transforms = list(transforms)
    if vocab_parallel is not None:
        mode = VocabMode.of(vocab_parallel)
        if mode.splits:
            transforms.insert(0, VocabPasses(mode.value))
    room = max((transform.room for transform in transforms), default=0)
    if room:
        if not family.makes_room:
            can = ", ".join(n for n, f in FAMILIES.items() if f.makes_room)
            asking = ", ".join(t.name for t in transforms if t.room)
            raise PipeloomError(
                f"{name} cannot take {asking}: it cannot delay the last stage's backward to make room for "
                f"them; families that can: {can}"
            )
        options["room"] = room
    if costs is not None and "costs" in family.options:
        options.setdefault("costs", costs)
    schedule = family.generate(pp, microbatches, chunks, **options)
    if vocab_parallel is not None and not VocabMode.of(vocab_parallel).splits:  # the transform sets its own
        schedule = replace(schedule, options={**schedule.options, "vocab_parallel": VocabMode.of(vocab_parallel).value})
    schedule = apply_all(schedule, transforms, options.get("costs", costs))
    if lowered:
        schedule = lower(schedule)
    return validate(schedule) if check else schedule
