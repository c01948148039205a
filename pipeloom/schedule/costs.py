"""Per-stage costs: the times and memory of one microbatch on one stage.

Shared by the simulator (which times schedules) and by the schedule
builders that search with real costs (``zb-auto``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence, Union

from ..errors import PipeloomError
from .deps import activation_delta
from .ir import IB, IF, S, T, VOCAB_KINDS, Z

Value = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Costs:
    """Time and activation memory of one microbatch on one stage.

    Each field is a number for a full stage (a rank's share of the layers
    when it holds one stage) or a list with one value per virtual stage. A
    number is split evenly over the chunks of interleaved and V schedules;
    ``comm`` (the time from a producer's end to the consumer having the
    data) is never split. ``m_b`` is the activation memory a microbatch keeps
    from F until its backward; ``m_w`` the part of it kept from B until W.

    The vocabulary passes (:data:`~pipeloom.schedule.ir.VOCAB_PASSES`) cost a
    number or one value per rank: ``s`` and ``t`` the S and T passes,
    ``e_f`` and ``e_b`` the input layer's forward and backward; ``c`` the
    collective after S (and naive's all-reduce of the sums), ``r`` the reduce
    of the input gradient, ``e_comm`` the all-reduce summing the input layer
    into stage 0 (the broadcasts of the last stage's output and of stage 0's
    gradient take ``comm``); ``m_v`` the memory an S keeps until its T.
    All default to 0.
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

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"f=1,b=1,w=1,comm=0"`` (any subset of the fields)."""
        names = [f.name for f in fields(cls)]
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
        return cls(**values)

    def per_stage(self, stages: int, chunks: int) -> StageCosts:
        """Expand to one value per virtual stage for ``stages`` stages of
        ``chunks`` per rank (and one per rank for the vocabulary passes)."""
        ranks = stages // chunks

        def expand(name: str, split: bool, count: int = stages, unit: str = "stages") -> tuple[float, ...]:
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                return (float(value) / (chunks if split else 1),) * count
            value = tuple(float(v) for v in value)
            if len(value) != count:
                raise PipeloomError(f"costs: {name} has {len(value)} values; the schedule has {count} {unit}")
            return value

        per_rank = {name: expand(name, False, ranks, "ranks") for name in VOCAB_FIELDS}
        return StageCosts(
            f=expand("f", True),
            b=expand("b", True),
            w=expand("w", True),
            comm=expand("comm", False),
            m_b=expand("m_b", True),
            m_w=expand("m_w", True),
            **per_rank,
        )


#: The fields of :class:`Costs` given per rank: the vocabulary passes.
VOCAB_FIELDS = ("s", "t", "c", "r", "e_f", "e_b", "e_comm", "m_v")


@dataclass(frozen=True)
class StageCosts:
    """Costs resolved to one value per virtual stage (per rank for the vocabulary passes)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: tuple[float, ...]
    m_b: tuple[float, ...]
    m_w: tuple[float, ...]
    s: tuple[float, ...]
    t: tuple[float, ...]
    c: tuple[float, ...]
    r: tuple[float, ...]
    e_f: tuple[float, ...]
    e_b: tuple[float, ...]
    e_comm: tuple[float, ...]
    m_v: tuple[float, ...]

    def duration(self, action) -> float:
        """Time of one action (kinds without a cost, the collectives, take no
        time on their rank: their time is in :meth:`transfer`)."""
        kind, s = action.kind, action.stage
        if kind == "F":
            return self.f[s]
        if kind == "B":
            return self.b[s]
        if kind == "W":
            return self.w[s]
        if kind == "BW":
            return self.b[s] + self.w[s]
        if kind == S:
            return self.s[s]
        if kind == T:
            return self.t[s]
        if kind == IF:
            return self.e_f[s]
        if kind == IB:
            return self.e_b[s]
        return 0.0

    def transfer(self, producer) -> float:
        """Time from ``producer``'s end until a consumer on another rank (or
        behind a collective) has its result."""
        kind = producer.kind
        if kind == S or kind == Z:
            return self.c[producer.stage]
        if kind == T:
            return self.r[producer.stage]
        if kind == IF:
            return self.e_comm[producer.stage]
        return self.comm[producer.stage]

    def memory_delta(self, action) -> float:
        """The action's change of its rank's activation memory (:func:`~.deps.activation_delta`)."""
        s = action.stage
        if action.kind in VOCAB_KINDS:
            return activation_delta(action, 0.0, 0.0, self.m_v[s])
        return activation_delta(action, self.m_b[s], self.m_w[s])
