"""Every registered family, for p = 2..16 and several m: validated, or refused with a clear message."""

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedule import BW, FAMILIES, build
from pipeloom.sim import simulate

# families that cannot use every microbatch count, and the words their refusal must contain
REFUSES = {"2bw": "needs microbatches >= pp", "interleaved-1f1b": "does not divide; use",
           "dualpipev": "needs microbatches >= 2*pp"}
# families that build for fewer of the microbatch counts tried (dualpipev: only m = 2p)
FEWEST = {"dualpipev": 15}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_validates_or_refuses_clearly(name):
    built = 0
    for p in range(2, 17):
        for m in sorted({1, p - 1, p, p + 1, 2 * p}):
            try:
                schedule = build(name, p, m)  # build validates
            except PipeloomError as err:
                assert name in REFUSES and REFUSES[name] in str(err), (name, p, m, str(err))
                assert "\n" not in str(err)
                continue
            built += 1
            assert schedule.pp == p and schedule.microbatches == m
            assert simulate(schedule).makespan > 0
    assert built >= FEWEST.get(name, 15 * 3)



@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.fused])
def test_a_fused_family_never_splits_a_backward(name):
    """The planner bounds a ``fused`` family's bubble counting each backward's W with it."""
    for p, m in ((2, 4), (4, 8), (3, 9)):
        schedule = build(name, p, m, vocab_parallel="vocab-1" if FAMILIES[name].makes_room else None)
        backwards = {a.kind for actions in schedule.ranks for a in actions if a.kind in ("B", "W", BW)}
        assert backwards == {BW}
