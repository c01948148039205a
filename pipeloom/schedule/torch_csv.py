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
from .ir import BW, B, F, W, Schedule

#: The kinds torch's compute-only format can hold.
TORCH_KINDS = (F, B, W, BW)


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's compute-only CSV text: one line per rank."""
    for rank, actions in enumerate(schedule.ranks):
        for action in actions:
            if action.kind not in TORCH_KINDS:
                raise PipeloomError(
                    f"rank {rank}: action {action} (kind {action.kind}) has no place in torch's compute-only CSV, "
                    f"which holds only F, B, W and BW actions; export the schedule before adding transforms"
                )
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([str(a) for a in actions] for actions in schedule.ranks)
    return out.getvalue()


def write_torch_csv(schedule: Schedule, path: str | Path) -> None:
    """Write :func:`to_torch_csv` of ``schedule`` to ``path``."""
    Path(path).write_text(to_torch_csv(schedule), newline="")
