"""The schedule language itself: actions, JSON, text, and the validator's errors."""

import pytest

from pipeloom.errors import ScheduleError
from pipeloom.schedule import BW, B, F, W, Action, Schedule, build, looped_placement, v_placement, validate


def test_action_strings_follow_pytorch():
    assert [str(Action(k, 1, 3)) for k in (F, B, W, BW)] == ["1F3", "1I3", "1W3", "1B3"]
    for text in ("1F3", "12I0", "0W7", "3B11"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ScheduleError, match="cannot read action"):
        Action.parse("F3")


def test_placements():
    assert looped_placement(3, 6) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)


@pytest.mark.parametrize("name,pp,m,chunks", [("1f1b", 4, 8, None), ("interleaved-1f1b", 3, 6, 3), ("2bw", 2, 4, None)])
def test_json_round_trip(name, pp, m, chunks):
    schedule = build(name, pp, m, chunks)
    again = Schedule.from_json(schedule.to_json())
    assert again == schedule
    assert validate(again) is again


def test_text_form_lists_every_rank():
    text = build("1f1b", 2, 2).text()
    assert text.splitlines() == [
        "1f1b: pp=2 stages=2 microbatches=2",
        "rank 0 (stages 0): 0F0 0F1 0B0 0B1",
        "rank 1 (stages 1): 1F0 1B0 1F1 1B1",
    ]


def _schedule(rank0, rank1, stages=2, m=1):
    return Schedule("hand", 2, m, looped_placement(2, stages),
                    (tuple(map(Action.parse, rank0.split())), tuple(map(Action.parse, rank1.split()))))


def test_valid_hand_written_split_schedule():
    validate(_schedule("0F0 0I0 0W0", "1F0 1I0 1W0"))


@pytest.mark.parametrize("rank0,rank1,message", [
    ("0F0 0W0 0I0", "1F0 1B0", r"rank 0: action 0W0 \(position 1\) runs before 0I0"),
    ("0B0", "1F0 1B0", "rank 0: the forward 0F0 is missing"),
    ("0F0 0I0", "1F0 1B0", "rank 0: 0W0 is missing"),
    ("0F0 0F0 0B0", "1F0 1B0", "rank 0: action 0F0 appears 2 times"),
    ("0F0 0B0 0I0 0W0", "1F0 1B0", "both a fused backward"),
    ("0F0 1B0", "1F0 0B0", "rank 0: action 1B0 belongs to rank 1"),
    ("0F0 0B0", "1F0 1B0 1F1", "names microbatch 1"),
])
def test_validator_names_rank_action_reason(rank0, rank1, message):
    with pytest.raises(ScheduleError, match=message):
        validate(_schedule(rank0, rank1))


def test_validator_finds_cycle_between_two_ranks():
    # rank 0 runs microbatch 1's backward before microbatch 0's forward reaches rank 1
    bad = _schedule("0F1 0B1 0F0 0B0", "1F0 1B0 1F1 1B1", m=2)
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at 0B1 for 1B1 from rank 1; "
                                            r"rank 1 waits at 1F0 for 0F0 from rank 0 \(a cycle"):
        validate(bad)


def test_validator_memory_limit():
    schedule = build("gpipe", 2, 4)
    validate(schedule, memory_limit=4)
    with pytest.raises(ScheduleError, match="rank 0: peak activation memory 4 M_B exceeds the limit 3 M_B"):
        validate(schedule, memory_limit=3)


def test_interleaved_microbatch_rule_suggests_fits():
    with pytest.raises(ValueError, match="microbatches=9 does not divide; use 8 or 10"):
        build("interleaved-1f1b", 4, 9)


def test_schedule_and_simulator_layers_import_no_torch():
    import subprocess
    import sys

    code = ("import sys, pipeloom, pipeloom.paths, pipeloom.schedule, pipeloom.schedule.lower, pipeloom.schedule.kinds, pipeloom.modes, pipeloom.schedule.torch_csv, "
            "pipeloom.sim, pipeloom.sim.trace, pipeloom.sim.grid, pipeloom.sim.plot, pipeloom.cli; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
