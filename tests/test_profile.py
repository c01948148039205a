"""Profiles: measuring on the CPU, the JSON format, costs from a profile, and `pipeloom profile`."""

import json

import pytest

from pipeloom.cli import main
from pipeloom.errors import PipeloomError
from pipeloom.schedule import Action
from pipeloom.schedule.transforms.kfac import KFAC_INV
from pipeloom.sim import MODELS, costs_from_model, get_device, layer_flops
from pipeloom.sim.formulas import kfac_unit_weights
from pipeloom.sim.profile import FORMAT, LAYER_FIELDS, Profile, load_profile

try:
    import torch
except ImportError:  # the format and the costs need no torch; measuring does
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="measuring needs torch")

TINY = MODELS["tiny"]  # hidden 32, 4 heads, vocab 256, 4 layers


def profile_dict(seq=64, link=(2e9, 0.05), host=None):
    """A hand-made profile of the tiny model: times and bytes that grow with the microbatch size."""
    def sample(b):
        return {
            "layer": {"f": 1.0 * b, "b": 2.0 * b, "w": 0.5 * b, "bw": 2.4 * b},
            "embedding": {"f": 0.1 * b, "b": 0.2 * b},
            "head": {"f": 3.0 * b, "b": 4.0 * b, "w": 1.0 * b},
            "message_bytes": 4 * b * seq * 32,
            "memory": {"layer": {"none": 1000 * b, "cheap": 600 * b, "full": 100 * b, "w": 900 * b},
                       "head": {"b": 5000 * b, "w": 4000 * b, "full": 4500 * b}},
        }
    return {
        "format": FORMAT,
        "machine": {"device": "cpu", "name": "test", "torch": "x", "threads": 1, "precision": "fp32"},
        "model": {"name": "tiny", "layers": 4, "hidden": 32, "heads": 4, "vocab": 256, "ffn": 4, "tied": False,
                  "kv_heads": None, "ffn_hidden": None, "gated": False, "bias": True, "rotary": False},
        "seq": seq,
        "repeats": 3,
        "bytes_per_param": 16.0,
        "cast_bytes_per_param": 0.0,
        "optimizer_ns_per_param": 5.0,
        "kfac": {"a": {"1": 0.2, "4": 0.8}, "g": {"1": 0.4, "4": 1.6}, "inv": 2.0, "pre": 0.6, "units": 4},
        "link": {"bandwidth": link[0] if link else None, "latency_ms": link[1] if link else None,
                 "reason": None if link else "one GPU"},
        "host_bandwidth": host,
        "microbatch_sizes": {"1": sample(1), "4": sample(4)},
    }


# -- the format ----------------------------------------------------------------

def test_a_profile_without_the_optimizer_time_loads_and_leaves_it_to_the_device():
    data = profile_dict()
    del data["optimizer_ns_per_param"]
    assert Profile.from_dict(data).optimizer_ns_per_param is None
    assert Profile.from_dict({**data, "optimizer_ns_per_param": None}).optimizer_ns_per_param is None
    with pytest.raises(PipeloomError, match="optimizer_ns_per_param is -1; expected a positive number or null"):
        Profile.from_dict({**data, "optimizer_ns_per_param": -1})


def test_an_older_profile_takes_autocasts_copy_from_its_precision():
    data = profile_dict()
    del data["cast_bytes_per_param"]
    assert Profile.from_dict(data).cast_bytes_per_param == 0.0
    data["machine"]["precision"] = "bf16"
    assert Profile.from_dict(data).cast_bytes_per_param == 2.0
    data["machine"]["precision"] = "fp8"
    with pytest.raises(PipeloomError, match="machine.precision is 'fp8'; expected one of fp32, bf16"):
        Profile.from_dict(data)


def test_the_layers_shape_beyond_a_gpts_is_read_and_absent_means_a_gpt():
    data = profile_dict()
    older = {**data, "model": {k: v for k, v in data["model"].items() if k not in LAYER_FIELDS}}
    assert Profile.from_dict(older).model == TINY  # GPT layers
    llama = MODELS["llama-tiny"]
    data["model"].update(name="llama-tiny", kv_heads=2, ffn_hidden=96, gated=True, bias=False, rotary=True)
    assert Profile.from_dict(data).model == llama
    assert Profile.from_dict(Profile.from_dict(data).to_dict()).model == llama
    with pytest.raises(PipeloomError, match="field model.gated is 1; expected true or false"):
        Profile.from_dict({**data, "model": {**data["model"], "gated": 1}})
    with pytest.raises(PipeloomError, match="measured with gated True .llama-tiny.; the model tiny has gated False"):
        costs_from_model(TINY, 2, 64, 1, "cpu", profile=Profile.from_dict({**data, "model": {
            **data["model"], "kv_heads": None, "ffn_hidden": None}}))


def test_round_trip_through_a_file(tmp_path):
    data = profile_dict()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    profile = load_profile(path)
    assert profile.to_dict() == data
    assert Profile.from_dict(profile.to_dict()) == profile
    assert sorted(profile.samples) == [1, 4] and profile.samples[4].layer_w == 2.0
    assert profile.model == TINY and profile.seq == 64 and profile.source == str(path)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="pipeloom-profile/0"),
     "field format is 'pipeloom-profile/0'; expected 'pipeloom-profile/1'"),
    (lambda d: d.pop("seq"), "field seq is missing"),
    (lambda d: d["model"].update(hidden="32"), "field model.hidden is '32'; expected an integer"),
    (lambda d: d["model"].update(hidden=30), "field model: model 'tiny': hidden 30 is not divisible by heads 4"),
    (lambda d: d["microbatch_sizes"]["1"]["layer"].pop("w"), "field microbatch_sizes.1.layer.w is missing"),
    (lambda d: d["microbatch_sizes"]["4"]["memory"]["head"].update(w=-1),
     "field microbatch_sizes.4.memory.head.w is -1; expected a non-negative number"),
    (lambda d: d["microbatch_sizes"].update({"two": {}}), "field microbatch_sizes.two: expected a positive integer"),
    (lambda d: d.update(microbatch_sizes={}), "field microbatch_sizes is empty"),
    (lambda d: d["link"].update(bandwidth=0), "field link.bandwidth is 0; expected a positive number or null"),
])
def test_a_bad_profile_names_its_field(tmp_path, edit, message):
    data = profile_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PipeloomError, match=f"^profile {path}: ") as err:
        load_profile(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(PipeloomError, match="cannot read it"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(PipeloomError, match="not JSON"):
        load_profile(tmp_path / "x.json")


# -- costs from a profile ------------------------------------------------------

def test_costs_at_a_profiled_size_are_the_measured_ones():
    profile = Profile.from_dict(profile_dict())
    # stages: the embedding alone, one bare layer, three layers and the head
    costs = costs_from_model(TINY, 3, 64, 4, "cpu", layers_per_stage=[0, 1, 3], profile=profile)
    assert costs.f == pytest.approx([0.4, 4.0, 3 * 4.0 + 12.0])
    assert costs.b == pytest.approx([0.8, 8.0, 3 * 8.0 + 16.0])
    assert costs.w == pytest.approx([0.0, 2.0, 3 * 2.0 + 4.0])
    assert costs.m_b == pytest.approx([0, 4000, 3 * 4000 + 20000])
    assert costs.m_w == pytest.approx([0, 3600, 3 * 3600 + 16000])
    message = 4 * 4 * 64 * 32
    assert costs.comm == pytest.approx([0.05 + 1e3 * message / 2e9] * 3)  # the measured link
    assert costs.extra["offload"] == pytest.approx([1e3 * m / get_device("cpu").host_bandwidth for m in costs.m_b])


def test_costs_at_another_size_scale_by_flops_from_the_nearest():
    profile = Profile.from_dict(profile_dict())
    assert profile.nearest(1) == 1 and profile.nearest(2) == 4 and profile.nearest(8) == 4  # by ratio; ties: the larger
    costs = costs_from_model(TINY, 3, 64, 3, "cpu", layers_per_stage=[0, 1, 3], profile=profile)
    wanted, measured = layer_flops(TINY, 64, 3), layer_flops(TINY, 64, 4)
    assert costs.f[1] == pytest.approx(4.0 * wanted[0] / measured[0])
    assert costs.b[1] == pytest.approx(8.0 * wanted[1] / measured[1])
    assert costs.w[1] == pytest.approx(2.0 * wanted[2] / measured[2]) == pytest.approx(2.0 * 3 / 4)
    assert costs.f[0] == pytest.approx(0.4 * 3 / 4)  # the ends' FLOPs are linear in the tokens
    assert costs.m_b[1] == pytest.approx(3000) and costs.m_w[1] == pytest.approx(2700)
    # sequence parallelism: a rank's FLOPs and bytes (half of each at sp = 2; the ring's exposed transfers on top)
    sp = costs_from_model(TINY, 3, 64, 4, "cpu", layers_per_stage=[0, 1, 3], profile=profile, sp=2)
    assert sp.w[1] == pytest.approx(1.0) and sp.m_b[1] == pytest.approx(2000)
    flops = layer_flops(TINY, 64, 4, 2)[0]
    ring = costs_from_model(TINY, 3, 64, 4, "cpu", layers_per_stage=[0, 1, 3], sp=2).f[1] - get_device("cpu").ms(flops)
    assert sp.f[1] == pytest.approx(4.0 * flops / layer_flops(TINY, 64, 4)[0] + ring)


def test_recomputation_with_a_profile():
    profile = Profile.from_dict(profile_dict())
    plain = costs_from_model(TINY, 3, 64, 1, "cpu", layers_per_stage=[0, 1, 3], profile=profile)
    full = costs_from_model(TINY, 3, 64, 1, "cpu", layers_per_stage=[0, 1, 3], profile=profile, recompute=True)
    cheap = costs_from_model(TINY, 3, 64, 1, "cpu", layers_per_stage=[0, 1, 3], profile=profile, recompute="cheap")
    assert full.b[1] == pytest.approx(plain.b[1] + plain.f[1])  # B reruns F
    assert full.m_b == pytest.approx([100, 100, 4500])  # a stage keeps its input; the last, what the loss keeps
    assert full.extra["m_rerun"] == pytest.approx(plain.m_b)
    assert cheap.m_b[1] == pytest.approx(600) and cheap.b == plain.b


def test_an_unmeasured_link_uses_the_device_and_host_bandwidth_is_used():
    profile = Profile.from_dict(profile_dict(link=None, host=20e9))
    costs = costs_from_model(TINY, 2, 64, 1, "h100", profile=profile)
    assert costs.comm == pytest.approx([1e3 * 4 * 64 * 32 / get_device("h100").link_bandwidth] * 2)
    assert costs.extra["offload"] == pytest.approx([1e3 * m / 20e9 for m in costs.m_b])


def test_a_profile_of_other_sizes_is_refused():
    from dataclasses import replace

    profile = Profile.from_dict(profile_dict(), "p.json")
    with pytest.raises(PipeloomError, match="profile p.json was measured with hidden 32 .tiny.; the model gpt-125m "
                                            "has hidden 768"):
        costs_from_model("gpt-125m", 2, 64, 1, "cpu", profile=profile)
    with pytest.raises(PipeloomError, match="measured at seq 64; costs were asked for seq 128"):
        costs_from_model(TINY, 2, 128, 1, "cpu", profile=profile)
    deeper = costs_from_model(replace(TINY, layers=8), 2, 64, 1, "cpu", profile=profile)  # depth may differ
    assert deeper.w == pytest.approx([4 * 0.5, 4 * 0.5 + 1.0])


def test_another_vocabulary_scales_the_output_layer_alone():
    """A tokenizer's own vocabulary: the output layer's times and bytes grow with it (its products and
    logits); the layers and the embedding stay as measured."""
    from dataclasses import replace

    profile = Profile.from_dict(profile_dict())
    same, double = (costs_from_model(replace(TINY, vocab=v), 2, 64, 1, "cpu", profile=profile) for v in (256, 512))
    assert double.f[0] == same.f[0] and double.b[0] == same.b[0] and double.m_b[0] == same.m_b[0]
    assert double.f[1] - same.f[1] == pytest.approx(3.0) and double.w[1] - same.w[1] == pytest.approx(1.0)
    assert double.m_b[1] - same.m_b[1] == pytest.approx(5000)


def test_a_fused_backward_costs_what_was_measured():
    """BW costs the profile's ``bw`` (2.4 a layer here), not B + W (2.5): the cost field ``fused``."""
    from pipeloom.schedule import build
    from pipeloom.sim import simulate

    profile = Profile.from_dict(profile_dict(link=None))
    costs = costs_from_model(TINY, 1, 64, 1, "cpu", profile=profile)
    assert costs.extra["fused"] == pytest.approx([4 * (2.4 - 2.5)])
    fused = simulate(build("1f1b", 1, 1), costs)
    split = simulate(build("zb-h1", 1, 1), costs)
    assert split.makespan - fused.makespan == pytest.approx(0.4)


def test_kfac_pieces_cost_what_was_measured():
    """Per unit a quarter of the layer's measured pieces; the curvature scales with the rows (the
    nearest size's, 4, for 8), the inversion and preconditioning do not; the syncs stay the link's.
    A profile without ``kfac`` leaves them to the formulas."""
    profile = Profile.from_dict(profile_dict())
    costs = costs_from_model(TINY, 2, 64, 8, "cpu", profile=profile, kfac=True, dp=2)
    assert costs.extra["kfac_a"] == pytest.approx(0.8 * 2 / 4) and costs.extra["kfac_g"] == pytest.approx(1.6 * 2 / 4)
    assert costs.extra["kfac_inv"] == pytest.approx(2.0 / 4) and costs.extra["kfac_pre"] == pytest.approx([1.2, 1.2])
    formulas = costs_from_model(TINY, 2, 64, 8, "cpu", kfac=True, dp=2)
    assert costs.extra["kfac_sync_a"] == formulas.extra["kfac_sync_a"] > 0
    older = profile_dict()
    del older["kfac"]
    assert costs_from_model(TINY, 2, 64, 8, "cpu", profile=Profile.from_dict(older), kfac=True).extra["kfac_inv"] == \
        formulas.extra["kfac_inv"]
    bad = profile_dict()
    del bad["kfac"]["g"]["4"]
    with pytest.raises(PipeloomError, match="field kfac.g.4 is missing"):
        Profile.from_dict(bad)


def test_kfac_units_weigh_what_was_measured():
    """Measured shares of a layer's units weigh its pieces (the share times the count); a profile
    without shares weighs them by the formulas' sizes; shares of the wrong length are named."""
    data = profile_dict()
    data["kfac"]["shares"] = {"a": [0.1, 0.1, 0.1, 0.7], "g": [0.25] * 4, "inv": [0.05, 0.05, 0.5, 0.4]}
    costs = costs_from_model(TINY, 2, 64, 8, "cpu", profile=Profile.from_dict(data), kfac=True)
    assert costs.extra["kfac_unit_a"] == pytest.approx((0.4, 0.4, 0.4, 2.8))
    assert costs.extra["kfac_unit_inv"] == pytest.approx((0.2, 0.2, 2.0, 1.6))
    per_stage = costs.per_stage(2, 1)
    assert per_stage.duration(Action(KFAC_INV, 0, 0, (2,))) == pytest.approx(2.0 * 2.0 / 4)  # 50% of 2.0 ms
    assert costs_from_model(TINY, 2, 64, 8, "cpu", profile=Profile.from_dict(profile_dict()), kfac=True
                            ).extra["kfac_unit_inv"] == pytest.approx(kfac_unit_weights(TINY)["kfac_unit_inv"])
    data["kfac"]["shares"]["g"] = [0.5, 0.5]
    with pytest.raises(PipeloomError, match="field kfac.shares.g is \\[0.5, 0.5\\]; expected 4 non-negative"):
        Profile.from_dict(data)


def test_without_a_profile_the_formulas_are_used():
    assert costs_from_model(TINY, 2, 64, 2, "cpu") == costs_from_model(TINY, 2, 64, 2, "cpu", profile=None)


# -- measuring on the CPU ------------------------------------------------------

@pytest.fixture(scope="module")
def measured():
    from pipeloom.nn import GPTConfig
    from pipeloom.runtime.profile import measure

    return measure(GPTConfig.preset("tiny"), 64, [1, 2], repeats=9, warmup=1, transfer=False, name="tiny")


@needs_torch
def test_measured_times_and_the_bw_split(measured):
    profile = Profile.from_dict(measured)
    assert profile.model == TINY and profile.machine["device"] == "cpu" and profile.machine["threads"] == 1
    for sample in profile.samples.values():
        times = [sample.layer_f, sample.layer_b, sample.layer_w, sample.layer_bw, sample.embedding_f,
                 sample.embedding_b, sample.head_f, sample.head_b, sample.head_w]
        assert min(times) > 0
        # B left the weight gradients to W: W is real work and B + W is about the fused backward
        assert sample.layer_w > 0.02 * sample.layer_bw
        assert 0.33 < (sample.layer_b + sample.layer_w) / sample.layer_bw < 3
    assert profile.link_bandwidth is None and profile.link_reason and profile.host_bandwidth is None
    kfac = profile.kfac  # K-FAC's pieces on the layer's four linear layers
    assert kfac["units"] == 4 and min(kfac["inv"], kfac["pre"], *kfac["a"].values(), *kfac["g"].values()) > 0
    shares = kfac["shares"]  # each linear layer's share (at hidden 32 the per-call overhead's, not the FLOPs')
    assert all(len(shares[k]) == 4 and min(shares[k]) > 0 and sum(shares[k]) == pytest.approx(1)
               for k in ("a", "g", "inv"))


@needs_torch
def test_measured_kfac_shares_follow_the_factor_sizes():
    """Wide enough that the FLOPs outweigh the calls' overhead: each linear layer's measured share of
    the curvature is its factor's d^2 over the layer's (MLP out has the widest inputs, MLP in the widest outputs)."""
    import dataclasses

    from pipeloom.nn import GPTConfig
    from pipeloom.runtime.profile import measure

    config = dataclasses.replace(GPTConfig.preset("tiny"), n_layer=1, n_embd=256)
    profile = Profile.from_dict(measure(config, 64, [1], repeats=5, warmup=1, transfer=False, name="wide"))
    shares, sizes = profile.kfac["shares"], kfac_unit_weights(profile.model)
    assert max(range(4), key=shares["a"].__getitem__) == 3 and max(range(4), key=shares["g"].__getitem__) == 2
    for key in ("a", "g"):
        assert shares[key] == pytest.approx([x / 4 for x in sizes[f"kfac_unit_{key}"]], abs=0.15)


@needs_torch
def test_measured_bytes_by_hand_count(measured):
    b, s, h, v = 2, 64, 32, 256
    memory = measured["microbatch_sizes"]["2"]["memory"]
    hidden = 4 * b * s * h  # one fp32 hidden state
    # B to W: every linear layer's input and output gradient (qkv 1 + 3, proj 1 + 1, fc 1 + 4, proj 4 + 1)
    assert memory["layer"]["w"] == 16 * hidden
    assert memory["layer"]["full"] == hidden  # checkpointing keeps the input
    assert memory["layer"]["cheap"] < memory["layer"]["none"] < 18 * hidden
    assert memory["head"]["w"] == 4 * b * s * v + hidden  # the logits' gradient and the head's input
    assert measured["microbatch_sizes"]["2"]["message_bytes"] == hidden
    assert measured["microbatch_sizes"]["1"]["memory"]["layer"]["none"] * 2 == memory["layer"]["none"]
    assert measured["bytes_per_param"] == 16.0  # fp32 weights, gradients, AdamW's two moments


@needs_torch
def test_fp32_formulas_count_the_bytes_an_fp32_run_keeps(measured):
    """The formulas at fp32 (the CPU's precision) against what the tiny GPT keeps on this CPU: a layer
    with and without cheap recomputation, from B to W, and the output layer (the fp32 softmax
    counted once); at bf16 they count half the 16-bit values."""
    memory = measured["microbatch_sizes"]["2"]["memory"]
    model = Profile.from_dict(measured).model
    split = [model.layers - 2, 1, 1]  # the middle stage is one layer, the last one layer and the head
    for precision, near in (("fp32", 0.07), ("bf16", None)):
        got = {}
        for recompute in (False, "cheap"):
            costs = costs_from_model(model, 3, 64, 2, "cpu", layers_per_stage=split, recompute=recompute,
                                     precision=precision)
            got["cheap" if recompute else "none"] = costs.m_b[1]
            if not recompute:
                got.update({"w": costs.m_w[1], "head b": costs.m_b[2] - costs.m_b[1],
                            "head w": costs.m_w[2] - costs.m_w[1]})
        want = {"none": memory["layer"]["none"], "cheap": memory["layer"]["cheap"], "w": memory["layer"]["w"],
                "head b": memory["head"]["b"], "head w": memory["head"]["w"]}
        if near:
            assert all(abs(got[k] / want[k] - 1) <= near for k in want), (got, want)
            assert got["w"] == want["w"]
        else:  # the layer's 16-bit values at 2 bytes: about half
            assert all(0.45 < got[k] / want[k] < 0.6 for k in ("none", "cheap", "w")), (got, want)


@needs_torch
def test_a_llama_layer_is_measured_and_costs_a_llama():
    """Grouped-query attention, SwiGLU, no biases, rotary positions: the profile says so and
    prices Llama runs (not GPT ones); B to W holds every linear layer's input and output gradient."""
    from pipeloom.nn import preset_config
    from pipeloom.runtime.profile import measure

    data = measure(preset_config("llama-tiny", block_size=64), 64, [2], repeats=2, warmup=1, transfer=False,
                   name="llama-tiny")
    profile = Profile.from_dict(data)
    assert profile.model == MODELS["llama-tiny"]
    b, s, h = 2, 64, 32
    kv, ffn = 2 * 8, 96  # 2 key/value heads of 8; the SwiGLU's width
    unit = 4 * b * s  # fp32 bytes per feature
    # q/k/v: h in, h + 2 kv out; proj: h, h; gate and up: one input of h, ffn out each; down: ffn, h
    assert data["microbatch_sizes"]["2"]["memory"]["layer"]["w"] == unit * (
        (h + h + 2 * kv) + 2 * h + (h + 2 * ffn) + (ffn + h))
    costs = costs_from_model("llama-tiny", 2, 64, 2, "cpu", profile=profile)
    assert min(costs.f) > 0 and min(costs.w) > 0
    with pytest.raises(PipeloomError, match="the model tiny has"):
        costs_from_model(TINY, 2, 64, 2, "cpu", profile=profile)


@needs_torch
def test_saved_bytes_match_autograds_own_saved_tensors():
    """The hooks' count equals the storages autograd's graph itself reports saved (its nodes' _saved_*)."""
    from pipeloom.nn.gpt import Block, GPTConfig
    from pipeloom.runtime.profile import saved_bytes

    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_embd=32, n_head=4, vocab_size=8, block_size=64))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    counted, y = saved_bytes(lambda: block(torch.randn(2, 64, 32, requires_grad=True)))
    storages, seen, nodes = {}, set(), [y.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        values = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        values += list(getattr(node, "saved_tensors", ()))  # custom autograd Functions (pipeloom's Linear)
        for value in values:
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in params:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        nodes += [f for f, _ in node.next_functions]
    assert counted == sum(storages.values()) > 0


@needs_torch
def test_bf16_keeps_fp32_state():
    from pipeloom.runtime.profile import bytes_per_param

    assert bytes_per_param(torch.device("cpu"), torch.bfloat16) == 16.0


@needs_torch
def test_link_fit():
    from pipeloom.runtime.profile import fit_link

    sizes = [4096, 2**20, 16 * 2**20]
    link = fit_link(sizes, [1e-4 + n / 2e9 for n in sizes])
    assert link["bandwidth"] == pytest.approx(2e9) and link["latency_ms"] == pytest.approx(0.1)
    assert fit_link(sizes, [3e-3, 2e-3, 1e-3])["bandwidth"] is None


@needs_torch
def test_a_profile_too_big_for_memory_is_refused():
    from pipeloom.nn import GPTConfig
    from pipeloom.runtime.profile import measure

    with pytest.raises(PipeloomError, match=r"needs about [\d.]+ GiB; cpu has [\d.]+ GiB free"):
        measure(GPTConfig(n_layer=1, n_embd=8192, n_head=64, vocab_size=2**24, block_size=4096), 4096, [8])


# -- the command line ----------------------------------------------------------

@needs_torch
@pytest.mark.timeout(180)
def test_profile_then_simulate_with_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "tiny.json"
    assert main(["profile", "--model", "tiny", "--seq", "64", "--microbatch-sizes", "1,2", "--repeats", "2",
                 "--out", str(path)]) == 0
    printed = capsys.readouterr()
    table = printed.out
    assert "one layer: times (ms), achieved GFLOP/s (cpu preset: 130)" in table and "stage-to-stage transfer" in table
    assert [line.split(":")[1].strip() for line in printed.err.splitlines() if line.startswith("pipeloom profile:")] == [
        "measuring microbatch size 1 (1 of 2)", "measuring microbatch size 2 (2 of 2)",
        "measuring the optimizer step and the state's bytes per parameter",
        "measuring K-FAC's curvature, inversion and preconditioning",
        "measuring the stage-to-stage transfer between two processes"]  # progress, as it goes
    profile = load_profile(path)
    assert profile.link_bandwidth > 0 and profile.link_latency_ms >= 0  # gloo between two processes
    assert main(["simulate", "--model", "tiny", "--profile", str(path), "--pp", "2", "--microbatches", "4",
                 "--microbatch-size", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["costs"] == f"profile {path}" and out["seq"] == 64 and out["device"] == "cpu"
    assert out["makespan"] > 0
    assert main(["simulate", "--model", "tiny", "--profile", str(path), "--pp", "2", "--microbatches", "4"]) == 0
    assert f"costs: profile {path}" in capsys.readouterr().out
    # its precision is the run's: fp32 (this CPU's) may be asked, bf16 is refused in one line
    assert main(["simulate", "--model", "tiny", "--profile", str(path), "--precision", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"] == f"profile {path}"
    assert main(["simulate", "--model", "tiny", "--profile", str(path), "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"profile {path} was measured in fp32; --precision bf16 needs a profile" in err


def test_without_a_profile_simulate_says_formulas(capsys):
    assert main(["simulate", "--model", "tiny", "--seq", "64", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["costs"] == "formulas, device preset cpu"


@pytest.mark.parametrize("args,message", [
    (["simulate", "--profile", "p.json"],
     "--profile sets the measured costs that --model derives costs for; give --model"),
    (["profile", "--model", "nope"], "--model 'nope': choose one of"),
    (["profile", "--hidden", "30"], "hidden 30 is not divisible by heads 4"),
    (["profile", "--microbatch-sizes", "1,x"], "--microbatch-sizes '1,x': give positive integers"),
    (["profile", "--microbatch-sizes", "2,2"], "each once"),
    (["profile", "--out", "p.txt"], "--out p.txt: the file name must end in .json"),
])
def test_command_line_mistakes(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1



@needs_torch
@pytest.mark.parametrize("threads", [1, 2])
def test_on_one_cpu_thread_only_the_threads_own_time_counts(threads):
    """With one thread the CPU timer counts the calling thread's CPU time: a wait in which it
    uses none (as when other processes take the core: a loaded machine) is not counted, so a
    profile taken beside other work is the op's cost; with more threads it is the host clock."""
    import time

    from pipeloom.runtime.profile import Timer

    kept = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timer = Timer(torch.device("cpu"))
    finally:
        torch.set_num_threads(kept)
    waited = timer(lambda: time.sleep(0.05))
    assert (waited < 5) if threads == 1 else (waited >= 50), waited
