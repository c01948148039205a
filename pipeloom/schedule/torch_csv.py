"""torch.distributed.pipelining's schedules both ways: export to its "compute_only" CSV, import of its classes and CSVs.

``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` reads
one row per rank (row ``r`` is rank ``r``), each cell an action string
(``1F3``, ``1I3``, ``1W3``, ``1B3``), infers the stage -> rank mapping from
the rows, checks that every stage runs each of its ``n_microbatches``
forwards and backwards in order, and adds the sends and receives itself.
The runtime must be built with ``n_microbatches`` equal to the schedule's
``total_microbatches`` and its stages numbered as here.

:func:`from_torch` goes the other way: the action order of a torch schedule
class, or of a CSV torch wrote, as a pipeloom :class:`~.ir.Schedule`. It
imports torch only when it reads a class; nothing else here does.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from ..errors import PipeloomError, ScheduleError
from .ir import Action, Schedule, parts
from .kinds import KINDS, get
from .validate import validate

#: The schedule classes of torch.distributed.pipelining (2.13) that :func:`from_torch` reads by name,
#: and the stages per rank each takes (None: any >= 2, default 2).
TORCH_SCHEDULES = {
    "ScheduleGPipe": (1,), "Schedule1F1B": (1,), "ScheduleInterleaved1F1B": None, "ScheduleLoopedBFS": None,
    "ScheduleInterleavedZeroBubble": None, "ScheduleZBVZeroBubble": (2,), "ScheduleDualPipeV": (2,),
}
#: Where pipeloom takes a family's name, ``torch:SOURCE`` names a torch schedule (a class or a CSV, as
#: :func:`from_torch` takes it): ``build("torch:ScheduleZBVZeroBubble", 4, 8)``.
TORCH_PREFIX = "torch:"
#: The local operations of torch's lowered CSV (FSDP's unshard and reshard, the gradient reduction).
_LOCAL_OP = re.compile(r"\d+(UNSHARD|RESHARD|REDUCE_GRAD)")


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute-only CSV text: one line per rank. Kinds
    whose ``torch_csv`` is False (sends and receives, which torch adds itself)
    are left out; a kind whose ``torch_csv`` is None has no place in it."""
    rows = []
    for rank, actions in enumerate(schedule.ranks):
        row = []
        for action in actions:
            written = get(action.kind).torch_csv
            if written is None:
                raise PipeloomError(
                    f"rank {rank}: action {action} (kind {action.kind}) has no place in torch's compute-only CSV, "
                    f"which holds only {_held()} actions; export the schedule before adding transforms"
                )
            if written:
                row.append(str(action))
        rows.append(row)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def write_torch_csv(schedule: Schedule, path: str | Path) -> None:
    """Write :func:`to_torch_csv` of ``schedule`` to ``path``."""
    Path(path).write_text(to_torch_csv(schedule), newline="")


def from_torch(source, pp: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """A torch.distributed.pipelining schedule's action order as a validated :class:`~.ir.Schedule`
    of family ``torch:SOURCE``, for ``pp`` ranks and ``microbatches`` microbatches.

    ``source``: a torch schedule class, its name (:data:`TORCH_SCHEDULES`, with or without
    ``Schedule``, in any case), or the path of a ``.csv`` torch's ``_dump_csv`` wrote: compute-only,
    or lowered (its sends, receives, unshards, reshards and gradient reductions are dropped:
    pipeloom lowers communication itself). ``chunks``: stages per rank of a multi-stage class
    (default 2). Torch's F, I, W, B and OVERLAP_F_B become pipeloom's F, B, W, BW and
    OVERLAP_F_B; each stage is placed on the rank whose list runs it.

    A multi-stage class (``PipelineScheduleMulti``) computes its ``pipeline_order`` in its
    constructor, here given stand-in stages; a single-stage class's order is what its
    ``_step_microbatches`` runs on each rank's stand-in stage (its ``pipeline_order``, drawn
    for torch's visualiser, misses microbatch 0 on 1F1B's last rank in torch 2.13).
    """
    if isinstance(source, (str, Path)) and str(source).lower().endswith(".csv"):
        name, rows = f"{TORCH_PREFIX}{source}", _csv_rows(source)
    else:
        cls = source if isinstance(source, type) else _torch_class(source)
        name, rows = f"{TORCH_PREFIX}{cls.__name__}", _class_rows(cls, pp, microbatches, chunks)
    return _schedule(name, rows, pp, microbatches, chunks)


def torch_chunks(source: str) -> tuple[int, ...] | None:
    """The stages per rank the torch schedule ``source`` (a name or a CSV, as :func:`from_torch`
    takes it) holds: (1,), (2,), a CSV's own count, or None for any >= 2."""
    if source.lower().endswith(".csv"):
        schedule = _schedule(f"{TORCH_PREFIX}{source}", _csv_rows(source), None, None, None)
        return (schedule.chunks,)
    return TORCH_SCHEDULES[_class_name(source)]


def _held() -> str:
    return ", ".join(name for name, kind in KINDS.items() if kind.torch_csv)


def _class_name(name: str) -> str:
    """The class of :data:`TORCH_SCHEDULES` ``name`` names (with or without ``Schedule``, any case)."""
    known = {key.lower(): n for n in TORCH_SCHEDULES for key in (n, n[len("Schedule"):])}
    if str(name).lower() not in known:
        raise PipeloomError(f"unknown torch schedule {name!r}; torch's schedules: {', '.join(TORCH_SCHEDULES)} "
                            f"(or a CSV torch wrote, FILE.csv)")
    return known[str(name).lower()]


def _torch_class(name: str) -> type:
    from torch.distributed.pipelining import schedules

    return getattr(schedules, _class_name(name))


class _Stage:
    """A stand-in for torch's pipeline stage: what its schedules' constructors read (no module, no
    process group), and a record of the forwards and backwards a single-stage schedule runs."""

    submod = None
    is_last = False

    def __init__(self, index: int, pp: int, stages: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, 0
        self.record: list[str] = []

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.record.append(f"{self.stage_index}F{microbatch}")

    def backward_one_chunk(self, microbatch, *args, **kwargs):
        self.record.append(f"{self.stage_index}B{microbatch}")

    def _no_messages(self, *args, **kwargs):
        return []

    get_fwd_recv_ops = get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = perform_reduce_grad = _no_messages


def _class_rows(cls: type, pp: int, microbatches: int, chunks: int | None) -> list[list[str]]:
    """Each rank's action strings in the torch schedule class ``cls``'s order; torch's refusal
    (a ValueError) as one PipeloomError naming the microbatch count nearest that it takes."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    if not issubclass(cls, (PipelineScheduleSingle, PipelineScheduleMulti)):
        raise PipeloomError(f"{cls.__name__} is not a torch.distributed.pipelining schedule class; "
                            f"torch's schedules: {', '.join(TORCH_SCHEDULES)}")
    for label, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise PipeloomError(f"{label}={value!r}: must be a whole number >= 1")
    single = issubclass(cls, PipelineScheduleSingle)
    if single and chunks not in (None, 1):
        raise PipeloomError(f"{cls.__name__} holds one stage per rank; chunks={chunks} does not fit: use chunks=1")
    chunks = 1 if single else chunks or 2

    def rows(m: int) -> list[list[str]]:
        if single:
            return [_run_single(cls, _Stage(rank, pp, pp), m) for rank in range(pp)]
        order = cls([_Stage(c * pp, pp, chunks * pp) for c in range(chunks)], m).pipeline_order
        return [[str(a) for a in order[rank] if a is not None] for rank in range(pp)]

    def takes(m: int) -> bool:
        try:
            rows(m)
        except ValueError:
            return False
        return True

    try:
        return rows(microbatches)
    except ValueError as err:
        near = (k for d in range(1, microbatches + 2 * chunks * pp) for k in (microbatches - d, microbatches + d))
        fit = next((k for k in near if k > 0 and takes(k)), None)
        raise PipeloomError(f"torch's {cls.__name__} refuses pp={pp} microbatches={microbatches} chunks={chunks}: "
                            f"{str(err).rstrip('.')}" + (f"; microbatches={fit} fits" if fit else "")) from None


def _run_single(cls: type, stage: _Stage, microbatches: int) -> list[str]:
    schedule = cls(stage, microbatches)
    schedule._initialize_stage = lambda *args, **kwargs: None  # shapes and messages: nothing to set up
    schedule._step_microbatches()
    return stage.record


def _csv_rows(path) -> list[list[str]]:
    try:
        with open(path, newline="") as file:
            return list(csv.reader(file))
    except OSError as err:
        raise PipeloomError(f"cannot read torch CSV {path}: {err.strerror}") from None


def _imported(cell: str) -> Action | None:
    """A cell of torch's order as pipeloom's action; None for an empty cell (torch's bubble) and for
    the communication torch adds (sends, receives, unshards, reshards, gradient reductions)."""
    cell = cell.strip()
    if not cell or _LOCAL_OP.fullmatch(cell):
        return None
    action = Action.parse(cell)
    written = get(action.kind).torch_csv
    if written is None:
        raise PipeloomError(f"action {cell} (kind {action.kind}) is no torch action; torch's CSV holds {_held()} "
                            "actions, sends and receives")
    return action if written else None


def _schedule(family: str, rows: list[list[str]], pp: int | None, microbatches: int | None,
              chunks: int | None) -> Schedule:
    """The validated schedule of torch's ``rows`` (one list of action strings per rank); ``pp``,
    ``microbatches`` and ``chunks`` must be what the rows hold (None: whatever they hold)."""
    ranks = []
    for rank, row in enumerate(rows):
        try:
            ranks.append(tuple(a for a in map(_imported, row) if a is not None))
        except PipeloomError as err:
            raise PipeloomError(f"{family}: rank {rank}: {err}") from None
    placement: dict[int, int] = {}
    used = [(rank, part) for rank, actions in enumerate(ranks) for a in actions for part in parts(a)]
    for rank, part in used:
        if placement.setdefault(part.stage, rank) != rank:
            raise PipeloomError(f"{family}: stage {part.stage} runs on ranks {placement[part.stage]} and {rank}; "
                                "a stage belongs to one rank")
    stages = len(placement)
    if not stages:
        raise PipeloomError(f"{family}: no action; a line per rank lists its actions, such as 0F0,0F1,0B0,0B1")
    if sorted(placement) != list(range(stages)):
        missing = min(set(range(stages + 1)) - set(placement))
        raise PipeloomError(f"{family}: stage {missing} has no action; stages are numbered 0 .. S-1")
    held = {"pp": len(ranks), "microbatches": 1 + max(part.microbatch for _, part in used),
            "chunks": stages // len(ranks)}
    for label, given in (("pp", pp), ("microbatches", microbatches), ("chunks", chunks)):
        if given is not None and given != held[label]:
            raise PipeloomError(f"{family} holds {label}={held[label]}; {label}={given} does not fit")
    placed = tuple(placement[s] for s in range(stages))
    schedule = Schedule(family, held["pp"], held["microbatches"], placed, tuple(ranks))
    try:
        return validate(schedule)
    except ScheduleError as err:
        raise ScheduleError(f"{family}: {err}") from None
