"""Memory per rank: the model state of its stages beside the simulated activations, at their peak.

The state is :data:`BYTES_PER_PARAM` a parameter (mixed precision with Adam),
of which a stage's gradient (:data:`GRAD_BYTES_PER_PARAM`) exists only from
its first backward of the step, plus :data:`VERSION_BYTES_PER_PARAM` for each
weight version beyond the first (2bw).
"""

from __future__ import annotations

import math

from ..modes import VocabMode
from ..schedule.ir import parts
from ..schedule.kinds import COMPOUND, get, graded
from .formulas import _attention, _attention_memory, kfac_state_bytes
from .simulate import Result
from .specs import ModelSpec, _positive, get_model
from .stages import stage_layers, stage_parameters

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
    (the costs' ``m_rerun``). ``layers_per_stage``, ``vocab_parallel`` (default: the
    schedule's ``options["vocab_parallel"]``), ``microbatch_size``, ``sp``
    and ``attention`` must match the ones the costs used. ``cast_bytes_per_param``: the low-precision
    copy of a stage's weights that autocast keeps while one of its forwards runs (a profile's, 2 under
    bf16; the formulas' state already counts bf16 weights), added where a forward is running. A schedule
    with K-FAC work (``options["kfac"]``) adds its state, :func:`~.formulas.kfac_state_bytes` a layer."""
    schedule, model = result.schedule, get_model(model)
    mode = VocabMode.of(vocab_parallel or schedule.options.get("vocab_parallel") or "none")
    split = stage_layers(model, schedule.stages, seq, layers_per_stage, mode)
    params = stage_parameters(model, schedule.stages, seq, split, mode)
    shard = model.vocab_shard_params(schedule.pp) if mode.splits else 0
    _positive(microbatch_size=microbatch_size)
    transient = _attention_memory(model, seq, microbatch_size, sp, _attention(attention, sp))[1]
    rerun = result.costs.m_rerun
    held, grad = state_bytes_per_param(bytes_per_param, schedule.weight_versions)
    kfac = kfac_state_bytes(model) if schedule.options.get("kfac") else 0.0
    peaks = []
    for rank in range(schedule.pp):
        stages = schedule.stages_of(rank)
        state = (held + grad) * shard + held * sum(params[s] for s in stages)  # a shard's gradient from the start
        state += kfac * sum(split[s] for s in stages)
        peaks.append(state + _with_gradients(result, rank, {s: grad * params[s] for s in stages},
                                             {s: cast_bytes_per_param * params[s] for s in stages})
                     + max(rerun[s] for s in stages) + (transient if any(split[s] for s in stages) else 0))
    return peaks


def _with_gradients(result: Result, rank: int, grads: dict[int, float], casts: dict[int, float] | None = None,
                    ) -> float:
    """The peak over the step of ``rank``'s activation memory plus the gradients (``grads``:
    bytes per stage) of the stages whose backward has begun (from the start of a stage's first
    action timed by the ``b`` or ``w`` cost, or a compound action holding one), plus, at the start
    of an action timed by ``f`` (its activations are counted from then), its stage's ``casts``."""
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
    peak, held, k = 0.0, 0.0, 0
    for t, level in result.memory_timeline(rank):
        while k < len(appear) and appear[k][0] <= t:
            held += appear[k][1]
            k += 1
        peak = max(peak, level + held + forward.get(t, 0.0))
    return max(peak, sum(g for t, g in appear if t < math.inf))  # after the last backward, as before the next step
