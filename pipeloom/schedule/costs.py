"""Per-stage costs: the times and memory of one microbatch on one stage.

Shared by the simulator (which times schedules) and by the schedule
builders that search with real costs (``zb-auto``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence, Union

from ..errors import PipeloomError

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
    """

    f: Value = 1.0
    b: Value = 1.0
    w: Value = 1.0
    comm: Value = 0.0
    m_b: Value = 1.0
    m_w: Value = 0.0

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
            if values[key] < 0:
                raise PipeloomError(f"bad cost {item!r}: costs cannot be negative")
        return cls(**values)

    def per_stage(self, stages: int, chunks: int) -> StageCosts:
        """Expand to one value per virtual stage for ``stages`` stages of ``chunks`` per rank."""
        def expand(name: str, split: bool) -> tuple[float, ...]:
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                return (float(value) / (chunks if split else 1),) * stages
            value = tuple(float(v) for v in value)
            if len(value) != stages:
                raise PipeloomError(f"costs: {name} has {len(value)} values; the schedule has {stages} stages")
            return value

        return StageCosts(
            f=expand("f", True),
            b=expand("b", True),
            w=expand("w", True),
            comm=expand("comm", False),
            m_b=expand("m_b", True),
            m_w=expand("m_w", True),
        )


@dataclass(frozen=True)
class StageCosts:
    """Costs resolved to one value per virtual stage."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: tuple[float, ...]
    m_b: tuple[float, ...]
    m_w: tuple[float, ...]

    def duration(self, action) -> float:
        """Time of one action (kinds without a cost take no time)."""
        kind, s = action.kind, action.stage
        if kind == "F":
            return self.f[s]
        if kind == "B":
            return self.b[s]
        if kind == "W":
            return self.w[s]
        if kind == "BW":
            return self.b[s] + self.w[s]
        return 0.0

    def transfer(self, producer) -> float:
        return self.comm[producer.stage]
