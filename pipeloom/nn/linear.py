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
import weakref
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
        store = _active
        if store is None:
            flat = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = (flat.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
            return grad_x, grad_w, (flat.sum(0).to(bias.dtype) if bias is not None else None)
        store.add(_weight_grads(weight, bias), (grad_out, x), weight, bias)
        return grad_x, None, None


def _weight_grads(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The work that accumulates a linear layer's weight (and bias) gradients into their ``.grad``,
    called on the output gradient and the saved input."""

    def work(grad_out: torch.Tensor, x: torch.Tensor) -> None:
        flat = grad_out.reshape(-1, grad_out.shape[-1])
        if weight.grad is None or weight.grad.dtype != grad_out.dtype:
            _accumulate(weight, (flat.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype))
            if bias is not None:
                _accumulate(bias, flat.sum(0).to(bias.dtype))
            return
        # one GEMM adding into the gradient: no temporary, no second pass over it
        weight.grad.addmm_(flat.t(), x.reshape(-1, x.shape[-1]))
        if bias is not None:
            _accumulate(bias, flat.sum(0))

    return work


# Under torch.compile the layer's backward is an operator of its own, which the compiled backward graph
# calls as one opaque step: torch.compile traces a backward but keeps none of its side effects, and graph
# breaks around an uncompiled layer cost more than the compiled block saves. The forward stays in the
# graph (an autograd.Function the compiler traces: its product and bias fuse with what surrounds them);
# it takes the input already in the autocast dtype (cast in the graph) and the weights as they are, so
# the backward receives the parameters themselves and accumulates their gradients (or queues that work
# in the active store) as _LinearFunction's does; autograd gets only the input gradient.

class _CompiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        return _linear_backward_op(grad_out, *ctx.saved_tensors), None, None


#: The layers whose parameters a compiled backward may receive: :class:`Linear` and those :func:`deferrable` runs.
_layers: weakref.WeakSet = weakref.WeakSet()
#: Their parameters by the address of their storage (rebuilt when an address is not found).
_by_storage: dict[int, torch.Tensor] = {}


def _parameter(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The parameter that the saved ``tensor`` stands for: a saved-tensor hook (checkpoint's recomputation,
    offload) may hand back a detached alias of it. A tensor of no layer (2bw's weight versions) is its own."""
    if tensor is None or isinstance(tensor, nn.Parameter):
        return tensor
    key = tensor.untyped_storage().data_ptr()
    found = _by_storage.get(key)
    if found is None or found.untyped_storage().data_ptr() != key:
        _by_storage.clear()
        _by_storage.update((p.untyped_storage().data_ptr(), p) for layer in _layers
                           for p in (layer.weight, layer.bias) if p is not None)
        found = _by_storage.get(key, tensor)
    return found


# The backward as a plain operator (a Python kernel, no autograd of its own: it runs inside a backward);
# torch.library.custom_op's wrappers cost more host time per call than the kernel's own Python.
_library = torch.library.Library("pipeloom", "DEF")
_library.define("linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _linear_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The input gradient; the weight gradients queued in the active store, or accumulated now."""
    weight, bias = _parameter(weight), _parameter(bias)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        work = _weight_grads(weight, bias)
        if _active is None:
            work(grad_out, x)
        else:
            _active.add(work, (grad_out, x), weight, bias)
    return grad_out @ weight.to(grad_out.dtype)


_library.impl("linear_backward", _linear_backward, "CompositeExplicitAutograd")
torch.library.register_fake("pipeloom::linear_backward", lambda grad_out, x, weight, bias: x.new_empty(x.shape),
                            lib=_library)
_linear_backward_op = torch.ops.pipeloom.linear_backward


class Linear(nn.Linear):
    """``nn.Linear`` with a backward that :func:`defer_weight_grads` can split, compiled or not."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _layers.add(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if torch.is_autocast_enabled(x.device.type):
                x = x.to(torch.get_autocast_dtype(x.device.type))
            return _CompiledLinear.apply(x, self.weight, self.bias)
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
    _layers.update(swapped)
    for m in swapped:
        m.forward = Linear.forward.__get__(m)
    try:
        yield
    finally:
        for m in swapped:
            del m.forward
