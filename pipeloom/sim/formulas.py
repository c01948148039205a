"""One transformer layer's costs: its FLOP and byte formulas, sequence parallelism's ring, K-FAC's pieces.

The per-layer formulas are those of "Zero Bubble Pipeline Parallelism" (a
GPT layer with ``ffn = 4h``; see docs/design.md), with the 4 generalised to
:attr:`~.specs.ModelSpec.ffn`: for one layer and one microbatch of ``b`` sequences
of ``s`` tokens,

- forward ``F = bsh((8 + 4·ffn)h + 4s)`` FLOPs, input-gradient backward
  ``B = bsh((8 + 4·ffn)h + 8s)``, weight-gradient backward ``W = (8 + 4·ffn)bsh²``
  (24 for ``ffn = 4``);
- activations kept from F to the backward ``M_B = sb((18 + 4·ffn)h + 5as)``
  bytes (34h), of which ``M_W = (16 + 4·ffn)sbh`` (32) stay from B to W;
- parameters ``(4 + 2·ffn)h² + (9 + ffn)h`` (12h² + 13h).

Llama-style layers (:class:`~.specs.ModelSpec`'s ``kv_heads``, ``ffn_hidden``,
``gated``, ``bias``, ``rotary``) count the same things from their shapes: with
``P`` the weights of a layer's matrices (:attr:`~.specs.ModelSpec.matrix_params`:
``2h² + 2h·kv`` for q, k, v and the output projection, ``kv`` the width of
the keys, plus 2 or, gated (SwiGLU), 3 matrices of ``h × f``), ``F =
bs(2P + 4sh)``, ``B = bs(2P + 8sh)``, ``W = 2bsP``; ``M_B = sb(14h + 4kv + 4f
+ 5as)`` bytes, ``8f`` instead of ``4f`` when gated (the gate, its SiLU, the up
projection and their product), ``M_W = sb(12h + 4kv + 4f)`` (``6f`` gated: the
inputs and output gradients of the linear layers); no biases and one-weight
norms (RMSNorm) without ``bias``, and no position embeddings with ``rotary``.
With ``kv = h``, ``f = ffn·h`` these are the formulas above.

Times are in milliseconds, memory in bytes. :mod:`.model` sums these over the
layers of each stage, with the input embedding and the output layer.

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
  :func:`~.memory.peak_memory_bytes` adds once.
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

from dataclasses import dataclass

from ..errors import PipeloomError
from ..modes import Attention
from .specs import Device, ModelSpec, _positive, get_device, get_model


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


#: Bytes of one activation value by the training's precision: 16-bit under bf16 autocast (the
#: formulas' counts, as the papers give them), 4 in fp32.
ELEMENT_BYTES = {"bf16": 2, "fp32": 4}


def element_bytes(precision: str) -> int:
    """:data:`ELEMENT_BYTES` of ``precision``, or one line naming the precisions there are."""
    if precision not in ELEMENT_BYTES:
        raise PipeloomError(f"precision={precision!r}: choose {' or '.join(ELEMENT_BYTES)}")
    return ELEMENT_BYTES[precision]


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
    attention: str | None = None, precision: str = "bf16",
) -> SequenceParallelCosts:
    """What ``attention`` (``ring`` or ``rsa``; default as :func:`~.model.costs_from_model`)
    over an SP group of ``sp`` ranks costs one transformer layer for one
    microbatch of ``microbatch_size`` sequences of ``seq`` tokens (module docstring; K and V
    blocks of :data:`ELEMENT_BYTES` values of ``precision``)."""
    model, device = get_model(model), get_device(device)
    _positive(microbatch_size=microbatch_size)
    attention = _attention(attention, sp)
    b, s, h, t = microbatch_size, seq, model.hidden, _local_tokens(seq, sp)
    kept, transient = _attention_memory(model, seq, microbatch_size, sp, attention)
    element = element_bytes(precision)
    block = element * b * t * h  # one rank's K (or V) of a layer

    def link_ms(nbytes: float) -> float:
        return 1e3 * nbytes / device.link_bandwidth

    if attention == Attention.RSA:
        forward = 2 * (sp - 1) * link_ms(block)
        backward = forward + _collective_ms(device, 2 * element * b * s * h, sp, 2)  # all-reduce full-length dK, dV
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


#: The fraction of a device's fp32 matmul rate (at its ``efficiency``) a damped factor's Cholesky
#: inversion reaches: 0.16 measured on an H100 (a gpt-350m layer's 8 factors, 30 ms), 0.29 on the
#: development CPU (gpt-125m); the GPU's, where it decides the refresh.
INVERSION_EFFICIENCY = 0.16
#: K-FAC pieces per transformer layer: one per linear layer (:mod:`pipeloom.schedule.transforms.kfac`'s units).
KFAC_UNITS_PER_LAYER = 4
#: Copies of a layer's K-FAC factors' sizes its rank holds at the peak (:mod:`pipeloom.optim.kfac`): the
#: factors and the inverses in use all along (from the first refresh on) and, while a refresh runs, either
#: the curvature sums (from a factor's first curvature piece to its sync) or the new inverses (from the
#: inversion, after both syncs, to the publish at the cycle's end), never both for one layer; the rest (a
#: sync's packed copy, an inversion's damped factor) is one layer's at a time. So 3 at the peak, the third
#: from a factor's first curvature piece on (:func:`~.memory.peak_memory_bytes` counts it from there).
#: Measured on an H100 (gpt-350m, 1f1b 4 x 4, bench/results/gpu): 3.1 copies above AdamW's peak with the
#: curvature soon after its producers, 2 copies with it (and every capture) held to the cycle's end.
KFAC_STATE_COPIES = 3


def kfac_costs(model: ModelSpec | str, seq: int, microbatch_size: int, device: Device | str, dp: int = 1,
               sp: int = 1) -> dict[str, float]:
    """Times (ms) of one transformer layer's K-FAC pieces (:mod:`pipeloom.schedule.transforms.kfac`)
    for the layer's four linear layers (q/k/v, attention output, the MLP's two; a gated MLP's gate and up
    projections are one; with biases if the model has them):
    ``kfac_a`` and ``kfac_g`` one microbatch's ``rowsᵀ·rows`` of inputs and output gradients
    (2·rows·d² FLOPs a factor of side d, rows the microbatch's tokens on one of ``sp`` ranks);
    ``kfac_sync_a``/``kfac_sync_g`` the fp32 all-reduce of the factors over the ``dp`` x ``sp``
    ranks holding the layer (0 with one); ``kfac_inv`` both factors' damped
    inverses (d³ FLOPs a factor, at :data:`INVERSION_EFFICIENCY` of the matmul rate);
    ``kfac_pre`` the preconditioning ``G⁻¹·∇W·A⁻¹`` of the layer's gradients, every step. It is fp32
    matrix work (:mod:`pipeloom.optim.kfac`): the inversions at the device's fp32 rate, the products
    (curvature, preconditioning) at its TF32 rate, as a 16-bit run on CUDA takes them (``KFAC(tf32=True)``;
    the device presets' rates are a 16-bit run's), or fp32 where it has no TF32."""
    model, device = get_model(model), get_device(device)
    _positive(seq=seq, microbatch_size=microbatch_size, dp=dp, sp=sp)
    rows = microbatch_size * (seq // sp)
    shapes = kfac_shapes(model)
    inputs = [a for a, _ in shapes]
    grads = [g for _, g in shapes]

    def sync(sides):
        holders = dp * sp
        return sum(_collective_ms(device, 4 * d * d, holders, 2) for d in sides) if holders > 1 else 0.0
    return {
        "kfac_a": device.ms(sum(2 * rows * d * d for d in inputs), tf32=True),
        "kfac_g": device.ms(sum(2 * rows * d * d for d in grads), tf32=True),
        "kfac_sync_a": sync(inputs),
        "kfac_sync_g": sync(grads),
        "kfac_inv": device.ms(sum(d ** 3 for d in inputs + grads), fp32=True) / INVERSION_EFFICIENCY,
        "kfac_pre": device.ms(sum(2 * (g * g * a + g * a * a) for a, g in shapes), tf32=True),
    }


def kfac_unit_weights(model: ModelSpec | str) -> dict[str, tuple[float, ...]]:
    """Each of one layer's :data:`KFAC_UNITS_PER_LAYER` linear layers' share of the layer's K-FAC pieces
    against the average (the cost fields ``kfac_unit_a``, ``kfac_unit_g``, ``kfac_unit_inv``): by d_A²,
    d_G² (a factor's curvature FLOPs and its sync's bytes) and d_A³ + d_G³ (its inversions)."""
    shapes = kfac_shapes(get_model(model))

    def shares(sizes):
        return tuple(len(sizes) * x / sum(sizes) for x in sizes)
    return {"kfac_unit_a": shares([a * a for a, _ in shapes]), "kfac_unit_g": shares([g * g for _, g in shapes]),
            "kfac_unit_inv": shares([a ** 3 + g ** 3 for a, g in shapes])}


def kfac_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    """(d_A, d_G) of each of one layer's :data:`KFAC_UNITS_PER_LAYER` linear layers (q/k/v, the attention's
    output, the MLP's two; a gated MLP's gate and up projections are one; a bias adds one to d_A)."""
    h, f, one = model.hidden, model.mlp_width, int(model.bias)
    up = 2 * f if model.gated else f
    return [(h + one, h + 2 * model.kv_width), (h + one, h), (h + one, up), (f + one, h)]


def kfac_capture_bytes(model: ModelSpec | str, seq: int, microbatch_size: int, sp: int = 1,
                       autocast: bool = True) -> list[tuple[int, int]]:
    """Bytes (A, G) of one microbatch's captures of each of one layer's :data:`KFAC_UNITS_PER_LAYER`
    linear layers (:func:`kfac_shapes`' order) on one of ``sp`` ranks: the rows (the microbatch's tokens)
    times the layer's input width (A) or output width (G) times the bytes the runtime's hooks keep. Under
    bf16 ``autocast`` a norm's output (q/k/v's and the MLP's first input) is fp32, the attention's output
    and the MLP's activation bf16, every output gradient bf16; without it all fp32."""
    model = get_model(model)
    _positive(seq=seq, microbatch_size=microbatch_size, sp=sp)
    rows, h, low = microbatch_size * (seq // sp), model.hidden, 2 if autocast else 4
    inputs = [(h, 4), (h, low), (h, 4), (model.mlp_width, low)]
    return [(rows * width * size, rows * d_g * low) for (width, size), (_, d_g) in zip(inputs, kfac_shapes(model))]


def kfac_factor_bytes(model: ModelSpec | str) -> list[tuple[int, int]]:
    """Bytes (A, G) of one fp32 copy of each of one layer's :data:`KFAC_UNITS_PER_LAYER` linear layers'
    factors (4·d_A², 4·d_G²)."""
    return [(4 * a * a, 4 * g * g) for a, g in kfac_shapes(get_model(model))]


def _layer_bytes(model: ModelSpec, cheap: bool, element: int = 2) -> tuple[int, int]:
    """Bytes per token one layer keeps from F to its backward (without the attention
    scores; ``cheap``: norms and the MLP's activation recomputed) and from B to W, its tensors of
    ``element`` bytes a value (:data:`ELEMENT_BYTES`; the byte masks stay bytes)."""
    h, kv, f = model.hidden, model.kv_width, model.mlp_width
    # in 16-bit values: norms' inputs 4h; the q/k/v input 2h, q 2h, k and v 4kv, the projection's
    # input 2h; the MLP's input 2h; GELU's input and output 4f, or gated 8f; and two dropout masks h each
    kept = 12 * h + 4 * kv + (8 if model.gated else 4) * f
    if cheap:  # the norms' outputs and the activation's output, rebuilt (PipeOffload's 20 of 34 with ffn = 4)
        kept -= 6 * h + 2 * f
    # the linear layers' inputs (6h + 2f) and their output gradients (6h + 4kv, and 2f or gated 4f)
    weights = 12 * h + 4 * kv + (6 if model.gated else 4) * f
    return kept * element // 2 + 2 * h, weights * element // 2
