"""The pipeline: runs one rank's share of any valid schedule on torch.distributed.

A façade over the runtime's parts: :mod:`.mesh` (the layout and the process
groups), :mod:`.context` (what the handlers share), :mod:`.executor` and
:mod:`.handlers` (the actions), :mod:`.grads` (reduction, clipping, gathering).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PipeloomError
from ..modes import Attention
from ..nn.stages import Stages
from ..schedule import Offload, Schedule, build, forward_only, lower, validate
from .batches import Batches
from .clock import StepClock
from .context import Context, Step
from .device import pipeline_device
from .executor import Executor
from .grads import Gradients, finals
from .handlers.compute import recomputed
from .handlers.kfac import kfac_cycle, preconditioned
from .handlers.offload import Offloader
from .handlers.vocab import GROUPS, VocabPasses
from .mesh import Layout, Mesh
from .p2p import Channel
from .versions import WeightVersions


class Pipeline:
    """Pipeline-parallel training of a model that can ``split`` itself into stages, or of your
    own stage modules (:meth:`from_stages`).

    Call inside a torchrun job (``torch.distributed`` initialised, world size
    ``dp * pp * sp``; the DeviceMesh has dims ``dp``, ``pp``, ``sp``); build the
    same ``model`` on every rank (same seed). Each rank
    keeps only its own stages (the other stages' weights are released).
    ``step(tokens, targets)`` runs one step's forward and backward on the
    global batch and returns its mean loss; ``evaluate(tokens, targets)`` its
    forward only (the schedule's :func:`~pipeloom.schedule.forward_only`), for a
    validation loss; ``gather_weights()`` gives the unsplit model's weights.

    ``schedule``: a family name (built with ``chunks`` and ``schedule_options``,
    e.g. ``costs`` and ``memory_limit`` for zb-auto) or any valid
    :class:`~pipeloom.schedule.Schedule`; each rank runs its list of the schedule
    lowered to communication (:func:`pipeloom.schedule.lower`). ``recompute``: True, or the stages
    whose activations are recomputed in their backward; "cheap" rebuilds only the
    norms' and GELU's outputs (:mod:`pipeloom.nn.recompute`). ``autocast``: a dtype
    such as ``torch.bfloat16`` for mixed precision (weights, gradients and the
    hidden states sent between ranks stay in the weights' dtype). ``timeout``:
    seconds a receive or collective waits for a peer before it looks at the
    peer's heartbeat (:mod:`pipeloom.runtime.heartbeat`): a peer that died,
    hangs or stalls stops the step with a :class:`~pipeloom.runtime.PeerTimeout`
    naming the rank and action; one that is alive and busy is waited for, on
    gloo, up to the process group's own timeout (on NCCL the step stops: NCCL
    aborts the communicator of a wait that times out).
    ``vocab_parallel``: "naive", "vocab-1" or "vocab-2" splits the token
    embedding and the LM head by vocabulary over the pipeline ranks and runs
    the schedule's vocabulary passes (:mod:`pipeloom.runtime.handlers.vocab`); "redis"
    and "none" keep them on the first and last stage (give ``layers_per_stage``,
    e.g. from :func:`pipeloom.partition.balanced_layers`, for the redis baseline).
    ``sp``: sequence parallelism; each stage runs on ``sp`` ranks that each hold
    a balanced share of every sequence (an early and a late chunk), attention
    running over them with ``attention`` ("ring", the default, or "rsa",
    :mod:`pipeloom.nn.ring_attention`); gradients are summed over them and
    averaged over the ``dp`` replicas in one all-reduce. With ``sp=1``,
    ``attention`` runs that algorithm on one rank instead of torch's
    ``scaled_dot_product_attention`` (to compare them). ``device``: where the
    stages run; by default the backend's (a GPU for NCCL, ``LOCAL_RANK``'s;
    the CPU for gloo), see :mod:`pipeloom.runtime.device`. ``loss_fn(logits, targets)``:
    the last stage's mean loss, by default the model's ``loss``.
    ``offload``: "none", "full" or "selective" (``offload_ratio`` in (0, 1]) builds
    the schedule with :class:`~pipeloom.schedule.Offload` (a given schedule runs its
    own copies; :mod:`pipeloom.runtime.handlers.offload`); :meth:`offload_stats` counts.
    ``optimizer="kfac"``: PipeFisher; K-FAC's work runs in the bubbles (the schedule
    through :class:`~pipeloom.schedule.Kfac`, placed with ``costs`` if given; ``kfac``:
    ``damping``, ``decay``, ``every``, ``margin``) and each step's gradients come out
    preconditioned (:attr:`kfac`; :mod:`pipeloom.runtime.handlers.kfac`): step your own
    optimizer on them.
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: str | Schedule = "1f1b",
        pp: int | None = None,
        microbatches: int | None = None,
        dp: int = 1,
        chunks: int | None = None,
        *,
        layers_per_stage=None,
        recompute: bool | str | Iterable[int] = False,
        autocast: torch.dtype | None = None,
        timeout: float = 300.0,
        vocab_parallel: str | None = None,
        sp: int = 1,
        attention: str | None = None,
        device: str | torch.device | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        offload: str | None = None,
        offload_ratio: float | None = None,
        optimizer: str | None = None,
        kfac: dict | None = None,
        **schedule_options,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise PipeloomError("Pipeline needs torch.distributed initialised: launch with torchrun")
        self.schedule = _schedule(schedule, pp, microbatches, chunks, vocab_parallel, (offload, offload_ratio),
                                  schedule_options)
        self.layout = Layout(dp, self.schedule.pp, sp).check(dist.get_world_size())
        self.dp, self.pp, self.sp = dp, self.schedule.pp, sp
        self.attention = str(Attention.of(attention)) if attention is not None else "ring" if sp > 1 else None
        algorithm = self.schedule.vocab_parallel  # None also for "redis" and "none": plain stages
        loss_fn = loss_fn or getattr(model, "loss", None)
        if loss_fn is None and not algorithm:
            raise PipeloomError(f"{type(model).__name__} has no loss(logits, targets) method: give loss_fn")
        self.device = pipeline_device(device, dist.get_backend())
        self.mesh = Mesh(self.layout, self.device, self.schedule, GROUPS if algorithm else ())
        self.rank, self.pp_rank, self.pp_group = self.mesh.rank, self.mesh.pp_rank, self.mesh.pp_group
        dtype = next(model.parameters()).dtype  # hidden states travel in the weights' dtype
        self.stages = model.build_stages(self.schedule.stages, self.schedule.stages_of(self.pp_rank),
                                         layers_per_stage, algorithm is not None, self.device)
        self.channel = Channel(self.rank, self.mesh.links, timeout)
        self.channel.open(self.device)
        multi_step = self.schedule.steps > 1 or self.schedule.weight_versions > 1
        self.versions = WeightVersions(self.stages, self.schedule.weight_versions) if multi_step else None
        self.context = Context(
            self.schedule, self.mesh, self.stages, self.channel, self.device, dtype, autocast,
            recompute=recomputed(recompute, self.stages), loss_fn=loss_fn,
            boundary=model.boundary_shape if isinstance(model, Stages) else _hidden_states(model),
            versions=self.versions)
        self.vocab = VocabPasses(self.context, model, algorithm) if algorithm else None
        cheap = recompute == "cheap"
        counting = offload or cheap or self.schedule.options.get("offload")
        self.offloader = Offloader(self.context, cheap) if counting else None
        self.grads = Gradients(self.context, self.vocab)
        _free_unused(model, self.grads.params)
        self.names = self.grads.names
        self._batches = Batches(self.schedule, self.mesh, self.stages, self.device, self.attention,
                                any_input=isinstance(model, Stages))
        calls = [lower(self.schedule).ranks[self.pp_rank]]
        #: the K-FAC state of PipeFisher (``optimizer="kfac"``), else None
        self.kfac = None
        if optimizer is not None:
            work, self.schedule, calls = kfac_cycle(self.context, optimizer, kfac, schedule_options.get("costs"))
            self.kfac = work.kfac
        averaged = self.layout.replicas > 1 and not multi_step
        self._calls = [_Call(self.context, self.grads, actions, averaged, self.kfac is not None) for actions in calls]
        self.last_step: Step | None = None
        self._evaluation: Executor | None = None  # the forward-only list, made on the first evaluate()
        self.channel.heartbeat.idle()  # set up: a peer that waits for this rank now sees it outside a step

    @classmethod
    def from_stages(cls, stages: Sequence[nn.Module], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    schedule: str | Schedule = "1f1b", pp: int | None = None, microbatches: int | None = None,
                    dp: int = 1, chunks: int | None = None, **options) -> Pipeline:
        """A pipeline of your own stage modules, ``stages[k]`` being stage ``k`` of the schedule
        (``pp * chunks`` of them; ``chunks`` by default ``len(stages) // pp``), as torch's
        ``PipelineStage`` takes a stage and its schedule a ``loss_fn``. Stage 0 takes the step's
        input (``tokens``: token ids or any tensor), each next stage the one floating-point tensor
        the previous returns, the last returns what ``loss_fn(output, targets)`` takes, the mean
        loss of a microbatch. Every rank gives the whole list (built on the meta device, no rank
        holds the whole model; or materialised with the same seed); each keeps and materialises
        only its own (:mod:`pipeloom.nn.stages`). Parameters are named ``"<stage>.<name in the
        stage>"``, as ``nn.Sequential(*stages)`` names them. Plain ``nn.Linear`` layers defer
        their weight gradients to W; the rest come in B. ``options`` as for the constructor
        (``recompute``, ``autocast``, ``offload``, ``device``, ``timeout``, ``steps`` for 2bw,
        schedule options), except those that reach into pipeloom's GPT, refused in one line
        each (:data:`_NOT_FOR_STAGES`)."""
        given = {**options, "vocab_parallel": schedule.vocab_parallel} if isinstance(schedule, Schedule) else options
        for option, refused, why in _NOT_FOR_STAGES:
            if option in given and refused(given[option]):
                raise PipeloomError(f"{option}={given[option]!r} with your own stages: {why}")
        model = stages if isinstance(stages, Stages) else Stages(stages)
        if chunks is None and isinstance(schedule, str) and pp and len(model) % pp == 0:
            chunks = len(model) // pp
        return cls(model, schedule, pp, microbatches, dp, chunks, loss_fn=loss_fn, **options)

    @property
    def steps_done(self) -> int:
        """Steps run so far by :meth:`run_steps` (multi-version schedules)."""
        return self.context.steps_done

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self.context.steps_done = value

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of its own stages, and its vocabulary shards), for an optimizer."""
        return list(self.grads.params)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the unsplit model, parameter) of this rank's stages (not its
        vocabulary shards); a tied copy held beside its original appears under the same name."""
        return [(self.names[id(p)], p) for stage in self.stages.values() for p in stage.parameters()]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step's forward and backward on the global batch
        ``tokens``/``targets`` (the same tensors on every rank); returns the
        step's mean loss on every rank. Gradients accumulate in ``.grad``."""
        if self.versions:
            raise PipeloomError(
                f"{self.schedule.family} runs {self.schedule.steps} steps per call with "
                f"{self.schedule.weight_versions} weight versions: use run_steps(tokens, targets, optimizer)"
            )
        return self._execute(tokens, targets, None)[0]

    def run_steps(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer) -> list[float]:
        """The schedule's ``steps`` training steps without a flush between them
        (PipeDream-2BW): ``tokens``/``targets`` hold that many global batches one
        after another. Each stage applies ``optimizer`` (built on :meth:`parameters`)
        as soon as it has finished a step's gradient, with the delayed update of
        :mod:`pipeloom.runtime.versions`; versions carry over to the next call.
        Returns each step's mean loss."""
        if not self.versions:
            raise PipeloomError(f"{self.schedule.family} is synchronous: use step() and optimizer_step()")
        done = self.steps_done
        updates = {k: [partial(self.versions.update, s, done + t, optimizer, partial(self.grads.reduce_version, s))
                       for s, t in pairs] for k, pairs in self._calls[0].finals.items()}
        return self._execute(tokens, targets, updates)

    def _execute(self, tokens, targets, after) -> list[float]:
        """Run this rank's actions on the batches, with the calls ``after`` each action
        (by index; None: the call's gradient averaging); the mean loss of each step."""
        call = self._calls[self.context.calls % len(self._calls)]
        try:
            step = Step(self.pp_rank, StepClock(self.device), *self._batches.split(tokens, targets),
                        loss=torch.zeros(self.context.schedule.steps, device=self.device))
            call.executor.run(step, call.averaging if after is None else after)
            self.context.calls += 1
            self.channel.flush()
            if self.versions:
                self.steps_done += self.context.schedule.steps
            else:
                self.grads.finish()
            self.last_step = step
            return self._mean_losses(step)
        finally:
            self.channel.heartbeat.idle()

    def _mean_losses(self, step: Step) -> list[float]:
        """The mean loss of each step of a call, on every rank: the last stage's, over the replicas."""
        last = self.mesh.peers[self.schedule.placement[-1]]
        self.channel.all_reduce(step.loss, self.pp_group,
                                f"the end of the step waited for the loss of the last stage, on rank {last}")
        self.channel.all_reduce(step.loss, self.mesh.replica_group,
                                "the end of the step waited for the other replicas' loss")
        return (step.loss / self.dp).tolist()

    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The model's mean loss on one step's global batch ``tokens``/``targets`` (the same
        tensors on every rank), forward only: this rank's list of the schedule's
        :func:`~pipeloom.schedule.forward_only` order (with vocabulary parallelism its
        passes up to the loss), under ``torch.no_grad``, with the newest weights (2bw:
        the stages' parameters, which the next step's version copies), without the
        wrappers techniques put around F (offload, K-FAC's captures). No gradient is
        touched and nothing is kept; every rank calls it, between steps."""
        if self._evaluation is None:
            self._evaluation = Executor(self.context, lower(forward_only(self.context.schedule)).ranks[self.pp_rank],
                                        wrapped=False)
        try:
            step = Step(self.pp_rank, StepClock(self.device), *self._batches.split(tokens, targets, steps=1),
                        loss=torch.zeros(1, device=self.device), training=False)
            with torch.no_grad():
                self._evaluation.run(step, {})
            self.channel.flush()
            return self._mean_losses(step)[0]
        finally:
            self.channel.heartbeat.idle()

    def gather_weights(self, to: int | None = None) -> dict[str, torch.Tensor]:
        """Every weight of the unsplit model by its name there (``named_parameters``': a tied
        weight once) as CPU tensors, on every rank, or with ``to`` on that pipeline rank only
        (the others get an empty dict): the vocabulary shards gathered whole; with 2bw the
        newest weights. Every rank calls it."""
        own: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if name not in own:  # a tied copy beside its original holds the same values
                own[name] = p.detach().cpu().clone()
        full = {name: self.vocab.full(shard.detach()).cpu().clone() for name, shard in self.vocab.named_shards()} \
            if self.vocab else {}
        if to is None:
            parts: list | None = [None] * self.pp
            dist.all_gather_object(parts, own, group=self.pp_group)
        else:
            parts = [None] * self.pp if self.pp_rank == to else None
            dist.gather_object(own, parts, dst=self.mesh.peers[to], group=self.pp_group)
            if parts is None:
                return {}
        return {**{name: tensor for part in parts for name, tensor in part.items()}, **full}

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient of the unsplit model by parameter name, on every rank (CPU tensors)."""
        return self.grads.gather()

    def zero_grad(self) -> None:
        self.grads.zero()

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> float | None:
        """Clip by the global gradient norm (over all stages) if ``max_norm``, step
        ``optimizer``, zero the gradients. Returns the norm before clipping, or None
        without ``max_norm`` (no norm is computed: no reduction, no host sync). A
        non-finite norm skips the step and raises :class:`PipeloomError`."""
        norm = self.grads.clip(max_norm) if max_norm is not None else None
        optimizer.step()
        self.zero_grad()
        return norm

    def autocasting(self) -> torch.autocast:
        """The mixed-precision region of the stages' forwards and the LM head's S passes
        (disabled without ``autocast``)."""
        return self.context.autocasting()

    def offload_stats(self) -> dict[str, int]:
        """This rank's activation bytes on the device and the host, now and at their peaks since
        the step began (:class:`~pipeloom.runtime.handlers.offload.OffloadStats`)."""
        if self.offloader is None:
            raise PipeloomError("offload_stats() counts with Pipeline(..., offload='none'|'full'|'selective')")
        return dataclasses.asdict(self.offloader.stats)


class _Call:
    """One call's actions (a K-FAC cycle has several), its executor, when each stage's gradient
    is final (:func:`~.grads.finals`; with K-FAC after its preconditioning) and the averaging then."""

    def __init__(self, context: Context, grads: Gradients, actions, averaged: bool, kfac: bool):
        self.executor = Executor(context, actions)
        self.finals = preconditioned(actions) if kfac else finals(actions, context.schedule.microbatches)
        self.averaging = grads.averaging(self.finals) if averaged else {}


def _schedule(schedule, pp, microbatches, chunks, vocab_parallel, offload, options) -> Schedule:
    """The validated schedule: ``schedule`` itself if one is given, else the family it names, built
    (with ``offload``'s (policy, ratio) transform)."""
    policy, ratio = offload
    if policy is None and ratio is not None:
        raise PipeloomError(f"offload_ratio={ratio!r} goes with offload='selective'")
    if isinstance(schedule, Schedule):
        if schedule.options.get("kfac"):
            raise PipeloomError("the schedule holds K-FAC pieces: give it without them and optimizer='kfac', which "
                                "places them for the model's stages")
        if policy is not None:
            raise PipeloomError(f"offload={policy!r} goes with a family name: build a given Schedule with "
                                "transforms=[Offload(...)] instead")
        if (pp or schedule.pp, microbatches or schedule.microbatches) != (schedule.pp, schedule.microbatches):
            raise PipeloomError(f"the schedule is for pp={schedule.pp}, microbatches={schedule.microbatches}; "
                                f"got pp={pp}, microbatches={microbatches}")
        return validate(schedule)
    if pp is None or microbatches is None:
        raise PipeloomError("give pp and microbatches with a schedule name")
    if vocab_parallel is not None:
        options["vocab_parallel"] = vocab_parallel
    if policy is not None:
        options["transforms"] = [*options.get("transforms", ()), Offload(policy, ratio)]
    return build(schedule, pp, microbatches, chunks, **options)


#: What :meth:`Pipeline.from_stages` refuses: (option, whether a value is refused, why).
_NOT_FOR_STAGES = (
    ("vocab_parallel", lambda v: v not in (None, "none"),
     "the vocabulary passes shard pipeloom's GPT embedding and LM head; your stages hold their own"),
    ("sp", lambda v: v != 1, "sequence parallelism needs attention over the sp group and each token's "
     "global position, which pipeloom's GPT has and your stages do not; use sp=1"),
    ("attention", lambda v: v is not None, "it swaps the attention of pipeloom's GPT; leave it out"),
    ("optimizer", lambda v: v is not None, "K-FAC captures each linear layer's input in its forward, and "
     "torch's attention uses its projections without one (nn.MultiheadAttention); step your own optimizer"),
    ("recompute", lambda v: v == "cheap", "it rebuilds the norms and GELU that pipeloom's GPT marks; yours mark "
     "nothing: use recompute=True"),
    ("layers_per_stage", lambda v: v is not None, "your stages come cut; leave it out"),
)


def _hidden_states(model: nn.Module):
    """``boundary(k, x)`` (:class:`~.context.Context`) of pipeloom's GPT: hidden states [microbatch, time, n_embd]."""
    hidden = getattr(getattr(model, "config", None), "n_embd", None)
    return lambda k, x: (*x.shape[:2], hidden)


def _free_unused(model: nn.Module, kept: list[nn.Parameter]) -> None:
    """Release the storage of ``model``'s weights that this rank does not run (those of
    the other stages, and the unsplit ones of its vocabulary shards); they stay as empty
    tensors. A model described on the meta device has none to release."""
    keep = {id(p) for p in kept}
    for p in model.parameters():
        if id(p) not in keep and not p.is_meta:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
