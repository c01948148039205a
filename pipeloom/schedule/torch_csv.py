"""Export to the "compute_only" CSV of torch.distributed.pipelining.

``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` reads
one row per rank (row ``r`` is rank ``r``), each cell an action string
(``1F3``, ``1I3``, ``1W3``, ``1B3``), infers the stage -> rank mapping from
the rows, checks that every stage runs each of its ``n_microbatches``
forwards and backwards in order, and adds the sends and receives itself.
The runtime must be built with ``n_microbatches`` equal to the schedule's
``total_microbatches`` and its stages numbered as here.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..errors import PipeloomError
from .ir import Schedule
from .kinds import KINDS, get


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
                holds = ", ".join(name for name, kind in KINDS.items() if kind.torch_csv)
                raise PipeloomError(
                    f"rank {rank}: action {action} (kind {action.kind}) has no place in torch's compute-only CSV, "
                    f"which holds only {holds} actions; export the schedule before adding transforms"
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
