"""PipeFisher's pieces: K-FAC work run where the schedule put it (:mod:`pipeloom.schedule.transforms.kfac`).

One :class:`~pipeloom.optim.kfac.KFAC` (no base optimizer) manages the linear
layers of the rank's stages (not the LM head: its G would be vocab × vocab;
not those inside an ``nn.MultiheadAttention``, which reads their weights
without calling them, so nothing captures their inputs).
A unit of a stage is one of its managed layers, in module order. The
schedule is a cycle of k calls (:func:`split_cycle` cuts a rank's list into
them); in the cycle's first call the forwards and backwards capture (their
order per stage must be the microbatches' order, which is checked), and
``KFAC_A``/``KFAC_G`` (curvature), ``KFAC_SYNC_*`` (the sum over the
data-parallel replicas), ``KFAC_INV`` run the refresh wherever the schedule
placed them; ``KFAC_PRE`` preconditions its stage's gradients every step,
with the new inverses from the cycle's last step on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
from torch import nn

from ...errors import PipeloomError
from ...optim.kfac import KFAC, tf32_for
from ...schedule import BW, B, F, Kfac, lower, validate
from ...schedule.ir import shifted
from ...schedule.kinds import get
from ...schedule.transforms.kfac import KFAC_A, KFAC_G, KFAC_INV, KFAC_PRE, KFAC_SYNC_A, KFAC_SYNC_G, PIECES
from ..parts import Part
from . import around, register

NAME = "kfac"
#: The factor each curvature and sync piece works on.
_CURVATURE, _SYNC = {KFAC_A: "A", KFAC_G: "G"}, {KFAC_SYNC_A: "A", KFAC_SYNC_G: "G"}


class KfacWork:
    """One rank's K-FAC state (in ``context.extras[NAME]``) and the call of the cycle being run."""

    def __init__(self, context, damping: float = 1e-3, decay: float = 0.95):
        self.context = context
        stages = nn.ModuleDict({str(s): stage for s, stage in context.stages.items()})
        heads = [n for n, m in stages.named_modules() if isinstance(m, nn.Linear) and n.endswith("lm_head")]
        # torch's attention reads its projections' weights without calling them: nothing to capture
        unused = [f"{n}.{inner}" for n, m in stages.named_modules() if isinstance(m, nn.MultiheadAttention)
                  for inner, linear in m.named_modules() if isinstance(linear, nn.Linear)]
        group = context.mesh.replica_group if context.mesh.layout.replicas > 1 else None
        summed = "K-FAC's sum of the curvature over the data-parallel replicas"
        self.kfac = KFAC(stages, None, damping, decay, exclude=heads + unused, group=group,
                         all_reduce=lambda tensor: context.channel.all_reduce(tensor, group, summed),
                         tf32=tf32_for(context.device, context.autocast), some=False)
        self.kfac.capturing = False
        # a captured output gradient carries 1 / (the microbatch's tokens over the sp group x microbatches):
        # its rows times this are the per-token gradients
        self.kfac.accumulation = context.schedule.microbatches * context.mesh.layout.sp
        #: each stage's units: its managed layers' names, in module order
        self.units = {s: [n for n in self.kfac.layers if n.split(".", 1)[0] == str(s)] for s in context.stages}
        self.calls = 1  # calls in the cycle
        context.extras[NAME] = self

    @property
    def call(self) -> int:
        """The call of the cycle being run."""
        return self.context.calls % self.calls

    def capturing(self, action) -> bool:
        """Whether ``action`` (an F or a backward) captures: in the cycle's first step, on a stage with
        units, checked to come in microbatch order on its stage."""
        units = self.units[action.stage]
        if self.call or action.microbatch >= self.context.schedule.microbatches or not units:
            return False
        factor = "A" if action.kind == F else "G"
        done = len(self.kfac.layers[units[0]].captures[factor])
        if done != action.microbatch:
            raise PipeloomError(f"K-FAC: stage {action.stage} ran {action} after {done} captures of {factor}; "
                                "the schedule must run each stage's forwards and backwards in microbatch order")
        return True

    @contextmanager
    def around(self, action):
        """Around an F: capture the layer inputs; around a backward: check its order (the
        hooks its forward left capture the output gradients). A recomputing stage's F runs without
        autograd: it captures the inputs alone, and its backward's forward, run again, the gradients."""
        capturing = self.capturing(action)
        recomputed = self.context.recomputes(action.stage)
        if action.kind == F:
            self.kfac.capturing = capturing and ("A" if recomputed else True)
        else:
            self.kfac.capturing = capturing and recomputed and "G"
        try:
            yield
        finally:
            self.kfac.capturing = False

    def piece(self, action) -> None:
        name, kind = self.units[action.stage][action.payload[0]], action.kind
        if kind == KFAC_INV:
            self.kfac.invert(name)
        elif kind in _CURVATURE:
            self.kfac.curvature(name, _CURVATURE[kind], action.microbatch)
        else:
            self.kfac.reduce(name, _SYNC[kind])

    def precondition(self, action) -> None:
        """Stage ``action.stage``'s gradients of step ``action.microbatch`` of the call preconditioned
        (with weight versions, those of the step's version); in the cycle's last step with the new
        inverses."""
        names = self.units[action.stage]
        context = self.context
        steps = context.schedule.steps
        if self.call == self.calls - 1 and action.microbatch == steps - 1:
            self.kfac.publish(names)
        weights = None
        if context.versions is not None:  # the step's gradient is in its version's leaves
            leaves = context.versions.weights[action.stage, context.steps_done + action.microbatch]
            weights = {name: (leaves[f"{local}.weight"], leaves.get(f"{local}.bias"))
                       for name in names for local in [name.split(".", 1)[1]]}
        self.kfac.precondition(names, weights)


def kfac_cycle(context, optimizer: str, options: dict | None, costs=None):
    """Set up PipeFisher on a pipeline whose ``context`` runs one call of its schedule:
    the rank's :class:`KfacWork`, the schedule through :class:`~pipeloom.schedule.Kfac`
    (units from every rank's stages, placed with ``costs``), and this rank's list of it cut into
    its calls. ``options``: ``damping``, ``decay`` (of K-FAC), ``every``, ``margin`` (of the placement)."""
    if optimizer != "kfac":
        raise PipeloomError(f"optimizer={optimizer!r}: the pipeline runs 'kfac' (PipeFisher) or none")
    base, options = context.schedule, dict(options or {})
    unknown = sorted(set(options) - {"damping", "decay", "every", "margin"})
    if unknown:
        raise PipeloomError(f"kfac option {unknown[0]!r}; options: damping, decay, every, margin")
    work = KfacWork(context, **{k: options[k] for k in ("damping", "decay") if k in options})
    counts: list = [None] * context.mesh.layout.pp
    dist.all_gather_object(counts, {s: len(u) for s, u in work.units.items()}, group=context.mesh.pp_group)
    units = {s: n for part in counts for s, n in part.items()}  # 0 where a stage has no layer (redis's ends)
    transform = Kfac([units[s] for s in range(base.stages)], options.get("every"), options.get("margin", 0.05))
    schedule = validate(transform.apply(base, costs))
    work.calls = schedule.options["kfac"]["every"]
    return work, schedule, split_cycle(lower(schedule).ranks[context.mesh.pp_rank], base.microbatches, base.steps)


def split_cycle(actions, microbatches: int, steps: int) -> list[list]:
    """One rank's list of a K-FAC cycle cut into its calls, each renumbered as a call of
    ``steps`` steps of ``microbatches``. A piece goes with the call of the next compute action
    (a send or receive, which lowering may post a call early, does not count); the pieces keep
    their capture's numbers."""
    per_call = microbatches * steps
    calls: list[list] = [[]]
    waiting: list = []
    for action in actions:
        if action.kind in PIECES:
            waiting.append(action)
            continue
        if action.kind == KFAC_PRE:
            call, action = action.microbatch // steps, action._replace(microbatch=action.microbatch % steps)
        else:
            call = action.microbatch // per_call
            action = shifted(action, -call * per_call)
        while len(calls) <= call:
            calls.append([])
        if get(action.kind).drawn:
            calls[call] += waiting
            waiting = []
        calls[call].append(action)
    calls[-1] += waiting
    return calls


def preconditioned(actions) -> dict[int, list[tuple[int, int]]]:
    """After which action each stage's gradient of each step is final: its KFAC_PRE
    (the form of :func:`pipeloom.runtime.grads.finals`)."""
    plan: dict[int, list[tuple[int, int]]] = {}
    for k, action in enumerate(actions):
        if action.kind == KFAC_PRE:
            plan.setdefault(k, []).append((action.stage, action.microbatch))
    return plan


class KfacPart(Part):
    """PipeFisher in a pipeline: ``optimizer="kfac"`` (``kfac``: its options; ``costs``, a build
    option too, places the pieces) makes the rank's K-FAC cycle (:func:`kfac_cycle`), whose
    gradients are final once preconditioned; :attr:`kfac` is its state."""

    keywords = {"optimizer": None, "kfac": None}
    exposes = ("kfac",)
    #: the K-FAC state of PipeFisher (``optimizer="kfac"``), else None
    kfac = None

    def __init__(self, options: dict):
        super().__init__(options)
        self.costs = options.get("costs")

    def check(self) -> None:
        if self.given["kfac"] is not None and self.given["optimizer"] != "kfac":
            raise PipeloomError(f"kfac={self.given['kfac']!r}: K-FAC's options go with optimizer='kfac'")
        if self.given["kfac"] is not None and not isinstance(self.given["kfac"], dict):
            raise PipeloomError(f"kfac={self.given['kfac']!r}: give K-FAC's options as a dict (damping, decay, "
                                "every, margin)")

    def check_schedule(self, schedule) -> None:
        if schedule.options.get("kfac"):
            raise PipeloomError("the schedule holds K-FAC pieces: give it without them and optimizer='kfac', which "
                                "places them for the model's stages")

    def calls(self, pipe, calls: list) -> tuple:
        if self.given["optimizer"] is None:
            return pipe.schedule, calls
        work, schedule, calls = kfac_cycle(pipe.context, self.given["optimizer"], self.given["kfac"], self.costs)
        self.kfac, self.base = work.kfac, pipe.context.schedule
        return schedule, calls

    def in_cycle(self, action, call: int):
        if self.kfac is None or action.kind in PIECES:  # the pieces keep their numbers in every call
            return action
        base = self.base  # one call's schedule
        if action.kind == KFAC_PRE:
            return action._replace(microbatch=action.microbatch + call * base.steps)
        return shifted(action, call * base.microbatches * base.steps)

    def finals(self, actions) -> dict | None:
        return preconditioned(actions) if self.kfac is not None else None


def _around(action, context):
    work = context.extras.get(NAME)
    return work.around(action) if work is not None else None


for _kind in (F, B, BW):
    around(_kind, _around)
for _kind in PIECES:
    register(_kind, lambda action, context: context.extras[NAME].piece(action))
register(KFAC_PRE, lambda action, context: context.extras[NAME].precondition(action))
