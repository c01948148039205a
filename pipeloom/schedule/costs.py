"""Per-stage costs: the times and memory of one microbatch on one stage.

Shared by the simulator (which times schedules) and by the schedule
builders that search with real costs (``zb-auto``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Sequence, Union

from ..errors import PipeloomError
from .deps import memory_delta
from .ir import parts
from .kinds import get

Value = Union[float, Sequence[float]]


@dataclass(frozen=True)
class CostField:
    """A cost field: ``per`` "stage" (one value per virtual stage; a number for a
    full stage is split over the chunks when ``split``), "rank" (one per rank) or
    "unit" (weights of a stage's units, cycled over them: a :class:`~.kinds.Kind`'s
    ``weight``; none given, every unit weighs 1). ``derive``: where the costs do not give
    it, its values from the other fields' (``derive(values)``, resolved per stage)."""

    name: str
    per: str = "stage"
    split: bool = True
    derive: Callable[[dict], tuple[float, ...]] | None = None


#: Every cost field by name: :class:`Costs`' own, and those a technique adds with :func:`register_field`.
COST_FIELDS: dict[str, CostField] = {}


def register_field(name: str, per: str = "stage", split: bool = True,
                   derive: Callable[[dict], tuple[float, ...]] | None = None) -> CostField:
    """Declare cost field ``name`` (a technique's: given in ``Costs(extra={name: ...})``;
    ``derive`` as in :class:`CostField`)."""
    if per not in ("stage", "rank", "unit"):
        raise PipeloomError(f"cost field {name}: per={per!r}; choose 'stage', 'rank' or 'unit'")
    COST_FIELDS[name] = CostField(name, per, split and per == "stage", derive)
    return COST_FIELDS[name]


@dataclass(frozen=True)
class Costs:
    """Time and activation memory of one microbatch on one stage.

    Each field is a number for a full stage (a rank's share of the layers
    when it holds one stage) or a list with one value per virtual stage. A
    number is split evenly over the chunks of interleaved and V schedules;
    ``comm`` (the time from a producer's end to the consumer having the
    data) is never split. ``m_b`` is the activation memory a microbatch keeps
    from F until its backward; ``m_w`` the part of it kept from B until W.

    The vocabulary passes (:data:`~pipeloom.schedule.transforms.vocab.VOCAB_PASSES`) cost a
    number or one value per rank: ``s`` and ``t`` the S and T passes,
    ``e_f`` and ``e_b`` the input layer's forward and backward; ``c`` the
    collective after S (and naive's all-reduce of the sums), ``r`` the reduce
    of the input gradient, ``e_comm`` the all-reduce summing the input layer
    into stage 0 (the broadcasts of the last stage's output and of stage 0's
    gradient take ``comm``); ``m_v`` the memory an S keeps until its T.
    All default to 0. ``extra`` holds the fields techniques add
    (:func:`register_field`), by name.
    """

    f: Value = 1.0
    b: Value = 1.0
    w: Value = 1.0
    comm: Value = 0.0
    m_b: Value = 1.0
    m_w: Value = 0.0
    s: Value = 0.0
    t: Value = 0.0
    c: Value = 0.0
    r: Value = 0.0
    e_f: Value = 0.0
    e_b: Value = 0.0
    e_comm: Value = 0.0
    m_v: Value = 0.0
    extra: Mapping[str, Value] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.extra) - set(COST_FIELDS))
        if unknown:
            raise PipeloomError(f"costs: unknown field {unknown[0]!r}; fields: {', '.join(COST_FIELDS)}")

    def value(self, name: str) -> Value:
        """The field ``name``, one of :class:`Costs`' own or an ``extra`` one (0 when not given)."""
        return getattr(self, name) if name in _OWN else self.extra.get(name, 0.0)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"f=1,b=1,w=1,comm=0"`` (any subset of the fields)."""
        names = list(COST_FIELDS)
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in names:
                raise PipeloomError(f"bad cost {item!r} in {text!r}: expected NAME=NUMBER with NAME one of {', '.join(names)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise PipeloomError(f"bad cost {item!r} in {text!r}: {value.strip()!r} is not a number") from None
            if not 0 <= values[key] < math.inf:
                raise PipeloomError(f"bad cost {item!r}: costs must be finite numbers >= 0")
        extra = {k: values.pop(k) for k in list(values) if k not in _OWN}
        return cls(**values, extra=extra)

    def per_stage(self, stages: int, chunks: int) -> StageCosts:
        """Expand to one value per virtual stage for ``stages`` stages of
        ``chunks`` per rank (one per rank for the fields given per rank)."""
        ranks = stages // chunks

        def expand(spec: CostField) -> tuple[float, ...]:
            value = self.value(spec.name)
            if spec.per == "unit":
                if isinstance(value, (int, float)) and not value:
                    return ()  # not given: every unit weighs 1
                try:
                    weights = tuple(float(v) for v in value)
                except (TypeError, ValueError):
                    weights = ()
                if not weights or min(weights) < 0:
                    raise PipeloomError(f"costs: {spec.name} weighs a stage's units: give a list of numbers >= 0, "
                                        f"not {value!r}")
                return weights
            count, unit = (stages, "stages") if spec.per == "stage" else (ranks, "ranks")
            if isinstance(value, (int, float)):
                return (float(value) / (chunks if spec.split else 1),) * count
            value = tuple(float(v) for v in value)
            if len(value) != count:
                raise PipeloomError(f"costs: {spec.name} has {len(value)} values; the schedule has {count} {unit}")
            return value

        values = {name: expand(spec) for name, spec in COST_FIELDS.items() if not spec.derive or name in self.extra}
        for name, spec in COST_FIELDS.items():
            if name not in values:
                values[name] = spec.derive(values)
        return StageCosts(values)


_OWN = frozenset(f.name for f in fields(Costs)) - {"extra"}
for _name in ("f", "b", "w", "m_b", "m_w"):
    register_field(_name)
register_field("comm", split=False)
#: Memory a recomputed stage holds again while its backward reruns its forward (the stage's
#: activations without recomputation); read by the memory model, not by any action's timing.
register_field("m_rerun")
#: Memory a stage's backward holds beyond what its F kept while it computes the loss's gradient (the
#: stage with the output layer: the gradient of the fp32 log-softmax and that of the logits, beside
#: the log-softmax kept); read by the memory model, not by any action's timing.
register_field("m_loss")
#: The share of a compound action's shorter parts hidden under its longest (DualPipeV's overlapped
#: F and B: 0, the default, runs them one after the other; 1 takes only the longer), in [0, 1].
register_field("overlap", split=False)
#: BW's time less its B's and W's (:mod:`.compute`): a profile's measured ``bw - b - w``, what one
#: backward call saves over two (on a GPU, the split's second pass over the graph); 0 from formulas.
register_field("fused")
#: The fields of :class:`Costs` given per rank: the vocabulary passes.
VOCAB_FIELDS = ("s", "t", "c", "r", "e_f", "e_b", "e_comm", "m_v")
for _name in VOCAB_FIELDS:
    register_field(_name, per="rank")


class StageCosts:
    """Costs resolved to one value per virtual stage (per rank for the fields
    given per rank), read as attributes (``costs.f[stage]``); kinds' actions
    timed by their :class:`~.kinds.Kind` fields."""

    def __init__(self, values: dict[str, tuple[float, ...]]):
        self.values = values
        self._deltas: tuple[dict, dict] = ({}, {})  # activation and host changes by (kind, stage, payload)
        #: id of a list of actions -> (the list, :meth:`memory_changes` of it)
        self._changes: dict[int, tuple[object, tuple[list, list]]] = {}

    def __getattr__(self, name: str) -> tuple[float, ...]:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __eq__(self, other) -> bool:
        return isinstance(other, StageCosts) and self.values == other.values

    def __repr__(self) -> str:
        return f"StageCosts({self.values!r})"

    def duration(self, action) -> float:
        """Time of one action: the sum of its kind's cost fields (the collectives
        take no time on their rank: theirs is in :meth:`transfer`); a compound
        action's, its longest part's and the rest of its parts' not hidden (:class:`~.kinds.Kind`)."""
        s, values, kind = action.stage, self.values, get(action.kind)
        if kind.compound:
            times = [self.duration(part) for part in parts(action)]
            hidden = values[kind.overlap][s] if kind.overlap else 0.0
            if not 0.0 <= hidden <= 1.0:
                raise PipeloomError(f"costs: {kind.overlap}={hidden:g} is a share of time; give a number in [0, 1]")
            return max(times) + (1.0 - hidden) * (sum(times) - max(times))
        time = sum(values[name][s] for name in kind.cost)
        weights = values[kind.weight] if kind.weight else ()
        return time * weights[action.payload[0] % len(weights)] if weights else time

    def transfer(self, producer) -> float:
        """Time from ``producer``'s end until a consumer on another rank (or
        behind a collective) has its result: its kind's ``transfer`` field."""
        name = get(producer.kind).transfer
        return self.values[name][producer.stage] if name else 0.0

    def memory_delta(self, action) -> float:
        """The action's change of its rank's activation memory (:func:`~.deps.memory_delta`)."""
        found = self._deltas[0].get((action[0], action[1], action[3]))
        return self._delta(action, "memory") if found is None else found

    def memory_changes(self, actions) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """(index, :meth:`memory_delta`) of the actions of the list ``actions`` that raise its rank's
        activation memory, and of those that lower it; kept while these costs live, per list object
        (a placement times the same lists again and again)."""
        known = self._changes.get(id(actions))
        if known is None or known[0] is not actions:
            deltas = list(map(self.memory_delta, actions))
            found = ([(k, d) for k, d in enumerate(deltas) if d > 0], [(k, d) for k, d in enumerate(deltas) if d < 0])
            known = self._changes[id(actions)] = actions, found
        return known[1]

    def host_delta(self, action) -> float:
        """The action's change of its rank's host memory (its kind's ``host`` terms)."""
        found = self._deltas[1].get((action[0], action[1], action[3]))
        return self._delta(action, "host") if found is None else found

    def _delta(self, action, memory: str) -> float:
        """:func:`~.deps.memory_delta` of ``action``, kept for every action of its kind, stage and payload."""
        found = self._deltas[memory == "host"][action[0], action[1], action[3]] = memory_delta(
            action, lambda name, a: self.values[name][a.stage], memory)
        return found
