"""The one schedule builder: a run spec's costs and its schedule, for simulate, plan and train alike.

:func:`costs_of` prices a :class:`~pipeloom.spec.RunSpec` (a profile, the cost
formulas on its hardware preset, or the costs it gives); :func:`build_run`
builds its schedule with those costs: the family's order, then each
technique's part (:mod:`pipeloom.techniques`: the vocabulary passes, offload,
K-FAC's bubble work), validated. The schedule's digest
(:meth:`~pipeloom.schedule.Schedule.digest`) shows that what was costed is what
runs: ``pipeloom simulate --json`` and ``pipeloom train --dry-run --json``
report it and every worker logs it. Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from .schedule import Costs, Schedule, build, get_family, validate
from .schedule.costs import StageCosts
from .spec import RunSpec
from .techniques import TECHNIQUES, ordered


@dataclass(frozen=True)
class Priced:
    """A spec with what its costs come from: the model (None without one), the hardware preset
    and the loaded profile (None without one)."""

    spec: RunSpec

    @cached_property
    def model(self):
        """The :class:`~pipeloom.sim.model.ModelSpec` of the spec's model (a preset, or the sizes
        of its ``init_from`` directory) and vocabulary, or None."""
        size = self.spec.size
        if size is None:
            return None
        from .sim.specs import get_model, size_spec

        model = get_model(self.spec.model) if self.spec.init_from is None else size_spec(self.spec.init_from, size)
        return model if self.spec.vocab is None else replace(model, vocab=self.spec.vocab)

    @cached_property
    def device(self):
        """The hardware preset, its links at the spec's ``link_bandwidth`` if one is given."""
        from .sim.specs import get_device

        device = get_device(self.spec.hardware_preset)
        link = self.spec.link_bandwidth
        return device if link is None else replace(device, link_bandwidth=link * 1e9)

    @cached_property
    def profile(self):
        if self.spec.profile is None:
            return None
        from .sim.profile import load_profile

        profile = load_profile(self.spec.profile)
        if self.model is not None:
            profile.check(self.model, self.spec.seq)
        return profile

    @property
    def source(self) -> str:
        """What the costs come from, as the reports say it."""
        if self.model is None:
            return "given"
        if not self.spec.profile:
            return f"formulas, device preset {self.device.name}"
        measured = self.profile.model.vocab
        return f"profile {self.spec.profile}" + (
            f" (output layer scaled from its vocabulary {measured})" if measured != self.model.vocab else "")

    @cached_property
    def costs(self) -> Costs:
        """Per full stage: times (ms) and bytes from the model, or the spec's ``costs`` in their units;
        each technique's settings applied (:meth:`~pipeloom.techniques.Technique.cost_options`,
        :meth:`~pipeloom.techniques.Technique.costs`)."""
        if self.model is None:
            return technique_costs(self.spec, Costs.parse(self.spec.costs))
        return model_costs(self.spec, self.model, self.device, self.profile)

    def schedule(self, without: tuple[str, ...] = ()) -> Schedule:
        """The spec's schedule under its costs (:func:`build_run`), ``without`` those techniques."""
        return build_run(self.spec, self.costs, without=without)


def model_costs(spec: RunSpec, model, device, profile=None) -> Costs:
    """The costs of ``spec`` from ``model`` (a :class:`~pipeloom.sim.model.ModelSpec`) on ``device``
    (a :class:`~pipeloom.sim.model.Device`), or from ``profile``: the cost formulas with each
    technique's settings, then each technique's own fields; in the spec's
    :attr:`~pipeloom.spec.RunSpec.costed_precision`, or the profile's (:meth:`~pipeloom.sim.profile.Profile.precision_for`).
    The planner prices its candidates here too."""
    from .sim.model import costs_from_model

    options = {k: v for t in TECHNIQUES.values() for k, v in t.cost_options(spec).items()}
    precision = spec.costed_precision if profile is None else profile.precision_for(spec.precision)
    costs = costs_from_model(model, spec.pp, spec.seq, spec.microbatch_size, device, chunks=spec.family_chunks,
                             dp=spec.dp, profile=profile, precision=precision, **options)
    return technique_costs(spec, costs)


def technique_costs(spec: RunSpec, costs: Costs) -> Costs:
    """``costs`` with each technique's own fields (:meth:`~pipeloom.techniques.Technique.costs`)."""
    for technique in TECHNIQUES.values():
        costs = technique.costs(spec, costs)
    return costs


def costs_of(spec: RunSpec) -> Costs:
    """The costs of ``spec`` (:attr:`Priced.costs`)."""
    return Priced(spec).costs


def build_run(spec: RunSpec, costs: Costs | None = None, *, without: tuple[str, ...] = ()) -> Schedule:
    """The schedule ``spec`` runs, built with ``costs`` (by default :func:`costs_of`): its family's
    order (zb-auto searched under the costs and ``memory_limit``), then each technique's build
    options and transforms in their order (vocabulary passes, offload copies placed by the costs,
    K-FAC's pieces in the bubbles), validated. ``without``: techniques left out (to compare)."""
    priced = Priced(spec)
    costs = priced.costs if costs is None else costs
    family = get_family(spec.schedule)
    limited = spec.memory_limit is not None and "memory_limit" in family.options
    stages = spec.pp * spec.family_chunks
    unit = full_stage_m_b(costs.per_stage(stages, spec.family_chunks), spec.pp) if limited else None
    options = {"memory_limit": spec.memory_limit, "memory_unit": unit} if limited else {}
    techniques = [t for t in ordered() if t.name not in without]
    for technique in techniques:
        options.update(technique.build_options(spec))
    transforms = [x for technique in techniques for x in technique.transforms(spec, priced, stages)]
    schedule = build(spec.schedule, spec.pp, spec.microbatches, spec.chunks, transforms=transforms, costs=costs,
                     **options)
    if spec.memory_limit is not None and "memory_limit" not in options:
        validate(schedule, memory_limit=spec.memory_limit, m_w=_m_w_fraction(costs))
    return schedule


def full_stage_m_b(costs: StageCosts, pp: int) -> float:
    """One full stage's M_B in the unit of ``costs.m_b`` (bytes under a model's costs): the mean over
    the ``pp`` ranks of their stages' activations of one microbatch; the unit of ``--memory-limit``
    and of the reports' peak activation in M_B."""
    return sum(costs.m_b) / pp


def _m_w_fraction(costs: Costs) -> float:
    """M_W as a share of M_B, where both are single numbers (else 0)."""
    m_b, m_w = costs.m_b, costs.m_w
    if isinstance(m_b, (int, float)) and isinstance(m_w, (int, float)) and m_b:
        return m_w / m_b
    return 0.0
