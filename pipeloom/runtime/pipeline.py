"""The pipeline: interprets one rank's action list of any valid schedule on torch.distributed."""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from ..errors import PipeloomError
from ..nn.gpt import SequenceParallel, set_sequence_parallel
from ..nn.linear import WeightGradStore, defer_weight_grads
from ..nn.ring_attention import sequence_layout
from ..schedule import BW, B, F, W, Action, Schedule, build, validate
from ..schedule.transforms.vocab import VOCAB_KINDS
from ..schedule.links import Message, link_messages, sent_message
from .clock import StepClock
from .device import pipeline_device
from .p2p import Channel
from .versions import WeightVersions
from .vocab import VocabPasses


@dataclass
class _Slot:
    """What one (stage, microbatch) keeps between its passes."""

    input: torch.Tensor | None = None
    output: torch.Tensor | None = None  # the stage output, or the loss on the last stage
    grad: torch.Tensor | None = None  # gradient of the output, once known
    weights: WeightGradStore | None = None


@dataclass
class TimedAction:
    """One executed action: seconds from the start of the step."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass
class _Step:
    rank: int
    clock: StepClock
    slots: dict = field(default_factory=dict)
    marks: list = field(default_factory=list)  # (action, start mark, end mark) of each action run
    loss: torch.Tensor | None = None  # the sum of each step's microbatch losses / microbatches

    @property
    def wall_start(self) -> float:
        return self.clock.wall_start

    @functools.cached_property
    def timeline(self) -> list[TimedAction]:
        """The actions run, in seconds from the start of the step (read once the step is over)."""
        seconds = self.clock.seconds
        return [TimedAction(self.rank, action, seconds(start), seconds(end)) for action, start, end in self.marks]


class Pipeline:
    """Pipeline-parallel training of a model that can ``split`` itself into stages.

    Call inside a torchrun job (``torch.distributed`` initialised, world size
    ``dp * pp * sp``, a DeviceMesh with dims ``dp``, ``pp``, ``sp``); build the
    same ``model`` on every rank (same seed). Each rank
    keeps only its own stages (the other stages' weights are released); a
    model described on the meta device (``GPT(config, device="meta")``) has
    only those stages materialised, with the weights it would have had.
    ``step(tokens, targets)`` runs one step's forward and backward on the
    global batch and returns its mean loss.

    ``schedule``: a family name (built with ``chunks`` and ``schedule_options``,
    e.g. ``costs`` and ``memory_limit`` for zb-auto) or any valid
    :class:`~pipeloom.schedule.Schedule`. ``recompute``: True, or the stages
    whose activations are recomputed in their backward. ``autocast``: a dtype
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
    the schedule's vocabulary passes (:mod:`pipeloom.runtime.vocab`); "redis"
    and "none" keep them on the first and last stage (give ``layers_per_stage``,
    e.g. from :func:`pipeloom.sim.model.balanced_layers`, for the redis baseline).
    ``sp``: sequence parallelism; each stage runs on ``sp`` ranks that each hold
    a balanced share of every sequence (an early and a late chunk), attention
    running over them with ``attention`` ("ring", the default, or "rsa",
    :mod:`pipeloom.nn.ring_attention`); gradients are summed over them and
    averaged over the ``dp`` replicas in one all-reduce. With ``sp=1``,
    ``attention`` runs that algorithm on one rank instead of torch's
    ``scaled_dot_product_attention`` (to compare them). ``device``: where the
    stages run; by default the backend's (a GPU for NCCL, ``LOCAL_RANK``'s;
    the CPU for gloo), see :mod:`pipeloom.runtime.device`.
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
        recompute: bool | Iterable[int] = False,
        autocast: torch.dtype | None = None,
        timeout: float = 300.0,
        vocab_parallel: str | None = None,
        sp: int = 1,
        attention: str | None = None,
        device: str | torch.device | None = None,
        **schedule_options,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise PipeloomError("Pipeline needs torch.distributed initialised: launch with torchrun")
        if isinstance(schedule, Schedule):
            self.schedule = validate(schedule)
            pp = pp or schedule.pp
            if (pp, microbatches or schedule.microbatches) != (schedule.pp, schedule.microbatches):
                raise PipeloomError(
                    f"the schedule is for pp={schedule.pp}, microbatches={schedule.microbatches}; "
                    f"got pp={pp}, microbatches={microbatches}"
                )
        else:
            if pp is None or microbatches is None:
                raise PipeloomError("give pp and microbatches with a schedule name")
            if vocab_parallel is not None:
                schedule_options["vocab_parallel"] = vocab_parallel
            self.schedule = build(schedule, pp, microbatches, chunks, **schedule_options)
        algorithm = self.schedule.vocab_parallel  # None also for "redis" and "none": plain stages
        world = dist.get_world_size()
        if world != dp * pp * sp:
            raise PipeloomError(
                f"world size {world} does not match dp={dp} x pp={pp} x sp={sp} = {dp * pp * sp}; "
                f"launch {dp * pp * sp} processes or choose dp, pp and sp whose product is {world}"
            )
        if attention not in (None, "ring", "rsa"):
            raise PipeloomError(f"attention={attention!r}: choose ring or rsa")
        if attention is None and sp > 1:
            attention = "ring"
        if self.schedule.vocab_parallel and (self.schedule.steps > 1 or self.schedule.weight_versions > 1):
            raise PipeloomError(f"vocabulary parallelism runs with synchronous schedules, not {self.schedule.family}")
        if sp > 1 and self.schedule.vocab_parallel:
            raise PipeloomError("vocabulary parallelism with sequence parallelism (sp > 1) is not supported yet")
        self.dp, self.pp, self.sp, self.attention = dp, pp, sp, attention
        self.device = pipeline_device(device, dist.get_backend())
        self.mesh = init_device_mesh(self.device.type, (dp, pp, sp), mesh_dim_names=("dp", "pp", "sp"))
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank, self.sp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("sp")
        self.pp_group, self.sp_group = self.mesh.get_group("pp"), self.mesh.get_group("sp")
        #: every pipeline (a row of global ranks by pipeline rank), one per (dp, sp) replica; this rank's row
        self.pipelines = self.mesh.mesh.transpose(1, 2).reshape(-1, pp).tolist()
        self.line = self.dp_rank * sp + self.sp_rank
        self.replicas = dp * sp
        self.rank = dist.get_rank()
        self.replica_group = self._replica_group()
        self.peers = [dist.get_global_rank(self.pp_group, q) for q in range(pp)]
        self.dtype = next(model.parameters()).dtype  # hidden states travel in the weights' dtype
        mine = self.schedule.stages_of(self.pp_rank)
        self.stages = model.build_stages(self.schedule.stages, mine, layers_per_stage, algorithm is not None,
                                         self.device)
        self.names = {id(p): self.stages[s].param_names[n] for s in mine for n, p in self.stages[s].named_parameters()}
        self.tied = [p for s in mine for n, p in self.stages[s].named_parameters() if n in self.stages[s].tied]
        # a tied copy (the last stage's LM head) counts once in the gradient norm, as in the unsplit model
        self.copies = {id(p) for s in mine for n, p in self.stages[s].named_parameters()
                       if self.stages[s].param_names[n] != n}
        self.tied_group = self._embedding_group(model.has_tied_copies(self.schedule.stages, algorithm is not None))
        self.recompute = set(mine) if recompute is True else set(recompute or ())
        self.autocast = autocast
        self.actions = self.schedule.ranks[self.pp_rank]
        links = link_messages(self.schedule)
        self.channel = Channel(self.rank, self._link_groups(links), timeout)
        self.channel.open(self.device)
        self._posts = self._receive_plan(links)
        multi_step = self.schedule.steps > 1 or self.schedule.weight_versions > 1
        self.vocab = VocabPasses(self, model, algorithm) if algorithm else None
        self._params = [p for stage in self.stages.values() for p in stage.parameters()] + (
            self.vocab.parameters() if self.vocab else [])
        _free_unused(model, self._params)
        self.versions = WeightVersions(self.stages, self.schedule.weight_versions) if multi_step else None
        self._update_after = self._update_plan() if multi_step else {}
        self._reduce_after = self._data_parallel_plan() if self.replicas > 1 and not multi_step else {}
        self._layouts: dict[int, object] = {}  # sequence-parallel layout by sequence length
        self.last_step: _Step | None = None
        self._empty_w: set[int] = set()  # stages whose B deferred nothing (warned once)
        self.steps_done = 0  # steps run so far by run_steps (multi-version schedules)
        self._hidden = getattr(getattr(model, "config", None), "n_embd", None)
        self.channel.heartbeat.idle()  # set up: a peer that waits for this rank now sees it outside a step

    # -- the public surface ---------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of its own stages, and its vocabulary shards), for an optimizer."""
        return list(self._params)

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
        try:
            return self._execute(tokens, targets, None)[0]
        finally:
            self.channel.heartbeat.idle()

    def run_steps(self, tokens: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer) -> list[float]:
        """The schedule's ``steps`` training steps without a flush between them
        (PipeDream-2BW): ``tokens``/``targets`` hold that many global batches one
        after another. Each stage applies ``optimizer`` (built on :meth:`parameters`)
        as soon as it has finished a step's gradient, with the delayed update of
        :mod:`pipeloom.runtime.versions`; versions carry over to the next call.
        Returns each step's mean loss."""
        if not self.versions:
            raise PipeloomError(f"{self.schedule.family} is synchronous: use step() and optimizer_step()")
        try:
            return self._execute(tokens, targets, optimizer)
        finally:
            self.channel.heartbeat.idle()

    def _execute(self, tokens, targets, optimizer) -> list[float]:
        """Run this rank's actions on the batches; the mean loss of each step."""
        micro_tokens, micro_targets = self._microbatches(tokens, targets)
        clock = StepClock(self.device)
        step = _Step(self.pp_rank, clock, loss=torch.zeros(self.schedule.steps, device=self.device))
        reductions = []
        for k, action in enumerate(self.actions):
            for src, message in self._posts.get(k, ()):
                self._post_receive(src, message, micro_tokens)
            self._receive_input(action, step)  # waiting for a peer is not the action's time
            self.channel.heartbeat.running(action)  # for peers that wait for this rank meanwhile
            start = clock.mark()
            self._run(action, step, micro_tokens, micro_targets)
            step.marks.append((action, start, clock.mark()))
            for p in self._reduce_after.get(k, ()):  # this stage's gradients are final: average them now
                if p.grad is not None:
                    reductions.append((p, dist.all_reduce(p.grad, group=self.replica_group, async_op=True)))
            for s, t in self._update_after.get(k, ()):
                self.versions.update(s, t + self.steps_done, optimizer, partial(self._reduce_now, s))
        self.channel.flush()
        if not self.versions:
            self._sum_tied()
            self._finish_data_parallel(reductions)
        self.steps_done += self.schedule.steps if self.versions else 0
        self.last_step = step
        loss = step.loss
        self._all_reduce(loss, self.pp_group, "the end of the step waited for the loss of the last stage, "
                                              f"on rank {self.peers[self.schedule.placement[-1]]}")
        self._all_reduce(loss, self.replica_group, "the end of the step waited for the other replicas' loss")
        return (loss / self.dp).tolist()

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient of the unsplit model by parameter name, on every rank (CPU tensors)."""
        own = {
            self.names[id(p)]: p.grad.detach().cpu().clone()
            for stage in self.stages.values() for p in stage.parameters() if p.grad is not None
        }
        parts: list = [None] * self.pp
        dist.all_gather_object(parts, own, group=self.pp_group)
        grads = {name: grad for part in parts for name, grad in part.items()}
        return {**grads, **self.vocab.gather_grads()} if self.vocab else grads

    @staticmethod
    def slot(step: _Step, stage: int, microbatch: int) -> _Slot:
        """What (stage, microbatch) keeps between its passes in ``step``."""
        return step.slots.setdefault((stage, microbatch), _Slot())

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None) -> float | None:
        """Clip by the global gradient norm (over all stages) if ``max_norm``, step
        ``optimizer``, zero the gradients. Returns the norm before clipping, or None
        without ``max_norm`` (no norm is computed: no reduction, no host sync). A
        non-finite norm skips the step and raises :class:`PipeloomError`."""
        norm = None
        if max_norm is not None:
            with_grad = [p for p in self._params if p.grad is not None]
            own = [p.grad for p in with_grad if id(p) not in self.copies]
            square = nn.utils.get_total_norm(own, foreach=True).float().square() if own \
                else torch.zeros((), device=self.device)
            self._all_reduce(square, self.pp_group, "the optimizer step waited for the gradient norm of the other stages")
            total = square.sqrt()
            norm = total.item()
            if not math.isfinite(norm):
                self.zero_grad()
                raise PipeloomError(f"the gradient norm is {norm}; the optimizer step was skipped")
            nn.utils.clip_grads_with_norm_(with_grad, max_norm, total, foreach=True)
        optimizer.step()
        self.zero_grad()
        return norm

    def autocasting(self) -> torch.autocast:
        """The mixed-precision region of the stages' forwards and the LM head's S passes
        (disabled without ``autocast``)."""
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    # -- one action -----------------------------------------------------------
    def _run(self, action: Action, step: _Step, tokens, targets) -> None:
        kind, s, i = action.kind, action.stage, action.microbatch
        if self.vocab and kind in VOCAB_KINDS:
            self.vocab.run(action, step, tokens, targets)
            return
        slot = self.slot(step, s, i)
        if kind == F:
            self._forward(action, step, slot, tokens, targets)
        elif kind in (B, BW):
            self._backward(action, step, slot)
        elif kind == W:
            slot.weights.run()
            del step.slots[(s, i)]
        else:
            raise PipeloomError(f"rank {self.rank}: the runtime cannot run action {action} of kind {kind!r}")

    def _forward(self, action: Action, step: _Step, slot: _Slot, tokens, targets) -> None:
        s, i = action.stage, action.microbatch
        if s == 0 and not self.vocab:
            slot.input = tokens[i]
        else:  # received, or the token embeddings summed by the vocabulary passes
            slot.input.requires_grad_()
        x = slot.input
        stage = self.versions.module(s, self.steps_done + i // self.schedule.microbatches) if self.versions \
            else self.stages[s]
        last = s == self.schedule.stages - 1
        with self.autocasting():
            y = checkpoint(stage, x, use_reentrant=False) if s in self.recompute else stage(x)
            if last and not self.vocab:
                # as the unsplit model: under autocast, log-softmax reads the low-precision logits
                # and computes in fp32 (no fp32 copy of them); without it, in fp32 at least
                logits = y.flatten(0, 1) if self.autocast else y.flatten(0, 1).float()
                # the mean over the step's tokens: this rank holds 1/sp of each sequence
                loss = nn.functional.cross_entropy(logits, targets[i].flatten()) / (
                    self.schedule.microbatches * self.sp)
        if last and self.vocab:
            slot.output = y.to(self.dtype)
            self.vocab.share_output(i, slot.output.detach())  # for every rank's S
        elif last:
            step.loss[i // self.schedule.microbatches] += loss.detach()
            slot.output = loss
        else:
            slot.output = y.to(self.dtype)
            self._deliver(action, slot.output.detach(), step)

    def _backward(self, action: Action, step: _Step, slot: _Slot) -> None:
        s, i = action.stage, action.microbatch
        # B queues the linear layers' weight gradients for W; BW accumulates each at once, in one GEMM
        slot.weights = WeightGradStore(eager=action.kind == BW)
        with defer_weight_grads(slot.weights):
            torch.autograd.backward(slot.output, slot.grad)
        if action.kind == B and not slot.weights.work and s not in self._empty_w:
            self._empty_w.add(s)
            warnings.warn(f"rank {self.rank}: B of stage {s} deferred no weight gradient: its W actions do no work "
                          f"(the stage has no pipeloom.nn.Linear layers, or the B/W split failed)", stacklevel=2)
        if s > 0:
            self._deliver(action, slot.input.grad, step)
        elif self.vocab:
            self.vocab.share_input_grad(i, slot.input.grad)  # for every rank's IB
        slot.input = slot.output = slot.grad = None
        if action.kind == BW:
            del step.slots[(s, i)]

    # -- data movement --------------------------------------------------------
    def _deliver(self, action: Action, tensor: torch.Tensor, step: _Step) -> None:
        """Hand the output (F) or input gradient (B, BW) of ``action`` to the stage
        that needs it: in memory on this rank, else a send."""
        sent = sent_message(self.schedule, action)
        if sent:
            self.channel.send(tensor, self.peers[sent[0]])
            return
        s, i = action.stage, action.microbatch
        if action.kind == F:
            self.slot(step, s + 1, i).input = tensor.detach()
        else:
            self.slot(step, s - 1, i).grad = tensor

    def _receive_input(self, action: Action, step: _Step) -> None:
        """Wait for the input ``action`` needs from another rank, if any, and keep it in its slot."""
        s, i = action.stage, action.microbatch
        if self.vocab and action.kind == F and s == 0:
            self.slot(step, s, i).input = self.vocab.stage_input(i, action)
        elif self.vocab and action.kind in (B, BW) and s == self.schedule.stages - 1:
            slot = self.slot(step, s, i)
            slot.grad = self.vocab.grad_input(i, action, slot.output)
        need = self._remote_input(action)
        if need:
            slot = self.slot(step, action.stage, action.microbatch)
            data = self.channel.recv(need[1], action)
            if action.kind == F:
                slot.input = data
            else:
                slot.grad = data

    def _link_groups(self, links) -> dict[tuple[int, int], dist.ProcessGroup]:
        """A process group for each direction of each link (global ranks), so every backend
        matches a link's messages in send order. Every rank creates every group in one
        order (:meth:`Channel.open` then opens this rank's in that order)."""
        groups = {}
        for line in self.pipelines:
            for src, dst in links:
                ranks = [line[q] for q in (src, dst)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    groups[tuple(ranks)] = group
        return groups

    def _receive_plan(self, links) -> dict[int, list[tuple[int, Message]]]:
        """Which receives (source rank, message) to post before each action (by index).
        The receive an action needs is posted when the action needing the one before it
        starts (the first before action 0), so it is in flight while that action runs;
        with it go the messages its link sends earlier and this rank needs later."""
        incoming = {src: messages for (src, dst), messages in links.items() if dst == self.pp_rank}
        position = {(src, m): k for src, messages in incoming.items() for k, m in enumerate(messages)}
        posted = dict.fromkeys(incoming, 0)  # per link: how many messages are posted
        plan: dict[int, list[tuple[int, Message]]] = {}
        point = 0
        for k, action in enumerate(self.actions):
            need = self._remote_input(action)
            if need is None:
                continue
            src, message = need
            upto = position[need] + 1
            if upto > posted[src]:
                plan.setdefault(point, []).extend((src, m) for m in incoming[src][posted[src]:upto])
                posted[src] = upto
            point = k
        return plan

    def _remote_input(self, action: Action) -> tuple[int, Message] | None:
        """(source rank, message) of the input ``action`` receives from another rank, if any."""
        s, i, placement = action.stage, action.microbatch, self.schedule.placement
        if action.kind == F and s > 0 and placement[s - 1] != self.pp_rank:
            return placement[s - 1], Message("activation", s - 1, i)
        if action.kind in (B, BW) and s < self.schedule.stages - 1 and placement[s + 1] != self.pp_rank:
            return placement[s + 1], Message("gradient", s + 1, i)
        return None

    def _post_receive(self, src: int, message: Message, tokens) -> None:
        """Post the receive of ``message`` from pipeline rank ``src`` (hidden states
        [microbatch, time, hidden] either way)."""
        buffer = torch.empty((*tokens[message.microbatch].shape[:2], self._hidden), dtype=self.dtype, device=self.device)
        self.channel.post(buffer, self.peers[src], message)

    def _microbatches(self, tokens: torch.Tensor, targets: torch.Tensor):
        """This replica's microbatches of every step, in the schedule's numbering."""
        m, steps = self.schedule.microbatches, self.schedule.steps
        if tokens.shape != targets.shape:
            raise PipeloomError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} differ in shape")
        whole = steps * self.dp * m
        if tokens.shape[0] % whole:
            what = f"{steps} steps x " if steps > 1 else ""
            raise PipeloomError(
                f"a batch of {tokens.shape[0]} sequences does not divide into {what}dp={self.dp} x "
                f"microbatches={m}; use a multiple of {whole}"
            )
        # step t's rows of this replica: [(t * dp + dp_rank) * share, ... + share), as views (no index tensor)
        tokens, targets = (x.unflatten(0, (steps, self.dp, -1))[:, self.dp_rank].flatten(0, 1).to(self.device)
                           for x in (tokens, targets))
        if self.attention:  # this rank's share of every sequence
            layout = self._sequence_layout(tokens.shape[1])
            tokens, targets = layout.local(tokens, 1), layout.local(targets, 1)
        return tokens.chunk(steps * m), targets.chunk(steps * m)

    def _sequence_layout(self, seq_len: int):
        """The sequence-parallel layout of ``seq_len`` tokens (balanced for causal
        attention), set on this rank's stages when the length changes."""
        if seq_len not in self._layouts:
            self._layouts[seq_len] = sequence_layout(seq_len, self.sp, self.sp_rank, balanced=True)
        layout = self._layouts[seq_len]
        set_sequence_parallel(self.stages.values(), SequenceParallel(self.sp_group, layout, self.attention))
        return layout

    def _replica_group(self):
        """The ranks that hold this rank's stages: its data- and sequence-parallel replicas
        (their gradients are summed; the sequence-parallel ones each hold part of them)."""
        if self.sp == 1:
            return self.mesh.get_group("dp")
        mine = None
        for q in range(self.pp):  # every rank creates every group, in the same order
            ranks = [line[q] for line in self.pipelines]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _embedding_group(self, tied: bool):
        """The process group of the ranks holding tied weights (first and last
        stage, as Megatron's embedding group), or None if one rank holds both."""
        first, last = self.schedule.placement[0], self.schedule.placement[-1]
        if not tied or first == last:
            return None
        mine = None
        for line in self.pipelines:  # every rank creates every group, in the same order
            ranks = [line[q] for q in (first, last)]
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def _sum_tied(self) -> None:
        """Tied input/output embeddings: each copy gets the sum of both gradients."""
        if not self.tied:
            return
        if self.tied_group is None:
            total = sum(p.grad for p in self.tied if p.grad is not None)
            for p in self.tied:
                p.grad = total.clone()
        else:
            for p in self.tied:
                self._all_reduce(p.grad, self.tied_group, "summing the tied embedding's gradients")

    def _update_plan(self) -> dict[int, list[tuple[int, int]]]:
        """After which action (index) each stage has finished each step's gradient:
        (stage, step of this call) to update then."""
        last = {}
        for k, action in enumerate(self.actions):
            if action.kind in (B, W, BW):
                last[action.stage, action.microbatch // self.schedule.microbatches] = k
        plan: dict[int, list[tuple[int, int]]] = {}
        for (s, t), k in sorted(last.items()):
            plan.setdefault(k, []).append((s, t))
        return plan

    def _reduce_now(self, s: int, grads: dict[str, torch.Tensor]) -> None:
        """A multi-version update's reduction of stage ``s``'s gradients (by local name):
        tied copies summed across their ranks, then the average over replicas."""
        for name, grad in grads.items():
            if name in self.stages[s].tied and self.tied_group is not None:
                self._all_reduce(grad, self.tied_group, "summing the tied embedding's gradients")
            if self.replicas > 1:
                self._all_reduce(grad, self.replica_group, "averaging gradients over the data-parallel replicas")
                grad /= self.dp

    def _data_parallel_plan(self) -> dict[int, list[nn.Parameter]]:
        """After which action (index) to start averaging each stage's gradients over
        the data-parallel replicas: its last backward on this rank. Tied weights wait
        until the end, when both copies have been summed."""
        last = {}
        for k, action in enumerate(self.actions):
            if action.kind in (B, W, BW):
                last[action.stage] = k
        tied = {id(p) for p in self.tied}
        return {k: [p for p in self.stages[s].parameters() if p.requires_grad and id(p) not in tied]
                for s, k in last.items()}

    def _finish_data_parallel(self, reductions) -> None:
        """Wait for the overlapped averages, then average what was left (tied weights)."""
        if self.replicas == 1:
            return
        for p, work in reductions:
            self.channel.wait(work, "averaging gradients over the data-parallel replicas", self.replica_group)
            p.grad /= self.dp
        for p in self.tied + (self.vocab.parameters() if self.vocab else []):
            if p.grad is not None:
                self._all_reduce(p.grad, self.replica_group, "averaging gradients over the data-parallel replicas")
                p.grad /= self.dp

    def _all_reduce(self, tensor: torch.Tensor, group, what: str) -> None:
        """Sum ``tensor`` over ``group``; a dead or stalled peer raises a PeerTimeout saying ``what`` waited."""
        if dist.get_world_size(group) == 1:
            return
        self.channel.wait(dist.all_reduce(tensor, group=group, async_op=True), what, group)


def _free_unused(model: nn.Module, kept: list[nn.Parameter]) -> None:
    """Release the storage of ``model``'s weights that this rank does not run (those of
    the other stages, and the unsplit ones of its vocabulary shards); they stay as empty
    tensors. A model described on the meta device has none to release."""
    keep = {id(p) for p in kept}
    for p in model.parameters():
        if id(p) not in keep and not p.is_meta:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
