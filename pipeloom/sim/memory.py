"""Memory per rank: the model state of its stages beside the simulated activations, at their peak.

The state is :data:`BYTES_PER_PARAM` a parameter (mixed precision with Adam),
of which a stage's gradient (:data:`GRAD_BYTES_PER_PARAM`) exists only from
its first backward of the step, plus :data:`VERSION_BYTES_PER_PARAM` for each
weight version beyond the first (2bw).
"""

from __future__ import annotations

import math

from ..modes import VocabMode
from ..schedule.ir import BW, B, F, parts
from ..schedule.kinds import COMPOUND, get, graded
from ..schedule.transforms.kfac import KFAC_A, KFAC_G
from .formulas import (KFAC_STATE_COPIES, KFAC_UNITS_PER_LAYER, _attention, _attention_memory, kfac_capture_bytes,
                       kfac_factor_bytes)
from .simulate import Result
from .specs import ModelSpec, _positive, get_model
from .stages import stage_layers, stage_parameters

#: Bytes of model state per parameter, Megatron-style mixed precision: bf16
#: weights (2) + fp32 gradient buffer (4) + fp32 master weights (4) + Adam's
#: two fp32 moments (4 + 4). No distributed optimizer: every rank keeps all of
#: it for its own stages.
BYTES_PER_PARAM = 18
#: Bytes of model state per parameter by the training's precision: :data:`BYTES_PER_PARAM` under
#: bf16 autocast; in fp32 the weights are their own master copy (4 + gradient 4 + Adam's 8).
STATE_BYTES_PER_PARAM = {"bf16": BYTES_PER_PARAM, "fp32": 16}
#: Of those, the fp32 gradient: it exists only from a stage's first backward
#: of the step (the runtime frees gradients after each optimizer step).
GRAD_BYTES_PER_PARAM = 4
#: Bytes per parameter of each weight version beyond the first that a schedule
#: running several steps without a flush keeps (2bw: 2 versions, so one more): a
#: copy of the fp32 weights the runtime keeps. The newest version is the
#: parameters themselves, and a stage runs its backwards in step order, so it holds
#: one gradient at a time (:mod:`pipeloom.runtime.versions`).
VERSION_BYTES_PER_PARAM = 4


def state_bytes_per_param(bytes_per_param: float, versions: int) -> tuple[float, float]:
    """(bytes of model state per parameter held all step, bytes of its gradient, which
    appears at the stage's first backward) with ``versions`` weight versions (0 or 1:
    the parameters only; each more, :data:`VERSION_BYTES_PER_PARAM`)."""
    grad = min(GRAD_BYTES_PER_PARAM, bytes_per_param)
    return bytes_per_param - grad + max(versions - 1, 0) * VERSION_BYTES_PER_PARAM, grad


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
    cast_bytes_per_param: float = 0.0,
) -> list[float]:
    """Peak bytes per rank: model state of the rank's stages and vocabulary
    shard (``bytes_per_param`` each, of which a stage's gradient,
    :data:`GRAD_BYTES_PER_PARAM`, only from its first backward of the step on;
    with weight versions, :data:`VERSION_BYTES_PER_PARAM` more per version beyond
    the first; the shard's too)
    plus the simulated activation memory (with the vocabulary buffers), which
    is in bytes when ``result`` was simulated with :func:`~.model.costs_from_model`
    costs, at the moment their sum peaks, plus, with ring
    attention, one score block alive while a layer computes (on a rank
    with layers), plus, with recomputation, the largest of the rank's
    stages' activations alive again while its backward reruns its forward
    (the costs' ``m_rerun``), and where the output layer is, the loss's gradients while its
    backward computes them (``m_loss``): :func:`backward_transient`. ``layers_per_stage``, ``vocab_parallel`` (default: the
    schedule's ``options["vocab_parallel"]``), ``microbatch_size``, ``sp``
    and ``attention`` must match the ones the costs used. ``cast_bytes_per_param``: the low-precision
    copy of a stage's weights that autocast keeps while one of its forwards runs (a profile's, 2 under
    bf16; the formulas' state already counts bf16 weights), added where a forward is running. A schedule
    with K-FAC work (``options["kfac"]``) adds its state, :data:`~.formulas.KFAC_STATE_COPIES` copies of each
    layer's factors (:func:`~.formulas.kfac_factor_bytes`; the refresh's copy from each factor's first
    curvature piece on), and its captures (:func:`_kfac_changes`)."""
    schedule, model = result.schedule, get_model(model)
    _, split, params = _stage_sizes(model, schedule, seq, layers_per_stage, vocab_parallel)
    _positive(microbatch_size=microbatch_size)
    transient = _attention_memory(model, seq, microbatch_size, sp, _attention(attention, sp))[1]
    grad = state_bytes_per_param(bytes_per_param, schedule.weight_versions)[1]
    layer = None
    if schedule.options.get("kfac"):  # the factors and inverses in use are held; the rest comes and goes
        layer = list(zip(kfac_capture_bytes(model, seq, microbatch_size, sp), kfac_factor_bytes(model)))
    held = held_memory_bytes(model, schedule, seq, layers_per_stage=layers_per_stage, vocab_parallel=vocab_parallel,
                             bytes_per_param=bytes_per_param)
    peaks = []
    for rank, state in enumerate(held):
        stages = schedule.stages_of(rank)
        peaks.append(state + _with_gradients(result, rank, {s: grad * params[s] for s in stages},
                                             {s: cast_bytes_per_param * params[s] for s in stages},
                                             _kfac_changes(result, rank, layer) if layer else ())
                     + backward_transient(result.costs, stages) + (transient if any(split[s] for s in stages) else 0))
    return peaks


def backward_transient(costs, stages) -> float:
    """The most one of ``stages``' backwards holds beyond what its F kept, while it runs: a
    recomputed stage's rerun activations (``m_rerun``) and, on the stage with the output layer,
    the loss's gradients (``m_loss``), counted at the rank's peak."""
    rerun, loss = costs.m_rerun, costs.m_loss
    return max(rerun[s] + loss[s] for s in stages)


def held_memory_bytes(model: ModelSpec | str, schedule, seq: int, *, layers_per_stage=None,
                      vocab_parallel: str | None = None, bytes_per_param: float = BYTES_PER_PARAM) -> list[float]:
    """Per rank, the bytes :func:`peak_memory_bytes` counts as held from one step to the next: its
    stages' model state without their gradients (which appear at a stage's first backward and go
    with the optimizer step), with its weight versions, the vocabulary shard's whole state, and
    K-FAC's factors and inverses in use. A step's peak less this is what the step adds (what
    ``pipeloom train --report`` measures above a step's start)."""
    model = get_model(model)
    mode, split, params = _stage_sizes(model, schedule, seq, layers_per_stage, vocab_parallel)
    shard = model.vocab_shard_params(schedule.pp) if mode.splits else 0
    held, grad = state_bytes_per_param(bytes_per_param, schedule.weight_versions)
    kfac = kfac_layer_state_bytes(model) if schedule.options.get("kfac") else 0.0
    stages = [schedule.stages_of(rank) for rank in range(schedule.pp)]
    return [(held + grad) * shard + held * sum(params[s] for s in mine) + kfac * sum(split[s] for s in mine)
            for mine in stages]  # a shard's gradient from the start


def _stage_sizes(model: ModelSpec, schedule, seq: int, layers_per_stage, vocab_parallel: str | None) -> tuple:
    """(the vocabulary mode, each stage's layers, each stage's parameters) of ``schedule``'s stages
    (``vocab_parallel`` None: the schedule's ``options["vocab_parallel"]``)."""
    mode = VocabMode.of(vocab_parallel or schedule.options.get("vocab_parallel") or "none")
    split = stage_layers(model, schedule.stages, seq, layers_per_stage, mode)
    return mode, split, stage_parameters(model, schedule.stages, seq, split, mode)


def kfac_layer_state_bytes(model: ModelSpec | str) -> float:
    """Bytes of K-FAC's state each transformer layer holds all step long: its factors and their inverses
    in use (:data:`~.formulas.KFAC_STATE_COPIES` copies less the refresh's, which comes with its curvature)."""
    return (KFAC_STATE_COPIES - 1) * sum(a + g for a, g in kfac_factor_bytes(model))


def _kfac_changes(result: Result, rank: int, layer: list[tuple]) -> list[tuple[float, int, float]]:
    """K-FAC's memory on ``rank`` beside its state held all along, as (time, order, change): stage s's
    captured inputs of microbatch j of the capture step from the end of F(s, j), its output gradients
    from the end of its backward (B or BW), each unit's until the end of its curvature piece; and the
    refresh's copy of a unit's factor (its sums, then its new inverses) from the start of its first
    curvature piece. ``layer``: per linear layer of a layer, ((A, G) captured bytes, (A, G) factor
    bytes); units cycle over them. At one instant frees come first (order 0), then the activations'
    changes (1), then what appears (2)."""
    schedule = result.schedule
    units, m = schedule.options["kfac"]["units"], schedule.microbatches
    kept = {F: 0, B: 1, BW: 1, KFAC_A: 0, KFAC_G: 1}  # which of (A, G) an action captures or frees
    changes, summed = [], set()
    for action, start, end in zip(schedule.ranks[rank], result.starts[rank], result.ends[rank]):
        for part in parts(action) if action.kind in COMPOUND else (action,):
            factor = kept.get(part.kind)
            if factor is None or part.microbatch >= m:
                continue
            if part.kind in (KFAC_A, KFAC_G):
                captured, sums = layer[part.payload[0] % KFAC_UNITS_PER_LAYER]
                changes.append((end, 0, -captured[factor]))
                if (part.kind, part.stage, part.payload) not in summed:
                    summed.add((part.kind, part.stage, part.payload))
                    changes.append((start, 2, sums[factor]))
            else:
                changes.append((end, 2, sum(layer[u % KFAC_UNITS_PER_LAYER][0][factor]
                                            for u in range(units[part.stage]))))
    return changes


def _with_gradients(result: Result, rank: int, grads: dict[int, float], casts: dict[int, float] | None = None,
                    kfac=()) -> float:
    """The peak over the step of ``rank``'s activation memory plus the gradients (``grads``:
    bytes per stage) of the stages whose backward has begun (from the start of a stage's first
    action timed by the ``b`` or ``w`` cost, or a compound action holding one), plus, at the start
    of an action timed by ``f`` (its activations are counted from then), its stage's ``casts``, plus
    K-FAC's captures and refresh state (``kfac``: :func:`_kfac_changes`)."""
    backward = graded()
    casts = {s: c for s, c in (casts or {}).items() if c}  # none: the list read only up to each first backward
    first, forward = {}, {}
    for action, start in zip(result.schedule.ranks[rank], result.starts[rank]):
        for part in parts(action) if action.kind in COMPOUND else (action,):
            if part.kind in backward and part.stage in grads and part.stage not in first:
                first[part.stage] = start
            if casts.get(part.stage) and "f" in get(part.kind).cost:
                forward[start] = max(forward.get(start, 0.0), casts[part.stage])
        if not casts and len(first) == len(grads):
            break
    appear = sorted((first.get(s, math.inf), g) for s, g in grads.items())
    changes, previous = [], 0.0
    for t, level in result.memory_timeline(rank):
        changes.append((t, 1, level - previous))
        previous = level
    changes += [(t, 0, g) for t, g in appear if t < math.inf]  # counted from the activations' changes at t on
    changes += kfac
    peak = level = 0.0
    for t, order, change in sorted(changes, key=lambda c: c[:2]):
        level += change
        if order:  # no peak as a gradient appears or a capture goes
            peak = max(peak, level + forward.get(t, 0.0))
    return max(peak, sum(g for t, g in appear if t < math.inf))  # after the last backward, as before the next step
