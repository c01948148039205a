"""The schedule language: actions, schedules, their JSON and text forms.

An :class:`Action` is one unit of work on one rank. A :class:`Schedule` is
the ordered action list of every rank plus the facts needed to read it
(pipeline size, stage count, microbatch count, placement). Dependencies are
not stored: :mod:`pipeloom.schedule.deps` derives them from the kinds
(:mod:`pipeloom.schedule.kinds`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from types import MethodType
from typing import NamedTuple, Sequence

from ..errors import ScheduleError
from ..modes import VocabMode
from .kinds import COMPOUND, KINDS, RANK, from_code, get

#: Forward pass of a stage.
F = "F"
#: Input-gradient backward (the "B" of zero bubble; PyTorch calls it "I").
B = "B"
#: Weight-gradient backward.
W = "W"
#: Fused backward: B then W in one pass (PyTorch's "B").
BW = "BW"

_ACTION_RE = re.compile(r"^(\d+)([A-Z_]+)(\d+)$")
_COMPOUND_RE = re.compile(r"^\(([^()]+)\)([A-Z_]+)$")


class Action(NamedTuple):
    """One unit of work: ``kind`` on ``stage`` for ``microbatch``.

    For a kind owned by a rank (:data:`~.kinds.RANK`, such as the vocabulary
    passes) ``stage`` names the rank instead; :meth:`Schedule.rank_of` reads
    the kind's owner. ``str(action)`` is PyTorch's action string (``1F3``,
    ``1I3``, ``1W3``, ``1B3``, ``1SEND_F3``: stage, kind, microbatch), which
    :meth:`parse` reads back; kinds torch lacks print as themselves (``3S7``:
    rank 3's S pass of microbatch 7). A compound action (:mod:`~.kinds`) prints as
    torch prints one with ``sub_actions``: its parts, then its code (``(0F3;7B1)OVERLAP_F_B``).

    ``Action.from_fields((kind, stage, microbatch, payload))`` makes one as fast as a
    tuple (hot paths); :meth:`compound` makes a compound one from its parts, which
    :func:`parts` reads back.
    """

    kind: str
    stage: int
    microbatch: int
    payload: tuple = ()

    def __str__(self) -> str:
        kind = KINDS.get(self.kind)
        code = kind.code if kind else self.kind
        if kind and kind.compound:
            return f"({';'.join(map(str, parts(self)))}){code}"
        return f"{self.stage}{code}{self.microbatch}"

    @classmethod
    def compound(cls, kind: str, parts: Sequence[Action]) -> Action:
        """The action of compound kind ``kind`` standing for ``parts``: their (kind, stage,
        microbatch) triples are its payload, the first one's stage and microbatch its own."""
        payload = ()
        for part in parts:
            payload += (part.kind, part.stage, part.microbatch)
        return cls(kind, parts[0].stage, parts[0].microbatch, payload)

    @classmethod
    def parse(cls, text: str) -> Action:
        found = _COMPOUND_RE.match(text.strip())
        if found:
            return cls.compound(from_code(found.group(2)), [cls.parse(part) for part in found.group(1).split(";")])
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise ScheduleError(
                f"cannot read action {text!r}: expected STAGE KIND MICROBATCH such as '1F3', '1I3', '1W3' or '1B3'"
            )
        stage, code, mb = match.groups()
        return cls(from_code(code), int(stage), int(mb))


#: ``Action.from_fields((kind, stage, microbatch, payload))``: the action of those four fields,
#: made by ``tuple.__new__`` without the NamedTuple constructor's argument handling (nor its check
#: of their number), as fast as a tuple: for the hot paths that make millions (dependency rules,
#: list schedulers). Bound here, as a class has no name for itself in its own body.
Action.from_fields = MethodType(tuple.__new__, Action)


def parts(action: Action) -> tuple[Action, ...]:
    """The actions ``action`` stands for: a compound action's parts (:mod:`~.kinds`), else itself alone."""
    if action.kind not in COMPOUND:
        return (action,)
    p = action.payload
    return tuple(Action.from_fields((p[k], p[k + 1], p[k + 2], ())) for k in range(0, len(p) - 2, 3))


def shifted(action: Action, by: int) -> Action:
    """``action`` with its microbatch, and a compound action's parts', ``by`` later (a later step's)."""
    kind, stage, microbatch, payload = action
    if kind not in COMPOUND:
        return Action.from_fields((kind, stage, microbatch + by, payload))
    return Action.compound(action.kind, [part._replace(microbatch=part.microbatch + by) for part in parts(action)])


def rank_of(action: Action, placement: tuple[int, ...]) -> int:
    """The rank that runs ``action``: its stage's, or for a rank-owned kind the one it names."""
    return action.stage if get(action.kind).owner == RANK else placement[action.stage]


def looped_placement(pp: int, stages: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % pp`` (GPipe, 1F1B, interleaved 1F1B)."""
    return tuple(s % pp for s in range(stages))


def v_placement(pp: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: stage ``s`` on rank ``s`` for ``s < pp``,
    on rank ``2pp - 1 - s`` otherwise (ZB-V, V-Min, V-Half, V-ZB)."""
    return tuple(s if s < pp else 2 * pp - 1 - s for s in range(2 * pp))


@dataclass(frozen=True)
class Schedule:
    """The ordered actions of every rank and the facts to read them by.

    ``microbatches`` is per training step; a schedule that spans several
    steps (PipeDream-2BW) numbers its microbatches ``0 .. steps*microbatches-1``.
    ``weight_versions`` is 1 for synchronous schedules (a flush per step) and
    2 for PipeDream-2BW's double-buffered weights.
    """

    family: str
    pp: int
    microbatches: int
    placement: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    steps: int = 1
    weight_versions: int = 1
    options: dict = field(default_factory=dict, compare=False)

    @property
    def stages(self) -> int:
        return len(self.placement)

    @property
    def chunks(self) -> int:
        """Stages per rank (1 for GPipe and 1F1B, v for interleaved, 2 for V)."""
        return self.stages // self.pp

    @property
    def total_microbatches(self) -> int:
        return self.microbatches * self.steps

    @property
    def split_backward(self) -> bool:
        """True when backward is split into B and W (zero-bubble families)."""
        return any(a.kind == W for actions in self.ranks for a in actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def rank_of(self, action: Action) -> int:
        """The rank that runs ``action``: its stage's rank, or for a kind owned
        by a rank the rank its ``stage`` field names."""
        return rank_of(action, self.placement)

    @property
    def vocab_parallel(self) -> str | None:
        """The vocabulary-parallel algorithm whose passes the lists hold (one of
        :data:`~pipeloom.modes.VOCAB_ALGORITHMS`, from ``options["vocab_parallel"]``), or None."""
        algorithm = self.options.get("vocab_parallel")
        return algorithm if algorithm in {m.value for m in VocabMode if m.splits} else None

    @property
    def forward_only(self) -> bool:
        """True for a schedule that computes the loss only (``options["forward_only"]``,
        :func:`~pipeloom.schedule.forward.forward_only`): no backward, no update."""
        return bool(self.options.get("forward_only"))

    def weight_version(self, microbatch: int) -> int:
        """The weight version microbatch ``microbatch`` (0-based) runs with.

        Flushing schedules use version ``t`` in step ``t``. PipeDream-2BW
        uses ``max(t - 1, 0)``: the update of step ``t`` lands one step late.
        """
        step = microbatch // self.microbatches
        return max(step - 1, 0) if self.weight_versions == 2 else step

    def num_actions(self) -> int:
        return sum(len(actions) for actions in self.ranks)

    # -- serialisation ---------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "steps": self.steps,
            "weight_versions": self.weight_versions,
            "placement": list(self.placement),
            "options": self.options,
            "ranks": [[_action_to_json(a) for a in actions] for actions in self.ranks],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def digest(self) -> str:
        """sha256 of the canonical JSON (keys sorted, no spaces): equal for equal schedules, options included."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        try:
            return cls(
                family=str(data["family"]),
                pp=int(data["pp"]),
                microbatches=int(data["microbatches"]),
                placement=tuple(int(r) for r in data["placement"]),
                ranks=tuple(tuple(_action_from_json(a) for a in actions) for actions in data["ranks"]),
                steps=int(data.get("steps", 1)),
                weight_versions=int(data.get("weight_versions", 1)),
                options=dict(data.get("options", {})),
            )
        except KeyError as missing:
            raise ScheduleError(f"schedule JSON lacks the field {missing}") from None

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))

    # -- text ------------------------------------------------------------
    def text(self) -> str:
        """One line per rank: ``rank r (stages ...): 0F0 0F1 ... 0B0``."""
        lines = [
            f"{self.family}: pp={self.pp} stages={self.stages} microbatches={self.microbatches}"
            + (f" steps={self.steps}" if self.steps > 1 else "")
        ]
        for rank, actions in enumerate(self.ranks):
            stages = ",".join(map(str, self.stages_of(rank)))
            lines.append(f"rank {rank} (stages {stages}): " + " ".join(map(str, actions)))
        return "\n".join(lines)

    __str__ = text


def _action_to_json(action: Action):
    if action.payload:
        return {"action": str(action), "payload": list(action.payload)}
    return str(action)


def _action_from_json(item) -> Action:
    if isinstance(item, dict):
        return Action.parse(item["action"])._replace(payload=tuple(item.get("payload", ())))
    return Action.parse(item)
