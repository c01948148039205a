"""The cost model (docs/design.md): the zero-bubble paper's formulas, presets, memory per rank."""

import subprocess
import sys

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.partition import split_layers
from pipeloom.schedule import build
from pipeloom.schedule.deps import ListPeaks
from pipeloom.schedule.ir import B, F, W, Action
from pipeloom.sim import (
    BYTES_PER_PARAM, DEVICES, MODELS, Device, ModelSpec, costs_from_model, get_device, peak_memory_bytes, simulate,
    stage_parameters,
)
from pipeloom.sim.memory import _with_gradients, backward_transient

# "Zero Bubble Pipeline Parallelism": the paper's profiled costs (ms; A100, s = 1024): p, b, T_F.
PROFILED = {"1.5b": (8, 6, 18.522), "6.2b": (8, 3, 29.718), "14.6b": (16, 1, 11.347), "28.3b": (32, 1, 10.419)}


def test_middle_stage_formula_ratios():
    c = costs_from_model("6.2b", 8, 1024, 3, "a100")
    f, b, w = c.f[3], c.b[3], c.w[3]
    assert w < f < b
    assert b + w == pytest.approx(2 * f)


def test_output_layer_to_transformer_layer_compute_ratio():
    """The output layer against one transformer layer (the imbalance the Vocabulary Parallelism paper
    addresses): h = 4096, s = 2048, V = 128k gives V/(12h + 2s) ~ 2.4x."""
    h, s, v = 4096, 2048, 128_000
    spec = ModelSpec("ref", 4, h, 32, v)
    c = costs_from_model(spec, 4, s, 1, "a100", layers_per_stage=[1, 1, 1, 1])
    layer = c.f[1] + c.b[1] + c.w[1]
    head = c.f[3] + c.b[3] + c.w[3] - layer
    assert head / layer == pytest.approx(v / (12 * h + 2 * s))
    assert head / layer == pytest.approx(2.4, abs=0.05)


def test_first_and_last_stages_are_heavier():
    c = costs_from_model("4b", 8, 2048, 1, "a100")  # 32 layers: 4 on every stage
    middle = set(c.f[1:-1])
    assert len(middle) == 1
    assert c.f[0] > c.f[1] and c.f[-1] > c.f[1]
    for field in ("b", "w", "m_b", "m_w"):
        values = getattr(c, field)
        assert values[-1] > values[1] == values[0]


@pytest.mark.parametrize("name,size", [
    ("1.5b", 1.5e9), ("6.2b", 6.2e9), ("14.6b", 14.6e9), ("28.3b", 28.3e9),
    ("gpt-125m", 125e6), ("gpt-350m", 350e6), ("gpt-1.3b", 1.3e9),
])
def test_parameter_counts_match_preset_names(name, size):
    assert MODELS[name].parameters(1024) == pytest.approx(size, rel=0.1)


@pytest.mark.parametrize("name,size", [("4b", 4e9), ("10b", 10e9), ("21b", 21e9)])
def test_vocabulary_parallelism_presets_near_their_names(name, size):
    """"≈ 4B/10B/21B" in the paper; V = 128k and an untied head add a few percent."""
    assert MODELS[name].parameters(2048) == pytest.approx(size, rel=0.15)


def test_chunks_split_the_stage():
    whole = costs_from_model("4b", 4, 2048, 1, "a100")  # 8 layers per stage
    split = costs_from_model("4b", 4, 2048, 1, "a100", chunks=2)  # 4 per virtual stage
    assert len(split.f) == 8
    assert split.f[3] == pytest.approx(whole.f[1] / 2)
    assert split.m_b[3] == pytest.approx(whole.m_b[1] / 2)
    for field in ("f", "b", "w", "m_b", "m_w"):
        assert sum(getattr(split, field)) == pytest.approx(sum(getattr(whole, field)))
    assert split.comm == [whole.comm[0]] * 8


def test_split_layers_gives_the_remainder_to_the_middle():
    assert split_layers(30, 8) == (3, 4, 4, 4, 4, 4, 4, 3)
    assert split_layers(10, 4) == (2, 3, 3, 2)
    assert split_layers(5, 4) == (1, 2, 1, 1)
    assert split_layers(3, 2) == (2, 1)
    assert split_layers(7, 1) == (7,)


def test_fewer_layers_than_stages_is_an_error():
    with pytest.raises(PipeloomError, match="22 layers cannot fill 32 stages"):
        costs_from_model("1.5b", 16, 1024, 1, "a100", chunks=2)


@pytest.mark.parametrize("kwargs,message", [
    ({"model": "7b"}, "unknown model '7b'; presets: 1.5b, 6.2b"),
    ({"device": "tpu"}, "unknown device 'tpu'; presets: a100, h100"),
    ({"layers_per_stage": [10, 10]}, "need 2 non-negative integers summing to 22"),
    ({"seq": 0}, "seq must be a positive integer"),
])
def test_bad_inputs_name_the_value(kwargs, message):
    args = {"model": "1.5b", "pp": 2, "seq": 1024, "microbatch_size": 1, "device": "a100", **kwargs}
    with pytest.raises(PipeloomError, match=message):
        costs_from_model(**args)


def test_bad_specs_are_rejected():
    with pytest.raises(PipeloomError, match="hidden 100 is not divisible by heads 3"):
        ModelSpec("x", 2, 100, 3, 1000)
    with pytest.raises(PipeloomError, match="efficiency must be in"):
        Device("x", 1e12, 1e9, 1e9, 1e9, efficiency=1.5)


def test_recompute_keeps_stage_inputs_and_reruns_forward():
    plain = costs_from_model("4b", 8, 2048, 1, "a100")
    again = costs_from_model("4b", 8, 2048, 1, "a100", recompute=True)
    # the stage's input, 2sbh, as the runtime's recomputing stage keeps; the last reruns its loss too
    assert again.m_b[1] == again.m_b[-1] == 2 * 2048 * 3072
    assert again.b[1] == pytest.approx(plain.b[1] + plain.f[1])
    assert again.f == plain.f
    # while B reruns the forward the stage holds its whole activations once more
    assert again.extra["m_rerun"] == plain.m_b
    schedule = build("1f1b", 8, 16)
    kept, rerun = (peak_memory_bytes("4b", simulate(schedule, c), 2048) for c in (plain, again))
    assert [r - a for r, a in zip(rerun, simulate(schedule, again).peak_activation)] == pytest.approx(
        [k - a + m for k, a, m in zip(kept, simulate(schedule, plain).peak_activation, plain.m_b)])


def test_fused_attention_keeps_no_scores():
    """With sp = 1 the runtime runs torch's fused attention: a layer keeps its log-sum-exp
    (4bas bytes, fp32), not the zero-bubble paper's 5as²b of scores (kept with rsa)."""
    s, b, model = 2048, 2, MODELS["4b"]
    fused = costs_from_model("4b", 8, s, b, "a100")
    plain = costs_from_model("4b", 8, s, b, "a100", attention="rsa")
    layers = 4
    assert fused.m_b[1] == layers * (34 * s * b * model.hidden + 4 * b * model.heads * s)
    assert plain.m_b[1] - fused.m_b[1] == layers * (5 * model.heads * s * s * b - 4 * b * model.heads * s)
    with pytest.raises(PipeloomError, match="'sdpa' runs on one rank"):
        costs_from_model("4b", 8, s, b, "a100", sp=2, attention="sdpa")


@pytest.mark.parametrize("name", PROFILED)
def test_forward_time_near_the_zero_bubble_profile(name):
    pp, b, t_f = PROFILED[name]
    c = costs_from_model(name, pp, 1024, b, "a100")
    assert 0.5 < c.f[pp // 2] / t_f < 2


def test_1f1b_6_2b_fits_an_a100_and_rank_0_holds_most():
    schedule = build("1f1b", 8, 16)
    costs = costs_from_model("6.2b", 8, 1024, 3, "a100")
    result = simulate(schedule, costs)
    assert result.peak_activation[0] == pytest.approx(8 * costs.m_b[0])  # p microbatches in flight
    memory = peak_memory_bytes("6.2b", result, 1024)
    assert max(memory) < DEVICES["a100"].memory
    assert memory[0] > memory[-1]


def test_peak_memory_counts_every_virtual_stage_of_a_rank():
    schedule = build("interleaved-1f1b", 4, 8, chunks=2)
    result = simulate(schedule, costs_from_model("4b", 4, 2048, 1, "a100", chunks=2))
    memory = peak_memory_bytes("4b", result, 2048)
    # less the loss's gradients of the last rank's backward (m_loss)
    state = [m - a - backward_transient(result.costs, schedule.stages_of(r))
             for r, (m, a) in enumerate(zip(memory, result.peak_activation))]
    assert backward_transient(result.costs, [7]) == 8 * 2048 * MODELS["4b"].vocab
    params = stage_parameters("4b", 8, 2048)
    assert schedule.stages_of(3) == [3, 7]  # looped: the last stage (LM head) on the last rank
    assert state[3] == pytest.approx(BYTES_PER_PARAM * (params[3] + params[7]))
    assert sum(state) == pytest.approx(BYTES_PER_PARAM * sum(params))


def test_autocasts_weight_copy_counts_where_a_forward_runs():
    """The bf16 copy of the weights autocast keeps during a forward (2 bytes a parameter) adds to the
    peak where a forward runs: 1F1B's second forward, with the gradients of the first backward."""
    result = simulate(build("1f1b", 1, 4), costs_from_model("gpt-350m", 1, 1024, 4, "h100"))
    params = stage_parameters("gpt-350m", 1, 1024)[0]
    plain, cast = (peak_memory_bytes("gpt-350m", result, 1024, microbatch_size=4, cast_bytes_per_param=c)[0]
                   for c in (0.0, 2.0))
    assert cast - plain == pytest.approx(2.0 * params)


@pytest.mark.parametrize("name,options", [
    ("1f1b", {}), ("gpipe", {}), ("interleaved-1f1b", {"chunks": 2}), ("zb-h1", {}), ("zb-v", {}),
    ("2bw", {"steps": 2}), ("1f1b", {"vocab_parallel": "vocab-1"}), ("dualpipev", {}),
])
def test_list_peaks_with_gradients_never_exceed_the_simulated_peak(name, options):
    """The planner's bound read off the lists (activations plus the gradients of the stages whose
    backward has begun) is at most what the simulated timeline holds, and equal to it for the
    families whose lists change memory at every action."""
    schedule = build(name, 4, 8, **options)
    costs = costs_from_model("4b", 4, 2048, 1, "a100", chunks=schedule.chunks,
                             vocab_parallel=options.get("vocab_parallel"))
    result = simulate(schedule, costs)
    grads = {s: 4.0 * n for s, n in enumerate(stage_parameters("4b", schedule.stages, 2048,
                                                              vocab_parallel=options.get("vocab_parallel")))}
    listed = ListPeaks(schedule.ranks)(result.costs.memory_delta, grads)
    for rank, bound in enumerate(listed):
        simulated = _with_gradients(result, rank, {s: grads[s] for s in schedule.stages_of(rank)})
        assert bound <= simulated * (1 + 1e-12)
        if name in ("1f1b", "gpipe"):
            assert bound == pytest.approx(simulated, rel=1e-12)


def test_list_peaks_count_a_gradient_from_the_next_change():
    """A stage's gradient joins the activations where memory next changes after its first
    backward starts, as the simulator reads it: a B that keeps what it frees (no change) waits
    for its W."""
    actions = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(W, 0, 0), Action(B, 0, 1), Action(W, 0, 1)]
    delta = {F: 1.0, B: 0.0, W: -1.0}
    assert ListPeaks([actions])(lambda a: delta[a.kind], {0: 10.0}) == [11.0]  # not 2 + 10 at the first B
    assert ListPeaks([actions])(lambda a: delta[a.kind]) == [2.0]


def test_model_module_does_not_import_torch():
    code = ("import sys, pipeloom.sim.model, pipeloom.presets, pipeloom.partition, pipeloom.modes; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp32_runs_at_the_devices_fp32_rate_and_keeps_and_sends_4_byte_values():
    """``precision="fp32"``: compute at the preset's fp32 rate (the cpu preset's one rate unchanged),
    the layers' 16-bit values at 4 bytes, kept and sent; the fp32 softmax as it was."""
    bf16, fp32 = (costs_from_model("gpt-1.3b", 4, 1024, 1, "h100", precision=p) for p in ("bf16", "fp32"))
    h100 = get_device("h100")
    for field in ("f", "b", "w"):
        assert getattr(fp32, field) == pytest.approx([x * h100.peak_flops / h100.fp32_flops
                                                      for x in getattr(bf16, field)], rel=1e-12)
    assert fp32.comm == pytest.approx([2 * x for x in bf16.comm], rel=1e-12)
    assert fp32.m_w[1] == 2 * bf16.m_w[1] and 1.9 < fp32.m_b[1] / bf16.m_b[1] < 2
    cpu = [costs_from_model("gpt-1.3b", 4, 1024, 1, "cpu", precision=p).f for p in ("bf16", "fp32")]
    assert cpu[0] == cpu[1]
    with pytest.raises(PipeloomError, match="precision='fp16': choose bf16 or fp32"):
        costs_from_model("gpt-1.3b", 4, 1024, 1, "h100", precision="fp16")
