"""Vocabulary parallelism: the embedding and the LM head split by vocabulary over every pipeline rank."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ..modes import VocabMode
from ..partition import balanced_layers, split_layers
from . import Flag, PlanAxis, Technique, register

CHOICES = tuple(mode.value for mode in VocabMode)


class VocabParallel(Technique):
    name = "vocab_parallel"
    summary = "embedding and LM head split by vocabulary over the pipeline ranks, in extra passes"
    flags = (Flag("vocab_parallel", "where the vocabulary layers go: none (first and last stage), redis (layers "
                  "moved to balance them), naive, vocab-1, vocab-2 (split over every pipeline rank, in extra passes); "
                  "default none", metavar="MODE", compared=True),)

    def active(self, spec) -> bool:
        return spec.vocab_parallel != "none"

    def check(self, spec) -> None:
        VocabMode.of(spec.vocab_parallel)

    def cost_options(self, spec) -> dict:
        return {"vocab_parallel": spec.vocab_mode}

    def build_options(self, spec) -> dict:
        return {"vocab_parallel": spec.vocab_mode}

    def report(self, result, priced) -> dict:
        return {"vocab_parallel": priced.spec.vocab_parallel}

    def pipeline_options(self, spec, costs) -> dict:
        """The schedule carries its passes; redis balances the layers, the vocabulary layers on the ends."""
        if spec.vocab_parallel != "redis":
            return {}
        from ..builder import Priced
        from ..partition import balanced_layers

        return {"layers_per_stage": balanced_layers(Priced(spec).model, spec.pp * spec.family_chunks, spec.seq)}

    def runtime_part(self):
        from ..runtime.handlers.vocab import VocabPart

        return VocabPart

    def describe(self, spec, pipe) -> str:
        return f", vocab-parallel {spec.vocab_parallel}" if self.active(spec) else ""

    def plan_axis(self) -> PlanAxis:
        return PlanAxis("vocab_parallel", ("none", "redis", "vocab-1", "vocab-2"),
                        "vocabulary placements to search (default {default})", "vocab", 7, choices=VocabMode.of,
                        priced=True, placed=True, shaped=True)

    def plan_allows(self, request, c) -> bool:
        """Only with pp > 1; with a family that builds several steps a call (2bw), an algorithm only
        with enough microbatches (:func:`~pipeloom.schedule.transforms.vocab.versioned_microbatches`,
        which the planner's builds of 1 and 2 steps do not reach)."""
        if c.vocab_parallel == "none":
            return True
        if c.pp == 1:
            return False
        from ..schedule.transforms.vocab import ALGORITHMS, versioned_microbatches

        return not (c.vocab_parallel in ALGORITHMS and _builds_steps(c.schedule)
                    and c.microbatches < versioned_microbatches(c.pp, c.vocab_parallel))

    def plan_same(self, request, c):
        """redis where it balances the layers as the even split places them: none's plan."""
        if c.vocab_parallel != "redis":
            return c
        return replace(c, vocab_parallel="none") if _balanced_evenly(request.model, c.pp * c.chunks, request.seq) else c

    def plan_passes(self, c) -> tuple:
        from ..schedule.transforms.vocab import VOCAB_PASSES

        return VOCAB_PASSES.get(c.vocab_parallel, ())

    def plan_shard_params(self, request, c) -> int:
        from ..schedule.transforms.vocab import ALGORITHMS

        return request.model.vocab_shard_params(c.pp) if c.vocab_parallel in ALGORITHMS else 0

    def plan_model_options(self, c) -> dict:
        return {"vocab_parallel": None if c.vocab_parallel == "none" else c.vocab_parallel}


@lru_cache(maxsize=1024)
def _balanced_evenly(model, stages: int, seq: int) -> bool:
    """Whether redis's balanced layers are the even split's."""
    return balanced_layers(model, stages, seq) == split_layers(model.layers, stages)


@lru_cache(maxsize=None)
def _builds_steps(schedule: str) -> bool:
    """Whether the family builds several steps a call (2bw)."""
    from ..schedule import get_family

    return "steps" in get_family(schedule).options


register(VocabParallel())
