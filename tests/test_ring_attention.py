"""Sequence-parallel attention (ring and RSA) against torch's scaled_dot_product_attention on the whole sequence."""

import itertools

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import (SP_ATTENTION_KINDS, ring_attention, rsa_attention, sequence_layout,  # noqa: E402
                         sequence_parallel_attention)
from pipeloom.runtime.local import spawn  # noqa: E402

BATCH, HEADS, SEQ = 2, 3, 32
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

# (kind, causal, balanced, head_dim, dtype, scale): every kind, mask and layout in fp64 with
# uneven head dims, then fp32 and explicit scales
CASES = [(kind, causal, balanced, (12, 17)[i % 2], torch.float64, None)
         for i, (kind, causal, balanced) in enumerate(itertools.product(SP_ATTENTION_KINDS, (False, True),
                                                                        (False, True)))]
CASES += [("ring", True, True, 8, torch.float32, None), ("rsa", True, False, 8, torch.float32, 0.3),
          ("ring", False, False, 17, torch.float64, 0.3)]


def close(name, got, want, tol):
    """Relative error (against the largest entry of ``want``) below ``tol``."""
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    error = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert error < tol, f"{name}: relative error {error:.2e}"


def check(case, group, parts, index, seed=0):
    """One rank's output and ∇q, ∇k, ∇v against the slices of the reference's on the whole sequence."""
    kind, causal, balanced, head_dim, dtype, scale = case
    g = torch.Generator().manual_seed(seed)
    q, k, v, upstream = (torch.randn(BATCH, HEADS, SEQ, head_dim, generator=g, dtype=torch.float64).to(dtype)
                         for _ in range(4))
    full = [x.double().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal, scale=scale)
    want_grads = torch.autograd.grad(want, full, upstream.double())

    layout = sequence_layout(SEQ, parts, index, balanced)
    local = [layout.local(x, 2).requires_grad_() for x in (q, k, v)]
    out = sequence_parallel_attention(*local, group, layout, causal, kind, scale)
    grads = torch.autograd.grad(out, local, layout.local(upstream, 2))
    name = f"{kind} causal={causal} balanced={balanced} d={head_dim} {dtype} N={parts} rank {index}"
    assert out.dtype == dtype and all(grad.dtype == dtype for grad in grads), name
    for what, got, ref in zip(("out", "grad q", "grad k", "grad v"), (out, *grads), (want, *want_grads)):
        close(f"{name}: {what}", got, layout.local(ref, 2), TOLERANCE[dtype])


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operation returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


def measure(attention, world, rank, causal, balanced, mode):
    """Run ``attention`` forward and backward under ``mode`` on 16 tokens per rank, head dim 4."""
    layout = sequence_layout(16 * world, world, rank, balanced)
    q, k, v = (torch.randn(1, 2, 16, 4, requires_grad=True) for _ in range(3))
    with mode:
        attention(q, k, v, None, layout, causal).sum().backward()
    return mode


def worker(rank, world):
    """Every case on the world group, then (world 4) on two groups of 2 with interleaved ranks,
    (world 2) on groups of one; returns how many ran, and what ``measure`` found."""
    for i, case in enumerate(CASES):
        check(case, None if i % 2 else dist.group.WORLD, world, rank, seed=i)
    checked = len(CASES)
    if world == 4:
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        for i, case in enumerate(CASES[3::4]):
            check(case, groups[rank % 2], 2, rank // 2, seed=i)
            checked += 1
    else:
        singles = [dist.new_group([r]) for r in range(world)]
        for i, case in enumerate(CASES[1::3]):
            check(case, singles[rank] if i % 2 else None, 1, 0, seed=i)
            checked += 1
    largest = {(kind, causal): measure(attention, world, rank, causal, causal, LargestTensor()).numel
               for kind, attention in (("ring", ring_attention), ("rsa", rsa_attention)) for causal in (False, True)}
    flops = {balanced: measure(ring_attention, world, rank, True, balanced, FlopCounterMode(display=False))
             .get_total_flops() for balanced in (False, True)}
    return checked, largest, flops


@pytest.mark.parametrize("world", [2, 4])
def test_matches_torch_on_ranks(world):
    results = spawn(world, worker, world, timeout=80, group_timeout=40)
    extra = len(CASES[3::4]) if world == 4 else len(CASES[1::3])
    assert [checked for checked, _, _ in results] == [len(CASES) + extra] * world
    for _, largest, _ in results:  # batch 1, 2 heads, 16 tokens per rank, head dim 4
        assert largest[("ring", False)] == largest[("ring", True)] == 2 * 16 * 16  # one [s/N, s/N] block per head
        assert largest[("rsa", False)] == largest[("rsa", True)] == 2 * 16 * 16 * world  # whole [s/N, s] rows
    unbalanced, balanced = ([flops[b] for _, _, flops in results] for b in (False, True))
    assert len(set(balanced)) == 1, f"balanced causal work differs between ranks: {balanced}"
    assert unbalanced == sorted(unbalanced) and unbalanced[0] < unbalanced[-1], unbalanced
    assert sum(balanced) == sum(unbalanced), "balancing changed the total work of causal attention"


@pytest.mark.parametrize("case", CASES)
def test_matches_torch_without_distributed(case):
    check(case, None, 1, 0)


def test_layout_positions():
    assert sequence_layout(8, 2, 0, balanced=True).positions.tolist() == [0, 1, 6, 7]
    assert sequence_layout(8, 2, 1, balanced=True).positions.tolist() == [2, 3, 4, 5]
    assert sequence_layout(8, 2, 1).positions.tolist() == [4, 5, 6, 7]
    layout = sequence_layout(12, 3, 2, balanced=True)
    assert (layout.chunks, layout.local_len) == (((4, 6), (6, 8)), 4)
    x = torch.arange(24).view(2, 12)
    assert torch.equal(layout.local(x, 1), x[:, layout.positions])
    assert torch.equal(layout.local(x.T, 0), x.T[layout.positions])


@pytest.mark.parametrize("args, match", [
    ((30, 4, 0), "does not split evenly into 4 parts"),
    ((36, 4, 0, True), r"does not split evenly into 2 x 4 chunks"),
    ((32, 0, 0), "parts must be an integer >= 1"),
    ((32, 4, 4), r"index must be an integer in \[0, 4\)"),
    ((32, 4, -1), r"index must be an integer in \[0, 4\)"),
    ((0, 1, 0), "seq_len must be an integer >= 1"),
    ((32, 2, 0, "yes"), "balanced must be True or False"),
])
def test_layout_rejects_bad_arguments(args, match):
    with pytest.raises(PipeloomError, match=match):
        sequence_layout(*args)


def test_attention_rejects_bad_arguments():
    q = torch.randn(1, 2, 8, 4)
    one = sequence_layout(8, 1, 0)
    with pytest.raises(PipeloomError, match="unknown attention 'flash'; choose one of ring, rsa"):
        sequence_parallel_attention(q, q, q, None, one, True, kind="flash")
    with pytest.raises(PipeloomError, match="the layout is part 1 of 2"):
        ring_attention(q, q, q, None, sequence_layout(16, 2, 1), True)
    with pytest.raises(PipeloomError, match="gives this rank 8 tokens, but q has 4"):
        rsa_attention(q[:, :, :4], q[:, :, :4], q[:, :, :4], None, one, True)
    with pytest.raises(PipeloomError, match="same shape"):
        ring_attention(q, q[..., :3], q, None, one, False)
    with pytest.raises(PipeloomError, match="not the sequence of 8 tokens"):
        one.local(q, 3)
