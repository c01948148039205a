"""An offloaded schedule's timing program, derived from its bare schedule's.

PipeOffload's placement (:mod:`.offload`) times each of its attempts with the
as-soon-as-possible engine (:func:`~..deps.asap`); compiling the dependency
program of every attempt's schedule took most of a plan's time. The copies
never change the inputs of the bare schedule's actions, so each attempt's
program is the bare one's with the copies added (:func:`with_copies`), the
same floats as compiling it gives (a test compares them). Likewise each W move
it tries (:func:`~.offload._moved`) changes a few inputs of one rank's
actions: its program is the one before the move, renumbered, with those
changed (:func:`with_moved`).
"""

from __future__ import annotations

from .. import deps as _deps
from ..ir import F, W, Action, Schedule
from ..kinds import COMPOUND, KINDS
from .offload import _CLOSES, _OPENS, COPIES, _offloaded, copies, pair_of, paced


def with_copies(schedule: Schedule, base: Schedule) -> None:
    """Give ``schedule`` (``base`` with copies inserted by :func:`_insert`) the timing program
    (:func:`~..deps.asap`'s) derived from ``base``'s: each base action keeps its inputs (the copies,
    on a side stream, never advance a rank's clock), each copy waits for its rank's clock at its
    place in the list, the stream's previous copy and the action that opens its pair (a copy to
    host) or its copy to host (a copy back), the action that closes a copied pair for its copy back
    too, and each paced F for the OFFLOAD it waits for; the order runs each
    copy as its rank's list reaches it. What compiling ``schedule`` gives, in a fraction of its
    time (the placement times each of its attempts); anything else, and the program is compiled
    as usual."""
    _keep(schedule, lambda: _derive(schedule, base))


def with_moved(schedule: Schedule, current: Schedule, pair: tuple[int, int]) -> None:
    """Give ``schedule`` (``current`` with the W of ``pair`` moved right after its B, the copies of
    what that B keeps for it dropped: :func:`~.offload._move_w`) the timing program derived from
    ``current``'s (:func:`_derive_moved`), as :func:`with_copies` does: the placement times each move it tries."""
    _keep(schedule, lambda: _derive_moved(schedule, current, pair))


def _keep(schedule: Schedule, derive) -> None:
    """``derive()`` kept as ``schedule``'s timing program unless it has one under the registered kinds
    and rules already or ``derive()`` is None (then it is compiled on its first use)."""
    registry = (tuple(KINDS.values()), tuple(_deps.INPUT_RULES))
    entry = _deps._programs.get(id(schedule))
    if entry is not None and entry[0] == registry:
        return
    program = derive()
    if program is not None:
        key = id(schedule)
        _deps._programs[key] = (registry, _deps.weakref.ref(schedule, lambda _: _deps._programs.pop(key, None)),
                                program)


def _derive(schedule: Schedule, base: Schedule):
    """The program of ``schedule`` from ``base``'s (see :func:`with_copies`), or None where it cannot be derived."""
    old = _deps._program(base)
    if any(old.steps[3]):  # the base waits on side streams already
        return None
    lists, n_old = schedule.ranks, old.n
    offsets = [0]
    for actions in lists:
        offsets.append(offsets[-1] + len(actions))
    n = offsets[-1]
    zero = 2 * n
    new_of = [0] * (2 * n_old + 1)  # old slot -> new slot
    new_of[2 * n_old] = zero
    rank_at = [0] * n_old  # old slot -> its rank
    # the base's keys (distinct (kind, stage, payload), each timed by the last action of it in the
    # lists, as compiling does), then the copies'
    timed = list(old.timed)
    copy_keys: dict[tuple, int] = {}
    before: dict[int, list] = {}  # old slot -> the copies (slot, action) right before it in its list
    copies = []  # per rank: the copies after its last base action
    for r, (actions, was) in enumerate(zip(lists, base.ranks)):
        at, first, mine = offsets[r], old.bounds[r][0], []
        j = first
        for k, a in enumerate(actions):
            if a.kind in COPIES:
                mine.append((at + k, a))
                key = copy_keys.setdefault((a.kind, a.stage, a.payload), len(timed))
                if key == len(timed):
                    timed.append(a)
                timed[key] = a
                continue
            if mine:
                before[j], mine = mine, []
            index = j - first
            if (index >= len(was) or (was[index] is not a and was[index] != a) or KINDS[a.kind].stream
                    or a.kind in COMPOUND):  # a compound's parts wait for copies: compiling says which
                return None
            new_of[j] = at + k
            new_of[j + n_old] = at + k + n
            rank_at[j] = r
            j += 1
        if j != old.bounds[r][1]:
            return None
        copies.append(mine)
    old_keys = old.steps[2]
    offloaded, waits = _offloaded(schedule), paced(schedule)
    reloads = {}  # pair -> slot of its copy back
    opened = {}  # pair -> slot of the action that opens it
    copied = {}  # pair -> slot of its copy to host
    order, inputs_of, keys_of, sides = [], [], [], []
    clock = [zero] * len(lists)
    stream = [{True: zero, False: zero} for _ in lists]  # the last copy on each of a rank's streams (to host, back)
    get = new_of.__getitem__
    flat_new = [a for actions in lists for a in actions]

    def place(r: int, mine: list) -> bool:
        """Each copy as its rank's list reaches it: after the clock there, the stream's previous
        copy and the action that opens its pair (to host) or its copy to host (back)."""
        for slot, a in mine:
            pair, out = pair_of(a), COPIES[a.kind][1]
            q = (opened if out else copied).get(pair)
            if q is None:
                return False
            order.append(slot)
            inputs_of.append((clock[r], stream[r][out], q))
            keys_of.append(copy_keys[a.kind, a.stage, a.payload])
            sides.append(None)
            stream[r][out] = slot
            (copied if out else reloads)[pair] = slot
        return True

    for old_slot, inputs, key in zip(old.steps[0], old.steps[1], old_keys):
        slot, r = new_of[old_slot], rank_at[old_slot]
        mine = before.get(old_slot)
        if mine is not None and not place(r, mine):
            return None
        kind, stage, microbatch, payload = flat_new[slot]
        order.append(slot)
        inputs_of.append(tuple(map(get, inputs)))
        keys_of.append(key)
        clock[r] = slot
        opens, closes = _OPENS.get(kind), _CLOSES.get(kind)
        if opens is not None:
            opened[stage, microbatch, opens] = slot
        if kind == F:
            if payload:
                return None
            waited = waits.get((stage, microbatch))
            if waited is not None and (*waited, 0) not in copied:
                return None  # its OFFLOAD comes later in the list: compiling says so
            sides.append(None if waited is None else (r, (zero, copied[(*waited, 0)])))
        elif closes is not None and (stage, microbatch, closes) in offloaded:
            waited = reloads.get((stage, microbatch, closes))
            if waited is None:
                return None  # its copy back comes later in the list: compiling says so
            sides.append((r, (zero, waited)))
        else:
            sides.append(None)
    for r, mine in enumerate(copies):
        if not place(r, mine):
            return None
    if len(order) != n or len(reloads) != len(offloaded):
        return None
    program = object.__new__(_deps._Program)
    program.n = n
    program.timed = timed
    program.sent = old.sent  # the copies' results never cross ranks
    program.steps = order, inputs_of, keys_of, sides
    program.bounds = list(zip(offsets, offsets[1:]))
    return program


def _derive_moved(schedule: Schedule, current: Schedule, pair: tuple[int, int]):
    """The program of ``schedule`` from ``current``'s (see :func:`with_moved`), or None where it cannot
    be derived: each slot renumbered to its action's place in ``schedule``; on the W's rank, each
    action's clock (and a copy's stream) read again from its list, the W no longer waiting for its
    dropped copy back; the W run right after the action before it (its B, which its other inputs
    precede)."""
    old = _deps._program(current)
    rank = schedule.placement[pair[0]]
    was, actions = current.ranks[rank], schedule.ranks[rank]
    w = Action(W, *pair)
    gone = set(was).difference(actions)
    if gone and gone != set(copies((*pair, 1))) or len(actions) + len(gone) != len(was) or any(
            a is not b for r, (a, b) in enumerate(zip(current.ranks, schedule.ranks)) if r != rank):
        return None
    first, last = old.bounds[rank]
    n = old.n - len(gone)
    zero = 2 * n
    place = {a: first + k for k, a in enumerate(actions)}  # each action of the rank -> its new slot
    slots = [*range(first), *(place.get(a, -1) for a in was), *range(last - len(gone), n)]
    new_of = [*slots, *(s + n if s >= 0 else -1 for s in slots), zero]
    get = new_of.__getitem__
    heads = {}  # new slot -> its clock (and stream) inputs, on the W's rank
    clock, stream = zero, {}
    for slot, a in enumerate(actions, first):
        side = KINDS[a.kind].stream
        if side:
            heads[slot] = clock, stream.get(side, zero)
            stream[side] = slot
        else:
            heads[slot] = (clock,)
            clock = slot
    slot_of, inputs_of, keys_of, sides = old.steps
    order = [new_of[slot] for slot in slot_of]
    inputs_of = [tuple(map(get, inputs)) for inputs in inputs_of]
    sides = [waited and (waited[0], tuple(map(get, waited[1]))) for waited in sides]
    step_of = dict(zip(order, range(len(order))))  # new slot -> its step
    for slot, head in heads.items():  # the rank's clock (and stream) read again
        k = step_of[slot]
        inputs_of[k] = (*head, *inputs_of[k][len(head):])
    steps = order, inputs_of, list(keys_of), sides
    for _ in gone:  # the dropped copies' steps
        k = order.index(-1)
        for step in steps:
            del step[k]
    w_slot, k = place[w], order.index(place[w])
    before = heads[w_slot][0]  # the action before the moved W (its B, which its other inputs precede)
    if sides[k] and not gone or not all(first <= q <= before for q in inputs_of[k]):
        return None  # it waits on a side stream, or for an input that may come later in the order
    at = order.index(before) + 1
    for step in steps:
        step.insert(at, step.pop(k))
    sides[at] = None
    program = object.__new__(_deps._Program)
    program.n = n
    program.timed = old.timed
    program.sent = old.sent
    program.steps = steps
    program.bounds = [(a - len(gone) * (r > rank), b - len(gone) * (r >= rank))
                      for r, (a, b) in enumerate(old.bounds)]
    return program
