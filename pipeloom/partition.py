"""How many transformer layers each pipeline stage holds.

The GPT split (:meth:`pipeloom.nn.GPT.split`) and the simulator's cost model
(:mod:`pipeloom.sim.model`) both place layers with these functions. Pure
Python: nothing here imports torch.
"""

from __future__ import annotations

from .errors import PipeloomError


def split_layers(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage, as even as possible; the remainder goes to the middle
    stages (centre first), since the first and last stages also carry the
    embedding and the output layer; then to the first stage, then the last."""
    if layers < stages:
        raise PipeloomError(
            f"{layers} layers cannot fill {stages} stages (pp x chunks): need layers >= stages; "
            f"use at most {layers} stages or give layers_per_stage"
        )
    base, extra = divmod(layers, stages)
    favoured = set((_centre_first(stages)[: max(stages - 2, 0)] + [0, stages - 1])[:extra])
    return tuple(base + (s in favoured) for s in range(stages))


def balanced_layers(model, stages: int, seq: int) -> tuple[int, ...]:
    """Layers per stage of the ``redis`` baseline for ``model`` (anything with
    ``layers``, ``hidden``, ``matrix_params`` and ``vocab``, such as a
    :class:`~pipeloom.sim.ModelSpec`) and sequences of ``seq`` tokens: each
    layer in turn goes to the stage with the least compute (F + B + W) so far,
    the first stage starting with the input layer's and the last with the
    output layer's, so the slowest stage is as fast as whole layers allow
    (stages may get none); ties go to the middle stages. FLOP ratios only: the
    microbatch size and the device cancel."""
    for name, value in (("stages", stages), ("seq", seq)):
        if not isinstance(value, int) or value < 1:
            raise PipeloomError(f"{name} must be a positive integer, got {value!r}")
    load = [0] * stages  # FLOPs / bsh
    load[0] += 3
    load[-1] += 6 * model.vocab
    layer = 6 * model.matrix_params // model.hidden + 12 * seq  # (F + B + W) / bsh: 3(8 + 4·ffn)h + 12s for a GPT
    centre_first = _centre_first(stages)
    counts = [0] * stages
    for _ in range(model.layers):
        s = min(centre_first, key=load.__getitem__)
        load[s] += layer
        counts[s] += 1
    return tuple(counts)


def _centre_first(stages: int) -> list[int]:
    """The stages from the middle outwards (the lower of two equally central first)."""
    return sorted(range(stages), key=lambda s: (abs(2 * s - (stages - 1)), s))


def stage_totals(split, per_layer: float, first: float = 0, last: float = 0) -> list:
    """Per stage of ``split`` layers: ``per_layer`` for each of its layers, plus ``first`` on the
    first stage (the embedding) and ``last`` on the last (the output layer)."""
    values = [n * per_layer for n in split]
    values[0] += first
    values[-1] += last
    return values
