"""The vocabulary passes of a pipeline (Vocabulary Parallelism), on one rank.

Every pipeline rank holds a shard of the token embedding and of the LM head
(:mod:`pipeloom.nn.vocab`) and runs, per microbatch, the passes the schedule
places on it (their dependencies are in :mod:`pipeloom.schedule.deps`):

- ``IF``: this shard's lookups, summed (reduce) into stage 0's input;
- ``S``: the head's S pass on the last stage's output (broadcast from its rank
  as soon as that stage's forward ends), under the pipeline's autocast: it
  sets the dtype of the head's products, in S and in T;
- ``C``: the global max and sum from every rank's S (gathered as soon as each
  S ends), so the loss; with vocab-2 the parts of ∇X, also ready at the end of
  S, are gathered into the last stage's rank, which finishes ∇X there;
- ``Z``, ``CZ`` (naive): the exponentials and their sum over ranks;
- ``T``: ∇W of this shard, and with naive and vocab-1 its part of ∇X;
- ``R``: nothing here: the last stage's backward waits for ∇X itself;
- ``IB``: this shard's embedding gradient, from stage 0's input gradient
  (broadcast from its rank as soon as that stage's backward ends).

So each rank gives to a collective as soon as its part is ready and waits
only where it needs the result, as the simulator assumes. Each collective has
a process group of its own (the replica's pipeline ranks), so only the order
of microbatches within one must agree between ranks, which the constructor
checks. Waits use the pipeline's timeout and say which action waited.

With sequence parallelism a rank's passes run on its own share of the tokens,
and the groups are its pipeline's ranks, which share its sp (and dp) index,
so the shards' statistics are reduced over the vocabulary, never over the
sequence; S divides the loss by the tokens of the whole sequences, and the
shards' gradients are summed over the sequence-parallel ranks with the
stages'. With weight versions (2bw), the shards are one more versioned module
(:data:`SHARDS`): every pass runs with the weights of its microbatch's step,
and their gradient of a step is applied once the rank's last T and IB of it
end (:func:`~pipeloom.runtime.grads.finals`), as a stage's.

In a forward-only call (evaluation: IF, S, C and naive's Z and CZ) the passes
keep nothing for a backward: no embedding partials, no vocab-2 ∇X parts; a
microbatch's head state goes as soon as its loss is known.

The compute handlers meet the passes through the context's
:class:`~pipeloom.runtime.context.Ends`, which :class:`VocabPasses` sets:
stage 0's F takes the summed embeddings as its input, the last stage's F
shares its output instead of computing the loss, that stage's backward takes
the gradient of its output from the head, and stage 0's backward shares its
input gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...errors import PipeloomError
from ...nn.models import model_spec
from ...nn.vocab import VocabParallelEmbedding, VocabParallelLMHead
from ...partition import balanced_layers
from ...schedule.ir import BW, B, F, Action, Schedule
from ...schedule.transforms.vocab import IB, IF, VOCAB_KINDS, C, S, T, Z
from ..context import Context, Ends
from ..parts import Part
from . import register

#: The collectives, each on a group of its own over the replica's pipeline ranks
#: (:attr:`~pipeloom.runtime.mesh.Mesh.line_groups`): which action kind issues each
#: (see :meth:`VocabPasses._check_order`).
GROUPS = ("sum-embeddings", "share-output", "gather-stats", "sum-exp", "sum-grad-input", "gather-grad-input",
          "share-input-grad")
#: The key of the vocabulary shards among the weight versions and the gradients' finals.
SHARDS = "vocab"
#: The vocabulary passes' key in ``Context.extras``.
NAME = "vocab"
#: The passes that add to the shards' gradient.
GRADIENT_PASSES = (T, IB)


class _Shards(nn.Module):
    """A rank's vocabulary shards as one module, for weight versions: ``forward(run, action)``
    runs pass ``action`` with them. ``param_names``: the unsplit name of each parameter (a tied
    head's is ``wte.weight``); ``tied``: none across ranks."""

    tied = ()

    def __init__(self, embedding: nn.Module, head: nn.Module, names: dict[int, str]):
        super().__init__()
        self.wte, self.lm_head = embedding, head
        self.param_names = {n: names[id(p)] for n, p in self.named_parameters(remove_duplicate=False)}

    def forward(self, run, action):
        return run(action)


class VocabPasses:
    """One rank's shards of a model's ``wte`` and ``lm_head`` and its vocabulary passes;
    kept in ``context.extras[NAME]``, they set ``context.ends``."""

    def __init__(self, context: Context, model: nn.Module, algorithm: str):
        self.context = context
        mesh = context.mesh
        self.groups = {name: mesh.line_groups[name] for name in GROUPS}
        config = model.config
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.n_embd, group=self.groups["sum-embeddings"])
        rows = (self.embedding.shard.start, self.embedding.shard.end)  # only this shard's rows are read
        self.embedding.load_shard(model.parameter_value("wte.weight", rows=rows))
        tied = config.tie_embeddings
        self.head = VocabParallelLMHead(config.vocab_size, config.n_embd, group=self.groups["gather-stats"],
                                        algorithm=algorithm, weight=self.embedding.weight if tied else None)
        if not tied:
            self.head.load_shard(model.parameter_value("lm_head.weight", rows=rows))
        self.embedding.to(context.device)
        self.head.to(context.device)
        self.names = {id(self.embedding.weight): "wte.weight"}
        if not tied:
            self.names[id(self.head.weight)] = "lm_head.weight"
        if context.versions:
            context.versions.add(SHARDS, _Shards(self.embedding, self.head, self.names))
        schedule = context.schedule
        self.rank, self.pp = mesh.rank, mesh.layout.pp
        self.first, self.last = mesh.peers[schedule.placement[0]], mesh.peers[schedule.placement[-1]]
        self.partials: dict[int, torch.Tensor] = {}  # IF -> IB
        self.states: dict = {}  # S -> T (and vocab-2, on the last stage's rank, S -> its backward)
        self.stats: dict[int, torch.Tensor] = {}  # vocab-2, on the last stage's rank: C -> its backward
        self.incoming: dict[tuple[str, int], tuple] = {}  # (collective, microbatch) -> (work, result) to wait for
        self.own: dict[tuple[str, int], torch.Tensor] = {}  # what this rank broadcast: it needs no wait
        self._check_order()
        context.ends = Ends(input=self.stage_input, output=self.share_output, output_grad=self.grad_input,
                            input_grad=self.share_input_grad)
        context.extras[NAME] = self

    def _check_order(self) -> None:
        """Every collective must meet its microbatches in one order on every rank: the
        order in which each rank issues it (microbatch order, as the families build)."""
        schedule = self.context.schedule
        issuers = {IF: None, S: None, C: None, Z: None, T: None, IB: None, F: schedule.stages - 1, B: 0, BW: 0}
        for rank, actions in enumerate(schedule.ranks):
            for kind, stage in issuers.items():
                order = [a.microbatch for a in actions if a.kind == kind and stage in (None, a.stage)]
                if order != sorted(order):
                    raise PipeloomError(
                        f"rank {rank} runs the {kind} passes of microbatches {order}: the vocabulary-parallel "
                        f"runtime needs each collective's microbatches in increasing order on every rank")

    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys([self.embedding.weight, self.head.weight]))

    # -- the input layer ----------------------------------------------------------
    def _if(self, action) -> None:
        i = action.microbatch
        partial = self.embedding.partial(self.context.step.tokens[i])
        if self.context.step.training:
            self.partials[i] = partial
        self._give("sum-embeddings", i, partial.detach().clone(), self.first, dist.reduce)

    def stage_input(self, action: Action) -> torch.Tensor:
        """Stage 0's input for its F ``action``: the summed token embeddings (on its rank)."""
        return self._wait("sum-embeddings", action.microbatch, action,
                          "the sum of the token embeddings").to(self.context.dtype)

    def share_input_grad(self, action: Action, grad: torch.Tensor) -> None:
        """Stage 0's input gradient from its backward ``action`` (on its rank), for every rank's ``IB``."""
        self.own["share-input-grad", action.microbatch] = grad
        self._give("share-input-grad", action.microbatch, grad, self.first, dist.broadcast)

    def _ib(self, action) -> None:
        i = action.microbatch
        partial = self.partials.pop(i)
        if self.rank == self.first:
            grad = self.own.pop(("share-input-grad", i))
        else:
            grad = self._receive("share-input-grad", i, torch.empty_like(partial, dtype=self.context.dtype),
                                 self.first, action, "the gradient of the token embeddings")
        torch.autograd.backward(partial, grad.to(partial.dtype))

    # -- the output layer ---------------------------------------------------------
    def share_output(self, action: Action, y: torch.Tensor) -> None:
        """The last stage's output from its F ``action`` (on its rank), for every rank's ``S``."""
        self.own["share-output", action.microbatch] = y
        self._give("share-output", action.microbatch, y, self.last, dist.broadcast)

    def _s(self, action) -> None:
        i, context = action.microbatch, self.context
        tokens, targets = context.step.tokens, context.step.targets
        if self.rank == self.last:
            x = self.own.pop(("share-output", i))
        else:
            buffer = torch.empty((*tokens[i].shape, self.head.n_embd), dtype=context.dtype, device=context.device)
            x = self._receive("share-output", i, buffer, self.last, action, "the last stage's output")
        # the mean over the replica's batch: this rank holds 1/sp of each sequence
        denominator = targets[i].numel() * context.schedule.microbatches * context.mesh.layout.sp
        with context.autocasting():  # the head's products in the autocast dtype, T's as well
            self.states[i] = state = self.head.s_pass(x, targets[i], denominator)
        if self.head.algorithm == "vocab-2" and context.step.training:  # ∇X's parts: to the last stage's rank
            parts = self.head.grad_input_parts(state)
            into = [torch.empty_like(parts) for _ in range(self.pp)] if self.rank == self.last else None
            work = dist.gather(parts, into, dst=self.last, group=self.groups["gather-grad-input"], async_op=True)
            if into is None:
                context.channel.send_work(work, parts, self.groups["gather-grad-input"])
            else:
                self.incoming["gather-grad-input", i] = (work, into)
                self.states["last", i] = state  # its row weights and shape, for the backward
        stats = self.head.row_stats(state)
        every = [torch.empty_like(stats) for _ in range(self.pp)]
        work = dist.all_gather(every, stats, group=self.groups["gather-stats"], async_op=True)
        self.incoming["gather-stats", i] = (work, every)

    def _c(self, action) -> None:
        i = action.microbatch
        state = self.states[i]
        stats = torch.stack(self._wait("gather-stats", i, action, "every rank's softmax maxima and sums"))
        self.head.combine(state, stats)
        if state.loss is not None:
            self._count_loss(i, state.loss)
        if not self.context.step.training:
            if state.loss is not None:  # naive finds its loss in CZ
                del self.states[i]
        elif self.head.algorithm == "vocab-2" and self.rank == self.last:
            self.stats[i] = stats

    def _z(self, action) -> None:
        i = action.microbatch
        sums = self.head.row_sums(self.states[i])
        work = dist.all_reduce(sums, group=self.groups["sum-exp"], async_op=True)
        self.incoming["sum-exp", i] = (work, sums)

    def _cz(self, action) -> None:
        i = action.microbatch
        state = self.states[i]
        self.head.combine_sums(state, self._wait("sum-exp", i, action, "every rank's softmax sums"))
        self._count_loss(i, state.loss)
        if not self.context.step.training:
            del self.states[i]

    def _t(self, action) -> None:
        state = self.states.pop(action.microbatch)
        self.head.t_pass(state)
        if state.grad_input_partial is not None:  # naive, vocab-1
            self._give("sum-grad-input", action.microbatch, state.grad_input_partial, self.last, dist.reduce)

    def _r(self, action) -> None:
        """R: the sum of ∇X was started by every rank's T; the last stage's backward waits for it."""

    def grad_input(self, action: Action, like: torch.Tensor) -> torch.Tensor:
        """∇ of the last stage's output ``like`` for its backward ``action`` (on its rank), from every shard."""
        i = action.microbatch
        if self.head.algorithm == "vocab-2":
            parts = self._wait("gather-grad-input", i, action, "every rank's part of the LM head's input gradient")
            grad = self.head.grad_input_from(self.states.pop(("last", i)), self.stats.pop(i), torch.stack(parts))
        else:
            grad = self._wait("sum-grad-input", i, action, "the LM head's gradient of its input")
        return grad.to(like.dtype).reshape(like.shape)

    def _count_loss(self, i: int, loss: torch.Tensor) -> None:
        if self.rank == self.last:  # the pipeline sums the loss over its ranks: count it once
            self.context.step.loss[i // self.context.schedule.microbatches] += loss

    # -- giving, receiving, waiting -------------------------------------------------
    def _give(self, group: str, i: int, tensor: torch.Tensor, root: int, collective) -> None:
        """Start ``collective`` (``dist.reduce`` into, or ``dist.broadcast`` from, global rank
        ``root``) of ``tensor`` for microbatch ``i``. The root of a reduce waits for it where it
        needs the result; every other giver treats it as a send, waited for at the end of the step."""
        key = "dst" if collective is dist.reduce else "src"
        work = collective(tensor, **{key: root}, group=self.groups[group], async_op=True)
        if collective is dist.reduce and self.rank == root:
            self.incoming[group, i] = (work, tensor)
        else:
            self.context.channel.send_work(work, tensor, self.groups[group])

    def _receive(self, group: str, i: int, buffer: torch.Tensor, src: int, action: Action, what: str) -> torch.Tensor:
        """Receive a broadcast from global rank ``src`` into ``buffer``."""
        self.incoming[group, i] = (dist.broadcast(buffer, src=src, group=self.groups[group], async_op=True), buffer)
        return self._wait(group, i, action, what)

    def _wait(self, group: str, i: int, action: Action, what: str):
        work, result = self.incoming.pop((group, i))
        self.context.channel.wait(work, f"action {action} waited for {what} over the pipeline ranks",
                                  self.groups[group])
        return result

    # -- whole tensors by the unsplit model's names ---------------------------------
    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """(unsplit name, this rank's shard): ``wte.weight`` and an untied ``lm_head.weight``."""
        return [(self.names[id(p)], p) for p in self.parameters()]

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """The unsplit [vocab_size, ...] tensor whose rows the pipeline ranks hold as ``shard``
        (a weight, its gradient or its optimizer state); every pipeline rank calls this."""
        parts = [torch.empty_like(shard) for _ in range(self.pp)]
        dist.all_gather(parts, shard.contiguous(), group=self.context.mesh.pp_group)
        return torch.cat(parts)[: self.embedding.shard.vocab_size]

    @torch.no_grad()
    def load_rows(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """Copy this rank's rows of the unsplit ``full`` into ``shard`` (padding rows zero)."""
        rows = self.embedding.shard
        shard[: rows.real_rows].copy_(full[rows.start:rows.end])
        shard[rows.real_rows:].zero_()

    def gather_grads(self) -> dict[str, torch.Tensor]:
        """The full gradients of the shards by unsplit name (every pipeline rank calls this)."""
        return {name: self.full(p.grad if p.grad is not None else torch.zeros_like(p)).cpu()
                for name, p in self.named_shards()}


class VocabPart(Part):
    """Vocabulary parallelism in a pipeline: ``vocab_parallel`` builds a family with its passes;
    where the schedule has them, the model's stages are built without the vocabulary layers and
    :attr:`vocab` holds the rank's shards and passes, which compute the loss."""

    keywords = {"vocab_parallel": None}
    exposes = ("vocab",)
    not_for_stages = (("vocab_parallel", lambda v: v not in (None, "none"), "the vocabulary passes shard "
                       "pipeloom's GPT embedding and LM head; your stages hold their own"),)
    #: the rank's :class:`VocabPasses`, where the schedule has vocabulary passes, else None
    vocab = None

    @classmethod
    def refuse_for_stages(cls, schedule, options: dict) -> None:
        given = {**options, "vocab_parallel": schedule.vocab_parallel} if isinstance(schedule, Schedule) else options
        super().refuse_for_stages(schedule, given)

    def build(self, options: dict) -> None:
        if self.given["vocab_parallel"] is not None:
            options["vocab_parallel"] = self.given["vocab_parallel"]

    def computes_loss(self, schedule) -> bool:
        return schedule.vocab_parallel is not None  # None also for "redis" and "none": plain stages

    def groups(self, schedule) -> tuple[str, ...]:
        return GROUPS if self.computes_loss(schedule) else ()

    def layers(self, model, schedule) -> tuple[int, ...] | None:
        """redis: the layers moved off the stages that hold the vocabulary layers
        (:func:`~pipeloom.partition.balanced_layers`, for sequences of the model's ``block_size``;
        ``pipeloom train`` gives the split for its ``--seq``)."""
        if schedule.options.get("vocab_parallel") != "redis":
            return None
        return balanced_layers(model_spec(model.config), schedule.stages, model.config.block_size)

    def stage_options(self, schedule) -> dict:
        return {"vocab_parallel": self.computes_loss(schedule)}

    def setup(self, pipe, model) -> None:
        if self.computes_loss(pipe.schedule):
            self.vocab = VocabPasses(pipe.context, model, pipe.schedule.vocab_parallel)

    def weights(self) -> dict:
        if self.vocab is None:
            return {}
        return {name: self.vocab.full(shard.detach()).cpu().clone() for name, shard in self.vocab.named_shards()}


def _pass(action: Action, context: Context) -> None:
    """Run vocabulary pass ``action`` for its microbatch (with the weights of its step, under versions)."""
    run = getattr(context.extras[NAME], "_" + action.kind.lower())
    versioned = context.versioned(SHARDS, action.microbatch)
    if versioned:
        versioned(run, action)
    else:
        run(action)


for _kind in VOCAB_KINDS:
    register(_kind, _pass)
