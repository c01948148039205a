"""When each action can run: the implied dependencies, and the timing that follows.

Dependencies are implied by the kinds (:mod:`~.kinds`): each kind's ``needs``
rule says which actions an action consumes (the compute kinds' rules are in
:mod:`~.compute`, the vocabulary passes' in :mod:`~.transforms.vocab`), and a
technique's input rules add inputs to other kinds' actions (stage 0's F after
the vocabulary input layer, say). A compound action (:mod:`~.kinds`) needs
what its parts need, and stands for its parts wherever another action needs
one. :func:`asap` runs every rank's list in
order, each action as soon as its rank is free and its inputs exist; the
simulator times schedules with it and the validator finds deadlocks with it.
"""

from __future__ import annotations

import weakref
from array import array
from collections import deque
from itertools import accumulate
from operator import itemgetter
from typing import Callable, Iterable

from ..errors import ScheduleError
from . import compute  # noqa: F401  (registers F, B, W, BW)
from .ir import BW, B, Action, Schedule, parts
from .kinds import COMPOUND, INPUT_RULES, KINDS, RANK, get, graded


class Dependencies:
    """The implied dependencies of one schedule's actions: ``deps(action)``
    lists the actions whose results ``action`` consumes. Kinds' rules read
    the schedule's facts from it (``last``, ``ranks``, :meth:`backward`,
    :meth:`every`, :meth:`fact`)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.last = schedule.stages - 1
        self.ranks = range(schedule.pp)
        watched = {B, BW} | COMPOUND
        found = [a for actions in schedule.ranks for a in actions if a.kind in watched]
        #: the compound action standing for each part
        self.compound = {part: a for a in found if a.kind in COMPOUND for part in parts(a)}
        backwards = found + list(self.compound) if self.compound else found
        self.split = frozenset(a.stage for a in backwards if a.kind == B)
        #: (stage, microbatch) of the fused backwards of stages that split others (DualPipeV mixes them)
        self.fused = self.split and frozenset((a.stage, a.microbatch) for a in backwards
                                              if a.kind == BW and a.stage in self.split)
        self._facts: dict = {}
        self._every: dict[tuple[str, int], tuple[Action, ...]] = {}
        self._needs = {name: _parts_need if kind.compound else kind.needs for name, kind in KINDS.items()}
        made = [(rule, getattr(factory, "kinds", None)) for factory in INPUT_RULES
                if (rule := factory(schedule)) is not None]
        #: per kind, the input rules that may add to its actions (:func:`~.kinds.register_inputs`)
        self.rules = {name: tuple(rule for rule, kinds in made if kinds is None or name in kinds) for name in KINDS}

    def __call__(self, action: Action, plain: bool = False) -> tuple[Action, ...]:
        """The actions ``action`` consumes: a compound action stands for each of its parts
        (``plain``: the parts themselves)."""
        needs = self._needs.get(action.kind)
        if needs is None:
            get(action.kind)  # raises, naming the registered kinds
        found = needs(action, self)
        for rule in self.rules[action.kind]:
            extra = rule(action, self)
            if extra:
                found = found + extra
        if self.compound and not plain:
            found = tuple(self.compound.get(dep, dep) for dep in found)
        return found

    def backward(self, s: int, i: int) -> Action:
        """The backward of stage ``s`` for microbatch ``i``: B where the stage splits it, else BW."""
        split = s in self.split and not (self.fused and (s, i) in self.fused)
        return Action.from_fields((B if split else BW, s, i, ()))

    def every(self, kind: str, i: int) -> tuple[Action, ...]:
        """``kind`` of microbatch ``i`` on every rank: the inputs of a collective (one tuple
        for all its consumers)."""
        key = kind, i
        found = self._every.get(key)
        if found is None:
            found = self._every[key] = tuple(Action.from_fields((kind, q, i, ())) for q in self.ranks)
        return found

    def fact(self, key: str, compute: Callable[[Schedule], object]):
        """``compute(schedule)``, computed once per schedule (a technique's facts)."""
        if key not in self._facts:
            self._facts[key] = compute(self.schedule)
        return self._facts[key]


def _parts_need(action: Action, deps: Dependencies) -> tuple[Action, ...]:
    """What a compound action needs: what its parts need (a module function, so that
    :class:`Dependencies` holds no reference to itself and dies with its last use)."""
    return tuple(dict.fromkeys(dep for part in parts(action) for dep in deps(part, True)))


def memory_delta(action: Action, value: Callable[[str, Action], float], memory: str = "memory") -> float:
    """Change of the rank's activation memory caused by ``action`` (``memory="host"``: of its
    host memory): the sum of its kind's terms (a compound's: its parts'), ``value(field, action)`` giving
    each cost field's value."""
    kind = get(action.kind)
    if kind.compound:
        return sum(memory_delta(part, value, memory) for part in parts(action))
    return sum(coefficient * value(name, action) for coefficient, name in getattr(kind, memory))


def asap(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[Action], float] = lambda producer: 0.0,
    waits: list[float] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every action when each rank runs its list in
    order and an action waits for its inputs; an input produced on another
    rank, or reduced over every rank (a kind's ``reduced``), arrives
    ``transfer(producer)`` after its producer ends.

    Sends never block (the runtime posts them non-blocking); a receive blocks
    its rank until the data arrives. An action of a side-stream kind (a
    kind's ``stream``) starts no earlier than its issue, the point its rank's
    list reaches it, and than the end of that stream's previous action on
    the rank; it does not advance the rank. ``waits``, if given (one float
    per rank), gathers the time each rank's compute actions waited for
    side-stream results beyond everything else they waited for. Raises
    :class:`ScheduleError` naming the ranks, the actions and what they wait
    for if the lists deadlock.

    ``duration`` and ``transfer`` are asked once per distinct (kind, stage,
    payload): an action's time must not depend on its microbatch. What does
    not depend on the costs is worked out once per schedule (:class:`_Program`).
    """
    return _program(schedule).run(duration, transfer, waits)


_BY_RANK, _REDUCED, _SIDE = 1, 2, 4
#: (kind, stage, payload) of an action: what its time depends on
_KEY = itemgetter(0, 1, 3)
_COLLECTED = _REDUCED | _SIDE  # a collective's inputs are reduced, not side-stream results


class _Program:
    """What :func:`asap` needs of one schedule, whatever the costs: its actions in
    an order that runs each after its inputs, each with the slots its start is
    the largest of. Slot ``q`` holds the end of the ``q``-th action of the ranks'
    lists laid end to end, slot ``n + q`` its arrival on another rank or through
    a collective (end plus transfer), slot ``2n`` holds 0.0. A program derived
    from another (:mod:`~.transforms.offload_program`) keeps the slots of the
    actions it shares with it, gives the actions it adds slots past ``2n``
    (their arrivals, never read, past those: ``size`` slots in all) and lists
    each rank's slots in list order in ``layout``; a compiled one has no
    ``layout``: rank r's slots are ``bounds[r]``'s range."""

    layout: list[list[int]] | None = None
    #: (a weak reference to the program this one was derived from, its first step that differs
    #: from that one's), if any
    origin: tuple[weakref.ref, int] | None = None

    def __init__(self, schedule: Schedule):
        lists = schedule.ranks
        offsets = [0]
        for actions in lists:
            offsets.append(offsets[-1] + len(actions))
        n = self.n = offsets[-1]
        zero = 2 * n
        deps_of = Dependencies(schedule)
        placement = schedule.placement
        side = {name: kind.stream for name, kind in KINDS.items() if kind.stream}
        # each kind's facts as bits: _BY_RANK (its stage names its rank), _REDUCED, _SIDE (a stream's)
        flags = {name: (_BY_RANK if kind.owner == RANK else 0) | (_REDUCED if kind.reduced else 0)
                 | (_SIDE if kind.stream else 0) for name, kind in KINDS.items()}
        flat = [action for actions in lists for action in actions]
        keys: dict[tuple, int] = {}  # each distinct (kind, stage, payload), numbered
        key_at = [keys.setdefault(key, len(keys)) for key in map(_KEY, flat)]
        #: an action of each key, standing for all in timing
        self.timed: list[Action] = list(dict(zip(key_at, flat)).values())
        sent = bytearray(len(keys))  # 1 for the keys of the actions whose arrival another reads
        # the dependency rules, read here as Dependencies.__call__ reads them (the hot loop below)
        needs_of, rules, compound = deps_of._needs, deps_of.rules, deps_of.compound
        # in the order the actions can run: each one's slot, its inputs' slots and, when
        # it waits for side-stream results, (its rank, their slots)
        order, inputs_of, sides = [], [], []
        done: dict[Action, int] = {}
        #: id of a tuple of inputs that all cross (a collective's) -> (the tuple, their slots)
        collected: dict[int, tuple[tuple, list[int]]] = {}
        waiting: dict[Action, list[int]] = {}
        blocked_on: dict[int, Action] = {}
        pos = [0] * len(lists)
        clock = [zero] * len(lists)  # the slot of each rank's latest compute end
        streams: list[dict[str, int]] = [{} for _ in lists]
        ready = deque(range(len(lists)))
        done_get, add_order, add_inputs, add_side = done.get, order.append, inputs_of.append, sides.append
        while ready:
            r = ready.popleft()
            blocked_on.pop(r, None)
            actions, k = lists[r], pos[r]
            at = offsets[r]
            last = clock[r]
            end = len(actions)
            while k < end:
                action = actions[k]
                kind = action[0]
                stream = side.get(kind) if side else None
                inputs = [last, streams[r].get(stream, zero)] if stream else [last]
                waited = None
                needs = needs_of.get(kind)
                if needs is None:
                    get(kind)  # raises, naming the registered kinds
                found = needs(action, deps_of)
                for rule in rules[kind]:
                    extra = rule(action, deps_of)
                    if extra:
                        found = found + extra
                if compound:
                    found = tuple(compound.get(dep, dep) for dep in found)
                known = collected.get(id(found)) if collected else None
                if known is not None and known[0] is found:  # a collective's inputs, resolved before
                    inputs.extend(known[1])
                    found = ()
                for dep in found:
                    q = done_get(dep)
                    if q is None:
                        flag = flags[dep[0]]
                        if (dep[1] if flag & _BY_RANK else placement[dep[1]]) == r:
                            _local_order_error(schedule, r, k, action, dep)
                        waiting.setdefault(dep, []).append(r)
                        blocked_on[r] = dep
                        break
                    flag = flags[dep[0]]
                    if flag:
                        if flag & _REDUCED or (dep[1] if flag & _BY_RANK else placement[dep[1]]) != r:
                            sent[key_at[q]] = 1
                            q += n
                        if flag & _SIDE and not stream:
                            waited = (waited or [zero]) + [q]
                            continue
                    elif placement[dep[1]] != r:
                        sent[key_at[q]] = 1
                        q += n
                    inputs.append(q)
                else:
                    if (len(found) > 1 and flags[found[0][0]] & _COLLECTED == _REDUCED
                            and all(flags[dep[0]] & _COLLECTED == _REDUCED for dep in found)):
                        collected[id(found)] = found, inputs[-len(found):]
                    slot = at + k
                    add_order(slot)
                    add_inputs(tuple(inputs))
                    add_side(waited and (r, tuple(waited)))
                    if stream:
                        streams[r][stream] = slot
                    else:
                        last = slot
                    done[action] = slot
                    k += 1
                    if waiting:
                        woken = waiting.pop(action, None)
                        if woken:
                            ready.extend(woken)
                    continue
                break
            pos[r] = k
            clock[r] = last
        if any(pos[r] < len(lists[r]) for r in range(len(lists))):
            raise ScheduleError(_deadlock_message(schedule, pos, blocked_on))
        self.sent = [key for key, crossed in enumerate(sent) if crossed]
        #: parallel lists, zipped by :meth:`run`: slot, inputs, key and side-stream inputs of each action
        self.steps = order, inputs_of, [key_at[slot] for slot in order], sides
        self.bounds = list(zip(offsets, offsets[1:]))
        self.size = 2 * n + 1

    def slots_of(self, rank: int) -> list[int] | range:
        """Rank ``rank``'s slots in its list's order."""
        return range(*self.bounds[rank]) if self.layout is None else self.layout[rank]

    def run(self, duration, transfer, waits):
        """:func:`asap`'s times under these costs."""
        return self.lists(*self.timeline(duration, transfer, waits))

    def timeline(self, duration, transfer, waits=None, resume=None) -> tuple[list[float], list[float]]:
        """Each slot's value and each action's start (by its slot) under these costs. ``resume``:
        ``(slots, starts, step)`` of the timeline under the same costs of a program whose steps
        before ``step`` are this one's (:attr:`origin`'s): those steps are not run again (``waits``
        then gathers what the steps from ``step`` on wait)."""
        times = [duration(action) for action in self.timed]
        delays = [0.0] * len(times)  # read only for the keys in self.sent
        for key in self.sent:
            delays[key] = transfer(self.timed[key])
        n = self.n
        if resume is None:
            slots, starts, first = [0.0] * self.size, [0.0] * self.size, 0
        else:
            slots, starts, first = list(resume[0]), list(resume[1]), resume[2]
        get = slots.__getitem__
        for slot, inputs, key, waited in zip(*(step[first:] if first else step for step in self.steps)):
            start = max(map(get, inputs))
            if waited:
                r, side = waited
                side_end = max(map(get, side))
                if side_end > start:
                    if waits is not None:
                        waits[r] += side_end - start
                    start = side_end
            starts[slot] = start
            slots[slot] = end = start + times[key]
            slots[slot + n] = end + delays[key]
        return slots, starts

    def lists(self, slots: list[float], starts: list[float]) -> tuple[list[list[float]], list[list[float]]]:
        """Per rank, the starts and ends of its actions in list order, from a :meth:`timeline`."""
        if self.layout is None:
            return [starts[a:b] for a, b in self.bounds], [slots[a:b] for a, b in self.bounds]
        return ([list(map(starts.__getitem__, ids)) for ids in self.layout],
                [list(map(slots.__getitem__, ids)) for ids in self.layout])


#: id(schedule) -> (the kinds and input rules it was compiled under, a weak reference to it, its program)
_programs: dict[int, tuple[tuple, weakref.ref, _Program]] = {}


def _program(schedule: Schedule) -> _Program:
    """``schedule``'s :class:`_Program`, compiled on its first use and kept while the
    schedule lives. The cache is keyed by identity, not equality: equal schedules
    may differ in their options, and hashing one walks every action. The weak
    reference drops the entry when the schedule dies; a kind or input rule
    registered since the compilation compiles it again."""
    registry = (tuple(KINDS.values()), tuple(INPUT_RULES))
    key = id(schedule)
    entry = _programs.get(key)
    if entry is None or entry[0] != registry:
        return _remember(schedule, registry, _Program(schedule))
    return entry[2]


def _remember(schedule: Schedule, registry: tuple, program: _Program) -> _Program:
    """Keep ``program`` as ``schedule``'s (compiled under ``registry``) while the schedule lives. The
    entry's callback holds the cache's own ``pop``: a schedule that dies as the interpreter exits,
    after this module's names are gone, still drops its entry."""
    key, pop = id(schedule), _programs.pop
    _programs[key] = (registry, weakref.ref(schedule, lambda _: pop(key, None)), program)
    return program


def _local_order_error(schedule: Schedule, rank: int, k: int, action: Action, dep: Action) -> None:
    """An input produced on the same rank must come earlier in its list."""
    try:
        j = schedule.ranks[rank].index(dep)
    except ValueError:
        raise ScheduleError(f"rank {rank}: action {action} needs {dep}, which no rank runs") from None
    raise ScheduleError(f"rank {rank}: action {action} (position {k}) runs before {dep} (position {j}), which it needs")


def _deadlock_message(schedule: Schedule, pos: list[int], blocked_on: dict[int, Action]) -> str:
    """Describe the cycle of waiting ranks (or the first stuck rank)."""
    def waits(r: int) -> str:
        dep = blocked_on[r]
        return f"rank {r} waits at {schedule.ranks[r][pos[r]]} for {dep} from rank {schedule.rank_of(dep)}"

    for r, dep in sorted(blocked_on.items()):
        if dep not in schedule.ranks[schedule.rank_of(dep)]:
            return f"rank {r}: action {schedule.ranks[r][pos[r]]} needs {dep}, which no rank runs"

    start = min(blocked_on)
    seen: list[int] = []
    r = start
    while r in blocked_on and r not in seen:
        seen.append(r)
        r = schedule.rank_of(blocked_on[r])
    if r in seen:
        cycle = seen[seen.index(r):]
        return "deadlock: " + "; ".join(waits(q) for q in cycle) + " (a cycle: none can proceed)"
    return "deadlock: " + "; ".join(waits(q) for q in seen)


def peak_activation(actions: Iterable[Action], delta: Callable[[Action], float]) -> float:
    """Peak activation memory of one rank's list, which depends on the order
    only; ``delta(action)`` is the action's :func:`memory_delta` (a compound's
    parts count one after the other)."""
    return ListPeaks((actions,))(delta)[0]


class ListPeaks:
    """:func:`peak_activation` of each of several lists, under any costs: the lists are
    read once, each part reduced to the number of its (kind, stage, payload), so that
    each later call asks ``delta`` once per number and sums in C."""

    def __init__(self, lists: Iterable[Iterable[Action]]):
        numbers: dict[tuple, int] = {}
        backward = graded()
        #: an action of each number, standing for all in ``delta``
        self.timed: list[Action] = []
        self.lists: list[array] = []
        #: per list, (position, stage) of each stage's first part of a :func:`~.kinds.graded` kind
        self.firsts: list[list[tuple[int, int]]] = []
        for actions in lists:
            sequence, first = array("i"), {}
            for action in actions:
                for part in parts(action):
                    key = part.kind, part.stage, part.payload
                    number = numbers.get(key)
                    if number is None:
                        number = numbers[key] = len(self.timed)
                        self.timed.append(part)
                    if part.kind in backward and part.stage not in first:
                        first[part.stage] = len(sequence)
                    sequence.append(number)
            self.lists.append(sequence)
            self.firsts.append(sorted((k, stage) for stage, k in first.items()))

    def __call__(self, delta: Callable[[Action], float], grads: dict[int, float] | None = None) -> list[float]:
        """Each list's peak, from 0 before its first action; with ``grads`` (bytes per stage), of
        the activations plus the gradients of the stages whose first backward part has run,
        each counted from the first change of activations there on, and no less than all
        gradients. Never above what :func:`~pipeloom.sim.memory.peak_memory_bytes` counts for the
        same list, which reads memory where it changes in time (without side streams: the same
        changes, in list order)."""
        get = [delta(action) for action in self.timed].__getitem__
        peaks = []
        for sequence, firsts in zip(self.lists, self.firsts):
            changes = list(map(get, sequence))
            levels = list(accumulate(changes))
            if not grads:
                peaks.append(max(0.0, max(levels, default=0.0)))
                continue
            joins = []  # (position, bytes): each gradient from the first change at or after its first backward
            for k, stage in firsts:
                while k < len(changes) and not changes[k]:
                    k += 1
                joins.append((k, grads[stage]))
            peak = held = 0.0
            start = 0
            for k, extra in sorted(joins) + [(len(levels), 0.0)]:
                if k > start:
                    peak = max(peak, held + max(levels[start:k]))
                held += extra
                start = k
            peaks.append(max(peak, held))
        return peaks
