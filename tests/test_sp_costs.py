"""Sequence parallelism in the cost model: ring and RSA attention over SP groups of N ranks."""

from dataclasses import replace

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.schedule import build
from pipeloom.sim import (
    BYTES_PER_PARAM, DEVICES, MODELS, costs_from_model, longest_sequence, peak_memory_bytes,
    sequence_parallel_costs, simulate, stage_parameters,
)
from pipeloom.sim.memory import backward_transient

SPEC = MODELS["gpt-1.3b"]  # 24 layers, h = 2048, 16 heads
A100 = DEVICES["a100"]
SEQ = 32768


def middle_layer(sp, attention=None, seq=SEQ, device="a100"):
    """Costs of one transformer layer alone on the middle stage (stages 0 and 2 take the rest)."""
    return costs_from_model(SPEC, 3, seq, 1, device, layers_per_stage=[11, 1, 12], sp=sp, attention=attention)


def test_sp_1_gives_todays_numbers():
    """Pinned from the model before sequence parallelism: 4b, pp 4, seq 2048, b 3, 1F1B with 8 microbatches,
    plain attention (scores kept; with sp = 1 the default is now fused attention, which keeps none); the
    last rank's peak since with the loss's gradients in its backward (``m_loss``: 8 x b x seq x V more)."""
    costs = costs_from_model("4b", 4, 2048, 3, "a100", attention="rsa")
    assert costs.f == [79.29206689476923, 79.29170392615384, 79.29170392615384, 110.2650257723077]
    assert costs.m_b == [17213423616.0, 17213423616.0, 17213423616.0, 20434649088.0]
    memory = peak_memory_bytes("4b", simulate(build("1f1b", 4, 8), costs), 2048, microbatch_size=3, attention="rsa")
    assert memory == [92358033408.0, 67953475584.0, 50740051968.0, 43825852416.0 + 8 * 3 * 2048 * MODELS['4b'].vocab]
    assert costs_from_model("4b", 4, 2048, 3, "a100", sp=1, attention="rsa") == costs
    fused = costs_from_model("4b", 4, 2048, 3, "a100")
    assert fused == costs_from_model("4b", 4, 2048, 3, "a100", sp=1, attention="sdpa")
    assert fused.f == costs.f and all(m < c for m, c in zip(fused.m_b, costs.m_b))
    for mode in ("redis", "vocab-2"):
        plain = costs_from_model("4b", 4, 2048, 3, "a100", vocab_parallel=mode, recompute=True)
        assert costs_from_model("4b", 4, 2048, 3, "a100", vocab_parallel=mode, recompute=True, sp=1) == plain


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("attention", ["ring", "rsa"])
def test_compute_falls_n_fold(n, attention):
    one = costs_from_model(SPEC, 4, SEQ, 1, "a100")
    many = costs_from_model(SPEC, 4, SEQ, 1, "a100", sp=n, attention=attention)
    layer = sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, attention)
    layers = 6  # per stage
    assert many.w == pytest.approx([w / n for w in one.w], rel=1e-12)  # linear parts only: exactly 1/N
    assert [f - layers * layer.exposed_forward_ms for f in many.f] == pytest.approx([f / n for f in one.f], rel=1e-12)
    assert [b - layers * layer.exposed_backward_ms for b in many.b] == pytest.approx([b / n for b in one.b], rel=1e-12)
    assert many.comm == pytest.approx([c / n for c in one.comm])  # each rank sends its s/N tokens on
    if attention == "ring":  # at 32k tokens the transfers hide under the block compute
        assert many.f == pytest.approx([f / n for f in one.f], rel=1e-12)
    else:
        assert layer.exposed_forward_ms == layer.forward_ms > 0


def test_ring_activation_memory_is_linear_in_s_and_rsa_quadratic():
    b, h, a = 1, SPEC.hidden, SPEC.heads
    for n in (2, 4):
        t = SEQ // n
        ring, ring2 = middle_layer(n, "ring").m_b[1], middle_layer(n, "ring", 2 * SEQ).m_b[1]
        assert ring == 34 * t * b * h + 4 * b * a * t  # 1/N of the zero-bubble paper's 34sbh, plus the log-sum-exp
        assert ring2 == 2 * ring
        rsa = sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, "rsa").kept_bytes
        assert rsa == 5 * a * t * SEQ * b
        assert sequence_parallel_costs(SPEC, 2 * SEQ, 1, "a100", n, "rsa").kept_bytes == 4 * rsa
        # rsa keeps 1/N of today's whole layer, scores included: s²/N
        assert middle_layer(n, "rsa").m_b[1] == pytest.approx(middle_layer(1, "rsa").m_b[1] / n, rel=1e-15)
        assert sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, "ring").transient_bytes == 5 * a * t * t * b


def test_model_state_does_not_change_and_ring_adds_one_block_at_peak():
    schedule = build("1f1b", 4, 8)
    state = [BYTES_PER_PARAM * p for p in stage_parameters(SPEC, 4, SEQ)]
    for attention in ("ring", "rsa"):
        costs = costs_from_model(SPEC, 4, SEQ, 2, "a100", sp=4, attention=attention)
        result = simulate(schedule, costs)
        memory = peak_memory_bytes(SPEC, result, SEQ, microbatch_size=2, sp=4, attention=attention)
        block = sequence_parallel_costs(SPEC, SEQ, 2, "a100", 4, attention).transient_bytes
        assert block == (5 * SPEC.heads * (SEQ // 4) ** 2 * 2 if attention == "ring" else 0)
        loss = [backward_transient(result.costs, [s]) for s in range(4)]  # the last stage's loss gradients
        assert loss[:3] == [0, 0, 0] and loss[3] == 8 * 2 * (SEQ // 4) * SPEC.vocab
        assert [m - a - block - x for m, a, x in zip(memory, result.peak_activation, loss)] == pytest.approx(state)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_transfers_are_n_minus_1_steps_at_the_link_bandwidth(n):
    t = SEQ // n
    step_bytes = 2 * 1 * t * SPEC.hidden * 2  # K and V of one rank's t tokens, bf16
    ring = sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, "ring")
    assert (ring.steps, ring.step_bytes) == (n - 1, step_bytes)
    assert ring.step_ms == pytest.approx(1e3 * step_bytes / A100.link_bandwidth)
    assert ring.forward_ms == pytest.approx((n - 1) * ring.step_ms)
    assert ring.backward_ms == pytest.approx(2 * ring.forward_ms)  # K, V and their gradients
    rsa = sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, "rsa")
    assert (rsa.steps, rsa.step_bytes) == (2 * (n - 1), step_bytes // 2)  # K, then V
    assert rsa.forward_ms == pytest.approx(ring.forward_ms)
    # "Sequence Parallelism: Long Sequence Training from System Perspective": RSA moves
    # 8(N-1)·b·(s/N)·h elements per layer, forward and backward
    assert rsa.comm_ms == pytest.approx(1e3 * 8 * (n - 1) * t * SPEC.hidden * 2 / A100.link_bandwidth)
    assert rsa.exposed_forward_ms + rsa.exposed_backward_ms == rsa.comm_ms


def test_ring_exposes_only_what_a_block_does_not_hide():
    slow = replace(A100, name="slow-link", link_bandwidth=1e9)
    n, seq = 4, 4096
    t = seq // n
    ring = sequence_parallel_costs(SPEC, seq, 1, slow, n, "ring")
    block_f, block_b = slow.ms(4 * t * t * SPEC.hidden), slow.ms(8 * t * t * SPEC.hidden)
    assert ring.step_ms > 2 * block_b
    assert ring.exposed_forward_ms == pytest.approx((n - 1) * (ring.step_ms - block_f))
    assert ring.exposed_backward_ms == pytest.approx((n - 1) * (2 * ring.step_ms - block_b))
    one = middle_layer(1, seq=seq, device=slow)
    many = middle_layer(n, "ring", seq=seq, device=slow)
    assert many.f[1] == pytest.approx(one.f[1] / n + ring.exposed_forward_ms)
    rsa = middle_layer(n, "rsa", seq=seq, device=slow)
    assert rsa.f[1] > many.f[1] and rsa.b[1] > many.b[1]
    assert sequence_parallel_costs(SPEC, SEQ, 1, "a100", n, "ring").exposed_forward_ms == 0  # hidden at 32k on A100


def test_longest_sequence_grows_n_fold_with_ring_and_slower_with_rsa():
    budget = 80 * 2**30
    ring = {n: longest_sequence(SPEC, budget, n, "ring") for n in (1, 2, 4)}
    rsa = {n: longest_sequence(SPEC, budget, n, "rsa") for n in (1, 2, 4)}
    assert ring[2] / ring[1] == pytest.approx(2, rel=0.03)
    assert ring[4] / ring[1] == pytest.approx(4, rel=0.05)  # the position embeddings grow with s, unsplit
    assert rsa[4] / rsa[1] < 2.2  # about sqrt(N) once the scores dominate
    assert all(rsa[n] < ring[n] for n in (1, 2, 4))
    for n, seq in ring.items():
        assert seq % n == 0
        for length, fits in ((seq, True), (seq + n, False)):
            result = simulate(build("1f1b", 1, 1), costs_from_model(SPEC, 1, length, 1, "a100", sp=n, attention="ring"))
            memory = peak_memory_bytes(SPEC, result, length, sp=n, attention="ring")
            assert (max(memory) <= budget) == fits


def test_vocabulary_passes_count_the_ranks_tokens():
    one = costs_from_model("4b", 4, 8192, 1, "a100", vocab_parallel="vocab-2")
    four = costs_from_model("4b", 4, 8192, 1, "a100", vocab_parallel="vocab-2", sp=4)
    assert four.s == pytest.approx(one.s / 4) and four.m_v == pytest.approx(one.m_v / 4)


@pytest.mark.parametrize("kwargs,message", [
    ({"sp": 3}, "sp=3 must divide seq=1024"),
    ({"sp": 0}, "sp must be a positive integer, got 0"),
    ({"sp": 2, "attention": "flash"}, "unknown attention 'flash'; choose one of ring, rsa"),
])
def test_bad_inputs_name_the_value(kwargs, message):
    with pytest.raises(PipeloomError, match=message):
        costs_from_model("1.5b", 2, 1024, 1, "a100", **kwargs)


def test_longest_sequence_when_nothing_fits():
    with pytest.raises(PipeloomError, match="does not fit"):
        longest_sequence(SPEC, 2**30, 4)
