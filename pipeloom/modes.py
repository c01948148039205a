"""The names of choices that several layers share, one enum each.

Pure Python (no torch): the schedule, the simulator, the models, the runtime
and the command line all read these.
"""

from __future__ import annotations

from enum import Enum

from .errors import PipeloomError


class _Choice(str, Enum):
    """A named choice whose value is its command-line spelling."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value) -> _Choice:
        """``value`` as a member; anything else raises one line listing the choices."""
        try:
            return cls(value)
        except ValueError:
            raise PipeloomError(
                f"unknown {cls._what} {value!r}; choose one of {', '.join(m.value for m in cls)}") from None


class VocabMode(_Choice):
    """Where the input embedding and the LM head go ("Balancing Pipeline
    Parallelism with Vocabulary Parallelism"): ``none`` on the first and last
    stage; ``redis`` the same with the transformer layers rebalanced; the
    three algorithms split both by vocabulary over every pipeline rank."""

    NONE = "none"
    REDIS = "redis"
    NAIVE = "naive"
    VOCAB_1 = "vocab-1"
    VOCAB_2 = "vocab-2"

    @property
    def splits(self) -> bool:
        """True for the algorithms that split the vocabulary (and add passes)."""
        return self in VOCAB_ALGORITHMS


VocabMode._what = "vocab_parallel mode"
#: The modes that split the vocabulary over the pipeline ranks.
VOCAB_ALGORITHMS = (VocabMode.NAIVE, VocabMode.VOCAB_1, VocabMode.VOCAB_2)


class Attention(_Choice):
    """The attention algorithm over a sequence split across ranks: ``ring``
    (blockwise, online softmax) or ``rsa`` (Ring Self-Attention)."""

    RING = "ring"
    RSA = "rsa"


Attention._what = "attention"

#: The ``--recompute`` names and the ``recompute`` that the cost model
#: (:func:`~pipeloom.sim.model.costs_from_model`) and ``Pipeline`` take for each:
#: nothing, the norms and activation functions, or whole stages (layers in the cost model).
RECOMPUTE = {"none": False, "cheap": "cheap", "full": True}
