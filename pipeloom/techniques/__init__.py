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
    technique option ``name`` (a plug-in's, whose ``default`` is its value when not given); of
    ``type`` bool, a switch that takes no value.
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
        if self.type is bool:  # a switch: given, True
            group.add_argument(self.flag, action="store_true", default=None, help=self.help)
        elif lists and self.compared:
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


@dataclass(frozen=True)
class PlanAxis:
    """A built-in technique's dimension of the planner's search. ``name`` is the field of the
    candidate, of the plan request (the values searched), of the run spec and of the ``--json``
    plans; ``pipeloom plan``'s flag ``--name`` (dashes) narrows ``values``, a comma list, or ``any``
    (:attr:`every`).

    ``values``: searched by default, in the order equal plans are ranked (the bare value, the
    technique off, first); ``choices``: what a request may name (default ``values``; a callable
    checks one value); ``help``: the flag's help (``{default}``: the values); ``column``, ``width``:
    its column of the table.

    What a value changes, for the planner's caches: ``priced`` the costs, ``placed`` the parameters
    each rank holds, ``shaped`` the schedule's order. ``added``: its work is added to the schedule
    built without it (:meth:`Technique.plan_add`), so that schedule's critical path bounds it.

    ``saver``: a memory saver, which only adds work (a plan is a layout with its best savers, the
    bare layout where it fits: :func:`~pipeloom.plan.search.taken`): its place among the savers
    when equal plans are ranked (lower first); ``saving``: its values, most memory saved first
    (default ``values`` reversed), the order the hunt for the least memory tries them in."""

    name: str
    values: tuple
    help: str
    column: str
    width: int
    choices: tuple | Callable | None = None
    priced: bool = False
    placed: bool = False
    shaped: bool = False
    added: bool = False
    saver: int | None = None
    saving: tuple | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def every(self) -> tuple:
        """What ``any`` names: every value a request may name (``values`` where ``choices`` checks one)."""
        return self.choices if isinstance(self.choices, tuple) else self.values

    @property
    def most_saving(self) -> tuple:
        return self.saving if self.saving is not None else self.values[::-1]

    def check(self, values) -> None:
        """Refuse, in one line, a value a request may not name."""
        if callable(self.choices):
            for value in values:
                self.choices(value)
            return
        allowed = self.values if self.choices is None else self.choices
        for value in values:
            if value not in allowed:
                raise PipeloomError(f"plan: unknown {self.name} {value!r}; choose from {', '.join(allowed)}")


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
        or None. (The built-in techniques declare theirs with :meth:`plan_axis`.)"""
        return None

    # The planner's hooks (:mod:`pipeloom.plan`). ``c`` is a candidate (:class:`~pipeloom.plan.Candidate`):
    # a built-in's axis is its field, a plug-in's dimension one of its ``options``.

    def plan_axis(self) -> PlanAxis | None:
        """A built-in's dimension of the planner's search, declared (:class:`PlanAxis`), or None."""
        return None

    def plan_allows(self, request, c) -> bool:
        """Whether the runtime accepts ``c`` on the request's cluster as far as the technique goes."""
        return True

    def plan_same(self, request, c):
        """A candidate whose plan is ``c``'s but for the names of its settings (the same costs, schedule
        and memory), or ``c``: the planner costs one of them for both."""
        return c

    def plan_fields(self, request, c) -> dict:
        """Run spec fields the technique derives from ``c`` and the request (also the plan's ``--json``
        fields after its axis's)."""
        return {}

    def plan_steady(self, schedule: str) -> bool:
        """Whether the family ``schedule`` never flushes, so the planner takes its steady step (the
        time of two steps less one's), bounds it by the ranks' work alone and keeps no critical path."""
        return False

    def plan_cycle(self, c) -> bool:
        """Whether ``c``'s schedule is a cycle of several steps that runs whole (K-FAC's refresh): the
        planner simulates it once, as ``train`` builds it, and takes its mean step."""
        return False

    def plan_weight_versions(self, schedule: str) -> int:
        """Weight versions each parameter has under the family ``schedule`` (1: the parameters)."""
        return 1

    def plan_passes(self, c) -> tuple:
        """Kinds each rank runs once per microbatch besides its stages' F, B and W (its busy time)."""
        return ()

    def plan_step_passes(self, c) -> tuple:
        """Kinds each stage runs once per step after its last weight gradient (its rank's busy time,
        and the end of the chain that bounds the step)."""
        return ()

    def plan_shard_params(self, request, c) -> int:
        """Parameters each rank holds besides its stages' (a vocabulary shard)."""
        return 0

    def plan_layer_state_bytes(self, request, c) -> float:
        """Bytes each transformer layer holds all step long besides its parameters' state, as the
        simulated peak counts them (K-FAC's factors): they raise the planner's memory bounds. A
        function of the request and ``c``'s priced settings (the planner asks it once per costs)."""
        return 0.0

    def plan_model_options(self, c) -> dict:
        """Keywords of :func:`~pipeloom.sim.stages.stage_parameters` and
        :func:`~pipeloom.sim.memory.peak_memory_bytes` the technique sets."""
        return {}

    def plan_add(self, request, c, schedule, costs):
        """``schedule`` (built without the technique's added axis) with its work added, placed by
        ``costs``, checked: what the builder makes of it for ``c``'s run spec."""
        return schedule

    def plan_memory_lists(self, c) -> tuple[tuple[str, bool], ...]:
        """The steps, cheapest first, that bound ``c``'s activation peak from a list before it is
        simulated: (a name for :meth:`plan_memory_list`, whether it reads the list built without the
        added axes); none: the peak of ``c``'s own list."""
        return ()

    def plan_memory_list(self, step: str, actions) -> list:
        """One rank's ``actions`` as the bound's ``step`` counts them (what is away held only while
        it is on the device)."""
        return list(actions)

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
