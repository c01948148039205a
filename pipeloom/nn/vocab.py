"""Vocabulary parallelism: the input embedding and the LM head split by rows
of the vocabulary over a process group ("Balancing Pipeline Parallelism with
Vocabulary Parallelism").

Each of the group's n ranks holds a contiguous shard of ``ceil(V / n)`` weight
rows (:class:`VocabShard`); the last shards end in padding rows, which are
never predicted: they take part in no softmax, max or sum, and their
gradients stay zero. Each layer's passes are separate methods, so that a
pipeline runtime can put each where its schedule says and run the
collectives between them itself (:mod:`pipeloom.runtime.vocab`):

* :class:`VocabParallelEmbedding`: ``partial`` (this shard's lookups), whose
  sum over ranks is the embedding; backward: ``torch.autograd.backward(partial,
  grad)`` on every rank with the full embedding's gradient.
* :class:`VocabParallelLMHead`: softmax cross-entropy in the passes S, C (the
  collective step), T and R of the paper's algorithms ``naive``, ``vocab-1``
  and ``vocab-2``, each microbatch carried by an :class:`LMHeadState`; or all
  of them in one differentiable call with blocking collectives (``forward``).

Without an initialised torch.distributed both layers work as a single shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import PipeloomError
from ..modes import VOCAB_ALGORITHMS, VocabMode

#: The passes of the LM head's algorithms (:data:`~pipeloom.modes.VOCAB_ALGORITHMS`: the paper's
#: naive placement, Algorithm 1 and Algorithm 2).
_PASSES = {VocabMode.NAIVE: ("S", "C", "T", "R"), VocabMode.VOCAB_1: ("S", "C", "T", "R"),
           VocabMode.VOCAB_2: ("S", "C", "T")}


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PipeloomError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class VocabShard:
    """Shard ``index`` of a vocabulary of ``vocab_size`` rows split into ``parts``:
    ``rows = ceil(vocab_size / parts)`` weight rows, the real ones being the
    vocabulary ids ``[start, end)`` (possibly none), the rest padding up to
    ``padded_size = rows * parts`` ids over all shards."""

    vocab_size: int
    parts: int
    index: int
    rows: int = field(init=False)
    start: int = field(init=False)
    end: int = field(init=False)
    padded_size: int = field(init=False)

    def __post_init__(self):
        _check_int("vocab_size", self.vocab_size, 1)
        _check_int("parts", self.parts, 1)
        if not isinstance(self.index, int) or isinstance(self.index, bool) or not 0 <= self.index < self.parts:
            raise PipeloomError(f"shard index must be an integer in [0, {self.parts}), got {self.index!r}")
        rows = -(-self.vocab_size // self.parts)
        start = min(self.index * rows, self.vocab_size)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", min(start + rows, self.vocab_size))
        object.__setattr__(self, "padded_size", rows * self.parts)

    @property
    def real_rows(self) -> int:
        """How many of the shard's rows are real vocabulary entries: ``end - start``."""
        return self.end - self.start


def vocab_shard(vocab_size: int, parts: int, index: int) -> VocabShard:
    """Shard ``index`` of ``vocab_size`` rows split into ``parts`` (see :class:`VocabShard`)."""
    return VocabShard(vocab_size, parts, index)


def _layout(group) -> tuple[int, int]:
    """(size of ``group``, this process's rank in it); (1, 0) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group)
        if rank < 0:
            raise PipeloomError("this process is not a member of the given process group")
        return dist.get_world_size(group), rank
    if group is not None:
        raise PipeloomError("a process group was given, but torch.distributed is not initialised")
    return 1, 0


class _VocabSharded(nn.Module):
    """What both layers share: the group, this rank's shard of the weight, the collectives."""

    weight: nn.Parameter

    def __init__(self, vocab_size: int, n_embd: int, group):
        super().__init__()
        _check_int("n_embd", n_embd, 1)
        parts, index = _layout(group)
        self.group, self.n_embd = group, n_embd
        self.shard = VocabShard(vocab_size, parts, index)

    def _new_weight(self) -> nn.Parameter:
        """A shard drawn like GPT's weights (normal, std 0.02), padding rows zero."""
        weight = nn.Parameter(torch.empty(self.shard.rows, self.n_embd))
        with torch.no_grad():
            nn.init.normal_(weight, std=0.02)
            weight[self.shard.real_rows:].zero_()
        return weight

    @torch.no_grad()
    def load_full(self, weight_full: torch.Tensor) -> None:
        """Copy this shard's rows of the unsplit weight [vocab_size, n_embd]; zero the padding rows."""
        want = (self.shard.vocab_size, self.n_embd)
        if tuple(weight_full.shape) != want:
            raise PipeloomError(f"load_full: the unsplit weight must have shape {list(want)}, "
                                f"got {list(weight_full.shape)}")
        self.load_shard(weight_full[self.shard.start:self.shard.end])

    @torch.no_grad()
    def load_shard(self, rows: torch.Tensor) -> None:
        """Copy this shard's rows [real rows, n_embd] of the unsplit weight (rows ``shard.start`` to
        ``shard.end``); zero the padding rows."""
        n = self.shard.real_rows
        if tuple(rows.shape) != (n, self.n_embd):
            raise PipeloomError(f"load_shard: shard {self.shard.index} takes rows {self.shard.start} to "
                                f"{self.shard.end} of the weight, shape {[n, self.n_embd]}; got {list(rows.shape)}")
        self.weight[:n].copy_(rows)
        self.weight[n:].zero_()

    def _real_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.detach()[: self.shard.real_rows].to(dtype)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.shard.parts > 1:
            dist.all_reduce(tensor, group=self.group)


class VocabParallelEmbedding(_VocabSharded):
    """Token embedding whose ``weight`` [rows, n_embd] is this rank's shard of the vocabulary.

    The embedding is the sum over ranks of :meth:`partial`; its backward is
    ``torch.autograd.backward(partial, grad)`` on every rank, ``grad`` the
    full embedding's gradient. Token ids outside ``[0, vocab_size)`` embed to zero.
    """

    def __init__(self, vocab_size: int, n_embd: int, group=None):
        super().__init__(vocab_size, n_embd, group)
        self.weight = self._new_weight()

    def partial(self, tokens: torch.Tensor) -> torch.Tensor:
        """This shard's part of the embedding [*tokens.shape, n_embd]: zero for tokens of other shards."""
        start, end = self.shard.start, self.shard.end
        inside = (tokens >= start) & (tokens < end)
        rows = F.embedding(torch.where(inside, tokens - start, 0), self.weight)
        return rows.masked_fill(~inside.unsqueeze(-1), 0.0)


@dataclass(eq=False)
class LMHeadState:
    """One microbatch on its way through a :class:`VocabParallelLMHead`.

    Made by ``s_pass`` and advanced by ``combine`` (and with naive
    ``combine_sums``), after which ``loss`` is the microbatch's loss (the
    same on every rank), and ``t_pass``, after which ``grad_input_partial``
    is this shard's part of ∇X (naive, vocab-1; vocab-2 has ∇X from
    ``grad_input_from``). ``probs`` is the [N, real rows] buffer kept from S
    to T, in the compute dtype: the logits (naive, until C), otherwise
    exp(logits − ``shift``), the local softmax times its sum. The per-row
    numbers are in the statistics dtype (fp32, or fp64 with fp64 products).
    What a pass no longer needs is dropped.
    """

    algorithm: VocabMode
    x: torch.Tensor | None  # [N, n_embd] in the compute dtype
    input_shape: torch.Size
    input_dtype: torch.dtype
    target_col: torch.Tensor | None  # [N] the target's column in this shard (0 where outside)
    hit: torch.Tensor | None  # [N] 1 where the target is a real row of this shard (and not ignored)
    row_weight: torch.Tensor  # [N] 1 / denominator, 0 on ignored rows
    probs: torch.Tensor | None
    target_term: torch.Tensor | None  # [N] sum of G·logits over this shard, G the target distribution
    shift: torch.Tensor | None = None  # [N] the local max m' (naive: the global max, after C)
    local_sum: torch.Tensor | None = None  # [N] the local sum z' (naive: from C)
    softmax_w: torch.Tensor | None = None  # [N, n_embd] vocab-2: probs·W_shard, compute dtype
    target_w: torch.Tensor | None = None  # [N, n_embd] vocab-2: G·W_shard, compute dtype
    scale: torch.Tensor | None = None  # [N] softmax = probs * scale, after C
    grad_input_partial: torch.Tensor | None = None  # naive, vocab-1: this shard's part of ∇X, from T to R
    loss: torch.Tensor | None = None


#: The bytes of an fp32 temporary as large as a row chunk of the [N, rows] buffer: a quarter of
#: the buffer's, within these bounds (least, most).
_CHUNK_BYTES = (1 << 24, 1 << 28)


def _row_chunks(buffer: torch.Tensor):
    """Row slices of ``buffer`` [N, cols], one row at least, each such that an fp32 temporary of
    its size takes a quarter of the buffer's bytes, within ``_CHUNK_BYTES``."""
    least, most = _CHUNK_BYTES
    size = min(max(buffer.numel() * buffer.element_size() // 4, least), most) // 4  # fp32 elements
    step = max(1, size // max(buffer.shape[1], 1))
    return (slice(start, start + step) for start in range(0, buffer.shape[0], step))


def _exp_shifted(buffer: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """exp(buffer − shift[:, None]) into ``buffer``, computed in ``shift``'s dtype; returns its row
    sums in that dtype. A narrower buffer goes through one temporary per row chunk."""
    sums = shift.new_empty(buffer.shape[0])
    for rows in _row_chunks(buffer):
        chunk = buffer[rows]
        exps = (chunk.sub_(shift[rows, None]) if chunk.dtype == shift.dtype else chunk - shift[rows, None]).exp_()
        sums[rows] = exps.sum(1)
        if exps is not chunk:
            chunk.copy_(exps)
    return sums


def _row_sums(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The row sums of ``buffer`` accumulated in ``dtype``, by row chunks."""
    return torch.cat([buffer[rows].sum(1, dtype=dtype) for rows in _row_chunks(buffer)])


def _global_softmax(stats: torch.Tensor):
    """From every shard's local max and sum per row [parts, N, 3+]: the global max [N],
    the global sum [N], and each shard's rescale exp(local max − global max) [parts, N]."""
    shifts, sums = stats[:, :, 0], stats[:, :, 1]
    top = shifts.amax(0)
    rescales = (shifts - top).exp()
    return top, (sums * rescales).sum(0), rescales


class _LMHeadLoss(torch.autograd.Function):
    """S and C forward, T and R backward, the collectives blocking: the LM head as one differentiable loss."""

    @staticmethod
    def forward(ctx, x, weight, head, targets, denominator):
        state = head.s_pass(x, targets, denominator)
        two = state.algorithm == VocabMode.VOCAB_2
        parts = head._gather(head.grad_input_parts(state)) if two else None
        stats = head._gather(head.row_stats(state))
        head.combine(state, stats)
        if state.algorithm == VocabMode.NAIVE:
            sums = head.row_sums(state)
            head._all_reduce(sums)
            head.combine_sums(state, sums)
        ctx.head, ctx.state = head, state
        ctx.grad_input = head.grad_input_from(state, stats, parts) if two else None
        return state.loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        head, state = ctx.head, ctx.state
        state.row_weight = state.row_weight * grad_loss  # T's products carry the incoming gradient
        grad, x = head._t(state)
        if ctx.grad_input is not None:  # vocab-2: from C, before the incoming gradient was known
            grad_input = ctx.grad_input * grad_loss
        else:  # R
            head._all_reduce(state.grad_input_partial)
            grad_input = state.grad_input_partial.to(state.input_dtype).reshape(state.input_shape)
        grad_weight = (grad.T @ x).to(head.weight.dtype)
        padding = head.weight.shape[0] - grad_weight.shape[0]
        return grad_input, F.pad(grad_weight, (0, 0, 0, padding)) if padding else grad_weight, None, None, None


class VocabParallelLMHead(_VocabSharded):
    """The output layer with softmax cross-entropy, split by vocabulary rows.

    ``weight`` [rows, n_embd] is this rank's shard: its own, or one given (a
    :class:`VocabParallelEmbedding`'s weight ties the input and output
    embeddings, and the gradients of both uses add up in it). A microbatch
    runs the passes :attr:`passes` names, each a method taking its
    :class:`LMHeadState`: ``s_pass`` (S, makes the state); C, the caller's
    collectives between :meth:`row_stats` (and vocab-2's
    :meth:`grad_input_parts`) gathered from every rank and :meth:`combine`
    (naive: then :meth:`row_sums` summed into :meth:`combine_sums`; vocab-2:
    ∇X from :meth:`grad_input_from`); ``t_pass`` (T); and, except with
    vocab-2, R, the sum over ranks of ``state.grad_input_partial``, which is
    ∇X. ``forward`` runs them all with blocking collectives over ``group``.
    Every rank runs every pass with the same ``x`` and targets. The products
    (x·Wᵀ, ∇Z·W, ∇Zᵀ·x, vocab-2's softmax·W) run in the compute dtype: the
    autocast dtype where S runs under autocast, else the wider of ``x``'s
    and the weight's; so does the [N, rows] buffer kept from S to T. The
    softmax statistics (maxima, sums, log-sum-exp, target terms, the loss)
    are fp32 (fp64 with fp64 products). ∇X comes back in ``x``'s dtype, ∇W
    in the weight's. The loss is that of ``F.cross_entropy((x @
    W_full.T).float(), targets, label_smoothing=..., ignore_index=...,
    reduction="sum") / denominator``, the logits rounded to the compute
    dtype, and the gradients are of it. Targets must be in ``[0,
    vocab_size)`` or ``ignore_index``.
    """

    def __init__(self, vocab_size: int, n_embd: int, group=None, algorithm: str = "vocab-2",
                 label_smoothing: float = 0.0, ignore_index: int = -100, weight: nn.Parameter | None = None):
        super().__init__(vocab_size, n_embd, group)
        if algorithm not in VOCAB_ALGORITHMS:
            raise PipeloomError(f"unknown vocabulary-parallel algorithm {algorithm!r}; "
                                f"choices: {', '.join(VOCAB_ALGORITHMS)}")
        if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float))
                or not 0.0 <= label_smoothing <= 1.0):
            raise PipeloomError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise PipeloomError(f"ignore_index must be an integer, got {ignore_index!r}")
        if weight is None:
            weight = self._new_weight()
        elif not isinstance(weight, nn.Parameter) or tuple(weight.shape) != (self.shard.rows, n_embd):
            raise PipeloomError(f"weight must be an nn.Parameter of shape [{self.shard.rows}, {n_embd}] "
                                f"(this rank's shard), got {type(weight).__name__} {list(weight.shape)}")
        self.algorithm = VocabMode(algorithm)
        self.label_smoothing, self.ignore_index = float(label_smoothing), ignore_index
        self.weight = weight

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes this algorithm runs per microbatch, in order: S, C, T and (not vocab-2) R."""
        return _PASSES[self.algorithm]

    @torch.no_grad()
    def s_pass(self, x: torch.Tensor, targets: torch.Tensor, denominator=None) -> LMHeadState:
        """S: the local logits of ``x`` [..., n_embd] and the algorithm's local softmax parts.

        ``denominator`` divides the summed per-token loss (a number or a
        tensor; by default this call's count of non-ignored targets, at least
        1); pass the whole batch's count so that microbatches add up to the
        batch mean.
        """
        algorithm = self.algorithm
        if x.dim() < 2 or x.shape[-1] != self.n_embd:
            raise PipeloomError(f"x must have shape [..., {self.n_embd}], got {list(x.shape)}")
        if targets.shape != x.shape[:-1]:
            raise PipeloomError(f"targets must have shape {list(x.shape[:-1])} (x without its last "
                                f"dimension), got {list(targets.shape)}")
        dtype = self._compute_dtype(x)
        stat = torch.promote_types(dtype, torch.float32)
        flat = x.detach().reshape(-1, self.n_embd).to(dtype)
        targets = targets.reshape(-1).to(device=flat.device, dtype=torch.long)
        valid = targets != self.ignore_index
        if denominator is None:
            denominator = valid.sum().clamp(min=1)
        row_weight = valid.to(stat) / torch.as_tensor(denominator, dtype=stat, device=flat.device)
        shard, eps = self.shard, self.label_smoothing
        inside = valid & (targets >= shard.start) & (targets < shard.end)
        target_col = torch.where(inside, targets - shard.start, 0)
        hit = inside.to(stat)
        weight = self._real_weight(dtype)
        logits = flat @ weight.T
        target_term = torch.zeros_like(row_weight)
        if shard.real_rows:
            target_term += logits.gather(1, target_col[:, None]).squeeze(1) * hit * (1.0 - eps)
        if eps:
            target_term += _row_sums(logits, stat) * (eps / shard.vocab_size)
        state = LMHeadState(algorithm, flat, x.shape, x.dtype, target_col, hit, row_weight, logits, target_term)
        if algorithm == VocabMode.NAIVE:
            return state
        state.shift = self._row_max(logits, stat)
        state.local_sum = _exp_shifted(logits, state.shift)
        if algorithm == VocabMode.VOCAB_2:
            state.softmax_w = logits @ weight
            target_w = weight[target_col] * (hit * (1.0 - eps))[:, None] if shard.real_rows \
                else row_weight.new_zeros(state.softmax_w.shape)
            if eps:
                target_w += weight.sum(0, dtype=stat) * (eps / shard.vocab_size)
            state.target_w = target_w.to(dtype)
        return state

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The products' dtype: autocast's where it is on for ``x``'s device, else the wider of
        ``x``'s and the weight's."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            return torch.get_autocast_dtype(device)
        return torch.promote_types(x.dtype, self.weight.dtype)

    def _row_max(self, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.shard.real_rows:
            return logits.amax(1).to(dtype)
        return logits.new_full(logits.shape[:1], float("-inf"), dtype=dtype)

    def row_stats(self, state: LMHeadState) -> torch.Tensor:
        """This shard's numbers per row [N, 3] that C gathers from every rank: the local max
        (naive: of the logits), the local sum (naive: unused) and the target term."""
        if state.algorithm == VocabMode.NAIVE:
            top = self._row_max(state.probs, state.target_term.dtype)
            return torch.stack([top, torch.zeros_like(top), state.target_term], 1)
        return torch.stack([state.shift, state.local_sum, state.target_term], 1)

    def _gather(self, stats: torch.Tensor) -> torch.Tensor:
        """Every rank's ``stats``, stacked [parts, ...] (blocking)."""
        if self.shard.parts == 1:
            return stats[None]
        parts = [torch.empty_like(stats) for _ in range(self.shard.parts)]
        dist.all_gather(parts, stats.contiguous(), group=self.group)
        return torch.stack(parts)

    @torch.no_grad()
    def combine(self, state: LMHeadState, gathered: torch.Tensor) -> None:
        """C from every rank's :meth:`row_stats` [parts, N, 3]: the global max, and (not
        naive, whose sums need a second round) the global sum, the scale and the loss."""
        state.target_term = gathered[:, :, 2].sum(0)
        if state.algorithm == VocabMode.NAIVE:
            state.shift = gathered[:, :, 0].amax(0)
            state.local_sum = _exp_shifted(state.probs, state.shift)
            return
        top, total, _ = _global_softmax(gathered)
        self._finish(state, top, total, (state.shift - top).exp())

    def row_sums(self, state: LMHeadState) -> torch.Tensor:
        """naive's second round: this shard's sum of exp(logits − global max) per row [N]
        (after :meth:`combine`)."""
        return state.local_sum

    @torch.no_grad()
    def combine_sums(self, state: LMHeadState, total: torch.Tensor) -> None:
        """naive: the scale and the loss from the summed :meth:`row_sums`."""
        self._finish(state, state.shift, total, torch.ones_like(total))

    def _finish(self, state: LMHeadState, top, total, rescale) -> None:
        state.scale = rescale / total
        state.loss = (state.row_weight * (top + total.log() - state.target_term)).sum()
        state.shift = state.local_sum = state.target_term = None

    def grad_input_parts(self, state: LMHeadState) -> torch.Tensor:
        """vocab-2: what this shard adds to ∇X [2, N, n_embd], ready at the end of S: its
        probs·W and G·W, to be gathered where ∇X is needed (:meth:`grad_input_from`)."""
        parts = torch.stack([state.softmax_w, state.target_w])
        state.softmax_w = state.target_w = None
        return parts

    @torch.no_grad()
    def grad_input_from(self, state: LMHeadState, stats: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """vocab-2: ∇X, shaped like the input, from every rank's :meth:`row_stats` [parts, N, 3]
        and :meth:`grad_input_parts` [parts, 2, N, n_embd] (after :meth:`combine`)."""
        _, total, rescales = _global_softmax(stats)
        scales = rescales / total  # [parts, N]: each shard's softmax correction
        grad = (parts[:, 0] * scales[..., None]).sum(0) - parts[:, 1].sum(0, dtype=scales.dtype)
        return (grad * state.row_weight[:, None]).to(state.input_dtype).reshape(state.input_shape)

    @torch.no_grad()
    def t_pass(self, state: LMHeadState) -> None:
        """T: the corrected softmax, ∇W_shard accumulated into ``weight.grad`` and (naive,
        vocab-1) this shard's part of ∇X for R."""
        grad, x = self._t(state)
        if self.weight.grad is None:
            self.weight.grad = torch.zeros_like(self.weight)
        into = self.weight.grad[: grad.shape[1]]
        if into.dtype == grad.dtype:  # one GEMM adding into the gradient: no temporary
            into.addmm_(grad.T, x)
        else:
            into.add_(grad.T @ x)

    @torch.no_grad()
    def _t(self, state: LMHeadState) -> tuple[torch.Tensor, torch.Tensor]:
        """T's work but ∇W: returns the logits' gradient [N, real rows] and ``x``, whose
        product is ∇W of the shard's real rows."""
        if state.scale is None:
            raise PipeloomError("run C (combine) on this microbatch's state before t_pass")
        if state.probs is None:
            raise PipeloomError("t_pass already ran on this microbatch's state")
        eps, real_rows = self.label_smoothing, self.shard.real_rows
        grad, col, row_weight = state.probs, state.target_col, state.row_weight
        factor = state.scale * row_weight  # the softmax times the row weight: probs · factor
        spread = row_weight * (eps / self.shard.vocab_size)  # G off the target, times the row weight
        if real_rows:  # the target's column, in the statistics' dtype
            g = eps / self.shard.vocab_size + state.hit * (1.0 - eps)
            target = (grad.gather(1, col[:, None]).squeeze(1) * state.scale - g) * row_weight
        for rows in _row_chunks(grad):  # (softmax − G) · row weight, G's target term aside
            torch.mul(grad[rows], factor[rows, None], out=grad[rows])
            if eps:
                grad[rows].sub_(spread[rows, None])
        if real_rows:  # (an index_put, not a scatter: that is slow on CPU in bf16)
            grad.index_put_((torch.arange(len(grad), device=grad.device), col), target.to(grad.dtype))
        if state.algorithm != VocabMode.VOCAB_2:
            state.grad_input_partial = grad @ self._real_weight(grad.dtype)
        x = state.x
        state.probs = state.x = state.target_col = state.hit = None
        return grad, x

    def forward(self, x: torch.Tensor, targets: torch.Tensor, denominator=None) -> torch.Tensor:
        """The loss, differentiable: S and C now, T and R in backward, where ∇W reaches
        ``weight.grad`` and ∇X flows on into ``x``; the collectives block. Every rank
        of the group must run it, and the backward."""
        return _LMHeadLoss.apply(x, self.weight, self, targets, denominator)
