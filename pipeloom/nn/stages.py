"""A user's own stage modules, as a model a pipeline can cut: :class:`Stages`.

A pipeline needs of its model what :class:`~pipeloom.nn.gpt.GPT` gives it:
``build_stages`` (one rank's stages, materialised on its device), each stage's
``param_names`` (local name -> name in the unsplit model) and ``tied``, and the
shape of what each stage hands on, to size the receive buffers. :class:`Stages`
gives them for any list of ``nn.Module`` s, the unsplit model being the list run
one after another (``Stages(modules)(x)``), whose parameters are named
``"<stage>.<name in the stage>"`` as in an ``nn.Sequential``.

The contract: stage 0 takes the step's input (tokens, or any tensor), stage
``k`` the output of stage ``k - 1``: one floating-point tensor whose shape
follows from the input's (the same for every microbatch of a step), found by
running the stages on the meta device; the last stage returns what the loss
function takes. No parameter is shared between two stages.

Every rank gives the whole list; a rank keeps only its own stages. A stage
built on the meta device (``with torch.device("meta"):``) holds no storage until
:meth:`Stages.build_stages` materialises it, on the CPU and then the device:
``init_weights()`` if the stage has one (torchtitan's convention), else every
submodule's ``reset_parameters()`` (or torch's private ``_reset_parameters()``,
which ``nn.MultiheadAttention`` has), children before parents as construction
runs them, with torch's generator seeded by the stage's index and ``init_seed``
(a number drawn from torch's default generator when the list is wrapped): the
same weights on every rank and in the one-process model made the same way.

:class:`Stage` is one stage as the runtime holds it: the module, its names,
and its plain ``nn.Linear`` layers switched to the deferrable backward
(:func:`~pipeloom.nn.linear.deferrable`) while it runs, so that zero-bubble
schedules defer their weight gradients to W; every other parameter (norms,
embeddings, ``nn.MultiheadAttention``'s projections, subclasses of
``nn.Linear`` with their own forward) gets its gradient in B.
"""

from __future__ import annotations

import itertools
import zlib
from typing import Iterable

import torch
from torch import nn
from torch.func import functional_call

from ..errors import PipeloomError
from .linear import deferrable, plain_linears


class Stage(nn.Module):
    """Stage ``index`` of a :class:`Stages`: ``module`` with the names a pipeline reads."""

    def __init__(self, module: nn.Module, index: int):
        super().__init__()
        self.module, self.index = module, index
        self.param_names = {f"module.{n}": f"{index}.{n}" for n, _ in module.named_parameters()}
        self.tied: dict[str, str] = {}
        self.linears = plain_linears(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with deferrable(self.linears):
            return self.module(x)


class Stages(nn.Module):
    """The stages ``modules`` (stage 0 first) as one model: ``Stages(modules)(x)`` runs them in
    turn. See the module docstring for what a stage may take and return."""

    def __init__(self, modules: Iterable[nn.Module]):
        super().__init__()
        modules = list(modules)
        if not modules or not all(isinstance(m, nn.Module) for m in modules):
            raise PipeloomError(f"stages: give a list of nn.Module, one per stage; got "
                                f"{[type(m).__name__ for m in modules] or 'none'}")
        owner: dict[int, str] = {}
        for k, module in enumerate(modules):
            self.add_module(str(k), module)
            for name, p in module.named_parameters():
                other = owner.setdefault(id(p), f"{k}.{name}")
                if not other.startswith(f"{k}."):
                    raise PipeloomError(f"stages share a parameter ({other} is {k}.{name}): a pipeline does not "
                                        f"tie weights across user stages; give each stage its own")
        meta = any(t.is_meta for m in modules for t in itertools.chain(m.parameters(), m.buffers()))
        #: seeds the initialisation of the stages built on the meta device (None: there are none)
        self.init_seed = int(torch.randint(2**32, (), device="cpu")) if meta else None
        # each stage's tensors as meta tensors, kept to run the stages for their shapes whatever is freed
        self._meta = [{n: torch.empty_like(t, device="meta")
                       for n, t in itertools.chain(m.named_parameters(), m.named_buffers())} for m in modules]
        self._shapes: dict[tuple, list[tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, k: int) -> nn.Module:
        return self._modules[str(k)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self._modules.values():
            x = module(x)
        return x

    def build_stages(self, n_stages: int, indices, layers_per_stage=None, vocab_parallel: bool = False,
                     device: str | torch.device | None = None) -> dict[int, Stage]:
        """The stages ``indices`` as :class:`Stage` modules on ``device``, as
        :meth:`pipeloom.nn.GPT.build_stages` gives them; meta stages materialised (module docstring)."""
        if n_stages != len(self):
            raise PipeloomError(f"{len(self)} stage modules for a schedule of {n_stages} stages: give {n_stages} "
                                f"modules, or a pp (and chunks) whose schedule has {len(self)} stages")
        if layers_per_stage is not None or vocab_parallel:
            raise PipeloomError("layers_per_stage and vocabulary parallelism cut pipeloom's GPT; user stages come cut")
        built = {}
        for k in indices:
            module = self._materialised(k)
            built[k] = Stage(module if device is None else module.to(device), k)
        return built

    def _materialised(self, k: int) -> nn.Module:
        """Stage ``k``, given storage on the CPU and initialised if it is on the meta device."""
        module = self[k]
        meta = [t.is_meta for t in itertools.chain(module.parameters(), module.buffers())]
        if not any(meta):
            return module
        if not all(meta):
            raise PipeloomError(f"stage {k} ({type(module).__name__}) holds both meta and materialised tensors: "
                                f"build it wholly on the meta device or wholly on a device")
        init = getattr(module, "init_weights", None)
        resets = [] if init else list(_resets(module, str(k)))
        module.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(zlib.crc32(str(k).encode(), self.init_seed))
            for reset in [init] if init else resets:
                reset()
        return module

    def boundary_shape(self, k: int, x: torch.Tensor) -> tuple[int, ...]:
        """The shape of what stage ``k`` hands on for a microbatch whose stage-0 input is ``x``."""
        key = (tuple(x.shape), x.dtype)
        if key not in self._shapes:
            self._shapes[key] = self._run_on_meta(x)
        return self._shapes[key][k]

    def _run_on_meta(self, x: torch.Tensor) -> list[tuple[int, ...]]:
        """The shapes every stage but the last hands on, running them on meta tensors; checks them."""
        shapes, y = [], torch.empty(x.shape, dtype=x.dtype, device="meta")
        with torch.no_grad():
            for k in range(len(self) - 1):
                module = self[k]
                try:
                    y = functional_call(module, self._meta[k], (y,))
                except Exception as err:
                    raise PipeloomError(
                        f"stage {k} ({type(module).__name__}) did not run on the meta device, which sizes what it "
                        f"sends: {type(err).__name__}: {err}; its forward must not read values (.item(), shapes "
                        f"that depend on data)") from err
                if not isinstance(y, torch.Tensor) or not y.is_floating_point():
                    what = f"a {y.dtype} tensor" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
                    raise PipeloomError(f"stage {k} ({type(module).__name__}) returns {what}: a stage hands on "
                                        f"one floating-point tensor (its gradient comes back)")
                shapes.append(tuple(y.shape))
        return shapes


def _resets(module: nn.Module, path: str):
    """The initialisers of ``module`` and its submodules, children first; one holding parameters or
    buffers of its own without one stops with the path and the way out."""
    for name, child in module.named_children():
        yield from _resets(child, f"{path}.{name}")
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if reset is None and (any(p is not None for p in module._parameters.values())
                          or any(b is not None for b in module._buffers.values())):
        raise PipeloomError(f"stage module {path} ({type(module).__name__}) is on the meta device and has no "
                            f"reset_parameters(): give its stage an init_weights() method, or build it materialised")
    if reset is not None:
        yield reset
