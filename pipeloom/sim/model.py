"""Costs from a model description: a decoder's per-stage costs on a device.

:func:`costs_from_model` sums one layer's formulas (:mod:`.formulas`: FLOPs,
activation bytes, sequence parallelism's ring, K-FAC's pieces) over the layers
of each stage (:mod:`.stages`) of a :class:`~.specs.ModelSpec` on a
:class:`~.specs.Device`, or takes measured ones from a :class:`~.profile.Profile`;
:mod:`.memory` adds the model state to the simulated activations. This module
is also the public path of all those names: it hands on those of :mod:`.specs`,
:mod:`.formulas`, :mod:`.stages` and :mod:`.memory`.

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
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PipeloomError
from ..modes import VocabMode
from ..partition import stage_totals
from ..schedule import build
from ..schedule.costs import Costs
from .formulas import (
    ATTENTIONS, ELEMENT_BYTES, FUSED, INVERSION_EFFICIENCY, KFAC_UNITS_PER_LAYER, SequenceParallelCosts, _collective_ms,
    _layer_bytes, element_bytes, kfac_costs, kfac_unit_weights, layer_flops, sequence_parallel_costs,
)
from .memory import (
    BYTES_PER_PARAM, GRAD_BYTES_PER_PARAM, STATE_BYTES_PER_PARAM, VERSION_BYTES_PER_PARAM, peak_memory_bytes,
    state_bytes_per_param,
)
from .profile import Profile
from .simulate import simulate
from .specs import CPU_MEMORY_BANDWIDTH, DEVICES, MODELS, Device, ModelSpec, _positive, get_device, get_model
from .stages import _stage_layers, stage_layers, stage_parameters

#: The cost model's public names: this module's and those it hands on from :mod:`.specs`,
#: :mod:`.formulas`, :mod:`.stages` and :mod:`.memory`.
__all__ = [
    "ATTENTIONS", "BYTES_PER_PARAM", "CPU_MEMORY_BANDWIDTH", "DEVICES", "ELEMENT_BYTES", "FUSED",
    "GRAD_BYTES_PER_PARAM", "INVERSION_EFFICIENCY", "KFAC_UNITS_PER_LAYER", "MODELS", "OPTIMIZER_BYTES_PER_PARAM",
    "STATE_BYTES_PER_PARAM", "VERSION_BYTES_PER_PARAM",
    "Device", "ModelSpec", "SequenceParallelCosts", "costs_from_model", "get_device", "get_model", "kfac_costs",
    "layer_flops", "longest_sequence", "offload_time_ratio", "optimizer_ms", "peak_memory_bytes",
    "sequence_parallel_costs", "stage_layers", "stage_parameters", "state_bytes_per_param",
]

#: Bytes an AdamW step with gradient clipping moves per fp32 parameter: reads the weight,
#: gradient and two moments (and the gradient once more for the norm), writes weight and moments.
OPTIMIZER_BYTES_PER_PARAM = 32


def optimizer_ms(params: float, device: Device, profile: Profile | None = None) -> float:
    """Milliseconds of the optimizer step (clipping, AdamW) over ``params`` parameters: the
    profile's measured time per parameter, else :data:`OPTIMIZER_BYTES_PER_PARAM` at the device's
    memory bandwidth (0 without one)."""
    if profile is not None and profile.optimizer_ns_per_param is not None:
        return params * profile.optimizer_ns_per_param / 1e6
    if device.memory_bandwidth is None:
        return 0.0
    return 1e3 * params * OPTIMIZER_BYTES_PER_PARAM / device.memory_bandwidth


def offload_time_ratio(
    model: ModelSpec | str, seq: int, microbatch_size: int, device: Device | str, sp: int = 1,
    attention: str | None = None, recompute: bool | str = False, profile=None, precision: str = "bf16",
) -> float:
    """PipeOffload's k = T_offload / T_compute of one transformer layer: the time
    to move the activations the layer keeps (``m_b``) to the host and back,
    over the layer's F, B and W time, under the costs of
    :func:`costs_from_model` (same ``sp``, ``attention``, ``recompute``, ``profile``, ``precision``). The
    paper's k counts both ways on one link; with a copy stream per direction
    each carries k/2, so with k <= 2 both keep up with full offload. "PipeOffload: Improving
    Scalability of Pipeline Parallelism with Memory Optimization" estimates
    k = 10 / (3(6h + s)) x FLOP/s / host bytes/s, counting 20bsh bytes a
    layer (cheap operations recomputed) where this model counts 34bsh."""
    model = get_model(model)
    one = [0, 1, model.layers - 1]  # the middle stage is one bare layer
    costs = costs_from_model(model, 3, seq, microbatch_size, device, layers_per_stage=one, recompute=recompute,
                             sp=sp, attention=attention, profile=profile, precision=precision)
    return 2 * costs.extra["offload"][1] / (costs.f[1] + costs.b[1] + costs.w[1])


#: Bytes per logit the loss's backward holds beside the log-softmax it kept (fp32 under any precision:
#: autocast runs the loss in fp32): the gradient of the log-softmax and that of the logits, which the
#: backward of ``F.cross_entropy`` holds at once (measured on this CPU: the last rank's peak 2 x 4btV
#: above the model without them, at vocabularies 4096 and 16384). A vocabulary-parallel head has its own.
LOSS_GRADIENT_BYTES = 8


def _activation_bytes(model: ModelSpec, split, seq: int, microbatch_size: int, sp: int, attention_kept: int,
                      mode: VocabMode, recompute, element: int = 2) -> tuple[list[float], list[float]]:
    """Per stage of ``split`` layers: bytes one microbatch keeps from F to its backward (``m_b``)
    and from B to W (``m_w``), as :func:`costs_from_model` says; ``attention_kept``: one layer's
    attention bytes kept (:func:`~.formulas._attention_memory`); ``element``: bytes of an
    activation value (:data:`~.formulas.ELEMENT_BYTES`)."""
    b, t, h, v = microbatch_size, seq // sp, model.hidden, model.vocab
    bth = b * t * h
    kept, weights = _layer_bytes(model, recompute == "cheap", element)
    layer_mb = b * t * kept + attention_kept
    layer_mw = b * t * weights
    if mode.splits:
        head_mb, head_mw = element * bth, 0  # the final norm's input
    else:
        # The output layer keeps the fp32 softmax (4btV) and its input and the
        # final norm's input (2bth each in bf16) for B; W keeps the logits' gradient
        # (2btV in bf16) and the LM head's input.
        head_mb, head_mw = 4 * b * t * v + 2 * element * bth, element * (b * t * v + bth)
    m_b, m_w = stage_totals(split, layer_mb, last=head_mb), stage_totals(split, layer_mw, last=head_mw)
    if recompute is True:
        # the runtime reruns whole stages in B, the last one's loss too: each keeps only its input
        m_b = [element * bth] * len(split)
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
    precision: str = "bf16",
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
    only its input (2bth bytes) and B first reruns the stage's forward (the
    last stage's loss too), as the runtime does: while it runs, the
    stage's whole activations are alive again (:func:`peak_memory_bytes` adds
    them). The stage with the output layer holds the loss's gradients while its
    backward computes them (``m_loss``, :data:`LOSS_GRADIENT_BYTES` a logit; with a
    profile too, which does not measure them). W still needs its inputs, so ``m_w`` exceeds ``m_b`` and memory
    grows from B to W (use a fused-backward schedule with it). ``vocab_parallel`` (none,
    redis, naive, vocab-1, vocab-2) places the vocabulary layers as the
    module docstring says. ``sp`` and ``attention`` (``ring``, the default
    with ``sp > 1``, or ``rsa``; with ``sp = 1`` the default is fused
    attention, ``sdpa``) add sequence parallelism as :mod:`.formulas` says: the
    ring's transfers that compute does not hide are in ``f`` and ``b``
    (:func:`sequence_parallel_costs` has them apart). ``kfac`` adds the
    K-FAC pieces' times (:func:`kfac_costs`: a unit per linear layer, the
    average unit's time and each unit's weight, :func:`kfac_unit_weights`; the
    syncs over ``dp`` replicas; the preconditioning per stage).

    ``precision`` (``bf16``: autocast, as the formulas count; ``fp32``) sets the bytes of an
    activation value (:data:`~.formulas.ELEMENT_BYTES`: every 16-bit term doubles in fp32, the
    fp32 softmax and byte masks do not) in what a microbatch keeps and sends, and in fp32 the compute
    runs at the device's fp32 rate (:attr:`~.specs.Device.fp32_flops`, where it has one).

    ``profile`` (a :class:`~pipeloom.sim.profile.Profile` of this model's sizes
    and ``seq``) replaces the formulas' compute times, activation bytes and
    stage-to-stage transfer with measured ones (:meth:`~pipeloom.sim.profile.Profile.stages`; a
    fused backward costs its measured time, the cost field ``fused``);
    ``device`` still gives the rest (the link when the profile measured none,
    sequence parallelism's ring, vocabulary passes, K-FAC's syncs, and its other
    pieces where the profile has no ``kfac``: :meth:`~pipeloom.sim.profile.Profile.kfac_costs`, and
    the units' weights where it measured no units apart).
    """
    model, device = get_model(model), get_device(device)
    _positive(pp=pp, seq=seq, microbatch_size=microbatch_size, chunks=chunks)
    mode = VocabMode.of(vocab_parallel or "none")
    stages = pp * chunks
    split = _stage_layers(model, stages, layers_per_stage, seq, mode)
    ring = sequence_parallel_costs(model, seq, microbatch_size, device, sp, attention, precision)
    element, fp32 = element_bytes(precision), precision == "fp32"

    def ms(flops: float) -> float:
        return device.ms(flops, fp32=fp32)

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
    m_b, m_w = _activation_bytes(model, split, seq, microbatch_size, sp, ring.kept_bytes, mode, recompute, element)
    rerun = (_activation_bytes(model, split, seq, microbatch_size, sp, ring.kept_bytes, mode, False, element)[0]
             if full else None)

    f, bwd, w = ([ms(x) for x in stage_totals(split, flops, first=first, last=head)]
                 for flops, first in ((layer_f, embedding), (layer_b, 0), (layer_w, 0)))
    comm, host_bandwidth, fused = 1e3 * element * bth / device.link_bandwidth, device.host_bandwidth, 0.0
    if profile is not None:
        measured = profile.stages(model, seq, microbatch_size, split, sp, recompute, mode.splits)
        f, bwd, w, m_b, m_w, rerun = measured.f, measured.b, measured.w, measured.m_b, measured.m_w, measured.m_rerun
        fused = measured.fused
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
        extra={"offload": [1e3 * x / host_bandwidth for x in m_b], "fused": fused,
               "m_loss": [0.0] * (stages - 1) + [0.0 if mode.splits else float(LOSS_GRADIENT_BYTES * b * t * v)],
               **({"m_rerun": rerun} if full else {})},
    )
    if kfac:
        pieces = kfac_costs(model, seq, microbatch_size, device, dp, sp)
        weights = kfac_unit_weights(model)
        if profile is not None and profile.kfac is not None:
            pieces.update(profile.kfac_costs(model, seq, microbatch_size, sp))  # the syncs stay the links'
            weights.update(profile.kfac_unit_weights())
        pre = pieces.pop("kfac_pre")
        unit = {name: value / KFAC_UNITS_PER_LAYER for name, value in pieces.items()}
        costs = replace(costs, extra={**costs.extra, **unit, **weights, "kfac_pre": [n * pre for n in split]})
    if not mode.splits:
        return costs
    shard = -(-v // pp)
    product = ms(2 * bth * shard)  # one [bt, h] x [h, V/p] product on one rank
    statistic = _collective_ms(device, 4 * b * t, pp, 2)  # all-reduce of one fp32 value per token
    grad_input = _collective_ms(device, element * bth, pp, 1)  # reduce of the input gradient to the last stage
    two = mode == VocabMode.VOCAB_2
    return replace(
        costs,
        s=2 * product if two else product,
        t=product if two else 2 * product,
        c=statistic if mode == VocabMode.NAIVE else 2 * statistic + (grad_input if two else 0.0),
        r=0.0 if two else grad_input,
        e_f=ms(bth / pp),
        e_b=ms(2 * bth / pp),
        e_comm=_collective_ms(device, element * bth, pp, 2),
        m_v=float(4 * b * t * shard + element * bth),
    )


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
