"""Vocabulary Parallelism in the runtime: loss and every gradient against the one-process GPT."""

import pytest

torch = pytest.importorskip("torch")

from parity import check, parity_worker  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

ALGORITHMS = ["naive", "vocab-1", "vocab-2"]


def _cases(families_and_algorithms, pp, dp, microbatches):
    return [((family, algorithm), dict(schedule=family, pp=pp, microbatches=microbatches, dp=dp,
                                       vocab_parallel=algorithm, timeout=30))
            for family, algorithm in families_and_algorithms]


def _run(world, cases, pp, dp, microbatches, config_overrides):
    # vocabulary 203: shards of uneven real rows, with padding
    check(spawn(world, parity_worker, _cases(cases, pp, dp, microbatches), {"vocab_size": 203, **config_overrides},
                dp * microbatches * 2, 16, timeout=240))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_two_ranks_every_algorithm_on_1f1b_and_v_half(tied):
    cases = [(family, algorithm) for family in ("1f1b", "v-half") for algorithm in ALGORITHMS]
    _run(2, cases, 2, 1, 4, {"tie_embeddings": tied})


@pytest.mark.timeout(300)
def test_four_ranks_and_data_parallel():
    _run(4, [("1f1b", a) for a in ALGORITHMS] + [("v-half", "vocab-2")], 4, 1, 8, {"n_layer": 8})
    _run(4, [("1f1b", "vocab-2"), ("1f1b", "vocab-1")], 2, 2, 4, {"tie_embeddings": True})
