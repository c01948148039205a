"""The compute-only CSV loads into torch.distributed.pipelining's runtime and passes its checks.

No process group is needed: ``_PipelineScheduleRuntime`` reads only
``num_stages``, ``group_size`` and ``group_rank`` from its stages, so a stub
stands in for one. Loading the CSV runs torch's ``_validate_schedule`` (via
``_validate_and_set_stage_mapping``) and its lowering (unshard/reshard,
reduce-grad, ``_add_send_recv``); the lowered order then goes through
torch's dry run ``_simulate_comms_compute``.
"""

import types
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch.distributed.pipelining.schedules import (  # noqa: E402
    _ComputationType,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
)

from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.schedule import FAMILIES, Action, Offload, Schedule, build, lower, to_torch_csv, write_torch_csv  # noqa: E402

#: Sizes tried in turn for each registered family; the first that builds is used.
SIZES = [(4, 8), (4, 16), (4, 12), (2, 8), (4, 4)]
#: Local ops torch's lowering adds that its dry run does not model.
LOCAL_OPS = {_ComputationType.UNSHARD, _ComputationType.RESHARD, _ComputationType.REDUCE_GRAD}


def build_any_size(name: str) -> Schedule:
    errors = []
    for pp, m in SIZES:
        try:
            return build(name, pp, m)
        except PipeloomError as error:
            errors.append(f"pp={pp} m={m}: {error}")
    pytest.fail(f"{name} builds for none of the sizes tried:\n" + "\n".join(errors))


def load_into_torch(schedule: Schedule, tmp_path) -> _PipelineScheduleRuntime:
    path = tmp_path / f"{schedule.family}.csv"
    write_torch_csv(schedule, path)
    stage = types.SimpleNamespace(
        num_stages=schedule.stages, group_size=schedule.pp, group_rank=0, stage_index_to_group_rank={}
    )
    runtime = _PipelineScheduleRuntime([stage], n_microbatches=schedule.total_microbatches)
    runtime._load_csv(str(path), format="compute_only")
    return runtime


def check_in_torch(schedule: Schedule, tmp_path) -> None:
    runtime = load_into_torch(schedule, tmp_path)
    # the compute order torch read is ours, action by action
    assert [[str(a) for a in runtime.pipeline_order[r]] for r in range(schedule.pp)] == [
        [str(a) for a in actions] for actions in schedule.ranks
    ]
    # torch inferred our placement
    assert runtime.stage_index_to_group_rank == dict(enumerate(schedule.placement))
    # every send lowered by torch has its receive
    lowered = [a for r in range(schedule.pp) for a in runtime.pipeline_order_with_comms[r]]
    kinds = Counter(a.computation_type for a in lowered)
    assert kinds[_ComputationType.SEND_F] == kinds[_ComputationType.RECV_F]
    assert kinds[_ComputationType.SEND_B] == kinds[_ComputationType.RECV_B]
    # torch's dry run completes (it raises on a hang) and runs every action; it does not read an
    # OVERLAP_F_B's sub_actions (torch's own DualPipeV fails it so), so they go in, in order
    comms = {r: [s for a in actions if a.computation_type not in LOCAL_OPS for s in a.sub_actions or (a,)]
             for r, actions in runtime.pipeline_order_with_comms.items()}
    timeline = _simulate_comms_compute(comms, lambda s: runtime.stage_index_to_group_rank[s], schedule.stages)
    for rank, actions in comms.items():
        assert [a for a in timeline[rank] if a is not None] == actions


@pytest.mark.parametrize("name,chunks", [("gpipe", None), ("1f1b", None), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
def test_classic_schedules_validate_in_torch(name, chunks, tmp_path):
    check_in_torch(build(name, 4, 8, chunks=chunks), tmp_path)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_validates_in_torch(name, tmp_path):
    check_in_torch(build_any_size(name), tmp_path)


def test_csv_text_is_one_row_of_action_strings_per_rank():
    schedule = build("1f1b", 2, 2)
    assert to_torch_csv(schedule) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_torch_rejects_a_broken_schedule(tmp_path):
    """The check is real: a backward before its forward fails torch's validation."""
    good = build("1f1b", 2, 2)
    ranks = (good.ranks[0], (Action("BW", 1, 0), Action("F", 1, 0), Action("F", 1, 1), Action("BW", 1, 1)))
    with pytest.raises(AssertionError, match="without first running Forward"):
        load_into_torch(Schedule("broken", 2, 2, good.placement, ranks), tmp_path)


def test_kinds_torch_cannot_hold_are_refused():
    with pytest.raises(PipeloomError, match=r"rank 0: action 0IF0 \(kind IF\) has no place in torch's compute-only"):
        to_torch_csv(build("1f1b", 2, 2, vocab_parallel="vocab-1"))
    good = build("1f1b", 2, 2)
    with pytest.raises(PipeloomError, match=r"action 0OFFLOAD1 \(kind OFFLOAD\) has no place in torch's"):
        to_torch_csv(build("1f1b", 2, 4, transforms=[Offload("full")]))
    ranks = (good.ranks[0] + (Action("SWAP", 0, 0),), good.ranks[1])
    with pytest.raises(PipeloomError, match="unknown action kind 'SWAP'; registered kinds: F, B, W, BW"):
        to_torch_csv(Schedule("swap", 2, 2, good.placement, ranks))


def test_sends_and_receives_are_left_to_torch():
    schedule = build("zb-v", 2, 4)
    assert to_torch_csv(lower(schedule)) == to_torch_csv(schedule)
