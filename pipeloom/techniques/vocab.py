"""Vocabulary parallelism: the embedding and the LM head split by vocabulary over every pipeline rank."""

from __future__ import annotations

from ..modes import VocabMode
from . import Flag, Technique, register

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


register(VocabParallel())
