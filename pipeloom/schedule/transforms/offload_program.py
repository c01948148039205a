"""An offloaded schedule's timing program, derived from its bare schedule's.

PipeOffload's placement (:mod:`.offload`) times each of its attempts with the
as-soon-as-possible engine (:func:`~..deps.asap`); compiling the dependency
program of every attempt's schedule took most of a plan's time. The copies
never change the inputs of the bare schedule's actions, so each attempt's
program is the bare one's with the copies added (:func:`with_copies`), the
same floats as compiling it gives (a test compares them). Likewise each W move
it tries (:func:`~.offload._moved`) changes a few inputs of one rank's
actions: its program is the one before the move with those changed
(:func:`with_moved`). A derived program keeps the slots of the actions it
shares with the one it comes from (the copies take slots of their own, each
rank's order is its ``layout``), so deriving never renumbers the steps it keeps.
What one rank's copies add is worked out once per list of that rank: the
placement's attempts mix the same ranks' lists (the timetable's, the eager
ones, paced or not), and each rank's copies have slots no other rank's take.
"""

from __future__ import annotations

import weakref
from itertools import compress
from operator import itemgetter, not_

from .. import deps as _deps
from ..ir import F, W, Action, Schedule
from ..kinds import COMPOUND, KINDS
from .offload import COPIES, PHASES, copies, paced

_KIND = itemgetter(0)
#: Per phase, the kind of the action that opens a pair (its copy to host follows it).
_OPENERS = tuple(phase.after[0] for phase in PHASES)


def with_copies(schedule: Schedule, base: Schedule, known: dict | None = None) -> None:
    """Give ``schedule`` (``base`` with copies inserted by :func:`_insert`) the timing program
    (:func:`~..deps.asap`'s) derived from ``base``'s: each base action keeps its inputs (the copies,
    on a side stream, never advance a rank's clock), each copy waits for its rank's clock at its
    place in the list, the stream's previous copy and the action that opens its pair (a copy to
    host) or its copy to host (a copy back), the action that closes a copied pair for its copy back
    too, and each paced F for the OFFLOAD it waits for; the order runs each
    copy as its rank's list reaches it. What compiling ``schedule`` gives, in a fraction of its
    time (the placement times each of its attempts); anything else, and the program is compiled
    as usual. ``known``: what was derived of each rank's list before (the same list objects, of
    ``base``), kept there for the next call."""
    _keep(schedule, lambda: _derive(schedule, base, known))


def with_moved(schedule: Schedule, current: Schedule, pair: tuple[int, int]) -> None:
    """Give ``schedule`` (``current`` with the W of ``pair`` moved right after its B, the copies of
    what that B keeps for it dropped: :func:`~.offload._move_w`) the timing program derived from
    ``current``'s (:func:`_derive_moved`), as :func:`with_copies` does: the placement times each move it tries."""
    _keep(schedule, lambda: _derive_moved(schedule, current, pair))


def with_program_of(schedule: Schedule, same: Schedule) -> None:
    """Give ``schedule`` the timing program of ``same``, whose lists and inputs it has (only options
    no input rule reads differ)."""
    _keep(schedule, lambda: _deps._program(same))


def _keep(schedule: Schedule, derive) -> None:
    """``derive()`` kept as ``schedule``'s timing program unless it has one under the registered kinds
    and rules already or ``derive()`` is None (then it is compiled on its first use)."""
    registry = (tuple(KINDS.values()), tuple(_deps.INPUT_RULES))
    entry = _deps._programs.get(id(schedule))
    if entry is not None and entry[0] == registry:
        return
    program = derive()
    if program is not None:
        _deps._remember(schedule, registry, program)


#: compiled base program -> what :func:`_derive` reads of it and its schedule (:func:`_base_facts`)
_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _base_facts(old, base: Schedule) -> tuple | None:
    """What :func:`_derive` reads of ``base``'s compiled program ``old``, once per base: per rank
    each action's index in its list, each slot's step, and the timed actions with the copies' keys
    after the base's ((kind, stage) -> key); None where copies cannot be derived into it (its
    actions wait on side streams, run as compounds, or are Fs with payloads)."""
    facts = _FACTS.get(old)
    if facts is None:
        derivable = old.layout is None and not any(old.steps[3]) and not any(
            KINDS[kind].stream or kind in COMPOUND for kind in {a[0] for actions in base.ranks for a in actions}) and not any(
            a[3] for actions in base.ranks for a in actions if a[0] == F)
        copied = [Action(kind, stage, 0) for kind in COPIES for stage in range(base.stages)]
        facts = _FACTS[old] = (([{a: k for k, a in enumerate(actions)} for actions in base.ranks],
                                dict(zip(old.steps[0], range(old.n))), [*old.timed, *copied],
                                {a[:2]: len(old.timed) + j for j, a in enumerate(copied)}) if derivable else None,)
    return facts[0]


def _derive(schedule: Schedule, base: Schedule, known: dict | None = None):
    """The program of ``schedule`` from ``base``'s (see :func:`with_copies`), or None where it cannot
    be derived: the base's steps and slots kept, each copy a slot of its own (rank r's past those
    any rank before it may take: :func:`_added_slot`), its step right before the step of the base
    action after it in its rank's list (after every base step where none is), and the closers of
    the copied pairs and the paced Fs waiting for their copies. Each rank's part is
    :func:`_rank_part`, kept in ``known`` (if given) by its list."""
    known = {} if known is None else known
    old = _deps._program(base)
    facts = _base_facts(old, base)
    if facts is None:
        return None
    indexes, step_of, timed, keys = facts
    n = old.n
    parts, copied, reloads = [], {}, {}
    for r, (actions, was) in enumerate(zip(schedule.ranks, base.ranks)):
        entry = known.get(id(actions))
        if entry is None or entry[0] is not actions:
            entry = known[id(actions)] = actions, _rank_part(r, actions, was, old, indexes[r], step_of, keys)
        part = entry[1]
        if part is None:
            return None
        parts.append(part)
        copied.update(part[2])
        reloads.update(part[3])
    zero = 2 * n
    sides = list(old.steps[3])
    waiting = [(PHASES[pair[2]].before, pair[:2], reload) for pair, reload in reloads.items()]  # the closers
    for pair, waited in paced(schedule).items():  # the paced Fs
        if (*waited, 0) not in copied:
            return None
        waiting.append(((F,), pair, copied[(*waited, 0)]))
    for kinds, (stage, microbatch), (q, r, before) in waiting:
        index = indexes[r]
        for kind in kinds:
            k = index.get((kind, stage, microbatch, ()))
            if k is not None:
                break
        if k is None or k < before:
            return None  # its copy comes later in the list or runs on another rank: compiling says so
        sides[step_of[old.bounds[r][0] + k]] = r, (zero, q)
    base_steps = (*old.steps[:3], sides)
    steps, start = ([], [], [], []), 0
    for end, slot, inputs, key in sorted(placed for part in parts for placed in part[1]):
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
    last = max((part[4] for part in parts if part[4] is not None), default=None)
    size = old.size if last is None else last + n + 1
    return _made(n, size, timed, old.sent, steps, [part[0] for part in parts])  # copies' results never cross ranks


def _rank_part(r: int, actions, was, old, index: dict, step_of: dict, keys: dict) -> tuple | None:
    """What rank ``r``'s list ``actions`` (its base list ``was`` with copies inserted) adds to the
    base's program ``old``: its slots in list order; per copy (the step it goes before, its slot,
    its inputs, its key); pair -> (slot, r, base actions before it) of its copies to host and
    back; its copies' last slot (None: none); or None where its copies cannot be derived."""
    n = old.n
    at, zero = old.bounds[r][0], 2 * n
    copy = list(map(COPIES.__contains__, map(_KIND, actions)))
    if tuple(compress(actions, map(not_, copy))) != was:
        return None  # not the base with copies inserted
    ids, placed, start, slot = [], [], 0, None  # start: the base index of the next base action
    copied, reloads = {}, {}
    stream = {True: zero, False: zero}  # the rank's last copy to host, back
    for j, k in enumerate(compress(range(len(actions)), copy)):
        if j >= 2 * len(was):
            return None  # more copies than pairs its actions open: the slots below would not be its own
        before = k - j  # the base actions before it
        if before > start:
            ids.extend(range(at + start, at + before))
            start = before
        kind, stage, microbatch, payload = actions[k]
        phase, out = COPIES[kind]
        pair = stage, microbatch, phase
        if out:
            opener = index.get((_OPENERS[phase], stage, microbatch, ()), before)
            q = at + opener if opener < before else None
        else:
            q = copied.get(pair, (None,))[0]
        if q is None:
            return None  # its input comes later in the list or from another rank: compiling says so
        slot = _added_slot(n, 2 * at + j)  # a plain base action opens at most one pair: two copies
        ids.append(slot)
        placed.append((step_of[at + before] if before < len(was) else n, slot,
                       (at + before - 1 if before else zero, stream[out], q), keys[kind, stage]))
        stream[out] = slot
        (copied if out else reloads)[pair] = slot, r, before
    ids.extend(range(at + start, at + len(was)))
    return ids, placed, copied, reloads, slot


def _added_slot(n: int, j: int) -> int:
    """The slot of the ``j``-th action a program of ``n`` compiled slots adds: past ``2n`` (zero's),
    in blocks of ``n`` with a gap of ``n`` after each, which the block's arrivals (slot + n, never
    read) take."""
    return 2 * n + 1 + 2 * n * (j // n) + j % n


def _derive_moved(schedule: Schedule, current: Schedule, pair: tuple[int, int]):
    """The program of ``schedule`` from ``current``'s (see :func:`with_moved`), or None where it cannot
    be derived: the slots kept; on the W's rank, each action's clock (and a copy's stream) read again
    from its list, the W no longer waiting for its dropped copy back, the dropped copies' steps gone;
    the W run right after the action before it (its B, which its other inputs precede)."""
    old = _deps._program(current)
    rank = schedule.placement[pair[0]]
    was, actions = current.ranks[rank], schedule.ranks[rank]
    w = Action(W, *pair)
    gone = set(was).difference(actions)
    if gone and gone != set(copies((*pair, 1))) or len(actions) + len(gone) != len(was) or any(
            a is not b for r, (a, b) in enumerate(zip(current.ranks, schedule.ranks)) if r != rank):
        return None
    zero = 2 * old.n
    slot_of = dict(zip(was, old.slots_of(rank)))
    ids = [slot_of[a] for a in actions]
    heads = {}  # slot -> its clock (and stream) inputs, on the W's rank
    clock, stream = zero, {}
    for slot, a in zip(ids, actions):
        side = KINDS[a.kind].stream
        if side:
            heads[slot] = clock, stream.get(side, zero)
            stream[side] = slot
        else:
            heads[slot] = (clock,)
            clock = slot
    steps = order, inputs_of, _, sides = tuple(map(list, old.steps))
    step_of = dict(zip(order, range(len(order))))
    for slot, head in heads.items():  # the rank's clock (and stream) read again
        k = step_of[slot]
        inputs_of[k] = (*head, *inputs_of[k][len(head):])
    for k in sorted((step_of[slot_of[a]] for a in gone), reverse=True):  # the dropped copies' steps
        for step in steps:
            del step[k]
    w_slot = slot_of[w]
    k, before = order.index(w_slot), heads[w_slot][0]  # the action before the moved W (its B)
    if sides[k] and not gone or not set(inputs_of[k]).issubset(ids[:ids.index(before) + 1]):
        return None  # it waits on a side stream, or for an input that may come later in the order
    at = order.index(before) + 1
    for step in steps:
        step.insert(at, step.pop(k))
    sides[at] = None
    layout = [ids if r == rank else old.slots_of(r) for r in range(len(schedule.ranks))]
    program = _made(old.n, old.size, old.timed, old.sent, steps, layout)
    program.origin = weakref.ref(old), at  # the steps before the W's are old's (the rank's list is, up to its B)
    return program


def _made(n: int, size: int, timed: list, sent: list, steps: tuple, layout: list):
    """A derived :class:`~..deps._Program` of these parts."""
    program = object.__new__(_deps._Program)
    program.n, program.size, program.timed, program.sent, program.steps = n, size, timed, sent, steps
    program.bounds, program.layout = None, layout
    return program
