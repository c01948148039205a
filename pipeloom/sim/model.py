"""Costs from a model description: decoder FLOP and memory formulas on a device.

The per-layer formulas are those of "Zero Bubble Pipeline Parallelism" (a
GPT layer with ``ffn = 4h``; see docs/design.md), with the 4 generalised to
:attr:`ModelSpec.ffn`: for one layer and one microbatch of ``b`` sequences
of ``s`` tokens,

- forward ``F = bsh((8 + 4·ffn)h + 4s)`` FLOPs, input-gradient backward
  ``B = bsh((8 + 4·ffn)h + 8s)``, weight-gradient backward ``W = (8 + 4·ffn)bsh²``
  (24 for ``ffn = 4``);
- activations kept from F to the backward ``M_B = sb((18 + 4·ffn)h + 5as)``
  bytes (34h), of which ``M_W = (16 + 4·ffn)sbh`` (32) stay from B to W;
- parameters ``(4 + 2·ffn)h² + (9 + ffn)h`` (12h² + 13h).

Llama-style layers (:class:`ModelSpec`'s ``kv_heads``, ``ffn_hidden``,
``gated``, ``bias``, ``rotary``) count the same things from their shapes: with
``P`` the weights of a layer's matrices (:attr:`ModelSpec.matrix_params`:
``2h² + 2h·kv`` for q, k, v and the output projection, ``kv`` the width of
the keys, plus 2 or, gated (SwiGLU), 3 matrices of ``h × f``), ``F =
bs(2P + 4sh)``, ``B = bs(2P + 8sh)``, ``W = 2bsP``; ``M_B = sb(14h + 4kv + 4f
+ 5as)`` bytes, ``8f`` instead of ``4f`` when gated (the gate, its SiLU, the up
projection and their product), ``M_W = sb(12h + 4kv + 4f)`` (``6f`` gated: the
inputs and output gradients of the linear layers); no biases and one-weight
norms (RMSNorm) without ``bias``, and no position embeddings with ``rotary``.
With ``kv = h``, ``f = ffn·h`` these are the formulas above.

The input embedding (3bsh FLOPs, hV + sh parameters) sits on the first stage;
the output layer (LM head and softmax cross-entropy: 2bshV FLOPs each for F,
B and W; hV parameters plus the final norm) on the last. Times are in
milliseconds, memory in bytes, so the simulator's peak activation comes out
in bytes.

``vocab_parallel`` picks where the vocabulary layers go ("Balancing Pipeline
Parallelism with Vocabulary Parallelism"): ``none`` as above; ``redis`` also,
with the transformer layers spread so that every stage's compute is as even as
whole layers allow (:func:`~pipeloom.partition.balanced_layers`); ``naive``, ``vocab-1``,
``vocab-2`` split both layers over the p ranks (V/p rows each, padded), whose
passes cost, per rank and microbatch, with ``X`` the ``[bs, V/p]`` by
``[V/p, h]`` product (2bshV/p FLOPs): S = X (vocab-2: 2X, the logits and
``softmax'·W``), T = 2X (vocab-2: X, the weight gradient), input forward bsh/p
and backward 2bsh/p (3bsh in all); collectives on the ring at the link
bandwidth (all-reduce of n bytes ``2(p-1)/p·n``, reduce ``(p-1)/p·n``): C the
all-reduces of the max and the sum (4bs bytes each; naive: the max only, and
as much for its CZ), plus for vocab-2 the reduce of the input gradient (2bsh),
which R is for vocab-1 and naive; the input layer's all-reduce (2bsh). An S
keeps the fp32 softmax (4bsV/p) and its input (2bsh) until its T. The first
stage keeps the position embeddings, the last the final norm (whose input
stays in its M_B).

``sp = N`` adds sequence parallelism inside every stage (Ring Self-Attention,
"Sequence Parallelism: Long Sequence Training from System Perspective"): each
of N ranks holds ``t = s/N`` tokens of every sequence and all the stage's
weights, so every per-token term above counts ``t`` tokens and attention ``t``
rows of ``s`` columns (compute and activations 1/N), the model state is
unchanged, and the keys and values go round a ring of N ranks, at the link
bandwidth:

- ``ring`` (blockwise ring attention, online softmax): N-1 steps of one K
  and one V block (``4bth`` bytes) per layer forward, twice the bytes
  backward (K, V, dK, dV); a step's transfer overlaps the compute of the
  current ``[t, t]`` block (``4bt²h`` FLOPs forward, ``8bt²h`` backward), so
  only ``max(0, transfer - block)`` per step adds to F and B. Between F and B
  a layer keeps its log-sum-exp (``4bat`` bytes) instead of the scores, and
  while it computes it holds one ``[b, a, t, t]`` block (``5at²b`` bytes,
  the 5 bytes a score of ``M_B``'s ``5as`` term), which
  :func:`peak_memory_bytes` adds once.
- ``rsa`` (Ring Self-Attention): K, then V, round the ring (2(N-1) steps of
  ``2bth`` bytes), not overlapped; the backward passes K and V again and
  all-reduces full-length dK and dV (the RSA paper's ``8(N-1)·b·t·h`` elements
  per layer in all), also on the critical path. A layer keeps its
  ``[b, a, t, s]`` scores: ``5atsb`` bytes.

With ``sp = 1`` and no ``attention`` a layer runs fused attention (``sdpa``,
torch's ``scaled_dot_product_attention``, as the runtime does): no scores at
all, only the log-sum-exp (``4bas`` bytes) kept, in place of ``M_B``'s
``5as`` term, which assumes the scores are kept (measured on an H100: gpt-350m
at microbatch 4 took 11.06 GiB where the ``5as²b`` term predicted 18.28).
``rsa`` on one rank is plain attention, whose scores stay from F to B;
``ring`` on one rank is blockwise attention (log-sum-exp kept, one
``[b, a, s, s]`` block while it computes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import PipeloomError
from ..modes import Attention, VocabMode
from ..partition import balanced_layers, split_layers, stage_totals
from ..presets import SIZES
from ..schedule import build
from ..schedule.costs import Costs
from ..schedule.ir import parts
from ..schedule.kinds import graded
from .simulate import Result, simulate

if TYPE_CHECKING:
    from .profile import Profile

#: Bytes of model state per parameter, Megatron-style mixed precision: bf16
#: weights (2) + fp32 gradient buffer (4) + fp32 master weights (4) + Adam's
#: two fp32 moments (4 + 4). No distributed optimizer: every rank keeps all of
#: it for its own stages.
BYTES_PER_PARAM = 18
#: Of those, the fp32 gradient: it exists only from a stage's first backward
#: of the step (the runtime frees gradients after each optimizer step).
GRAD_BYTES_PER_PARAM = 4
#: Bytes per parameter of each weight version beyond the first that a schedule
#: running several steps without a flush keeps (2bw: 2 versions, so one more): a
#: copy of the fp32 weights the runtime keeps. The newest version is the
#: parameters themselves, and a stage runs its backwards in step order, so it holds
#: one gradient at a time (:mod:`pipeloom.runtime.versions`).
VERSION_BYTES_PER_PARAM = 4


#: Bytes an AdamW step with gradient clipping moves per fp32 parameter: reads the weight,
#: gradient and two moments (and the gradient once more for the norm), writes weight and moments.
OPTIMIZER_BYTES_PER_PARAM = 32
#: See :data:`DEVICES`.
CPU_MEMORY_BANDWIDTH = 7e9


def optimizer_ms(params: float, device: Device, profile: Profile | None = None) -> float:
    """Milliseconds of the optimizer step (clipping, AdamW) over ``params`` parameters: the
    profile's measured time per parameter, else :data:`OPTIMIZER_BYTES_PER_PARAM` at the device's
    memory bandwidth (0 without one)."""
    if profile is not None and profile.optimizer_ns_per_param is not None:
        return params * profile.optimizer_ns_per_param / 1e6
    if device.memory_bandwidth is None:
        return 0.0
    return 1e3 * params * OPTIMIZER_BYTES_PER_PARAM / device.memory_bandwidth


def state_bytes_per_param(bytes_per_param: float, versions: int) -> tuple[float, float]:
    """(bytes of model state per parameter held all step, bytes of its gradient, which
    appears at the stage's first backward) with ``versions`` weight versions (0 or 1:
    the parameters only; each more, :data:`VERSION_BYTES_PER_PARAM`)."""
    grad = min(GRAD_BYTES_PER_PARAM, bytes_per_param)
    return bytes_per_param - grad + max(versions - 1, 0) * VERSION_BYTES_PER_PARAM, grad


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: ``layers`` transformer layers of width ``hidden`` with
    ``heads`` attention heads, a ``vocab``-token embedding, an LM head and an
    MLP ``ffn`` times as wide as ``hidden``.

    ``tied_embeddings`` shares the LM head with the token embedding in the
    parameter count; a pipeline still keeps a copy of it on the last stage
    (as Megatron-LM does), so per-stage memory is the same either way.

    The defaults describe a GPT. A Llama-style layer sets ``kv_heads``
    (grouped-query attention: keys and values of that many heads; None:
    ``heads``), ``ffn_hidden`` (the MLP's width, instead of ``ffn`` times
    ``hidden``), ``gated`` (a SwiGLU MLP: three matrices), ``bias`` False (no
    biases in the linear layers, norms of one weight vector: RMSNorm) and
    ``rotary`` (rotary positions: no position embeddings).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int = 4
    tied_embeddings: bool = False
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated: bool = False
    bias: bool = True
    rotary: bool = False

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            if value is None and field in ("kv_heads", "ffn_hidden"):
                continue
            if not isinstance(value, int) or value < 1:
                raise PipeloomError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise PipeloomError(
                f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}"
            )
        if self.heads % (self.kv_heads or self.heads):
            raise PipeloomError(f"model {self.name!r}: kv_heads {self.kv_heads} does not divide heads {self.heads}")

    @property
    def kv_width(self) -> int:
        """Width of a layer's keys (and of its values): ``kv_heads`` heads of ``hidden / heads``."""
        return self.hidden // self.heads * (self.kv_heads or self.heads)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: ``ffn_hidden``, or ``ffn`` times ``hidden``."""
        return self.ffn_hidden or self.ffn * self.hidden

    @property
    def matrix_params(self) -> int:
        """Weights of one layer's matrices: q, k, v and the output projection, the MLP's
        two (three when ``gated``). Each does 2 FLOPs per weight and token in F, B and W."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * self.mlp_width

    @property
    def norm_params(self) -> int:
        """One norm's parameters: a LayerNorm's weight and bias (2h), without ``bias`` a weight (h)."""
        return 2 * self.hidden if self.bias else self.hidden

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.mlp_width
        biases = 3 * h + 2 * self.kv_width + (2 if self.gated else 1) * f if self.bias else 0
        return self.matrix_params + 2 * self.norm_params + biases

    def parameters(self, seq: int) -> int:
        """Distinct parameters: layers, token and position embeddings (``seq``
        positions), LM head (unless tied) and final norm."""
        head = self.head_params - (self.hidden * self.vocab if self.tied_embeddings else 0)
        return self.layers * self.layer_params + self.embedding_params(seq) + head

    def position_params(self, seq: int) -> int:
        """Learned position embeddings of ``seq`` positions (none with ``rotary``)."""
        return 0 if self.rotary else self.hidden * seq

    def embedding_params(self, seq: int) -> int:
        return self.hidden * self.vocab + self.position_params(seq)

    @property
    def head_params(self) -> int:
        """LM head weights (hV) plus the final norm (2h; h without ``bias``)."""
        return self.hidden * self.vocab + self.norm_params

    def vocab_shard_params(self, ranks: int) -> int:
        """Parameters of one rank's vocabulary shard (V/p rows, padded) of the
        token embedding and the LM head (one matrix when they are tied)."""
        return -(-self.vocab // ranks) * self.hidden * (1 if self.tied_embeddings else 2)


def _spec(name: str, size) -> ModelSpec:
    """The simulator's model of the :class:`~pipeloom.presets.ModelSize` ``size``."""
    llama = size.family == "llama"
    return ModelSpec(name, size.layers, size.hidden, size.heads, size.vocab, tied_embeddings=size.tied,
                     kv_heads=size.kv_heads, ffn_hidden=size.ffn_hidden, gated=llama, bias=not llama, rotary=llama)


#: Model presets by lowercase name: every size of :data:`pipeloom.presets.SIZES`.
MODELS: dict[str, ModelSpec] = {name: _spec(name, size) for name, size in SIZES.items()}


@dataclass(frozen=True)
class Device:
    """One accelerator: dense 16-bit peak FLOP/s, memory bytes, achievable
    point-to-point bandwidth to the next pipeline rank and to host memory
    (bytes/s), ``efficiency``, the fraction of peak a transformer layer
    reaches (MFU-like; every FLOP count is divided by ``peak_flops * efficiency``),
    and ``memory_bandwidth`` (bytes/s), which times the optimizer step (None: not timed)."""

    name: str
    peak_flops: float
    memory: float
    link_bandwidth: float
    host_bandwidth: float
    efficiency: float = 0.5
    memory_bandwidth: float | None = None

    def __post_init__(self):
        for field in ("peak_flops", "memory", "link_bandwidth", "host_bandwidth"):
            if not getattr(self, field) > 0:
                raise PipeloomError(f"device {self.name!r}: {field} must be positive, got {getattr(self, field)!r}")
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise PipeloomError(f"device {self.name!r}: memory_bandwidth must be positive or None, "
                                f"got {self.memory_bandwidth!r}")
        if not 0 < self.efficiency <= 1:
            raise PipeloomError(f"device {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")

    def ms(self, flops: float) -> float:
        """Milliseconds to run ``flops`` at the achievable rate."""
        return 1e3 * flops / (self.peak_flops * self.efficiency)


_GiB = 2**30

#: Device presets by lowercase name. Link bandwidths are what pipeline P2P
#: achieves, not the NVLink headline: the zero-bubble paper's profiled T_comm
#: move a 2bsh activation at about 48 GB/s inside an A100 node;
#: H100 and V100 scale that by their NVLink generation (450 and 150 GB/s per
#: direction against the A100's 300). Host links: the ~15 GB/s for A100
#: (PCIe 4) of "PipeOffload: Improving Scalability of Pipeline Parallelism with
#: Memory Optimization"; H100: 55 GB/s, pinned copies of 64 MiB to 1 GiB
#: measured both ways on an H200 (PCIe 5) for this project; ~10 GB/s for PCIe 3.
#: Memory bandwidth: the HBM datasheet figures (A100 80 GB 2.0 TB/s, H100 SXM
#: 3.35, V100 0.9); the CPU's is what one thread's clipping and AdamW step
#: achieve over :data:`OPTIMIZER_BYTES_PER_PARAM` on the development VM (about
#: 5 ns per parameter: ``pipeloom train``'s measured step less its actions' span).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # A100 SXM 80 GB: 312 TFLOP/s dense bf16. Efficiency 0.5 puts the
        # zero-bubble paper's four models within ~20% of their profiled T_F.
        Device("a100", 312e12, 80 * _GiB, 50e9, 15e9, 0.5, 2.0e12),
        # H100 SXM 80 GB: 989 TFLOP/s dense bf16. Efficiency measured: one
        # layer's F, B and W (bench/gpu_layer.py, bf16, on an H200, the same
        # compute) of the zero-bubble 1.5B and 6.2B shapes and gpt-1.3b reach
        # 0.42-0.63 of peak, 0.53 over their summed time; the H100
        # figures for the 6.2B layer (T_F 2.07 ms) give 0.62 for F.
        Device("h100", 989e12, 80 * _GiB, 75e9, 55e9, 0.53, 3.35e12),
        # V100 SXM2 32 GB: 125 TFLOP/s fp16 tensor cores (no bf16 on V100).
        Device("v100", 125e12, 32 * _GiB, 25e9, 10e9, 0.4, 0.9e12),
        # A small x86 VM (2 AVX-512 cores): ~0.26 TFLOP/s fp32 matmul measured
        # with numpy on the development machine; gloo over loopback between ranks.
        Device("cpu", 0.26e12, 16 * _GiB, 5e9, 10e9, 0.5, CPU_MEMORY_BANDWIDTH),
    )
}


def get_model(model: ModelSpec | str) -> ModelSpec:
    """``model`` itself, or the preset of that name."""
    return _preset(model, ModelSpec, MODELS, "model")


def get_device(device: Device | str) -> Device:
    """``device`` itself, or the preset of that name."""
    return _preset(device, Device, DEVICES, "device")


def _preset(value, kind: type, presets: dict, what: str):
    if isinstance(value, kind):
        return value
    if value not in presets:
        raise PipeloomError(f"unknown {what} {value!r}; presets: {', '.join(presets)}")
    return presets[value]


def _stage_layers(model: ModelSpec, stages: int, layers_per_stage, seq: int = 0,
                  mode: VocabMode = VocabMode.NONE) -> tuple[int, ...]:
    if layers_per_stage is None:
        return balanced_layers(model, stages, seq) if mode == VocabMode.REDIS else split_layers(model.layers, stages)
    split = tuple(layers_per_stage)
    if len(split) != stages or any(not isinstance(n, int) or n < 0 for n in split) or sum(split) != model.layers:
        raise PipeloomError(
            f"layers_per_stage {list(split)}: need {stages} non-negative integers summing to {model.layers} "
            f"(the layers of {model.name!r})"
        )
    return split


def _positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise PipeloomError(f"{name} must be a positive integer, got {value!r}")


def _collective_ms(device: Device, nbytes: float, ranks: int, passes: int) -> float:
    """A ring collective of ``nbytes`` over ``ranks``: ``passes`` = 2 for an
    all-reduce, 1 for a reduce (each rank sends ``(ranks-1)/ranks`` per pass)."""
    return 1e3 * passes * (ranks - 1) / ranks * nbytes / device.link_bandwidth


#: The names of :class:`~pipeloom.modes.Attention`, the attention algorithms of sequence parallelism.
ATTENTIONS = tuple(Attention)


#: Fused attention on one rank (torch's ``scaled_dot_product_attention``, as the runtime runs
#: with ``sp = 1``): no ``[s, s]`` scores are kept or materialised, only the log-sum-exp.
FUSED = "sdpa"


def _attention(attention: str | None, sp: int) -> str:
    """``attention`` checked; by default ``ring``, or fused attention (``sdpa``) with ``sp = 1``."""
    if attention is None:
        return Attention.RING if sp > 1 else FUSED
    if attention == FUSED:
        if sp > 1:
            raise PipeloomError(f"attention {FUSED!r} runs on one rank; with sp={sp} choose ring or rsa")
        return FUSED
    return Attention.of(attention)


def _local_tokens(seq: int, sp: int) -> int:
    """Tokens of a sequence on each of ``sp`` ranks."""
    _positive(seq=seq, sp=sp)
    if seq % sp:
        raise PipeloomError(f"sp={sp} must divide seq={seq}: each rank holds seq/sp tokens of a sequence")
    return seq // sp


def _attention_memory(model: ModelSpec, seq: int, microbatch_size: int, sp: int, attention: str) -> tuple[int, int]:
    """Bytes of one layer's attention scores on one rank: (kept from F to B, alive only while it computes)."""
    b, s, a, t = microbatch_size, seq, model.heads, _local_tokens(seq, sp)
    if attention == Attention.RSA:
        return 5 * a * t * s * b, 0
    return 4 * b * a * t, 0 if attention == FUSED else 5 * a * t * t * b


@dataclass(frozen=True)
class SequenceParallelCosts:
    """Sequence parallelism's part of one layer, one microbatch, one rank (ms, bytes).

    The forward sends ``steps`` messages of ``step_bytes`` round the ring,
    ``step_ms`` each; ``forward_ms`` and ``backward_ms`` are all the ring's
    transfers, ``exposed_forward_ms`` and ``exposed_backward_ms`` the part no
    compute hides (all of it for rsa), which F and B take on top of their
    FLOPs. ``kept_bytes``: the scores (rsa) or the log-sum-exp (ring) kept
    from F to B; ``transient_bytes``: ring's score block while it computes.
    """

    sp: int
    attention: str
    steps: int
    step_bytes: int
    step_ms: float
    forward_ms: float
    backward_ms: float
    exposed_forward_ms: float
    exposed_backward_ms: float
    kept_bytes: int
    transient_bytes: int

    @property
    def comm_ms(self) -> float:
        """The ring's transfers of one layer's F and B."""
        return self.forward_ms + self.backward_ms


def sequence_parallel_costs(
    model: ModelSpec | str, seq: int, microbatch_size: int, device: Device | str, sp: int = 1,
    attention: str | None = None,
) -> SequenceParallelCosts:
    """What ``attention`` (``ring`` or ``rsa``; default as :func:`costs_from_model`)
    over an SP group of ``sp`` ranks costs one transformer layer for one
    microbatch of ``microbatch_size`` sequences of ``seq`` tokens (module docstring)."""
    model, device = get_model(model), get_device(device)
    _positive(microbatch_size=microbatch_size)
    attention = _attention(attention, sp)
    b, s, h, t = microbatch_size, seq, model.hidden, _local_tokens(seq, sp)
    kept, transient = _attention_memory(model, seq, microbatch_size, sp, attention)
    block = 2 * b * t * h  # one rank's K (or V) of a layer, bf16

    def link_ms(nbytes: float) -> float:
        return 1e3 * nbytes / device.link_bandwidth

    if attention == Attention.RSA:
        forward = 2 * (sp - 1) * link_ms(block)
        backward = forward + _collective_ms(device, 2 * (2 * b * s * h), sp, 2)  # all-reduce full-length dK, dV
        return SequenceParallelCosts(sp, attention, 2 * (sp - 1), block, link_ms(block), forward, backward,
                                     forward, backward, kept, transient)
    step = link_ms(2 * block)
    exposed_forward = (sp - 1) * max(0.0, step - device.ms(4 * b * t * t * h))
    exposed_backward = (sp - 1) * max(0.0, 2 * step - device.ms(8 * b * t * t * h))
    return SequenceParallelCosts(sp, attention, sp - 1, 2 * block, step, (sp - 1) * step, 2 * (sp - 1) * step,
                                 exposed_forward, exposed_backward, kept, transient)


def layer_flops(model: ModelSpec | str, seq: int, microbatch_size: int, sp: int = 1) -> tuple[int, int, int]:
    """FLOPs of one transformer layer's F, B (input gradients) and W (weight
    gradients) on a microbatch, on one of ``sp`` sequence-parallel ranks."""
    model = get_model(model)
    h, matrices = model.hidden, 2 * model.matrix_params  # (8 + 4·ffn)h² for a GPT layer
    bt = microbatch_size * (seq // sp)
    return (bt * (matrices + 4 * seq * h), bt * (matrices + 8 * seq * h), bt * matrices)


def offload_time_ratio(
    model: ModelSpec | str, seq: int, microbatch_size: int, device: Device | str, sp: int = 1,
    attention: str | None = None, recompute: bool | str = False,
) -> float:
    """PipeOffload's k = T_offload / T_compute of one transformer layer: the copy
    stream's time to move the activations the layer keeps (``m_b``) to the
    host and back, over the layer's F, B and W time, under the costs of
    :func:`costs_from_model` (same ``sp``, ``attention``, ``recompute``). With
    k <= 1 the copy stream keeps up with full offload. "PipeOffload: Improving
    Scalability of Pipeline Parallelism with Memory Optimization" estimates
    k = 10 / (3(6h + s)) x FLOP/s / host bytes/s, counting 20bsh bytes a
    layer (cheap operations recomputed) where this model counts 34bsh."""
    model = get_model(model)
    one = [0, 1, model.layers - 1]  # the middle stage is one bare layer
    costs = costs_from_model(model, 3, seq, microbatch_size, device, layers_per_stage=one, recompute=recompute,
                             sp=sp, attention=attention)
    return 2 * costs.extra["offload"][1] / (costs.f[1] + costs.b[1] + costs.w[1])


#: The fraction of a device's matmul rate a damped factor's Cholesky inversion reaches (small,
#: sequential fp32 factorisations, far from a GEMM's efficiency; a judgment, not a measurement).
INVERSION_EFFICIENCY = 0.1
#: K-FAC pieces per transformer layer: one per linear layer (:mod:`pipeloom.schedule.transforms.kfac`'s units).
KFAC_UNITS_PER_LAYER = 4


def kfac_costs(model: ModelSpec | str, seq: int, microbatch_size: int, device: Device | str, dp: int = 1,
               sp: int = 1) -> dict[str, float]:
    """Times (ms) of one transformer layer's K-FAC pieces (:mod:`pipeloom.schedule.transforms.kfac`)
    for the layer's four linear layers (q/k/v, attention output, the MLP's two; a gated MLP's gate and up
    projections are one; with biases if the model has them):
    ``kfac_a`` and ``kfac_g`` one microbatch's ``rowsᵀ·rows`` of inputs and output gradients
    (2·rows·d² FLOPs a factor of side d); ``kfac_sync_a``/``kfac_sync_g`` the fp32 all-reduce
    of the factors over ``dp`` replicas (0 with one); ``kfac_inv`` both factors' damped
    inverses (d³ FLOPs a factor, at :data:`INVERSION_EFFICIENCY` of the matmul rate);
    ``kfac_pre`` the preconditioning ``G⁻¹·∇W·A⁻¹`` of the layer's gradients, every step."""
    model, device = get_model(model), get_device(device)
    _positive(seq=seq, microbatch_size=microbatch_size, dp=dp, sp=sp)
    h, f, one = model.hidden, model.mlp_width, int(model.bias)
    rows = microbatch_size * (seq // sp)
    up = 2 * f if model.gated else f
    shapes = [(h + one, h + 2 * model.kv_width), (h + one, h), (h + one, up), (f + one, h)]  # (d_A, d_G) of each
    inputs = [a for a, _ in shapes]
    grads = [g for _, g in shapes]

    def sync(sides):
        return sum(_collective_ms(device, 4 * d * d, dp, 2) for d in sides) if dp > 1 else 0.0
    return {
        "kfac_a": device.ms(sum(2 * rows * d * d for d in inputs)),
        "kfac_g": device.ms(sum(2 * rows * d * d for d in grads)),
        "kfac_sync_a": sync(inputs),
        "kfac_sync_g": sync(grads),
        "kfac_inv": device.ms(sum(d ** 3 for d in inputs + grads)) / INVERSION_EFFICIENCY,
        "kfac_pre": device.ms(sum(2 * (g * g * a + g * a * a) for a, g in shapes)),
    }


def _layer_bytes(model: ModelSpec, cheap: bool) -> tuple[int, int]:
    """Bytes per token one layer keeps from F to its backward (without the attention
    scores; ``cheap``: norms and the MLP's activation recomputed) and from B to W."""
    h, kv, f = model.hidden, model.kv_width, model.mlp_width
    # norms' inputs 4h; the q/k/v input 2h, q 2h, k and v 4kv, the projection's input 2h, a dropout
    # mask h; the MLP's input 2h and mask h; GELU's input and output 4f, or gated 8f
    kept = 14 * h + 4 * kv + (8 if model.gated else 4) * f
    if cheap:  # the norms' outputs and the activation's output, rebuilt (PipeOffload's 20 of 34 with ffn = 4)
        kept -= 6 * h + 2 * f
    # the linear layers' inputs (6h + 2f) and their output gradients (6h + 4kv, and 2f or gated 4f)
    weights = 12 * h + 4 * kv + (6 if model.gated else 4) * f
    return kept, weights


def _activation_bytes(model: ModelSpec, split, seq: int, microbatch_size: int, sp: int, attention_kept: int,
                      mode: VocabMode, recompute) -> tuple[list[float], list[float]]:
    """Per stage of ``split`` layers: bytes one microbatch keeps from F to its backward (``m_b``)
    and from B to W (``m_w``), as :func:`costs_from_model` says; ``attention_kept``: one layer's
    attention bytes kept (:func:`_attention_memory`)."""
    b, t, h, v = microbatch_size, seq // sp, model.hidden, model.vocab
    bth = b * t * h
    kept, weights = _layer_bytes(model, recompute == "cheap")
    layer_mb = b * t * kept + attention_kept
    layer_mw = b * t * weights
    if mode.splits:
        head_mb, head_mw = 2 * bth, 0  # the final norm's input
    else:
        # The output layer keeps the fp32 softmax (4btV) and its input and the
        # final norm's input (2bth each) for B; W keeps the logits' gradient
        # (2btV, bf16) and the LM head's input.
        head_mb, head_mw = 4 * b * t * v + 4 * bth, 2 * b * t * v + 2 * bth
    m_b, m_w = stage_totals(split, layer_mb, last=head_mb), stage_totals(split, layer_mw, last=head_mw)
    if recompute is True:
        # the runtime reruns whole stages in B: each keeps only its input; the last also the
        # loss's fp32 log-probabilities, which are outside the rerun
        m_b = [2 * bth + (head_mb - 4 * bth if last and not mode.splits else 0)
               for last in (i == len(split) - 1 for i in range(len(split)))]
    return [float(x) for x in m_b], [float(x) for x in m_w]


def costs_from_model(
    model: ModelSpec | str,
    pp: int,
    seq: int,
    microbatch_size: int,
    device: Device | str,
    chunks: int = 1,
    layers_per_stage=None,
    recompute: bool | str = False,
    vocab_parallel: str | None = None,
    sp: int = 1,
    attention: str | None = None,
    kfac: bool = False,
    dp: int = 1,
    profile: Profile | None = None,
) -> Costs:
    """Per-virtual-stage costs (ms, bytes) of ``model`` cut into ``pp * chunks``
    stages, for microbatches of ``microbatch_size`` sequences of ``seq`` tokens,
    on one rank of each stage's SP group of ``sp`` ranks.

    ``layers_per_stage`` overrides :func:`~pipeloom.partition.split_layers`
    (``balanced_layers`` with ``vocab_parallel="redis"``). ``recompute="cheap"``
    recomputes the norms and the MLP's activation function in B instead of
    keeping their outputs: a layer keeps (12 + 2·ffn)·bth bytes instead of
    (18 + 4·ffn)·bth (20 and 34 bsh for ffn = 4, as "PipeOffload: Improving
    Scalability of Pipeline Parallelism with Memory Optimization" counts; their
    FLOPs are not counted). With ``recompute`` True each stage keeps
    only its input (2bth bytes; the last stage also the loss's fp32
    log-probabilities) and B first reruns the stage's forward, as the runtime
    does (``torch.utils.checkpoint`` around the stage): while it runs, the
    stage's whole activations are alive again (:func:`peak_memory_bytes` adds
    them). W still needs its inputs, so ``m_w`` exceeds ``m_b`` and memory
    grows from B to W (use a fused-backward schedule with it). ``vocab_parallel`` (none,
    redis, naive, vocab-1, vocab-2) places the vocabulary layers as the
    module docstring says. ``sp`` and ``attention`` (``ring``, the default
    with ``sp > 1``, or ``rsa``; with ``sp = 1`` the default is fused
    attention, ``sdpa``) add sequence parallelism as the module docstring says: the
    ring's transfers that compute does not hide are in ``f`` and ``b``
    (:func:`sequence_parallel_costs` has them apart). ``kfac`` adds the
    K-FAC pieces' times (:func:`kfac_costs`, one unit a layer, the syncs over
    ``dp`` replicas; the preconditioning per stage).

    ``profile`` (a :class:`~pipeloom.sim.profile.Profile` of this model's sizes
    and ``seq``) replaces the formulas' compute times, activation bytes and
    stage-to-stage transfer with measured ones (:meth:`~pipeloom.sim.profile.Profile.stages`);
    ``device`` still gives the rest (the link when the profile measured none,
    sequence parallelism's ring, vocabulary passes, K-FAC pieces).
    """
    model, device = get_model(model), get_device(device)
    _positive(pp=pp, seq=seq, microbatch_size=microbatch_size, chunks=chunks)
    mode = VocabMode.of(vocab_parallel or "none")
    stages = pp * chunks
    split = _stage_layers(model, stages, layers_per_stage, seq, mode)
    ring = sequence_parallel_costs(model, seq, microbatch_size, device, sp, attention)
    b, s, h, v = microbatch_size, seq, model.hidden, model.vocab
    t = s // sp  # a rank's tokens of each sequence
    bth = b * t * h
    layer_f, layer_b, layer_w = layer_flops(model, seq, microbatch_size, sp)
    if recompute not in (False, True, "cheap"):
        raise PipeloomError(f"recompute={recompute!r}: choose False, True (whole stages) or 'cheap'")
    full = recompute is True
    layer_b += layer_f if full else 0
    exposed_b = ring.exposed_backward_ms + (ring.exposed_forward_ms if full else 0.0)
    # head: FLOPs of each of the output layer's F, B and W
    embedding, head = (0, 0) if mode.splits else (3 * bth, 2 * bth * v)
    m_b, m_w = _activation_bytes(model, split, seq, microbatch_size, sp, ring.kept_bytes, mode, recompute)
    rerun = _activation_bytes(model, split, seq, microbatch_size, sp, ring.kept_bytes, mode, False)[0] if full else None

    f, bwd, w = ([device.ms(x) for x in stage_totals(split, flops, first=first, last=head)]
                 for flops, first in ((layer_f, embedding), (layer_b, 0), (layer_w, 0)))
    comm, host_bandwidth = 1e3 * 2 * bth / device.link_bandwidth, device.host_bandwidth
    if profile is not None:
        measured = profile.stages(model, seq, microbatch_size, split, sp, recompute, mode.splits)
        f, bwd, w, m_b, m_w, rerun = measured.f, measured.b, measured.w, measured.m_b, measured.m_w, measured.m_rerun
        comm = measured.comm_ms
        if comm is None:  # no link measured: the device's
            comm = 1e3 * measured.message_bytes / device.link_bandwidth
        host_bandwidth = profile.host_bandwidth or host_bandwidth
    costs = Costs(
        f=[x + n * ring.exposed_forward_ms for x, n in zip(f, split)],
        b=[x + n * exposed_b for x, n in zip(bwd, split)],
        w=w,
        comm=[comm] * stages,
        m_b=m_b,
        m_w=m_w,
        extra={"offload": [1e3 * x / host_bandwidth for x in m_b], **({"m_rerun": rerun} if full else {})},
    )
    if kfac:
        pieces = kfac_costs(model, seq, microbatch_size, device, dp, sp)
        pre = pieces.pop("kfac_pre")
        unit = {name: value / KFAC_UNITS_PER_LAYER for name, value in pieces.items()}
        costs = replace(costs, extra={**costs.extra, **unit, "kfac_pre": [n * pre for n in split]})
    if not mode.splits:
        return costs
    shard = -(-v // pp)
    product = device.ms(2 * bth * shard)  # one [bt, h] x [h, V/p] product on one rank
    statistic = _collective_ms(device, 4 * b * t, pp, 2)  # all-reduce of one fp32 value per token
    grad_input = _collective_ms(device, 2 * bth, pp, 1)  # reduce of the input gradient to the last stage
    two = mode == VocabMode.VOCAB_2
    return replace(
        costs,
        s=2 * product if two else product,
        t=product if two else 2 * product,
        c=statistic if mode == VocabMode.NAIVE else 2 * statistic + (grad_input if two else 0.0),
        r=0.0 if two else grad_input,
        e_f=device.ms(bth / pp),
        e_b=device.ms(2 * bth / pp),
        e_comm=_collective_ms(device, 2 * bth, pp, 2),
        m_v=float(4 * b * t * shard + 2 * bth),
    )


def stage_layers(
    model: ModelSpec | str, stages: int, seq: int, layers_per_stage=None, vocab_parallel: str | None = None
) -> tuple[int, ...]:
    """Transformer layers of each of ``stages`` stages, as :func:`costs_from_model` places them."""
    model = get_model(model)
    _positive(stages=stages, seq=seq)
    return _stage_layers(model, stages, layers_per_stage, seq, VocabMode.of(vocab_parallel or "none"))


def stage_parameters(
    model: ModelSpec | str, stages: int, seq: int, layers_per_stage=None, vocab_parallel: str | None = None
) -> list[int]:
    """Parameters of each of ``stages`` stages: its layers, plus the
    embeddings on the first and the LM head and final norm on the last (with
    a vocabulary-parallel algorithm only the position embeddings and the
    final norm: the vocabulary shards belong to ranks, see
    :meth:`ModelSpec.vocab_shard_params`). Sequence parallelism does not
    change them: every rank of an SP group holds all its stage's weights."""
    model = get_model(model)
    params = [n * model.layer_params for n in stage_layers(model, stages, seq, layers_per_stage, vocab_parallel)]
    if VocabMode.of(vocab_parallel or "none").splits:
        params[0] += model.position_params(seq)
        params[-1] += model.norm_params
    else:
        params[0] += model.embedding_params(seq)
        params[-1] += model.head_params
    return params


def peak_memory_bytes(
    model: ModelSpec | str,
    result: Result,
    seq: int,
    *,
    layers_per_stage=None,
    vocab_parallel: str | None = None,
    bytes_per_param: float = BYTES_PER_PARAM,
    microbatch_size: int = 1,
    sp: int = 1,
    attention: str | None = None,
) -> list[float]:
    """Peak bytes per rank: model state of the rank's stages and vocabulary
    shard (``bytes_per_param`` each, of which a stage's gradient,
    :data:`GRAD_BYTES_PER_PARAM`, only from its first backward of the step on;
    with weight versions, :data:`VERSION_BYTES_PER_PARAM` more per version beyond
    the first; the shard's too)
    plus the simulated activation memory (with the vocabulary buffers), which
    is in bytes when ``result`` was simulated with :func:`costs_from_model`
    costs, at the moment their sum peaks, plus, with ring
    attention, one score block alive while a layer computes (on a rank
    with layers), plus, with recomputation, the largest of the rank's
    stages' activations alive again while its backward reruns its forward
    (the costs' ``m_rerun``). ``layers_per_stage``, ``vocab_parallel`` (default: the
    schedule's ``options["vocab_parallel"]``), ``microbatch_size``, ``sp``
    and ``attention`` must match the ones the costs used."""
    schedule, model = result.schedule, get_model(model)
    mode = VocabMode.of(vocab_parallel or schedule.options.get("vocab_parallel") or "none")
    split = stage_layers(model, schedule.stages, seq, layers_per_stage, mode)
    params = stage_parameters(model, schedule.stages, seq, split, mode)
    shard = model.vocab_shard_params(schedule.pp) if mode.splits else 0
    _positive(microbatch_size=microbatch_size)
    transient = _attention_memory(model, seq, microbatch_size, sp, _attention(attention, sp))[1]
    rerun = result.costs.m_rerun
    held, grad = state_bytes_per_param(bytes_per_param, schedule.weight_versions)
    peaks = []
    for rank in range(schedule.pp):
        stages = schedule.stages_of(rank)
        state = (held + grad) * shard + held * sum(params[s] for s in stages)  # a shard's gradient from the start
        peaks.append(state + _with_gradients(result, rank, {s: grad * params[s] for s in stages})
                     + max(rerun[s] for s in stages) + (transient if any(split[s] for s in stages) else 0))
    return peaks


def _with_gradients(result: Result, rank: int, grads: dict[int, float]) -> float:
    """The peak over the step of ``rank``'s activation memory plus the gradients
    (``grads``: bytes per stage) of the stages whose backward has begun: a
    stage's gradient appears when its first action timed by the ``b`` or ``w``
    cost (or a compound action holding one) starts."""
    backward = graded()
    first = {}
    for action, start in zip(result.schedule.ranks[rank], result.starts[rank]):
        for kind, stage, _, _ in parts(action):
            if kind in backward and stage in grads and stage not in first:
                first[stage] = start
        if len(first) == len(grads):
            break
    appear = sorted((first.get(s, math.inf), g) for s, g in grads.items())
    peak, held, k = 0.0, 0.0, 0
    for t, level in result.memory_timeline(rank):
        while k < len(appear) and appear[k][0] <= t:
            held += appear[k][1]
            k += 1
        peak = max(peak, level + held)
    return max(peak, sum(g for t, g in appear if t < math.inf))  # after the last backward, as before the next step


def longest_sequence(
    model: ModelSpec | str,
    budget_bytes: float,
    sp: int = 1,
    attention: str | None = None,
    *,
    schedule: str = "1f1b",
    pp: int = 1,
    microbatches: int | None = None,
    microbatch_size: int = 1,
    device: Device | str = "a100",
) -> int:
    """The longest sequence (a multiple of ``sp``) whose :func:`peak_memory_bytes`
    fits ``budget_bytes`` on every rank when ``schedule`` runs ``microbatches``
    (default ``pp``) microbatches over ``pp`` ranks with SP groups of ``sp``."""
    model = get_model(model)
    plan = build(schedule, pp, microbatches or pp)

    def fits(units: int) -> bool:
        seq = units * sp
        costs = costs_from_model(model, pp, seq, microbatch_size, device, chunks=plan.chunks, sp=sp,
                                 attention=attention)
        memory = peak_memory_bytes(model, simulate(plan, costs), seq, microbatch_size=microbatch_size, sp=sp,
                                   attention=attention)
        return max(memory) <= budget_bytes

    if not fits(1):
        raise PipeloomError(f"{model.name} does not fit {budget_bytes:.4g} bytes per rank even at seq={sp} (sp={sp})")
    low, high = 1, 2  # fits(low); does fits(high)?
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * sp
