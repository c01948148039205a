"""Messages on each link in send order: what a receiver posting in order must follow."""

import pytest

from pipeloom.schedule import build
from pipeloom.schedule.deps import Dependencies
from pipeloom.schedule.links import Message, link_messages


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half"])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_every_cross_rank_dependency_is_one_message(name, pp, m):
    schedule = build(name, pp, m)
    deps = Dependencies(schedule)
    expected = {}
    for dst, actions in enumerate(schedule.ranks):
        for action in actions:
            for dep in deps(action):
                src = schedule.placement[dep.stage]
                if src != dst:
                    kind = "activation" if action.stage > dep.stage else "gradient"
                    expected.setdefault((src, dst), set()).add(Message(kind, dep.stage, dep.microbatch))
    links = link_messages(schedule)
    assert {link: set(messages) for link, messages in links.items()} == expected
    assert all(len(set(messages)) == len(messages) for messages in links.values())


def test_link_order_is_the_senders_action_order():
    links = link_messages(build("1f1b", 2, 3))
    assert links[(0, 1)] == [Message("activation", 0, i) for i in range(3)]
    assert links[(1, 0)] == [Message("gradient", 1, i) for i in range(3)]


def test_v_schedule_sends_a_message_before_one_needed_earlier():
    """zb-v on 2 ranks: rank 0 sends microbatch 2's activation before the gradient of
    stage 3 for microbatch 0, which rank 1 needs first; the runtime posts both in send order."""
    schedule = build("zb-v", 2, 4)
    sent = link_messages(schedule)[(0, 1)]
    assert sent.index(Message("activation", 0, 2)) < sent.index(Message("gradient", 3, 0))
    needed = [a for a in schedule.ranks[1] if str(a) in ("1F2", "2I0")]
    assert [str(a) for a in needed] == ["2I0", "1F2"]
