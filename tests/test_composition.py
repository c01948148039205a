"""The composition matrix: every technique with every synchronous family, and every pair of
techniques, one step on 2 gloo ranks against the one-process model (loss and every gradient).

K-FAC (against K-FAC on one process), sequence parallelism and PipeDream-2BW (against its
delayed update) have references of their own: tests/test_runtime_kfac.py, test_runtime_sp.py
and test_runtime.py compose them with these techniques.
"""

import itertools

import pytest

pytest.importorskip("torch")

from parity import check, parity_worker  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.schedule import FAMILIES  # noqa: E402

#: Each technique's Pipeline options.
TECHNIQUES = {
    "recompute": {"recompute": True},
    "cheap": {"recompute": "cheap"},
    "offload": {"offload": "full"},
    "selective": {"offload": "selective", "offload_ratio": 0.5},
    "vocab-1": {"vocab_parallel": "vocab-1"},
    "vocab-2": {"vocab_parallel": "vocab-2"},
}
#: Techniques that are settings of one option: never together.
ALTERNATIVES = ({"recompute", "cheap"}, {"offload", "selective"}, {"vocab-1", "vocab-2"})
#: The synchronous families (2bw's delayed update has its own reference).
SYNCHRONOUS = sorted(name for name in FAMILIES if name != "2bw")


def _family(name: str) -> dict:
    return {"schedule": name, "pp": 2, "microbatches": 4, "timeout": 60,
            **({"chunks": 2} if name == "interleaved-1f1b" else {})}


def _cases() -> list[tuple[str, dict]]:
    """(label, Pipeline options): each technique on each family, then each pair of techniques on
    a family in turn."""
    cases = [(f"{family} + {technique}", {**_family(family), **options})
             for family in SYNCHRONOUS for technique, options in TECHNIQUES.items()]
    pairs = [pair for pair in itertools.combinations(TECHNIQUES, 2) if not any(set(pair) <= a for a in ALTERNATIVES)]
    families = itertools.cycle(SYNCHRONOUS)
    cases += [(f"{family} + {a} + {b}", {**_family(family), **TECHNIQUES[a], **TECHNIQUES[b]})
              for (a, b), family in zip(pairs, families)]
    return cases


@pytest.mark.timeout(180)
@pytest.mark.parametrize("half", [0, 1])  # two spawns of half the cases each, which two test workers can share
def test_every_technique_with_every_family_and_every_pair_matches_one_process(half):
    cases = _cases()
    assert len(cases) == len(SYNCHRONOUS) * len(TECHNIQUES) + 12
    cases = cases[half::2]
    results = spawn(2, parity_worker, cases, {"vocab_size": 203}, 8, 16, timeout=150)
    check(results)
    assert set(results[0]) == {label for label, _ in cases}
