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

from itertools import accumulate
from operator import itemgetter

from .. import deps as _deps
from ..ir import F, W, Action, Schedule
from ..kinds import COMPOUND, KINDS
from .offload import COPIES, PHASES, copies, paced

_KIND = itemgetter(0)
#: Per phase, the kind of the action that opens a pair (its copy to host follows it).
_OPENERS = tuple(phase.after[0] for phase in PHASES)


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
    """The program of ``schedule`` from ``base``'s (see :func:`with_copies`), or None where it cannot
    be derived: the base's steps renumbered, each copy's step right before the step of the base
    action after it in its rank's list (after every base step where none is), and the closers of
    the copied pairs and the paced Fs waiting for their copies."""
    old = _deps._program(base)
    if any(old.steps[3]):  # the base waits on side streams already
        return None
    lists, n_old = schedule.ranks, old.n
    offsets = list(accumulate(map(len, lists), initial=0))
    n = offsets[-1]
    zero = 2 * n
    # the base's keys (distinct (kind, stage, payload), each timed by the last action of it in the
    # lists, as compiling does), then the copies'
    timed = list(old.timed)
    copy_keys: dict[tuple, int] = {}
    step_of = dict(zip(old.steps[0], range(n_old)))  # old slot -> its step
    slots: list[int] = []  # old slot -> new slot
    placed = []  # per copy: (the step it goes before (n_old: after every one), slot, inputs, key)
    copied, reloads = {}, {}  # pair -> (slot, rank) of its copy to host, of its copy back
    ranks = []  # per rank: the index of each base action in its list (where it has copies), its first old slot
    at = 0
    for r, (actions, was) in enumerate(zip(lists, base.ranks)):
        found = [k for k, a in enumerate(actions) if a[0] in COPIES]
        first, start = len(slots), 0
        for k in found:
            slots.extend(range(at + start, at + k))
            start = k + 1
        slots.extend(range(at + start, at + len(actions)))
        if (len(slots) - first != len(was) or any(a[3] for a in was if a[0] == F)
                or any(KINDS[kind].stream or kind in COMPOUND for kind in set(map(_KIND, was)))
                or (tuple(a for a in actions if a[0] not in COPIES) if found else actions) != was):
            return None  # a compound's parts wait for copies: compiling says which
        index = {a: k for k, a in enumerate(was)} if found else {}
        ranks.append((index, first))
        stream = {True: zero, False: zero}  # the rank's last copy to host, back
        for j, k in enumerate(found):
            a = actions[k]
            kind, stage, microbatch, payload = a
            phase, out = COPIES[kind]
            pair, before = (stage, microbatch, phase), k - j  # and the base actions before it
            if out:
                opener = index.get((_OPENERS[phase], stage, microbatch, ()), before)
                q = slots[first + opener] if opener < before else None
            else:
                q, there = copied.get(pair, (None, r))
                q = q if there == r else None
            if q is None:
                return None  # its input comes later in the list or from another rank: compiling says so
            key = copy_keys.get((kind, stage, payload))
            if key is None:
                key = copy_keys[kind, stage, payload] = len(timed)
                timed.append(a)
            timed[key] = a
            slot = at + k
            placed.append((step_of[first + before] if before < len(was) else n_old, slot,
                           (slots[first + before - 1] if before else zero, stream[out], q), key))
            stream[out] = slot
            (copied if out else reloads)[pair] = slot, r
        at += len(actions)
    get = [*slots, *[s + n for s in slots], zero].__getitem__  # old slot -> new slot (an arrival: + n)
    sides: list = [None] * n_old
    waiting = [(PHASES[pair[2]].before, pair[:2], reload) for pair, reload in reloads.items()]  # the closers
    for pair, waited in paced(schedule).items():  # the paced Fs
        if (*waited, 0) not in copied:
            return None
        waiting.append(((F,), pair, copied[(*waited, 0)]))
    for kinds, (stage, microbatch), (q, r) in waiting:
        index, first = ranks[r]
        k = next((index[kind, stage, microbatch, ()] for kind in kinds if (kind, stage, microbatch, ()) in index), None)
        if k is None or slots[first + k] < q:
            return None  # its copy comes later in the list or runs on another rank: compiling says so
        sides[step_of[first + k]] = r, (zero, q)
    base_steps = ([slots[s] for s in old.steps[0]], [tuple(map(get, inputs)) for inputs in old.steps[1]],
                  old.steps[2], sides)
    steps, start = ([], [], [], []), 0
    for end, slot, inputs, key in sorted(placed):
        if end > start:  # the base steps up to the one the copy goes before
            for step, was in zip(steps, base_steps):
                step += was[start:end]
            start = end
        steps[0].append(slot)
        steps[1].append(inputs)
        steps[2].append(key)
        steps[3].append(None)
    for step, was in zip(steps, base_steps):
        step += was[start:]
    program = object.__new__(_deps._Program)
    program.n = n
    program.timed = timed
    program.sent = old.sent  # the copies' results never cross ranks
    program.steps = steps
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
