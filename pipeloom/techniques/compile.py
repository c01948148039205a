"""Compiled stages: each stage's blocks compiled with torch.compile (:mod:`pipeloom.runtime.compile`).

The schedule and the costs are those of the eager run: ``simulate`` and
``plan`` read ``--compile`` as part of the run and time it as eager (a
``pipeloom profile`` of the compiled run is not taken yet).
"""

from __future__ import annotations

from ..errors import PipeloomError
from . import Flag, Technique, register

#: What --compile does not compose with: (technique, the flags that use it, why).
REFUSED = (
    ("sequence_parallel", lambda spec: f"--sp {spec.sp}", "ring attention's collectives run inside the blocks"),
    ("weight_versions", lambda spec: f"--schedule {spec.schedule}",
     "its weight versions run each stage on a step's weights as tensors"),
    ("kfac", lambda spec: "--optimizer kfac", "its capture hooks on the linear layers run inside the blocks"),
)


class Compile(Technique):
    name = "compile"
    summary = "each stage's blocks compiled with torch.compile"
    order = 110  # sets the stages up after every other technique (no transform)
    flags = (Flag("compile", "compile each stage's transformer blocks with torch.compile (regional compilation; "
                  "the B/W split, recomputation and offload hold); default off", type=bool),)

    def active(self, spec) -> bool:
        return spec.compile

    def check(self, spec) -> None:
        if not isinstance(spec.compile, bool):
            raise PipeloomError(f"compile {spec.compile!r}: give true or false")
        if spec.compile:
            for name, flags, why in REFUSED:
                if spec.uses(name):
                    raise PipeloomError(f"--compile with {flags(spec)}: {why}; leave out --compile")

    def pipeline_options(self, spec, costs) -> dict:
        return {"compile": spec.compile}

    def runtime_part(self):
        from ..runtime.compile import CompilePart

        return CompilePart

    def describe(self, spec, pipe) -> str:
        return ", compiled" if spec.compile else ""


register(Compile())
