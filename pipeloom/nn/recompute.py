"""Cheap recomputation: norms and activation functions rebuilt in the backward, not kept.

Inside :func:`cheap_recompute` the GPT blocks mark the outputs of their
LayerNorms and of the MLP's GELU with how to rebuild them (:func:`mark`): the
module and its input, which autograd keeps anyway (a norm's input for its own
backward, GELU's for its). A ``saved_tensors_hooks`` pack that finds a mark
(:func:`recipe`) can save the recipe instead of the tensor, and its unpack
rerun the module on the input under ``no_grad``: the same values, for a few
elementwise passes. The runtime does this with ``Pipeline(recompute="cheap")``
(:mod:`pipeloom.runtime.handlers.offload`); a layer then keeps its norms'
and GELU's inputs but not their outputs, 22 instead of 34 bytes per token and
hidden unit (with ffn = 4h; "PipeOffload: Improving Scalability of Pipeline
Parallelism with Memory Optimization" counts 20, with dropout masks).

Your own stages (``Pipeline.from_stages``) mark nothing themselves: their
torch.nn modules of the kinds in :data:`REBUILT` are marked by forward hooks
(:func:`mark_modules`), each module's output as the module run on its input
(which these modules' own backward keeps).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

_active = False


@contextlib.contextmanager
def cheap_recompute():
    """Within this block, :func:`mark` marks tensors; outside it, it does nothing."""
    global _active
    previous, _active = _active, True
    try:
        yield
    finally:
        _active = previous


def mark(output: torch.Tensor, rebuild: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``output``, marked (inside :func:`cheap_recompute`) as ``rebuild(*inputs)``; returns it. A
    module rebuilds with the weights it runs with now: under ``torch.func.functional_call`` (2bw's
    weight versions: tensors, not its parameters) those of this forward, not the ones it holds when
    the backward unpacks."""
    if _active and not torch.compiler.is_compiling():  # a compiled graph picks what it recomputes itself
        weights = dict(rebuild.named_parameters()) if isinstance(rebuild, nn.Module) else {}
        if not all(isinstance(w, nn.Parameter) for w in weights.values()):
            module = rebuild

            def rebuild(*args):
                return functional_call(module, weights, args)
        output._pipeloom_rebuild = (rebuild, inputs)
    return output


def recipe(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]] | None:
    """How to rebuild ``tensor`` if it is marked, or is a view of a marked tensor (a linear layer
    saves its input flattened to rows): (function, inputs); else None."""
    found = getattr(tensor, "_pipeloom_rebuild", None)
    base = tensor._base
    if found is not None or base is None or (found := getattr(base, "_pipeloom_rebuild", None)) is None:
        return found
    rebuild, inputs = found
    size, stride, offset = tensor.size(), tensor.stride(), tensor.storage_offset()
    return (lambda *args: rebuild(*args).as_strided(size, stride, offset)), inputs


#: torch.nn modules whose output is rebuilt from their input, which their own backward keeps: the norms and
#: the activation functions transformer MLPs use (a ReLU keeps its output instead, so it is left alone).
REBUILT = tuple(getattr(nn, name) for name in ("LayerNorm", "RMSNorm", "GELU", "SiLU") if hasattr(nn, name))


def mark_modules(module: nn.Module) -> list:
    """Mark (:func:`mark`) the output of every :data:`REBUILT` module in ``module`` with a forward
    hook, as the module run on its input; the hooks' handles (``handle.remove()`` takes one off)."""
    return [m.register_forward_hook(_mark_output) for m in module.modules() if isinstance(m, REBUILT)]


def _mark_output(module: nn.Module, args: tuple, output):
    if _active and len(args) == 1 and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
        return mark(output, module, args[0])
    return None
