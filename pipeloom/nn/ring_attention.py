"""Sequence-parallel attention: every rank of a group of N holds s/N tokens of
each sequence, and attention runs over the whole sequence by passing key and
value blocks round the group's ring.

* :class:`SequenceLayout` says which global positions a rank holds: a
  contiguous block, or (``balanced``, for causal attention) the sequence cut
  into 2N chunks, rank i holding chunks i and 2N−1−i, so that every rank has
  the same amount of unmasked work.
* :func:`rsa_attention`: Ring Self-Attention (Li et al. 2021). Each rank builds
  its full score rows [s/N, s] from the keys passed round the ring, takes the
  softmax over whole rows and sums probabilities × values as the values pass
  round; it keeps those rows for the backward (memory quadratic in s).
* :func:`ring_attention`: blockwise Ring Attention (Liu et al. 2023) with an
  online softmax: one [s/N, s/N] score block at a time, merged into running
  (max, sum, output) accumulators while the next key/value block is already in
  flight; the backward recomputes each block from the saved log-sum-exp.

Both take q, k, v of shape [batch, heads, s/N, head_dim], causal masking by
global position, and have hand-written backwards that pass the gradients of
the keys and values round the ring back to the ranks that own them. Scores
and softmax statistics are computed in fp32, or in the inputs' wider dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..errors import PipeloomError
from ..modes import Attention

# message tags, one per stream that may be in flight between the same two ranks at once
_BLOCKS, _GRADS = 0, 1


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PipeloomError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class SequenceLayout:
    """The positions of a sequence of ``seq_len`` tokens that rank ``index`` of ``parts``
    holds: ``chunks``, the [start, end) ranges of global positions in local order (one
    of ``seq_len / parts`` tokens, or with ``balanced`` chunks ``index`` and
    ``2·parts − 1 − index`` of ``2·parts``), ``local_len`` tokens in all."""

    seq_len: int
    parts: int
    index: int
    balanced: bool = False
    chunks: tuple[tuple[int, int], ...] = field(init=False)
    local_len: int = field(init=False)

    def __post_init__(self):
        _check_int("seq_len", self.seq_len, 1)
        _check_int("parts", self.parts, 1)
        if not isinstance(self.index, int) or isinstance(self.index, bool) or not 0 <= self.index < self.parts:
            raise PipeloomError(f"layout index must be an integer in [0, {self.parts}), got {self.index!r}")
        if not isinstance(self.balanced, bool):
            raise PipeloomError(f"balanced must be True or False, got {self.balanced!r}")
        pieces = 2 * self.parts if self.balanced else self.parts
        if self.seq_len % pieces:
            what = f"2 x {self.parts} chunks (balanced)" if self.balanced else f"{self.parts} parts"
            raise PipeloomError(f"seq_len {self.seq_len} does not split evenly into {what}")
        size = self.seq_len // pieces
        order = (self.index, pieces - 1 - self.index) if self.balanced else (self.index,)
        object.__setattr__(self, "chunks", tuple((c * size, (c + 1) * size) for c in order))
        object.__setattr__(self, "local_len", size * len(order))

    @property
    def positions(self) -> torch.Tensor:
        """The global positions this rank holds, in local order: a LongTensor [local_len]."""
        return torch.cat([torch.arange(start, end) for start, end in self.chunks])

    def local(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of ``x``, whose dimension ``dim`` is the whole sequence."""
        if x.shape[dim] != self.seq_len:
            raise PipeloomError(f"dimension {dim} of a tensor of shape {list(x.shape)} is not the sequence "
                                f"of {self.seq_len} tokens")
        return torch.cat([x.narrow(dim, start, end - start) for start, end in self.chunks], dim)


def sequence_layout(seq_len: int, parts: int, index: int, balanced: bool = False) -> SequenceLayout:
    """Rank ``index``'s share of a sequence of ``seq_len`` tokens over ``parts`` ranks
    (see :class:`SequenceLayout`)."""
    return SequenceLayout(seq_len, parts, index, balanced)


class _Transfer:
    """A receive in flight: :meth:`wait` returns its buffer once it has arrived."""

    def __init__(self, buffer: torch.Tensor, work):
        self.buffer, self.work = buffer, work

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


class _Ring:
    """This rank's place in the ring of its sequence-parallel group: it sends to the
    next rank of the group and receives from the previous one (non-blocking)."""

    def __init__(self, group, layout: SequenceLayout):
        if not isinstance(layout, SequenceLayout):
            raise PipeloomError(f"layout must be a SequenceLayout, got {type(layout).__name__}")
        if group is None and layout.parts == 1:
            size, rank = 1, 0
        elif dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD if group is None else group
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            if rank < 0:
                raise PipeloomError("this process is not a member of the given process group")
        elif group is not None:
            raise PipeloomError("a process group was given, but torch.distributed is not initialised")
        else:
            size, rank = 1, 0
        if (size, rank) != (layout.parts, layout.index):
            raise PipeloomError(f"the layout is part {layout.index} of {layout.parts}, but this process is rank "
                                f"{rank} of a sequence-parallel group of {size}")
        self.group, self.size, self.rank = group, size, rank
        if size > 1:
            self.next = dist.get_global_rank(group, (rank + 1) % size)
            self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def exchange(self, tensor: torch.Tensor, tag: int) -> tuple:
        """Start sending ``tensor`` (contiguous, left untouched until waited) to the next rank
        and receiving one shaped like it from the previous rank: (send work, :class:`_Transfer`).
        gloo matches them by tag; NCCL runs both in one group (``batch_isend_irecv``), since
        it matches a pair of ranks' operations in order and two ranks that each receive first
        would wait for each other."""
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if dist.get_backend(self.group) == "gloo":
            received = dist.irecv(buffer, self.prev, group=self.group, tag=tag)
            return dist.isend(tensor, self.next, group=self.group, tag=tag), _Transfer(buffer, received)
        sent, received = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group),
                                                 dist.P2POp(dist.irecv, buffer, self.prev, self.group)])
        return sent, _Transfer(buffer, received)

    def rotate(self, block: torch.Tensor):
        """Yield (owner, block) N times: this rank's ``block`` first, then each block of the
        ranks before it in the ring. The next block is sent for before each yield and
        waited for after it, so the transfer overlaps the caller's work on the current one."""
        block = block.contiguous()
        for step in range(self.size):
            incoming = None
            if step < self.size - 1:
                sent, incoming = self.exchange(block, _BLOCKS)
            yield (self.rank - step) % self.size, block
            if incoming is not None:
                sent.wait()
                block = incoming.wait()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, device) -> torch.Tensor | None:
    """True where a key comes after its query; None where nothing is masked."""
    mask = k_pos[None, :] > q_pos[:, None]
    return mask.to(device) if mask.any() else None


def _span(chunks, keep, size: int) -> slice | None:
    """The local index range from the first to the last chunk that ``keep`` accepts."""
    kept = [i for i, (start, end) in enumerate(chunks) if keep(start, end)]
    return slice(kept[0] * size, (kept[-1] + 1) * size) if kept else None


def _block_plans(layout: SequenceLayout, causal: bool, device) -> list:
    """For each owner's key block, what of the score block [local queries, its keys] to
    compute: (rows, columns, mask within them or None), or None when all is masked."""
    everything = (slice(None), slice(None), None)
    if not causal:
        return [everything] * layout.parts
    size = layout.local_len // len(layout.chunks)
    last_query = max(end for _, end in layout.chunks) - 1
    plans = []
    for owner in range(layout.parts):
        keys = dataclasses.replace(layout, index=owner)
        first_key = min(start for start, _ in keys.chunks)
        rows = _span(layout.chunks, lambda start, end: end - 1 >= first_key, size)
        cols = _span(keys.chunks, lambda start, end: start <= last_query, size)
        if rows is None:
            plans.append(None)
        else:
            plans.append((rows, cols, _causal_mask(layout.positions[rows], keys.positions[cols], device)))
    return plans


def _check_inputs(q, k, v, layout: SequenceLayout, scale) -> float:
    """Check q, k, v against each other and the layout; return the scale."""
    if q.dim() != 4:
        raise PipeloomError(f"q must have shape [batch, heads, tokens, head_dim], got {list(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise PipeloomError(f"q, k and v must have the same shape, got {list(q.shape)}, {list(k.shape)}, "
                            f"{list(v.shape)}")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise PipeloomError(f"q, k and v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != layout.local_len:
        raise PipeloomError(f"the layout gives this rank {layout.local_len} tokens, but q has {q.shape[2]}")
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


class _RingAttention(torch.autograd.Function):
    """Blockwise attention with an online softmax round the ring; the backward recomputes
    each block from the saved log-sum-exp and passes ∇K, ∇V round behind their blocks."""

    @staticmethod
    def forward(ctx, q, k, v, ring, layout, causal, scale):
        dtype = _compute_dtype(q)
        qc = q.to(dtype)
        top = qc.new_full(q.shape[:-1], -math.inf)  # running row max of the scores
        total = qc.new_zeros(q.shape[:-1])  # running sum of exp(score − top)
        acc = torch.zeros_like(qc)  # running sum of exp(score − top) · value
        plans = _block_plans(layout, causal, q.device)
        for owner, kv in ring.rotate(torch.stack([k, v])):
            if plans[owner] is None:
                continue
            rows, cols, mask = plans[owner]
            scores = (qc[..., rows, :] @ kv[0, ..., cols, :].to(dtype).transpose(-1, -2)).mul_(scale)
            if mask is not None:
                scores.masked_fill_(mask, -math.inf)
            new_top = torch.maximum(top[..., rows], scores.amax(-1))
            fade = (top[..., rows] - new_top).exp_()
            probs = scores.sub_(new_top[..., None]).exp_()
            total[..., rows].mul_(fade).add_(probs.sum(-1))
            acc[..., rows, :].mul_(fade[..., None]).add_(probs @ kv[1, ..., cols, :].to(dtype))
            top[..., rows] = new_top
        out = (acc / total[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, top + total.log())
        ctx.ring, ctx.layout, ctx.causal, ctx.scale = ring, layout, causal, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dtype = lse.dtype
        qc, dout = q.to(dtype), grad_out.to(dtype)
        delta = (dout * out.to(dtype)).sum(-1)  # rowsum(∇out ∘ out) = rowsum(P ∘ ∇P)
        grad_q = torch.zeros_like(qc)
        plans = _block_plans(ctx.layout, ctx.causal, q.device)
        sends, incoming = [], None
        for owner, kv in ring.rotate(torch.stack([k, v])):
            grads = kv.new_zeros(kv.shape, dtype=dtype)  # this rank's share of ∇K, ∇V of the block
            if plans[owner] is not None:
                rows, cols, mask = plans[owner]
                keys, values = kv[0, ..., cols, :].to(dtype), kv[1, ..., cols, :].to(dtype)
                scores = (qc[..., rows, :] @ keys.transpose(-1, -2)).mul_(scale)
                if mask is not None:
                    scores.masked_fill_(mask, -math.inf)
                probs = scores.sub_(lse[..., rows, None]).exp_()
                grads[1, ..., cols, :] = probs.transpose(-1, -2) @ dout[..., rows, :]
                grad_scores = (dout[..., rows, :] @ values.transpose(-1, -2)).sub_(delta[..., rows, None])
                grad_scores.mul_(probs).mul_(scale)
                grad_q[..., rows, :] += grad_scores @ keys
                grads[0, ..., cols, :] = grad_scores.transpose(-1, -2) @ qc[..., rows, :]
            if incoming is not None:
                grads += incoming.wait()  # the shares of the ranks that held the block before
            if ring.size > 1:
                # the sum goes on to the next rank (after the last step: the block's owner), and the
                # previous rank's sum for the next block (after the last step: this rank's own) comes in
                sent, incoming = ring.exchange(grads, _GRADS)
                sends.append((sent, grads))
        if incoming is not None:
            grads = incoming.wait()
        for work, _ in sends:
            work.wait()
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None


class _RingSelfAttention(torch.autograd.Function):
    """RSA: whole score rows from the keys round the ring, softmax, values round the ring;
    the backward passes values and keys round again and sums ∇K, ∇V round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring, layout, causal, scale):
        dtype = _compute_dtype(q)
        qc, n = q.to(dtype), layout.local_len
        scores = qc.new_empty(*q.shape[:-1], ring.size * n)  # columns: owner 0's keys, then owner 1's, ...
        for owner, keys in ring.rotate(k):
            block = scores[..., owner * n:(owner + 1) * n]
            block.copy_(qc @ keys.to(dtype).transpose(-1, -2)).mul_(scale)
            key_positions = dataclasses.replace(layout, index=owner).positions
            mask = _causal_mask(layout.positions, key_positions, q.device) if causal else None
            if mask is not None:
                block.masked_fill_(mask, -math.inf)
        probs = scores.softmax(-1)
        del scores
        out = torch.zeros_like(qc)
        for owner, values in ring.rotate(v):
            out += probs[..., owner * n:(owner + 1) * n] @ values.to(dtype)
        ctx.save_for_backward(q, k, v, probs)
        ctx.ring, ctx.scale = ring, scale
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, probs = ctx.saved_tensors
        ring, scale, n = ctx.ring, ctx.scale, q.shape[2]
        dtype = probs.dtype
        qc, dout = q.to(dtype), grad_out.to(dtype)
        grad_scores = torch.empty_like(probs)
        for owner, values in ring.rotate(v):
            grad_scores[..., owner * n:(owner + 1) * n] = dout @ values.to(dtype).transpose(-1, -2)
        grad_scores.sub_((grad_scores * probs).sum(-1, keepdim=True)).mul_(probs).mul_(scale)  # row softmax
        grad_q = torch.zeros_like(qc)
        for owner, keys in ring.rotate(k):
            grad_q += grad_scores[..., owner * n:(owner + 1) * n] @ keys.to(dtype)
        # reduce-scatter round the ring: at step t the partial ∇K, ∇V of owner rank − t − 1 joins
        # the sum passed on from the previous rank; the last step's owner is this rank
        sends, incoming = [], None
        for step in range(ring.size):
            owner = (ring.rank - step - 1) % ring.size
            cols = slice(owner * n, (owner + 1) * n)
            grads = torch.stack([grad_scores[..., cols].transpose(-1, -2) @ qc,
                                 probs[..., cols].transpose(-1, -2) @ dout])
            if incoming is not None:
                grads += incoming.wait()
            if step < ring.size - 1:
                sent, incoming = ring.exchange(grads, _GRADS)
                sends.append((sent, grads))
        for work, _ in sends:
            work.wait()
        return grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: SequenceLayout,
                   causal: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, blockwise round the ring
    (Ring Attention): [batch, heads, local_len, head_dim] out, differentiable w.r.t. q, k, v.

    q, k, v [batch, heads, local_len, head_dim] are this rank's tokens as ``layout`` places
    them; ``group`` is the sequence-parallel group (None: the default group, or no group at
    all when ``layout.parts`` is 1) and ``layout.index`` must be this process's rank in it.
    ``causal`` masks keys after each query's global position; score blocks that are wholly
    masked are not computed. ``scale`` defaults to 1/sqrt(head_dim). Every rank of the group
    must call it (and its backward) together.
    """
    ring = _Ring(group, layout)
    return _RingAttention.apply(q, k, v, ring, layout, bool(causal), _check_inputs(q, k, v, layout, scale))


def rsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: SequenceLayout,
                  causal: bool, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence by Ring Self-Attention,
    which holds this rank's [local_len, seq_len] score rows per batch and head; arguments
    and result as :func:`ring_attention`."""
    ring = _Ring(group, layout)
    return _RingSelfAttention.apply(q, k, v, ring, layout, bool(causal), _check_inputs(q, k, v, layout, scale))


_KINDS = {Attention.RING: ring_attention, Attention.RSA: rsa_attention}

#: The sequence-parallel attention algorithms by name.
SP_ATTENTION_KINDS = tuple(_KINDS)


def sequence_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: SequenceLayout,
                                causal: bool, kind: str = "ring", scale: float | None = None) -> torch.Tensor:
    """:func:`ring_attention` (``kind="ring"``) or :func:`rsa_attention` (``"rsa"``)."""
    return _KINDS[Attention.of(kind)](q, k, v, group, layout, causal, scale)
