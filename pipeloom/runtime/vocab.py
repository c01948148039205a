"""The vocabulary passes of a pipeline (Vocabulary Parallelism), on one rank.

Every pipeline rank holds a shard of the token embedding and of the LM head
(:mod:`pipeloom.nn.vocab`) and runs, per microbatch, the passes the schedule
places on it:

- ``IF``: this shard's lookups, summed (reduce) into stage 0's input;
- ``IB``: stage 0's input gradient, broadcast from its rank, into this
  shard's embedding gradient;
- ``S``: the last stage's output, broadcast from its rank, into the head's S pass;
- ``C``: the algorithm's collective step (with vocab-2 it yields ∇X; with
  naive it also does the sum that the schedule places in ``Z`` and ``CZ``,
  which are then empty here);
- ``T``: the head's T pass (∇W; with naive and vocab-1 also this shard's ∇X);
- ``R``: naive and vocab-1: ∇X summed into the last stage's rank.

Each kind of pass talks on a process group of its own (the replica's pipeline
ranks), so only the order of microbatches within a kind must agree between
ranks. A rank that only gives to a broadcast or a reduce does not wait for it
(as a send, it is waited for at the end of the step); a rank that needs the
result waits, and a dead or stalled peer stops the wait with the pipeline's
timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..nn.vocab import VocabParallelEmbedding, VocabParallelLMHead
from ..schedule.ir import Action

_COLLECTIVE_KINDS = ("IF", "IB", "S", "C", "R")


class VocabPasses:
    """One rank's shards of a model's ``wte`` and ``lm_head`` and its vocabulary passes."""

    def __init__(self, pipe, model: nn.Module, algorithm: str):
        self.pipe = pipe
        self.groups = self._groups()
        config = model.config
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.n_embd, group=self.groups["IF"])
        self.embedding.load_full(model.wte.weight)
        tied = config.tie_embeddings
        self.head = VocabParallelLMHead(config.vocab_size, config.n_embd, group=self.groups["C"], algorithm=algorithm,
                                        weight=self.embedding.weight if tied else None, reduce_group=self.groups["R"])
        if not tied:
            self.head.load_full(model.lm_head.weight)
        self.embedding.to(pipe.device)
        self.head.to(pipe.device)
        self.names = {id(self.embedding.weight): "wte.weight"}
        if not tied:
            self.names[id(self.head.weight)] = "lm_head.weight"
        first, last = pipe.schedule.placement[0], pipe.schedule.placement[-1]
        self.first, self.last = pipe.peers[first], pipe.peers[last]
        self.partials: dict[int, torch.Tensor] = {}
        self.input_grads: dict[int, torch.Tensor] = {}
        self.states: dict = {}

    def _groups(self) -> dict[str, dist.ProcessGroup]:
        """A process group per collective kind over this replica's pipeline ranks (every
        rank creates every replica's groups, in one order)."""
        pipe, mine = self.pipe, {}
        for replica in range(pipe.dp):
            ranks = [int(r) for r in pipe.mesh.mesh[replica]]
            for kind in _COLLECTIVE_KINDS:
                group = dist.new_group(ranks)
                if replica == pipe.dp_rank:
                    mine[kind] = group
        return mine

    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys([self.embedding.weight, self.head.weight]))

    def run(self, action: Action, step, tokens, targets) -> None:
        """Run vocabulary pass ``action`` for its microbatch."""
        getattr(self, "_" + action.kind.lower())(action, step, tokens, targets)

    # -- the input layer ----------------------------------------------------------
    def _if(self, action, step, tokens, targets) -> None:
        i = action.microbatch
        partial = self.embedding.partial(tokens[i])
        self.partials[i] = partial
        total = partial.detach().clone()
        if self._reduce(total, self.first, "IF", action, "the sum of the token embeddings"):
            self.pipe.slot(step, 0, i).input = total.to(self.pipe.dtype)

    def _ib(self, action, step, tokens, targets) -> None:
        i = action.microbatch
        partial = self.partials.pop(i)
        grad = self.input_grads.pop(i) if self.pipe.rank == self.first else torch.empty_like(partial)
        self._broadcast(grad, self.first, "IB", action, "the gradient of the token embeddings")
        torch.autograd.backward(partial, grad.to(partial.dtype))

    # -- the output layer ---------------------------------------------------------
    def _s(self, action, step, tokens, targets) -> None:
        i, last_stage = action.microbatch, self.pipe.schedule.stages - 1
        if self.pipe.rank == self.last:
            x = step.slots[(last_stage, i)].output.detach()
        else:
            x = torch.empty((*tokens[i].shape, self.head.n_embd), dtype=self.pipe.dtype, device=self.pipe.device)
        self._broadcast(x, self.last, "S", action, "the last stage's output")
        denominator = targets[i].numel() * self.pipe.schedule.microbatches  # the mean over the replica's batch
        self.states[i] = self.head.s_pass(x, targets[i], denominator)

    def _c(self, action, step, tokens, targets) -> None:
        i = action.microbatch
        state = self.states[i]
        loss = self.head.collective(state)
        if self.pipe.rank == self.last:
            step.loss[i // self.pipe.schedule.microbatches] += loss.detach()
            if state.grad_input is not None:
                self._give_last_stage(step, i, state.grad_input)

    def _z(self, action, step, tokens, targets) -> None:
        """naive's exponentials and sums: done in ``C`` (see the module docstring)."""

    _cz = _z

    def _t(self, action, step, tokens, targets) -> None:
        i = action.microbatch
        self.head.t_pass(self.states[i])
        if self.head.algorithm == "vocab-2":
            del self.states[i]

    def _r(self, action, step, tokens, targets) -> None:
        state = self.states.pop(action.microbatch)
        grad = state.grad_input_partial
        if self._reduce(grad, self.last, "R", action, "the sum of the input gradient of the LM head"):
            self._give_last_stage(step, action.microbatch, grad.to(state.input_dtype).reshape(state.input_shape))

    def _give_last_stage(self, step, i: int, grad: torch.Tensor) -> None:
        self.pipe.slot(step, self.pipe.schedule.stages - 1, i).grad = grad

    def _broadcast(self, tensor: torch.Tensor, src: int, kind: str, action: Action, what: str) -> None:
        """Broadcast ``tensor`` from global rank ``src``; the receivers wait for it."""
        work = dist.broadcast(tensor, src=src, group=self.groups[kind], async_op=True)
        self._settle(work, self.pipe.rank != src, action, what, tensor)

    def _reduce(self, tensor: torch.Tensor, dst: int, kind: str, action: Action, what: str) -> bool:
        """Sum ``tensor`` into global rank ``dst``, which waits for it; True there."""
        work = dist.reduce(tensor, dst=dst, group=self.groups[kind], async_op=True)
        self._settle(work, self.pipe.rank == dst, action, what, tensor)
        return self.pipe.rank == dst

    def _settle(self, work, needed: bool, action: Action, what: str, tensor: torch.Tensor) -> None:
        """Wait for ``work`` if this rank needs its result; else treat it as a send, waited
        for at the end of the step (``tensor`` must live until then)."""
        if needed:
            self.pipe.channel.wait(work, f"action {action} waited for {what} over the pipeline ranks")
        else:
            self.pipe.channel.send_work(work, tensor)

    # -- whole tensors by the unsplit model's names ---------------------------------
    def named_shards(self) -> list[tuple[str, nn.Parameter]]:
        """(unsplit name, this rank's shard): ``wte.weight`` and an untied ``lm_head.weight``."""
        return [(self.names[id(p)], p) for p in self.parameters()]

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """The unsplit [vocab_size, ...] tensor whose rows the pipeline ranks hold as ``shard``
        (a weight, its gradient or its optimizer state); every pipeline rank calls this."""
        parts = [torch.empty_like(shard) for _ in range(self.pipe.pp)]
        dist.all_gather(parts, shard.contiguous(), group=self.pipe.pp_group)
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
