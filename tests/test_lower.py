"""The communication lowering pass: every rank's sends and receives, and when receives are posted."""

import pytest

from pipeloom.errors import ScheduleError
from pipeloom.schedule import RECV_B, RECV_F, SEND_B, SEND_F, Action, Costs, Schedule, build, lower, validate
from pipeloom.schedule.deps import Dependencies
from pipeloom.schedule.ir import parts
from pipeloom.schedule.lower import COMM_KINDS, links, matching, peer
from pipeloom.sim import simulate

FAMILIES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipev"]


def _compute(schedule: Schedule) -> Schedule:
    return Schedule(schedule.family, schedule.pp, schedule.microbatches, schedule.placement,
                    tuple(tuple(a for a in actions if a.kind not in COMM_KINDS) for actions in schedule.ranks),
                    schedule.steps, schedule.weight_versions)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_every_cross_rank_dependency_is_one_message(name, pp, m):
    schedule = build(name, pp, m)
    deps = Dependencies(schedule)
    expected = {}
    for dst, actions in enumerate(schedule.ranks):
        for action in (part for a in actions for part in parts(a)):
            for dep in deps(action, plain=True):
                src = schedule.placement[dep.stage]
                if src != dst:
                    send = Action(SEND_F if action.stage > dep.stage else SEND_B, dep.stage, dep.microbatch)
                    expected.setdefault((src, dst), set()).add(send)
    sent = links(schedule)
    assert {link: set(sends) for link, sends in sent.items()} == expected
    assert all(len(set(sends)) == len(sends) for sends in sent.values())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 8)])
def test_lowered_schedule_validates_and_times_as_the_compute_lists(name, pp, m):
    if name == "dualpipev" and m < 2 * pp:
        m = 2 * pp
    schedule = build(name, pp, m)
    lowered = validate(lower(schedule))
    assert lowered.options["lowered"] and lower(lowered) is lowered
    assert _compute(lowered).ranks == schedule.ranks
    costs = Costs(f=1.0, b=1.2, w=0.7, comm=0.3, m_w=0.5)
    plain, low = simulate(schedule, costs), simulate(lowered, costs)
    assert low.makespan == plain.makespan and low.peak_activation == plain.peak_activation
    for rank, actions in enumerate(lowered.ranks):
        for k, action in enumerate(actions):
            if action.kind in (SEND_F, SEND_B):  # right after the action whose output it sends (with its other sends)
                producer = next(a for a in reversed(actions[:k]) if a.kind not in (SEND_F, SEND_B))
                assert (action.stage, action.microbatch) in {(a.stage, a.microbatch) for a in parts(producer)}
                assert peer(lowered, action) != rank


def test_receives_are_posted_in_send_order_ahead_of_need():
    """zb-v on 2 ranks: rank 0 sends microbatch 2's activation before stage 3's gradient of
    microbatch 0, which rank 1 needs first; rank 1 posts both, in send order, before either."""
    lowered = lower(build("zb-v", 2, 4))
    sent = links(lowered)[(0, 1)]
    assert sent.index(Action(SEND_F, 0, 2)) < sent.index(Action(SEND_B, 3, 0))
    rank1 = [str(a) for a in lowered.ranks[1]]
    assert rank1.index("1RECV_F2") < rank1.index("2RECV_B0") < rank1.index("2I0") < rank1.index("1F2")
    posted = [a for a in lowered.ranks[1] if a.kind in (RECV_F, RECV_B) and peer(lowered, a) == 0]
    assert posted == [matching(a) for a in sent]


def test_1f1b_lists_read_like_torch():
    assert lower(build("1f1b", 2, 2)).text().splitlines()[1:] == [
        "rank 0 (stages 0): 0RECV_B0 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B0 0B1",
        "rank 1 (stages 1): 1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1",
    ]


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_json_round_trip(name):
    lowered = lower(build(name, 4, 8, vocab_parallel="vocab-2"))
    again = Schedule.from_json(lowered.to_json())
    assert again == lowered and again.options["lowered"]
    validate(again)


def _edit(schedule, rank, change):
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(change(list(ranks[rank])))
    return Schedule(schedule.family, schedule.pp, schedule.microbatches, schedule.placement, tuple(ranks),
                    options=schedule.options)


def _swap(xs, a, b):
    i, j = xs.index(a), xs.index(b)
    xs[i], xs[j] = xs[j], xs[i]
    return xs


@pytest.mark.parametrize("change,message", [
    (lambda s: _edit(s, 1, lambda xs: [a for a in xs if a != Action(SEND_B, 1, 0)]),
     "rank 1: the link to rank 0 lacks 1SEND_B0"),
    (lambda s: _edit(s, 1, lambda xs: _swap(xs, Action(RECV_F, 1, 0), Action(RECV_F, 1, 1))),
     r"rank 1: receive number 0 from rank 0 is 1RECV_F1, but rank 0 sends 0SEND_F0 then; .* \(1RECV_F0\)"),
    (lambda s: _edit(s, 1, lambda xs: [a for a in xs if a != Action(RECV_F, 1, 1)] + [Action(RECV_F, 1, 1)]),
     r"rank 1: receive number 1 from rank 0"),
    (lambda s: _edit(s, 0, lambda xs: [a for a in xs if a != Action(RECV_B, 0, 2)] + [Action(RECV_B, 0, 2)]),
     r"rank 0: action 0B2 \(position \d+\) runs before 0RECV_B2"),
])
def test_validator_names_the_broken_message_rule(change, message):
    with pytest.raises(ScheduleError, match=message):
        validate(change(lower(build("1f1b", 2, 3))))


def test_sends_belong_to_lowered_schedules():
    plain = build("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="sends and receives belong to lowered schedules"):
        validate(_edit(plain, 0, lambda xs: xs[:2] + [Action(SEND_F, 0, 1)] + xs[2:]))
