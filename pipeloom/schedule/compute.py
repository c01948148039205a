"""The compute kinds F, B, W and BW: their rules, registered like any other kind.

F(s,i) after F(s-1,i); B(s,i) and BW(s,i) after F(s,i) and the backward of
(s+1,i); W(s,i) after B(s,i). A forward keeps ``m_b`` of activation memory
until its backward; B frees all but ``m_w``, which W frees; BW frees all.
Each (stage, microbatch) runs one F and either one BW or one B and one W; in
a forward-only schedule (:mod:`.forward`) one F and no backward.
"""

from __future__ import annotations

from collections import Counter
from itertools import product

from ..errors import ScheduleError
from .ir import BW, B, F, W, Action, Schedule
from .kinds import Kind, register


def _forward_needs(action: Action, deps) -> tuple:
    s = action.stage
    return (Action.from_fields((F, s - 1, action.microbatch, ())),) if s > 0 else ()


def _backward_needs(action: Action, deps) -> tuple:
    s, i = action.stage, action.microbatch
    forward = Action.from_fields((F, s, i, ()))
    return (forward,) if s == deps.last else (forward, deps.backward(s + 1, i))


def _weight_needs(action: Action, deps) -> tuple:
    return (Action.from_fields((B, action.stage, action.microbatch, ())),)


def check_compute(schedule: Schedule) -> None:
    """Each (stage, microbatch) has one F and either one BW or one B and one W (a
    forward-only schedule: one F and no backward)."""
    if _complete(schedule):
        return  # else the checks below, pair by pair, name what is wrong
    counts = Counter(a for actions in schedule.ranks for a in actions if a.kind in (F, B, W, BW))
    if schedule.forward_only:
        backward = next((a for a in counts if a.kind != F), None)
        if backward is not None:
            raise ScheduleError(f"rank {schedule.rank_of(backward)}: {backward} in a forward-only schedule; "
                                "it runs the forwards only")
    for stage in range(schedule.stages):
        rank = schedule.placement[stage]
        for mb in range(schedule.total_microbatches):
            def has(kind):
                return (kind, stage, mb, ()) in counts
            if not has(F):
                raise ScheduleError(f"rank {rank}: the forward {stage}F{mb} is missing")
            if schedule.forward_only:
                continue
            split = has(B), has(W)
            if has(BW):
                if any(split):
                    raise ScheduleError(
                        f"rank {rank}: stage {stage} microbatch {mb} has both a fused backward {stage}B{mb} "
                        f"and a split one; use BW or B and W, not both"
                    )
            elif split == (False, False):
                raise ScheduleError(f"rank {rank}: the backward of stage {stage} microbatch {mb} is missing")
            elif not all(split):
                missing = f"{stage}W{mb}" if split[0] else f"{stage}I{mb}"
                raise ScheduleError(f"rank {rank}: {missing} is missing (a split backward needs both B and W)")


def _complete(schedule: Schedule) -> bool:
    """True when :func:`check_compute` finds nothing wrong, decided on sets of (stage, microbatch)
    pairs (a forward-only schedule: False, left to the checks pair by pair)."""
    if schedule.forward_only:
        return False
    pairs = {F: set(), B: set(), W: set(), BW: set()}
    for actions in schedule.ranks:
        for kind, stage, microbatch, payload in actions:
            found = pairs.get(kind)
            if found is not None and not payload:
                found.add((stage, microbatch))
    every = set(product(range(schedule.stages), range(schedule.total_microbatches)))
    forwards, split, weights, fused = pairs[F], pairs[B], pairs[W], pairs[BW]
    return forwards >= every and every <= fused | (split & weights) and not fused & (split | weights) & every


register(Kind(F, "forward", needs=_forward_needs, memory=((1.0, "m_b"),), cost=("f",), transfer="comm",
              colour="#4c72b0", torch_code="F", torch_csv=True, check=check_compute, forward=True))
register(Kind(B, "input grad", needs=_backward_needs, memory=((1.0, "m_w"), (-1.0, "m_b")), cost=("b",),
              transfer="comm", colour="#dd8452", torch_code="I", torch_csv=True, check=check_compute))
register(Kind(W, "weight grad", needs=_weight_needs, memory=((-1.0, "m_w"),), cost=("w",),
              colour="#55a868", torch_code="W", torch_csv=True, check=check_compute))
register(Kind(BW, "fused backward", needs=_backward_needs, memory=((-1.0, "m_b"),), cost=("b", "w", "fused"),
              transfer="comm", colour="#c44e52", torch_code="B", torch_csv=True, check=check_compute))
