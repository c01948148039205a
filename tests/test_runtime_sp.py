"""Sequence parallelism in the runtime: loss and every gradient against the one-process GPT."""

import pytest

torch = pytest.importorskip("torch")

from parity import check, parity_worker  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402


def _run(world, cases, pp, dp, sp, microbatches, config_overrides, **options):
    cases = [((family, attention), dict(schedule=family, pp=pp, microbatches=microbatches, dp=dp, sp=sp,
                                        attention=attention, timeout=30, **options)) for family, attention in cases]
    check(spawn(world, parity_worker, cases, config_overrides, dp * microbatches * 2, 32, timeout=240))


@pytest.mark.timeout(300)
def test_sequence_parallel_alone_on_four_ranks():
    _run(4, [("1f1b", "ring"), ("1f1b", "rsa")], 1, 1, 4, 2, {})


@pytest.mark.timeout(300)
def test_pipeline_times_sequence_parallel():
    cases = [("1f1b", "ring"), ("zb-v", "ring"), ("1f1b", "rsa")]
    _run(4, cases, 2, 1, 2, 4, {"tie_embeddings": True})


@pytest.mark.timeout(300)
def test_recomputation_with_sequence_parallel():
    """A recomputed stage's backward runs its forward again, the ring's exchanges with it, on every rank of
    the ring at once (fused backward, and the B/W split)."""
    _run(4, [("1f1b", "ring"), ("zb-v", "ring"), ("1f1b", "rsa")], 2, 1, 2, 4, {}, recompute=True)


@pytest.mark.timeout(300)
def test_data_pipeline_and_sequence_parallel_together():
    _run(8, [("1f1b", "ring")], 2, 2, 2, 2, {})


@pytest.mark.timeout(300)
def test_vocabulary_parallel_with_sequence_parallel():
    """pp 2 x sp 2: the vocabulary passes on each rank's share of the sequences, their statistics
    reduced over its pipeline's ranks (same sp index), the loss over whole sequences."""
    cases = [(algorithm, dict(schedule="1f1b", pp=2, microbatches=4, sp=2, vocab_parallel=algorithm, timeout=30))
             for algorithm in ("vocab-1", "vocab-2")]
    check(spawn(4, parity_worker, cases, {"vocab_size": 203}, 8, 32, timeout=240))
    # the Llama family, whose rotary positions count from each rank's share of the sequence
    check(spawn(4, parity_worker, cases[1:], {"vocab_size": 203}, 8, 32, None, None, "llama-tiny", timeout=240))
