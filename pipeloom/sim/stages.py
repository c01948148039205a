"""How a model is cut into pipeline stages: each stage's transformer layers and parameters.

Layers are split evenly (:func:`~pipeloom.partition.split_layers`), balanced
with the vocabulary layers (``redis``: :func:`~pipeloom.partition.balanced_layers`)
or as given; :mod:`.model` costs the stages, :mod:`.memory` their model state.
"""

from __future__ import annotations

from ..errors import PipeloomError
from ..modes import VocabMode
from ..partition import balanced_layers, split_layers
from .specs import ModelSpec, _positive, get_model


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


def stage_layers(
    model: ModelSpec | str, stages: int, seq: int, layers_per_stage=None, vocab_parallel: str | None = None
) -> tuple[int, ...]:
    """Transformer layers of each of ``stages`` stages, as :func:`~.model.costs_from_model` places them."""
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
    :meth:`~.specs.ModelSpec.vocab_shard_params`). Sequence parallelism does not
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
