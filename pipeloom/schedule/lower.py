"""Communication as a lowering pass: :func:`lower` adds every rank's sends and receives.

As torch.distributed.pipelining's ``_add_send_recv``, the pass turns the
compute-only lists into lists that say which messages each rank sends and
receives, and when each receive is posted. Kinds are torch's, numbered by the
stage that acts:

- ``SEND_F(s, i)``: stage ``s``'s rank sends its output of microbatch ``i``
  to the rank of stage ``s + 1``; ``RECV_F(s, i)``: stage ``s``'s rank posts
  the receive of its input from the rank of stage ``s - 1``;
- ``SEND_B(s, i)``: stage ``s``'s rank sends its input gradient to the rank of
  stage ``s - 1``; ``RECV_B(s, i)``: stage ``s``'s rank posts the receive of its
  output gradient from the rank of stage ``s + 1``.

Only hand-offs between different ranks become messages. A send follows the
action that produced its data (a compound action's parts' sends follow it,
as torch's ``_add_send_recv`` puts them after an ``OVERLAP_F_B``). A backend
that matches a link's messages in posting order (NCCL; gloo with one tag)
needs each receiver to post a link's receives in the order they are sent,
even where it needs a later message first (V schedules cross so): the
receive an action needs is posted when the action needing the previous
received input starts (the first before the list), together with the
messages its link sends before it. Posting does not block; the action that
consumes a message waits for it.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ScheduleError
from .ir import BW, B, F, Action, Schedule, parts
from .kinds import Kind, register, register_inputs

SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
#: The kinds this pass adds.
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
#: Each kind's neighbouring stage: the stage at the other end of the message.
_OTHER_END = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}


def peer(schedule: Schedule, action: Action) -> int:
    """The pipeline rank at the other end of a send or receive."""
    return schedule.placement[action.stage + _OTHER_END[action.kind]]


def _send(schedule: Schedule, action: Action) -> Action | None:
    """The send that follows ``action``, if its data goes to another rank."""
    s, last = action.stage, schedule.stages - 1
    if action.kind == F and s < last:
        send = Action(SEND_F, s, action.microbatch)
    elif action.kind in (B, BW) and s > 0:
        send = Action(SEND_B, s, action.microbatch)
    else:
        return None
    return send if peer(schedule, send) != schedule.placement[s] else None


def _receive(schedule: Schedule, action: Action) -> Action | None:
    """The receive whose message ``action`` consumes, if its input comes from another rank."""
    s, last = action.stage, schedule.stages - 1
    if action.kind == F and s > 0:
        recv = Action(RECV_F, s, action.microbatch)
    elif action.kind in (B, BW) and s < last:
        recv = Action(RECV_B, s, action.microbatch)
    else:
        return None
    return recv if peer(schedule, recv) != schedule.placement[s] else None


def matching(action: Action) -> Action:
    """The send a receive matches (or the receive a send matches)."""
    kind, s, i = action.kind, action.stage, action.microbatch
    return {
        SEND_F: Action(RECV_F, s + 1, i), RECV_F: Action(SEND_F, s - 1, i),
        SEND_B: Action(RECV_B, s - 1, i), RECV_B: Action(SEND_B, s + 1, i),
    }[kind]


def links(schedule: Schedule) -> dict[tuple[int, int], list[Action]]:
    """For each link ``(src, dst)`` of pipeline ranks, its sends in the order ``src`` makes them."""
    out: dict[tuple[int, int], list[Action]] = {}
    for src, actions in enumerate(schedule.ranks):
        for send in (_send(schedule, part) for action in actions for part in parts(action)):
            if send:
                out.setdefault((src, peer(schedule, send)), []).append(send)
    return dict(sorted(out.items()))


def lower(schedule: Schedule) -> Schedule:
    """``schedule`` with every rank's sends and receives (see the module docstring),
    ``options["lowered"]`` set. A lowered schedule is returned unchanged."""
    if schedule.options.get("lowered"):
        return schedule
    sent = links(schedule)
    lists = []
    for rank, actions in enumerate(schedule.ranks):
        incoming = {src: [matching(m) for m in messages] for (src, dst), messages in sent.items() if dst == rank}
        position = {recv: k for receives in incoming.values() for k, recv in enumerate(receives)}
        posted = dict.fromkeys(incoming, 0)  # per link: how many receives are posted
        posts: dict[int, list[Action]] = {}
        point = 0
        for k, action in enumerate(actions):
            needs = [need for part in parts(action) if (need := _receive(schedule, part))]
            for need in needs:
                src, upto = peer(schedule, need), position[need] + 1
                if upto > posted[src]:
                    posts.setdefault(point, []).extend(incoming[src][posted[src]:upto])
                    posted[src] = upto
            if needs:
                point = k
        lowered: list[Action] = []
        for k, action in enumerate(actions):
            lowered += posts.get(k, ())
            lowered.append(action)
            lowered += [send for part in parts(action) if (send := _send(schedule, part))]
        lists.append(tuple(lowered))
    return replace(schedule, ranks=tuple(lists), options={**schedule.options, "lowered": True})


def proofs(schedule: Schedule, rank: int) -> tuple[dict[Action, tuple[int, int]], dict[Action, tuple[int, int]]]:
    """For pipeline rank ``rank`` of a lowered ``schedule``: each of its sends with (its peer, the
    position in the peer's list of the action that consumes it), and each of its receives with (its
    peer, the position in the peer's list of the send it matches). A peer runs its list in order,
    the action that consumes a message first waiting for it: once a message arrives that the peer
    sent from a later position than a send's consumer, that send has been received (the runtime
    then lets it go: :meth:`~pipeloom.runtime.p2p.Channel.recv`)."""
    consumers: dict[Action, tuple[int, int]] = {}
    producers: dict[Action, tuple[int, int]] = {}
    for other, actions in enumerate(schedule.ranks):
        if other == rank:
            continue
        for k, action in enumerate(actions):
            if action.kind in (SEND_F, SEND_B):
                if peer(schedule, action) == rank:
                    producers[matching(action)] = other, k
            elif action.kind not in COMM_KINDS:
                for part in parts(action):
                    need = _receive(schedule, part)
                    if need is not None and peer(schedule, need) == rank:
                        consumers[matching(need)] = other, k
    return consumers, producers


# -- the kinds and their rules ------------------------------------------------------
def _send_needs(action: Action, deps) -> tuple:
    s, i = action.stage, action.microbatch
    return (Action(F, s, i),) if action.kind == SEND_F else (deps.backward(s, i),)


@register_inputs
def _posted_first(schedule: Schedule):
    """In a lowered schedule, an action whose input comes from another rank
    needs its receive posted earlier in its rank's list."""
    if not schedule.options.get("lowered"):
        return None

    def rule(action, deps):
        recv = _receive(schedule, action)
        return (recv,) if recv else ()
    return rule


def check_messages(schedule: Schedule) -> None:
    """A lowered schedule sends and receives exactly the messages between ranks,
    and each receiver posts a link's receives in the order they are sent."""
    comm = [a for actions in schedule.ranks for a in actions if a.kind in COMM_KINDS]
    if not schedule.options.get("lowered"):
        if comm:
            raise ScheduleError(f"action {comm[0]}: sends and receives belong to lowered schedules "
                                f"(options['lowered']); lower the schedule with pipeloom.schedule.lower")
        return
    compute = replace(schedule, ranks=tuple(tuple(a for a in actions if a.kind not in COMM_KINDS)
                                           for actions in schedule.ranks))
    for (src, dst), sends in links(compute).items():
        made = [a for a in schedule.ranks[src] if a.kind in (SEND_F, SEND_B) and peer(schedule, a) == dst]
        if made != sends:
            missing = next((a for a in sends if a not in made), None)
            what = f"lacks {missing}" if missing else f"sends {next(a for a in made if a not in sends)}, no message"
            raise ScheduleError(f"rank {src}: the link to rank {dst} {what}")
        posted = [a for a in schedule.ranks[dst] if a.kind in (RECV_F, RECV_B) and peer(schedule, a) == src]
        expected = [matching(a) for a in sends]
        if posted != expected:
            k = next(k for k, (a, b) in enumerate(zip(posted + [None] * len(expected), expected)) if a != b)
            raise ScheduleError(
                f"rank {dst}: receive number {k} from rank {src} is {posted[k] if k < len(posted) else 'missing'}, "
                f"but rank {src} sends {sends[k]} then; a link's receives are posted in send order ({expected[k]})")
    for action in comm:
        if peer(schedule, action) == schedule.rank_of(action):
            raise ScheduleError(f"rank {schedule.rank_of(action)}: {action} sends to its own rank; "
                                f"hand-offs on one rank need no message")


for _kind, _label in ((SEND_F, "send activation"), (SEND_B, "send gradient")):
    register(Kind(_kind, _label, needs=_send_needs, torch_code=_kind, torch_csv=False, drawn=False,
                  check=check_messages))
for _kind, _label in ((RECV_F, "receive activation"), (RECV_B, "receive gradient")):
    register(Kind(_kind, _label, torch_code=_kind, torch_csv=False, drawn=False, check=check_messages))
