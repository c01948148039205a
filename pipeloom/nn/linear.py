"""A ``nn.Linear`` whose weight gradient can be deferred: the B/W split.

Zero-bubble schedules split a layer's backward into B (the input gradient,
on the critical path) and W (the weight gradient, which can wait). Inside
:func:`defer_weight_grads` the backward of :class:`Linear` computes only the
input gradient and queues the weight-gradient work in the given store; the
runtime runs the store later, at the schedule's W action. Outside it,
:class:`Linear` is an ordinary ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch import nn

_state = threading.local()


class WeightGradStore:
    """Queued weight-gradient work of one (stage, microbatch) backward."""

    def __init__(self):
        self.work: list[Callable[[], None]] = []

    def run(self) -> None:
        """Compute and accumulate every queued weight gradient, then forget them."""
        for job in self.work:
            job()
        self.work.clear()


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore):
    """Within this block, :class:`Linear` backwards queue their weight gradients in ``store``."""
    previous = getattr(_state, "store", None)
    _state.store = store
    try:
        yield store
    finally:
        _state.store = previous


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # parameters: leaves, safe to hold
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])):
            return grad_x, None, None

        def weight_grads():
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = flat.t() @ x.reshape(-1, x.shape[-1])
            return grad_w, (flat.sum(0) if bias is not None else None)

        store = getattr(_state, "store", None)
        if store is None:
            return (grad_x, *weight_grads())

        def deferred():
            grad_w, grad_b = weight_grads()
            _accumulate(weight, grad_w)
            if grad_b is not None:
                _accumulate(bias, grad_b)

        store.work.append(deferred)
        return grad_x, None, None


class Linear(nn.Linear):
    """``nn.Linear`` with a backward that :func:`defer_weight_grads` can split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(x, self.weight, self.bias)
