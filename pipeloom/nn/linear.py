"""A ``nn.Linear`` whose weight gradient can be deferred: the B/W split.

Zero-bubble schedules split a layer's backward into B (the input gradient,
on the critical path) and W (the weight gradient, which can wait). Inside
:func:`defer_weight_grads` the backward of :class:`Linear` computes only the
input gradient and queues the weight-gradient work in the given store; the
runtime runs the store later, at the schedule's W action. A store made with
``eager=True`` does that work at once instead: a fused backward whose weight
gradients each accumulate in one GEMM (``addmm_``). Outside it,
:class:`Linear` is an ordinary ``nn.Linear``. A model's plain ``nn.Linear``
layers get the same backward inside :func:`deferrable` (a user's stages:
:mod:`.stages`).

The store follows the backward call, not a thread: for CUDA tensors autograd
runs the backward's nodes on a device thread of its own, which a
thread-local store would never reach (the B/W split then silently computed
every weight gradient in B). So one store is active per process at a time:
run one deferred backward at a time, as a pipeline's executor does.

The queued work holds its tensors (each layer's input and output gradient)
in the store, not in closures, so they can be moved while they wait:
:meth:`WeightGradStore.pack` (the runtime's offload copies them to host
memory after B and back before W).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from .recompute import mark, recipe


def _same(tensor):
    return tensor


class WeightGradStore:
    """Weight-gradient work of one (stage, microbatch) backward: queued until
    :meth:`run`, or with ``eager`` done as the backward reaches each layer
    (a fused backward whose weight gradients each accumulate in one GEMM)."""

    def __init__(self, eager: bool = False):
        self.eager = eager
        #: the queued work: each job with the tensors it is called on
        self.work: list[tuple[Callable[..., None], list]] = []
        self.deferred: set[int] = set()  # ids of the parameters whose gradients it computes
        self.unpack: Callable = _same

    def add(self, job: Callable[..., None], tensors: tuple[torch.Tensor, ...], *params: torch.Tensor) -> None:
        """Queue (or with ``eager`` do) ``job(*tensors)``, which computes the gradients of ``params``."""
        self.deferred.update(id(p) for p in params if p is not None)
        if self.eager:
            job(*tensors)
        else:
            self.work.append((job, list(tensors)))

    def held(self) -> list[torch.Tensor]:
        """The tensors the queued work holds until :meth:`run`."""
        return [t for _, tensors in self.work for t in tensors]

    def pack(self, pack: Callable, unpack: Callable) -> None:
        """Keep each queued tensor as ``pack(tensor)`` until :meth:`run`, which reads it back with
        ``unpack`` (the offloader's copy to host memory and back)."""
        self.work = [(job, [pack(t) for t in tensors]) for job, tensors in self.work]
        self.unpack = unpack

    def run(self) -> None:
        """Compute and accumulate every queued weight gradient, then forget them. Without
        autograd: the inputs kept for W require grad, and a gradient recorded as a function of
        them would keep every microbatch's output gradient alive until the gradients are freed."""
        with torch.no_grad():
            for job, tensors in self.work:
                job(*map(self.unpack, tensors))
        self.work.clear()


#: The store of the deferred backward in progress, process-wide (see the module docstring).
_active: WeightGradStore | None = None


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore):
    """Within this block, :class:`Linear` backwards queue their weight gradients in ``store``."""
    global _active
    previous, _active = _active, store
    try:
        yield store
    finally:
        _active = previous


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``; a rebuildable ``x`` (:mod:`.recompute`) stays rebuildable."""
    y, found = x.to(dtype), recipe(x)
    if found is not None and y is not x:
        rebuild, inputs = found
        mark(y, lambda *a: rebuild(*a).to(dtype), *inputs)
    return y


class _LinearFunction(torch.autograd.Function):
    """Under autocast the product runs in the autocast dtype: the saved input
    and the backward GEMMs use it too, and each gradient comes back in the
    dtype of the tensor it belongs to."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.input_dtype = x.dtype
        if torch.is_autocast_enabled(x.device.type):  # cast once, for the product and to save
            x = _cast(x, torch.get_autocast_dtype(x.device.type))
        out = nn.functional.linear(x, weight, bias)
        ctx.save_for_backward(x.to(out.dtype))
        ctx.weight, ctx.bias = weight, bias  # parameters: leaves, safe to hold
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        grad_x = (grad_out @ weight.to(grad_out.dtype)).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        if not (ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[2])):
            return grad_x, None, None

        def weight_grads(grad_out, x):
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = (flat.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
            return grad_w, (flat.sum(0).to(bias.dtype) if bias is not None else None)

        store = _active
        if store is None:
            return (grad_x, *weight_grads(grad_out, x))

        def deferred(grad_out, x):
            if weight.grad is None or weight.grad.dtype != grad_out.dtype:
                grad_w, grad_b = weight_grads(grad_out, x)
                _accumulate(weight, grad_w)
                if grad_b is not None:
                    _accumulate(bias, grad_b)
                return
            # one GEMM adding into the gradient: no temporary, no second pass over it
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            weight.grad.addmm_(flat.t(), x.reshape(-1, x.shape[-1]))
            if bias is not None:
                _accumulate(bias, flat.sum(0))

        store.add(deferred, (grad_out, x), weight, bias)
        return grad_x, None, None


class Linear(nn.Linear):
    """``nn.Linear`` with a backward that :func:`defer_weight_grads` can split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(x, self.weight, self.bias)


def plain_linears(module: nn.Module) -> list[nn.Linear]:
    """The layers of ``module`` that run ``nn.Linear``'s own forward (not :class:`Linear`'s, nor a
    subclass's override): those :func:`deferrable` gives a backward that can defer."""
    return [m for m in module.modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward]


@contextlib.contextmanager
def deferrable(layers: list[nn.Linear]):
    """Within this block ``layers`` (:func:`plain_linears`) run :class:`Linear`'s forward, whose
    backward :func:`defer_weight_grads` splits; the same numbers. An instance attribute shadows
    the class's ``forward`` (hooks still run) and is removed on exit; layers already swapped by an
    enclosing block are left to it."""
    swapped = [m for m in layers if "forward" not in m.__dict__]
    for m in swapped:
        m.forward = Linear.forward.__get__(m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward
