"""The pipeline: runs one rank's share of any valid schedule on torch.distributed.

A façade over the runtime's parts: :mod:`.mesh` (the layout and the process
groups), :mod:`.context` (what the handlers share), :mod:`.executor` and
:mod:`.handlers` (the actions), :mod:`.grads` (reduction, clipping, gathering),
and each technique's :class:`~.parts.Part`, whose hooks it calls in turn.
"""

from __future__ import annotations

import atexit
import functools
import gc
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PipeloomError
from ..nn.stages import Stages
from ..schedule import Schedule, build, forward_only, lower, validate
from ..schedule.lower import proofs as lower_proofs
from .batches import Batches
from .clock import StepClock
from .context import Context, Step
from .device import pipeline_device
from .executor import Executor
from .grads import Gradients, finals
from .mesh import Layout, Mesh
from .p2p import Channel
from .parts import Part, part_classes


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
    lowered to communication (:func:`pipeloom.schedule.lower`). ``autocast``: a dtype
    such as ``torch.bfloat16`` for mixed precision (weights, gradients and the
    hidden states sent between ranks stay in the weights' dtype). ``timeout``:
    seconds a receive or collective waits for a peer before it looks at the
    peer's heartbeat (:mod:`pipeloom.runtime.heartbeat`): a peer that died,
    hangs or stalls stops the step with a :class:`~pipeloom.runtime.PeerTimeout`
    naming the rank and action; one that is alive and busy is waited for, on
    gloo, up to the process group's own timeout (on NCCL the step stops: NCCL
    aborts the communicator of a wait that times out).
    ``sp``: each stage runs on ``sp`` ranks that each hold a share of every sequence;
    gradients are summed over them and averaged over the ``dp`` replicas in one
    all-reduce. ``layers_per_stage``: the model's layers per stage (default: the even split, or
    the technique's, e.g. ``vocab_parallel="redis"``'s). ``device``: where the
    stages run; by default the backend's (a GPU for NCCL, ``LOCAL_RANK``'s;
    the CPU for gloo), see :mod:`pipeloom.runtime.device`. ``loss_fn(logits, targets)``:
    the last stage's mean loss, by default the model's ``loss``.

    Each technique's part (:class:`~.parts.Part`, found through :mod:`pipeloom.techniques`) takes its
    own keywords and gives the pipeline its attributes; each built-in one says what they do:
    ``recompute`` (:class:`~.handlers.compute.RecomputePart`), ``vocab_parallel`` and ``pipe.vocab``
    (:class:`~.handlers.vocab.VocabPart`), ``attention`` (:class:`~.batches.SequencePart`), ``offload``,
    ``offload_ratio`` and ``offload_stats()`` (:class:`~.handlers.offload.OffloadPart`), ``optimizer``,
    ``kfac`` and ``pipe.kfac`` (:class:`~.handlers.kfac.KfacPart`); a schedule of several steps per call
    runs with ``pipe.versions`` by :meth:`run_steps` (:class:`~.versions.VersionsPart`).
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
        autocast: torch.dtype | None = None,
        timeout: float = 300.0,
        sp: int = 1,
        device: str | torch.device | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        **options,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise PipeloomError("Pipeline needs torch.distributed initialised: launch with torchrun")
        _check_arguments(schedule, autocast, timeout, loss_fn)
        _close_at_exit()
        #: each technique's part, in the techniques' order; what they leave of ``options`` builds the schedule
        self.parts: list[Part] = [cls(options) for cls in part_classes()]
        self.schedule = _schedule(schedule, pp, microbatches, chunks, self.parts, options)
        self.layout = Layout(dp, self.schedule.pp, sp).check(dist.get_world_size())
        self.dp, self.pp, self.sp = dp, self.schedule.pp, sp
        for part in self.parts:
            part.configure(self)
        loss_fn = loss_fn or getattr(model, "loss", None)
        if loss_fn is None and not any(part.computes_loss(self.schedule) for part in self.parts):
            raise PipeloomError(f"{type(model).__name__} has no loss(logits, targets) method: give loss_fn")
        self.device = pipeline_device(device, dist.get_backend())
        self.mesh = Mesh(self.layout, self.device, self.schedule,
                         [name for part in self.parts for name in part.groups(self.schedule)])
        self.rank, self.pp_rank, self.pp_group = self.mesh.rank, self.mesh.pp_rank, self.mesh.pp_group
        dtype = next(model.parameters()).dtype  # hidden states travel in the weights' dtype
        if layers_per_stage is None:
            layers_per_stage = next((counts for part in self.parts
                                     if (counts := part.layers(model, self.schedule)) is not None), None)
        self.stages = model.build_stages(self.schedule.stages, self.schedule.stages_of(self.pp_rank),
                                         layers_per_stage, device=self.device,
                                         **_merged(part.stage_options(self.schedule) for part in self.parts))
        self.channel = Channel(self.rank, self.mesh.links, timeout)
        self.channel.open(self.device)
        self.context = Context(
            self.schedule, self.mesh, self.stages, self.channel, self.device, dtype, autocast, loss_fn=loss_fn,
            boundary=model.boundary_shape if isinstance(model, Stages) else _hidden_states(model),
            **_merged(part.context_options(self) for part in self.parts))
        for part in self.parts:
            part.setup(self, model)
        self.grads = Gradients(self.context)
        _free_unused(model, self.grads.params)
        self.names = self.grads.names
        self._batches = Batches(self.schedule, self.mesh, self.device, [part.batch for part in self.parts],
                                any_input=isinstance(model, Stages))
        lowered = lower(self.schedule)
        calls = [lowered.ranks[self.pp_rank]]
        for part in self.parts:
            self.schedule, calls = part.calls(self, calls)
        # the lowered lists run as they are: a send is let go once its peer's messages prove it received
        proofs = lower_proofs(lowered, self.pp_rank) if calls == [lowered.ranks[self.pp_rank]] else None
        self._calls = [_Call(self.context, self.grads, actions, self.parts, proofs) for actions in calls]
        self.last_step: Step | None = None
        #: whether each step reads the memory held after each action (:attr:`~.context.Step.levels`)
        self.record_memory = False
        #: the steps of the calls of the last whole cycle (the schedule's calls run in turn), once one has run
        self.last_cycle: list[Step] | None = None
        self._cycle_so_far: list[Step] = []
        self._evaluation: Executor | None = None  # the forward-only list, made on the first evaluate()
        self.channel.heartbeat.idle()  # set up: a peer that waits for this rank now sees it outside a step
        _OPEN.add(self)

    def __getattr__(self, name: str):
        """What a technique's part gives as the pipeline's (its :attr:`~.parts.Part.exposes`)."""
        if self.__dict__.get("closed"):
            raise PipeloomError(f"the pipeline is closed (asked for {name!r}): make a new one")
        for part in self.__dict__.get("parts", ()):
            if name in part.exposes:
                return getattr(part, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Let go now, while Python is whole, of what the pipeline holds of torch.distributed: its
        process subgroups, their gloo work and the tensors that work holds; it cannot run again.
        Python closes every pipeline still open when it exits: freed while it shuts down instead, a
        gloo thread's release of a tensor takes the GIL and aborts the finished process
        ("terminate called without an active exception"). Call it before
        ``destroy_process_group`` where a script goes on after it."""
        _OPEN.discard(self)
        self.__dict__.clear()
        self.__dict__["closed"] = True
        gc.collect()

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
        (``autocast``, ``device``, ``timeout``, schedule options, the techniques'), except those
        that reach into pipeloom's GPT, refused in one line each (``layers_per_stage``, and
        each part's :attr:`~.parts.Part.not_for_stages`)."""
        for part in part_classes():
            part.refuse_for_stages(schedule, options)
        if options.get("layers_per_stage") is not None:
            raise PipeloomError(f"layers_per_stage={options['layers_per_stage']!r} with your own stages: your stages "
                                "come cut; leave it out")
        model = stages if isinstance(stages, Stages) else Stages(stages)
        if chunks is None and isinstance(schedule, str) and pp and len(model) % pp == 0:
            chunks = len(model) // pp
        return cls(model, schedule, pp, microbatches, dp, chunks, loss_fn=loss_fn, **options)

    @property
    def cycle(self) -> int:
        """Calls in the schedule's cycle: 1, or a K-FAC refresh's (:meth:`in_cycle` numbers their actions)."""
        return len(self._calls)

    def in_cycle(self, action, call: int):
        """``action`` as call ``call`` of the cycle ran it, numbered as :attr:`schedule` numbers it."""
        for part in self.parts:
            action = part.in_cycle(action, call)
        return action

    @property
    def steps_done(self) -> int:
        """Steps run so far by :meth:`run_steps`."""
        return self.context.steps_done

    @steps_done.setter
    def steps_done(self, value: int) -> None:
        self.context.steps_done = value

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of its own stages, and those a technique holds beside them), for an optimizer."""
        return list(self.grads.params)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name in the unsplit model, parameter) of this rank's stages (not those a technique
        holds beside them); a tied copy held beside its original appears under the same name."""
        return [(self.names[id(p)], p) for stage in self.stages.values() for p in stage.parameters()]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step's forward and backward on the global batch
        ``tokens``/``targets`` (the same tensors on every rank); returns the
        step's mean loss on every rank. Gradients accumulate in ``.grad``."""
        return self._execute(tokens, targets, None)[0]

    def run_steps(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer) -> list[float]:
        """The schedule's ``steps`` training steps without a flush between them
        (PipeDream-2BW): ``tokens``/``targets`` hold that many global batches one
        after another. Each stage applies ``optimizer`` (built on :meth:`parameters`)
        as soon as it has finished a step's gradient, with the delayed update of
        :mod:`pipeloom.runtime.versions`; versions carry over to the next call.
        Returns each step's mean loss."""
        return self._execute(tokens, targets, optimizer)

    def _execute(self, tokens, targets, optimizer) -> list[float]:
        """Run this rank's actions on the batches, after each action the calls of a part that
        applies the updates with ``optimizer`` (:meth:`~.parts.Part.updates`), or else the call's
        gradient averaging; the mean loss of each step."""
        index = self.context.calls % len(self._calls)
        call = self._calls[index]
        updates = [after for part in self.parts if (after := part.updates(self, call.finals, optimizer)) is not None]
        try:
            clock = StepClock(self.device, self.record_memory)
            step = Step(self.pp_rank, clock, *self._batches.split(tokens, targets),
                        loss=torch.zeros(self.context.schedule.steps, device=self.device))
            self.channel.proofs = call.proofs
            call.executor.run(step, updates[0] if updates else call.averaging)
            self.context.calls += 1
            self.channel.flush()
            if updates:
                self.steps_done += self.context.schedule.steps
            else:
                self.grads.finish()
            self.last_step = step
            self._cycle_so_far = [*self._cycle_so_far[:index], step]
            if index == len(self._calls) - 1:
                self.last_cycle = self._cycle_so_far
            return self._mean_losses(step)
        finally:
            self.channel.proofs = None
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
        :func:`~pipeloom.schedule.forward_only` order (with a technique's passes up to the
        loss), under ``torch.no_grad``, with the newest weights (of a schedule with several:
        the stages' parameters, which the next step's version copies), without the
        wrappers techniques put around F. No gradient is
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
        (the others get an empty dict): those a technique holds outside the stages whole
        (:meth:`~.parts.Part.weights`); the newest weights. Every rank calls it."""
        own: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            if name not in own:  # a tied copy beside its original holds the same values
                own[name] = p.detach().cpu().clone()
        full = _merged(part.weights() for part in self.parts)
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


class _Call:
    """One call's actions (a part may cut the schedule into several), its executor, when each
    stage's gradient is final (:func:`~.grads.finals`, unless a part says) and the averaging then."""

    def __init__(self, context: Context, grads: Gradients, actions, parts: list[Part], proofs=None):
        self.executor, self.grads, self.replicas = Executor(context, actions), grads, context.mesh.layout.replicas
        self.proofs = proofs  # :func:`~pipeloom.schedule.lower.proofs` of ``actions``, where they are the lowered list
        told = [final for part in parts if (final := part.finals(actions)) is not None]
        self.finals = told[0] if told else finals(actions, context.schedule.microbatches)

    @functools.cached_property
    def averaging(self) -> dict[int, list]:
        """The calls that start averaging each stage's gradients over the replicas, if any (a synchronous call's)."""
        return self.grads.averaging(self.finals) if self.replicas > 1 else {}


def _check_arguments(schedule, autocast, timeout, loss_fn) -> None:
    """Refuse, in one line each, arguments of the wrong type or range (before anything is built)."""
    if not isinstance(schedule, (str, Schedule)):
        raise PipeloomError(f"schedule={schedule!r}: give a family name (e.g. '1f1b') or a pipeloom.schedule.Schedule")
    if autocast is not None and not isinstance(autocast, torch.dtype):
        raise PipeloomError(f"autocast={autocast!r}: give a torch dtype such as torch.bfloat16, or None")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise PipeloomError(f"timeout={timeout!r}: give the seconds a wait for a peer may take, a number > 0")
    if loss_fn is not None and not callable(loss_fn):
        raise PipeloomError(f"loss_fn={loss_fn!r}: give a function of (logits, targets), or None for the model's loss")


def _schedule(schedule, pp, microbatches, chunks, parts: list[Part], options) -> Schedule:
    """The validated schedule: ``schedule`` itself if one is given, else the family it names, built
    with ``options`` and what the ``parts`` add."""
    for part in parts:
        part.check()
    if isinstance(schedule, Schedule):
        for part in parts:
            part.check_schedule(schedule)
        if (pp or schedule.pp, microbatches or schedule.microbatches) != (schedule.pp, schedule.microbatches):
            raise PipeloomError(f"the schedule is for pp={schedule.pp}, microbatches={schedule.microbatches}; "
                                f"got pp={pp}, microbatches={microbatches}")
        return validate(schedule)
    if pp is None or microbatches is None:
        raise PipeloomError("give pp and microbatches with a schedule name")
    for part in parts:
        part.build(options)
    return build(schedule, pp, microbatches, chunks, **options)


def _merged(dicts) -> dict:
    """The union of ``dicts``."""
    return {key: value for d in dicts for key, value in d.items()}


def _hidden_states(model: nn.Module):
    """``boundary(k, x)`` (:class:`~.context.Context`) of pipeloom's GPT: hidden states [microbatch, time, n_embd]."""
    hidden = getattr(getattr(model, "config", None), "n_embd", None)
    return lambda k, x: (*x.shape[:2], hidden)


def _free_unused(model: nn.Module, kept: list[nn.Parameter]) -> None:
    """Release the storage of ``model``'s weights that this rank does not run (those of
    the other stages, and the unsplit ones a technique holds in shards); they stay as empty
    tensors. A model described on the meta device has none to release."""
    keep = {id(p) for p in kept}
    for p in model.parameters():
        if id(p) not in keep and not p.is_meta:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


#: The pipelines of this process not closed yet (:meth:`Pipeline.close`).
_OPEN: weakref.WeakSet = weakref.WeakSet()


@functools.cache
def _close_at_exit() -> None:
    """Close the pipelines still open when the interpreter exits (once a pipeline exists)."""
    atexit.register(_close_open)


def _close_open() -> None:
    for pipe in list(_OPEN):
        pipe.close()
