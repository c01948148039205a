"""K-FAC: Kronecker-factored preconditioning of a model's linear layers.

Conventions. For a managed linear layer ``y = x Wᵀ + b`` (``W`` is
``d_out × d_in``) the layer's block of the empirical Fisher is approximated
by ``A ⊗ G``:

* ``A = E[a aᵀ]`` over the layer's input rows ``a``: every leading dimension
  (batch, time) flattened into rows, and a constant 1 appended to each row
  when the layer has a bias (``d_A = d_in + 1``, else ``d_in``).
* ``G = E[g gᵀ]`` over the rows ``g`` of the loss gradient with respect to
  the layer's output, each multiplied by ``grad_scale``. For a loss that is
  a mean over ``N`` rows autograd's output gradients carry a factor ``1/N``,
  while the empirical Fisher is made of per-example gradients: so by default
  (``grad_scale=None``) each captured gradient is multiplied by its own
  number of rows, which is right when the loss is the mean over the rows the
  layer saw (a language model's mean over batch × time tokens), times
  ``accumulation`` when that loss is further divided by that many equal
  microbatches (a pipeline's; each capture holds one microbatch). Otherwise
  pass the factor (the batch size for a loss averaged over ``B`` sequences
  whose rows the layer sees as ``B × T`` rows; times ``m`` when the loss is
  further divided by ``m`` microbatches).
* ``E`` is the mean over every row of every capture of one refresh, summed
  over the data-parallel replicas; across refreshes the factors are running
  averages ``F ← decay·F + (1 − decay)·F_new`` (the first refresh sets
  ``F = F_new``).
* Damping ``λ`` is split by ``π = sqrt((tr A / d_A) / (tr G / d_G))`` (1 when
  a trace is 0): the inverses are ``(A + √λ·π·I)⁻¹`` and ``(G + √λ/π·I)⁻¹``,
  by Cholesky, in fp32 (or the weight's dtype if wider).
* Preconditioning writes ``G⁻¹ [∇W | ∇b] A⁻¹`` (the bias as the last column)
  back into the gradients; the base optimizer then steps as usual. A layer
  with no inverses yet keeps its gradient unchanged.
* ``tf32`` (a pipeline sets it for a bf16 run on CUDA): the curvature's and
  the preconditioning's products in TF32 on CUDA (inputs rounded to 10
  mantissa bits, fp32 sums; torch's ``torch.backends.cuda.matmul`` setting
  for the call, put back after). A preconditioned gradient then differs from
  fp32's by 0.2-0.4% (a 2-layer GPT's factors after 30 steps, damping 1e-3,
  condition numbers 25-750, TF32 emulated on the CPU), the size of bf16's
  rounding of the gradient itself. The inversions stay fp32.

Managed layers: every ``nn.Linear`` (pipeloom's :class:`~pipeloom.nn.Linear`
included) whose weight requires a gradient, except those named in
``exclude`` and those whose weight is an ``nn.Embedding``'s weight (a tied LM
head: its gradient also holds the lookup table's, which ``A ⊗ G`` of the
linear use does not describe).

Capture: while :attr:`KFAC.capturing` is true and autograd records, a
forward hook keeps each call's input and puts a hook on its output that
keeps the output gradient in the backward's B part, so the capture works
when :func:`~pipeloom.nn.defer_weight_grads` delays the weight gradients.
Each forward (and each backward) of a layer is one capture, numbered from 0
in call order since the layer's last reduction: microbatch ``j`` of a step.
A forward with no backward (evaluation) should run under ``torch.no_grad()``
or with ``capturing`` off, or its inputs count in the next refresh. A
pipeline that recomputes a stage splits the capture: ``capturing = "A"``
keeps the inputs of a forward that runs without autograd, ``"G"`` the output
gradients of the same forward run again, recording, in its backward.

Pieces, for a pipeline to schedule one at a time: :meth:`KFAC.curvature`
(one factor of one layer from one capture), :meth:`KFAC.reduce` (one factor
of one layer over the replicas, into the running average),
:meth:`KFAC.invert` (one layer) and :meth:`KFAC.precondition` (all layers).
:meth:`KFAC.step` runs them in order for plain, non-pipelined training.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..errors import PipeloomError

FACTORS = ("A", "G")


@dataclass(eq=False)
class KFACLayer:
    """One managed layer: its pending captures, the current refresh's sums,
    and its factors and inverses (keyed ``"A"`` and ``"G"``)."""

    module: nn.Linear
    captures: dict[str, list[torch.Tensor | None]] = field(default_factory=lambda: {"A": [], "G": []})
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=lambda: {"A": 0, "G": 0})
    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    inverses: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types(self.module.weight.dtype, torch.float32)

    def dim(self, factor: str) -> int:
        w = self.module.weight
        return w.shape[0] if factor == "G" else w.shape[1] + (self.module.bias is not None)


class KFAC:
    """K-FAC around a base optimizer (see the module docstring).

    ``opt = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))``, then
    per step ``loss.backward(); opt.step(); opt.zero_grad()``. Factors refresh
    from the steps whose forward and backward ran while :attr:`capturing`
    (every ``update_every``-th step, from the first); inverses are recomputed
    every ``invert_every``-th step from the factors of then, and precondition
    from ``delay`` steps later on (PipeFisher's refresh of k steps: ``delay``
    k - 1, the step in which its pieces end). ``exclude``
    names linear layers (as in ``model.named_modules()``) to leave alone;
    ``group`` is the data-parallel process group the factors are summed over
    (None: no reduction), with ``all_reduce(tensor)`` if given (a pipeline's
    waits with a timeout), else ``torch.distributed.all_reduce``. ``base``
    None: no :meth:`step`; a pipeline runs the pieces and the caller steps its
    own optimizer. ``tf32``: the curvature's and preconditioning's products in
    TF32 on CUDA (see the module's conventions). ``some``: the model must hold
    a linear layer to manage (False: a pipeline rank whose stages hold only
    an excluded LM head manages none, and its pieces do nothing).
    """

    def __init__(self, model: nn.Module, base: torch.optim.Optimizer | None, damping: float = 1e-3, decay: float = 0.95,
                 update_every: int = 1, invert_every: int = 1, exclude=(), grad_scale: float | None = None,
                 group: dist.ProcessGroup | None = None, delay: int = 0, all_reduce=None, tf32: bool = False,
                 some: bool = True):
        if not damping >= 0:
            raise PipeloomError(f"KFAC: damping {damping} is negative; use a value >= 0 (e.g. 1e-3)")
        if not 0 <= decay < 1:
            raise PipeloomError(f"KFAC: decay {decay} is outside [0, 1); use e.g. 0.95")
        for name, every in (("update_every", update_every), ("invert_every", invert_every)):
            if not isinstance(every, int) or every < 1:
                raise PipeloomError(f"KFAC: {name} {every!r} is not a whole number of steps >= 1")
        if not isinstance(delay, int) or not 0 <= delay < invert_every:
            raise PipeloomError(f"KFAC: delay {delay!r} must be a whole number of steps in [0, invert_every="
                                f"{invert_every})")
        if grad_scale is not None and not grad_scale > 0:
            raise PipeloomError(f"KFAC: grad_scale {grad_scale} is not positive; use None (the rows of each "
                                "capture) or the factor that makes output gradients per-example")
        self.base, self.damping, self.decay, self.grad_scale, self.group = base, damping, decay, grad_scale, group
        self.all_reduce, self.tf32 = all_reduce, tf32
        self.update_every, self.invert_every, self.delay = update_every, invert_every, delay
        self.layers = self._managed_layers(model, set(exclude), some)
        if base is not None:
            self._check_base()
        for layer in self.layers.values():
            layer.module.register_forward_hook(self._forward_hook(layer))
        #: The number of equal microbatches the loss is averaged over (with ``grad_scale`` None).
        self.accumulation = 1
        #: Whether forwards and backwards capture curvature now (set by :meth:`step`; a pipeline may set it):
        #: True, False, or "A" / "G" for the inputs or the output gradients alone.
        self.capturing: bool | str = True
        self.steps = 0

    @staticmethod
    def _managed_layers(model: nn.Module, exclude: set[str], some: bool) -> dict[str, KFACLayer]:
        modules = dict(model.named_modules())
        linear = [name for name, m in modules.items() if isinstance(m, nn.Linear)]
        unknown = sorted(exclude - set(linear))
        if unknown:
            raise PipeloomError(f"KFAC: exclude names {unknown[0]!r}, not a linear layer of the model; "
                                f"its linear layers are {linear}")
        tied = {id(m.weight) for m in modules.values() if isinstance(m, nn.Embedding)}
        layers = {name: KFACLayer(modules[name]) for name in linear if name not in exclude
                  and id(modules[name].weight) not in tied and modules[name].weight.requires_grad}
        if not layers and some:
            raise PipeloomError(f"KFAC: model {type(model).__name__} has no linear layer to precondition "
                                f"(linear layers {linear}, excluded {sorted(exclude)}); K-FAC needs at least one "
                                "nn.Linear with a trainable, untied weight")
        return layers

    def _check_base(self) -> None:
        held = {id(p) for group in self.base.param_groups for p in group["params"]}
        for name, layer in self.layers.items():
            for kind, p in layer.module.named_parameters():
                if p.requires_grad and id(p) not in held:
                    raise PipeloomError(f"KFAC: the base optimizer does not hold parameter {name}.{kind} of the "
                                        "model; build it from model.parameters()")

    def _forward_hook(self, layer: KFACLayer):
        def hook(module, inputs, output):
            capturing = self.capturing
            records = torch.is_grad_enabled() and output.requires_grad
            if capturing == "A" or (capturing is True and records):
                layer.captures["A"].append(inputs[0].detach())
            if records and (capturing is True or capturing == "G"):
                output.register_hook(lambda grad: layer.captures["G"].append(grad.detach()))
        return hook

    def curvature(self, name: str, factor: str, microbatch: int) -> None:
        """Add one capture's ``Σ rows·rowsᵀ`` to layer ``name``'s ``factor``
        ("A": inputs, from forward ``microbatch``; "G": output gradients, from
        backward ``microbatch``), then drop the capture."""
        layer = self._layer(name)
        captures = layer.captures[self._factor(factor)]
        if not 0 <= microbatch < len(captures) or captures[microbatch] is None:
            pending = [j for j, c in enumerate(captures) if c is not None]
            raise PipeloomError(f"KFAC: layer {name!r} has no capture {microbatch} for {factor}; "
                                f"pending captures: {pending}")
        x, captures[microbatch] = captures[microbatch], None
        rows = x.reshape(-1, x.shape[-1]).to(layer.dtype)
        if factor == "A" and layer.module.bias is not None:
            rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
        if factor == "G":
            rows = rows * (self.grad_scale or rows.shape[0] * self.accumulation)
        with _tf32(self.tf32):
            total = rows.t() @ rows
        layer.sums[factor] = total if factor not in layer.sums else layer.sums[factor] + total
        layer.rows[factor] += rows.shape[0]

    def reduce(self, name: str, factor: str) -> None:
        """Sum layer ``name``'s curvature of ``factor`` since its last reduction
        over the replicas of ``group`` (an all-reduce every replica must join;
        nothing to do without a group) and fold its mean into the running
        average. Every capture must have been through :meth:`curvature`."""
        layer = self._layer(name)
        captures = layer.captures[self._factor(factor)]
        pending = [j for j, c in enumerate(captures) if c is not None]
        if pending:
            raise PipeloomError(f"KFAC: layer {name!r} still holds captures {pending} for {factor}; "
                                "run curvature on them before reduce")
        captures.clear()
        total, rows = layer.sums.pop(factor, None), layer.rows[factor]
        layer.rows[factor] = 0
        if self.group is not None:
            d = layer.dim(factor)
            if total is None:
                total = torch.zeros(d, d, dtype=layer.dtype, device=layer.module.weight.device)
            packed = torch.cat([total.flatten(), total.new_tensor([rows])])
            if self.all_reduce is not None:
                self.all_reduce(packed)
            else:
                dist.all_reduce(packed, group=self.group)
            total, rows = packed[:-1].view(d, d), packed[-1].item()
        if rows == 0:
            return
        new, old = total / rows, layer.factors.get(factor)
        layer.factors[factor] = new if old is None else self.decay * old + (1 - self.decay) * new

    def invert(self, name: str) -> None:
        """Compute layer ``name``'s damped inverses from its factors (π-split damping); they
        precondition once :meth:`publish` has run."""
        layer = self._layer(name)
        if len(layer.factors) < 2:
            raise PipeloomError(f"KFAC: layer {name!r} has factors {sorted(layer.factors)}, not both A and G; "
                                "capture, curvature and reduce both before invert")
        a, g = layer.factors["A"], layer.factors["G"]
        mean_a, mean_g = a.trace() / a.shape[0], g.trace() / g.shape[0]
        pi = torch.where((mean_a > 0) & (mean_g > 0), (mean_a / mean_g).sqrt(), torch.ones_like(mean_a))
        root = math.sqrt(self.damping)
        try:
            layer.pending = {"A": _damped_inverse(a, root * pi), "G": _damped_inverse(g, root / pi)}
        except torch.linalg.LinAlgError:
            raise PipeloomError(f"KFAC: a damped factor of layer {name!r} is not positive definite with "
                                f"damping {self.damping}; use a larger damping (e.g. 1e-3)") from None

    def publish(self, names=None) -> None:
        """Precondition with the inverses computed since the last publish, from now on
        (the layers ``names``, default all)."""
        for layer in self._chosen(names):
            if layer.pending:
                layer.inverses, layer.pending = layer.pending, {}

    def precondition(self, names=None, weights=None) -> None:
        """Replace every layer's (or the layers ``names``') gradient by ``G⁻¹ [∇W | ∇b] A⁻¹``
        (layers with no inverses yet or no weight gradient are left as they are). ``weights``: by
        layer name, the (weight, bias or None) whose ``.grad`` to precondition instead of the layer's
        own parameters' (a step's weight version, PipeDream-2BW's)."""
        with _tf32(self.tf32):  # once for the call: its other operations are no products
            for name in self.layers if names is None else names:
                layer = self._layer(name)
                w, b = weights[name] if weights else (layer.module.weight, layer.module.bias)
                if not layer.inverses or w.grad is None:
                    continue
                grad = w.grad.to(layer.dtype)
                if b is not None:
                    grad_b = b.grad if b.grad is not None else torch.zeros_like(b)
                    grad = torch.cat([grad, grad_b.to(layer.dtype).unsqueeze(1)], dim=1)
                grad = layer.inverses["G"] @ grad @ layer.inverses["A"]
                w.grad.copy_(grad[:, :w.shape[1]])
                if b is not None and b.grad is not None:
                    b.grad.copy_(grad[:, -1])

    def step(self) -> None:
        """One plain training step: refresh the factors (if this step
        captured), the inverses (every ``invert_every`` steps, in use ``delay``
        steps later), precondition, then the base optimizer's step."""
        if self.base is None:
            raise PipeloomError("KFAC: built without a base optimizer, it has no step(); run its pieces")
        if self.capturing:
            for name, layer in self.layers.items():
                for factor in FACTORS:
                    for j in range(len(layer.captures[factor])):
                        self.curvature(name, factor, j)
                    self.reduce(name, factor)
        if self.steps % self.invert_every == 0:
            for name, layer in self.layers.items():
                if len(layer.factors) == 2:
                    self.invert(name)
        if self.steps % self.invert_every == self.delay:
            self.publish()
        self.precondition()
        self.base.step()
        self.steps += 1
        self.capturing = self.steps % self.update_every == 0

    def state_dict(self) -> dict:
        """The base optimizer's state, the step count and every layer's factors and inverses
        (pending ones included), by layer name; captures in flight are not saved."""
        layers = {name: {part: dict(getattr(layer, part)) for part in ("factors", "inverses", "pending")}
                  for name, layer in self.layers.items()}
        return {"base": self.base.state_dict() if self.base else None, "steps": self.steps, "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (same managed layers)."""
        saved = state["layers"]
        if set(saved) != set(self.layers):
            raise PipeloomError(f"KFAC: the state is for layers {sorted(saved)}, this optimizer manages "
                                f"{sorted(self.layers)}")
        if self.base is not None:
            self.base.load_state_dict(state["base"])
        self.steps = state["steps"]
        self.capturing = self.steps % self.update_every == 0
        for name, layer in self.layers.items():
            device = layer.module.weight.device
            for part, tensors in saved[name].items():
                setattr(layer, part, {f: t.to(device) for f, t in tensors.items()})

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``."""
        self.base.zero_grad(set_to_none=set_to_none)

    def _chosen(self, names) -> list[KFACLayer]:
        return list(self.layers.values()) if names is None else [self._layer(name) for name in names]

    def _layer(self, name: str) -> KFACLayer:
        if name not in self.layers:
            raise PipeloomError(f"KFAC: {name!r} is not a managed layer; managed layers are {list(self.layers)}")
        return self.layers[name]

    @staticmethod
    def _factor(factor: str) -> str:
        if factor not in FACTORS:
            raise PipeloomError(f"KFAC: factor {factor!r} is not one of {list(FACTORS)}")
        return factor


def tf32_for(device: torch.device, autocast: torch.dtype | None) -> bool:
    """Whether a run on ``device`` under ``autocast`` (None: none) takes :class:`KFAC`'s ``tf32``:
    a 16-bit run on CUDA, whose other products are reduced precision already."""
    return device.type == "cuda" and autocast is not None


@contextmanager
def _tf32(enabled: bool):
    """CUDA's fp32 matrix products in TF32 within the block where ``enabled``, torch's setting as it
    was after (``fp32_precision``; ``allow_tf32`` before torch 2.9)."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, on = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    was = getattr(matmul, name)
    setattr(matmul, name, on)
    try:
        yield
    finally:
        setattr(matmul, name, was)


def _damped_inverse(factor: torch.Tensor, damping: torch.Tensor) -> torch.Tensor:
    """``(factor + damping·I)⁻¹`` by Cholesky."""
    damped = factor + damping * torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    return torch.cholesky_inverse(torch.linalg.cholesky(damped))
