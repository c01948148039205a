"""Action kinds as data: the registry every layer reads instead of naming kinds.

A :class:`Kind` declares what an action of that kind is: whether its
``stage`` field names a pipeline stage or a rank (its owner), which actions
it consumes (its dependency rule), what it does to activation memory, which
cost fields time it, and how renderers and torch's CSV show it. Dependencies,
the validator, costs, the simulator and the renderers look kinds up here; a
technique adds its kinds with :func:`register` and its inputs to other kinds'
actions with :func:`register_inputs`, and nothing else changes.

The built-in kinds F, B, W and BW are registered below like any other; the
vocabulary passes register in :mod:`.transforms.vocab`, the sends and
receives in :mod:`.lower`, DualPipeV's overlapped pair in
:mod:`.families.dualpipe`.

A *compound* kind's action stands for several actions run as one (torch's
``OVERLAP_F_B`` and its ``sub_actions``): its payload holds its parts as
(kind, stage, microbatch) triples, :func:`~.ir.parts` reads them, and its stage
and microbatch are its first part's. Its inputs, completeness, messages and
memory are its parts'; an action that consumes a part's result waits for the
compound (:class:`~.deps.Dependencies` maps each part to it).

This module is the schedule language's lowest: actions (:mod:`.ir`), the
dependencies (:mod:`.deps`) and everything else read it, and it imports none
of them, so the rules' arguments are named in words, not in types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import ScheduleError

#: ``Kind.owner``: the action's ``stage`` field is a pipeline stage, run by the rank it is placed on.
STAGE = "stage"
#: ``Kind.owner``: the action's ``stage`` field is the rank that runs it (a pass every rank makes).
RANK = "rank"

#: A dependency rule: ``rule(action, deps)`` gives the actions (:class:`~.ir.Action`) whose results
#: ``action`` consumes, ``deps`` being the schedule's :class:`~.deps.Dependencies`.
Rule = Callable[..., tuple]
#: A completeness rule: ``check(schedule)`` raises :class:`~pipeloom.errors.ScheduleError` where a
#: :class:`~.ir.Schedule` breaks it.
Check = Callable[..., None]


def _nothing(action, deps) -> tuple:
    return ()


@dataclass(frozen=True)
class Kind:
    """One action kind.

    ``needs(action, deps)``: the actions whose results ``action`` consumes
    (``deps`` is the schedule's :class:`~.deps.Dependencies`, with its facts).
    ``memory``: (coefficient, cost field) pairs; the action changes its rank's
    activation memory by the sum of coefficient times the field's value (a
    rise when it starts, a fall when it ends); ``host``: the same for the
    rank's host memory.
    ``cost``: the cost fields whose sum is its time; ``transfer``: the cost
    field that times the delivery of its result to a consumer on another rank
    (none: no delay); ``reduced``: its result reaches even a consumer on its
    own rank through a collective over every rank, so always after ``transfer``.
    ``torch_code``: its letter in torch's action strings; ``torch_csv``: True
    if torch's compute-only CSV holds it, False if an export leaves it out
    (torch adds it or does not need it), None if an export must refuse a
    schedule holding it. ``drawn``: renderers show it (the sends and receives
    take no time and are not drawn). ``stream``: None when the action runs
    on its rank's compute stream, else the name of a side stream of the rank
    (the host copies' ``"copy"``): it is issued when the rank's list reaches
    it, runs when that stream is free and its inputs exist, in list order
    with the stream's other actions, and does not hold up the rank.
    ``check(schedule)``: the kind's completeness rule, run by the validator
    on every schedule.
    ``forward``: the action is part of computing the loss, without gradients: a
    forward-only schedule (:func:`~.forward.forward_only`, for evaluation) keeps it.
    ``weight``: a cost field of per-unit weights (``per="unit"``) scaling the
    action's time by its unit, the payload's first entry (weights cycled over a
    stage's units; none given, 1).
    ``compound``: the action stands for its parts (see the module docstring);
    its time is the longest part's plus ``1 - overlap`` of the others' (the
    cost field ``overlap`` names the share of them hidden: 0 runs the parts
    one after the other, 1 entirely beside the longest).
    """

    name: str
    label: str
    owner: str = STAGE
    needs: Rule = _nothing
    memory: tuple[tuple[float, str], ...] = ()
    host: tuple[tuple[float, str], ...] = ()
    cost: tuple[str, ...] = ()
    transfer: str | None = None
    reduced: bool = False
    colour: str = "#8c8c8c"
    letter: str | None = None
    torch_code: str | None = None
    torch_csv: bool | None = None
    drawn: bool = True
    stream: str | None = None
    check: Check | None = None
    forward: bool = False
    compound: bool = False
    overlap: str | None = None
    weight: str | None = None

    def __post_init__(self):
        if self.owner not in (STAGE, RANK):
            raise ScheduleError(f"kind {self.name}: owner {self.owner!r}; choose {STAGE!r} or {RANK!r}")

    @property
    def code(self) -> str:
        """How action strings spell the kind: torch's letter, else its name."""
        return self.torch_code or self.name

    @property
    def grid_letter(self) -> str:
        """Its letter in text pictures: given, else the torch letter, else the lower-case initial."""
        return self.letter or self.torch_code or self.name[0].lower()


#: Every registered kind by name.
KINDS: dict[str, Kind] = {}
#: The names of the compound kinds.
COMPOUND: set[str] = set()
#: Factories of extra input rules: ``factory(schedule)`` gives a rule adding
#: inputs to other kinds' actions in that schedule, or None where it does not apply;
#: ``factory.kinds``: the kinds whose actions its rules add to (None: any).
INPUT_RULES: list[Callable[..., Rule | None]] = []
_BY_CODE: dict[str, str] = {}


def register(kind: Kind) -> Kind:
    """Add ``kind`` (re-registering the same name replaces it); returns it."""
    taken = _BY_CODE.get(kind.code)
    if taken not in (None, kind.name):
        raise ScheduleError(f"kind {kind.name}: its code {kind.code!r} is kind {taken}'s already")
    KINDS[kind.name] = kind
    _BY_CODE[kind.code] = kind.name
    (COMPOUND.add if kind.compound else COMPOUND.discard)(kind.name)
    return kind


def register_inputs(factory: Callable[..., Rule | None] | None = None, *, kinds: Iterable[str] | None = None):
    """Add a factory of input rules (see :data:`INPUT_RULES`); usable as a decorator, bare or
    with ``kinds``: the only kinds whose actions its rules add inputs to (the dependencies ask
    them of no other, so an action of a technique's own kind costs no call)."""
    def add(factory):
        factory.kinds = None if kinds is None else frozenset(kinds)
        INPUT_RULES.append(factory)
        return factory
    return add if factory is None else add(factory)


def get(name: str) -> Kind:
    """The kind ``name``; an unknown one raises, listing the registered kinds."""
    kind = KINDS.get(name)
    if kind is None:
        raise ScheduleError(f"unknown action kind {name!r}; registered kinds: {', '.join(KINDS)}")
    return kind


def from_code(code: str) -> str:
    """The kind an action string's code spells (torch's ``I`` is B, its ``B`` is BW)."""
    return _BY_CODE.get(code, code)


def graded() -> frozenset[str]:
    """The kinds of a stage timed by the ``b`` or ``w`` cost: a stage's gradient exists from the
    start of its first such action."""
    return frozenset(name for name, kind in KINDS.items() if kind.owner == STAGE and {"b", "w"} & set(kind.cost))


def checks() -> list[Check]:
    """The distinct completeness rules of the registered kinds, in registration order."""
    return list(dict.fromkeys(k.check for k in KINDS.values() if k.check))
