"""Techniques as plug-ins: each says, in one place, everything the commands need of it.

A :class:`Technique` declares its flags (each sets a field of the
:class:`~pipeloom.spec.RunSpec`, or an option of a technique from outside the
package), its checks, what it changes in the costs and in the schedule, its
fragment of the reports and of the run's first line, and what it asks of the
runtime. The run spec, the flags, the builder, the reports and ``train`` loop
over :data:`TECHNIQUES` and name none of them.

The built-in techniques (:mod:`.builtin`) are recomputation, vocabulary
parallelism, sequence parallelism, weight versions (PipeDream-2BW), offload
and K-FAC (PipeFisher). A technique from outside the package calls
:func:`register` in a module that :func:`load_plugins` imports: one named by
the environment variable ``PIPELOOM_PLUGINS`` (modules, comma-separated) or an
entry point of the group ``pipeloom.techniques``. Every command imports them
before it reads its flags, and so does every worker ``train`` starts.

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PipeloomError, comma_list


@dataclass(frozen=True)
class Flag:
    """One flag, ``--name`` with dashes: it sets the run spec's field ``name`` (a built-in's) or the
    technique option ``name`` (a plug-in's, whose ``default`` is its value when not given).
    ``compared``: ``simulate`` also takes a comma list of its values and sets them side by side."""

    name: str
    help: str
    type: Callable = str
    choices: tuple | None = None
    metavar: str | None = None
    default: Any = None
    compared: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def add(self, group, *, lists: bool = False) -> None:
        """Add the flag to an argparse group; not given, it reads None (the spec holds the default).
        ``lists``: a compared flag reads its text, a comma list that :meth:`values` parses."""
        if lists and self.compared:
            group.add_argument(self.flag, metavar=(self.metavar or "|".join(self.choices or ("X",))) + "[,...]",
                               help=self.help + "; a comma list compares them side by side")
        else:
            group.add_argument(self.flag, type=self.type, choices=self.choices, metavar=self.metavar, help=self.help)

    def values(self, text: str) -> list:
        """The values of a comma list given to the flag: at least one, none twice, each of its type and choices."""
        words = comma_list(self.flag, text)
        bad = next((word for word in words if self.choices and word not in self.choices), None)
        if bad:
            raise PipeloomError(f"{self.flag} {bad!r}: choose from {', '.join(self.choices)}")
        try:
            return [self.type(word) for word in words]
        except ValueError as err:
            raise PipeloomError(f"{self.flag} {text!r}: {err}") from None


class Technique:
    """A technique's hooks; each does nothing unless overridden. ``order`` places its transforms
    among the others' (lower first; K-FAC's pieces, which fill the final schedule's bubbles, last)."""

    name = ""
    summary = ""
    flags: tuple[Flag, ...] = ()
    order = 50
    #: The runtime places the technique's work itself, from its :meth:`pipeline_options` (K-FAC's
    #: pieces, for the model's own layers): the schedule ``train`` gives the pipeline is built without it.
    placed_by_runtime = False

    def active(self, spec) -> bool:
        """Whether ``spec`` uses the technique."""
        return False

    def check(self, spec) -> None:
        """Refuse, in one line each, settings that do not fit each other or the run."""

    def check_runnable(self, spec) -> None:
        """Refuse what the runtime cannot run yet (``pipeloom train`` only)."""

    def check_training(self, spec, config) -> None:
        """Refuse what ``pipeloom train`` cannot do yet with the technique given its
        :class:`~pipeloom.train.config.TrainConfig` (checkpoints, measured reports)."""

    def cost_options(self, spec) -> dict:
        """Keywords of :func:`~pipeloom.sim.model.costs_from_model` the technique sets."""
        return {}

    def costs(self, spec, costs):
        """The run's costs with the technique's own fields (given or derived)."""
        return costs

    def build_options(self, spec) -> dict:
        """Keywords of :func:`~pipeloom.schedule.build` the technique sets."""
        return {}

    def transforms(self, spec, priced, stages: int) -> list:
        """The transforms the technique applies to a schedule of ``stages`` stages."""
        return []

    def report(self, result, priced) -> dict:
        """Its fields of ``simulate --json`` (and ``train --dry-run --json``) for ``result``."""
        return {}

    def report_lines(self, report: dict) -> list[str]:
        """Its lines of the ``simulate`` table, from the report."""
        return []

    def compare_cells(self, report: dict) -> list[tuple[str, str]]:
        """Its columns of ``simulate --compare``'s table for one report: (header, cell) pairs, the
        same headers for every report of a comparison (the first one's decide which appear)."""
        return []

    def pipeline_options(self, spec, costs) -> dict:
        """Keywords of :class:`~pipeloom.runtime.Pipeline` the technique sets in ``train``."""
        return {}

    def runtime_part(self):
        """The class of its side of :class:`~pipeloom.runtime.Pipeline` (a
        :class:`~pipeloom.runtime.parts.Part`: the keywords it takes, its state and hooks), imported
        inside this method (torch), or None."""
        return None

    def plan_dimension(self, request) -> tuple[str, tuple] | None:
        """A plug-in's dimension of the planner's search: (its option's name, the values to try),
        or None. (The built-in techniques' dimensions are the planner's own candidate fields.)"""
        return None

    def setup_runtime(self) -> None:
        """Register what the runtime needs (handlers of its kinds); called once per worker."""

    def describe(self, spec, pipe) -> str:
        """Its fragment of ``train``'s first line (", offload full"), or ""."""
        return ""


#: The registered techniques, by name, in the order registered.
TECHNIQUES: dict[str, Technique] = {}


def register(technique: Technique) -> Technique:
    """Add ``technique`` (replacing one of the same name); returns it."""
    if not technique.name:
        raise PipeloomError(f"a technique needs a name: {type(technique).__name__}")
    TECHNIQUES[technique.name] = technique
    return technique


def ordered() -> list[Technique]:
    """The techniques in the order their transforms apply."""
    return sorted(TECHNIQUES.values(), key=lambda t: t.order)


def flags() -> list[Flag]:
    """Every technique's flags."""
    return [flag for technique in TECHNIQUES.values() for flag in technique.flags]


def size_text(nbytes: float) -> str:
    """Bytes as the reports print them: MiB, or GiB from 1 GiB on."""
    return f"{nbytes / 2**30:.4g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.4g} MiB"


def load_plugins() -> None:
    """Import the plug-in techniques: the modules in ``PIPELOOM_PLUGINS`` and the entry points of
    the group ``pipeloom.techniques`` (each registers itself on import)."""
    from importlib.metadata import entry_points

    for name in filter(None, (n.strip() for n in os.environ.get("PIPELOOM_PLUGINS", "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise PipeloomError(f"PIPELOOM_PLUGINS names {name!r}, which cannot be imported: {err}") from None
    for point in entry_points(group="pipeloom.techniques"):
        point.load()


from . import builtin  # noqa: E402,F401 -- registers the built-in techniques
