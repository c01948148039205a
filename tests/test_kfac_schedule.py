"""PipeFisher's schedule layer: K-FAC pieces in the bubbles of every family, the refresh interval, the report."""

import json
from dataclasses import replace

import pytest

from kfac_late import curvature_late
from pipeloom.cli import main
from pipeloom.errors import PipeloomError, ScheduleError
from pipeloom.schedule import FAMILIES, Action, Costs, Kfac, Schedule, build, validate
from pipeloom.schedule.deps import Dependencies
from pipeloom.schedule.ir import parts
from pipeloom.schedule.kinds import COMPOUND
from pipeloom.schedule.transforms.kfac import (KFAC_A, KFAC_G, KFAC_INV, KFAC_PRE, KFAC_SYNC_A, KFAC_SYNC_G,
                                               PIECES)
from pipeloom.sim import ModelSpec, costs_from_model, kfac_costs, kfac_report, simulate, stage_layers, without_pieces
from pipeloom.sim.formulas import INVERSION_EFFICIENCY, KFAC_STATE_COPIES, kfac_capture_bytes, kfac_factor_bytes
from pipeloom.sim.memory import peak_memory_bytes
from pipeloom.sim.model import KFAC_UNITS_PER_LAYER, get_device
from pipeloom.sim.specs import get_model

def _costs(pp, chunks=1, **kfac):
    """Uneven stage costs (the last stage heavier), and K-FAC pieces."""
    stages = pp * chunks
    return Costs(f=[1.0 + 0.1 * s for s in range(stages)], b=[1.2 + 0.1 * s for s in range(stages)],
                 w=[0.8] * stages, comm=0.05,
                 extra={"kfac_a": 0.15, "kfac_g": 0.2, "kfac_sync_a": 0.02, "kfac_sync_g": 0.02, "kfac_inv": 0.6,
                        "kfac_pre": 0.1, **kfac})


def _starts(result, before):
    """Each rank's F, B, W and BW of microbatches below ``before`` with their start (a
    preconditioning may wait for pieces in the bubble before it; it still ends in time)."""
    compute = ("F", "B", "W", "BW")
    return [[(e.action, e.start) for e in events if e.action.kind in compute and e.action.microbatch < before]
            for events in result.events]


CASES = [(name, pp) for name in FAMILIES for pp in (2, 4)]


@pytest.mark.parametrize("name,pp", CASES)
def test_every_family_takes_one_refresh_without_delaying_its_work(name, pp):
    family = FAMILIES[name]
    chunks = family.default_chunks
    costs = _costs(pp, chunks)
    schedule = build(name, pp, 2 * pp, costs=costs, transforms=[Kfac(units=3)])  # validated: complete, in order
    kfac = schedule.options["kfac"]
    base = build(name, pp, 2 * pp, costs=costs)
    assert schedule.steps == kfac["every"] * base.steps
    pieces = [a for actions in schedule.ranks for a in actions if a.kind in PIECES]
    assert len(pieces) == schedule.stages * 3 * (2 * schedule.microbatches + 3)
    result = simulate(schedule, costs)
    # every F, B and W starts when it would with pieces that take no time; with overflow, before the last step
    last = (kfac["every"] - 1 if any(kfac["overflow"]) else kfac["every"]) * base.total_microbatches
    for got, want in zip(_starts(result, last), _starts(without_pieces(result), last)):
        assert [a for a, _ in got] == [a for a, _ in want]
        assert [t for _, t in got] == pytest.approx([t for _, t in want], abs=1e-9)
    if not any(kfac["overflow"]):
        assert result.makespan == pytest.approx(without_pieces(result).makespan)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half"])
def test_the_refresh_interval_is_the_fewest_steps_whose_bubbles_hold_the_pieces(name):
    costs = _costs(4, FAMILIES[name].default_chunks)
    k = build(name, 4, 8, costs=costs, transforms=[Kfac(units=3)]).options["kfac"]["every"]
    forced = build(name, 4, 8, costs=costs, transforms=[Kfac(units=3, every=k)]).options["kfac"]
    assert forced["every"] == k and forced["forced"]
    if k > 1:
        fewer = build(name, 4, 8, costs=costs, transforms=[Kfac(units=3, every=k - 1)])
        assert fewer.options["kfac"]["every"] == k - 1 and sum(fewer.options["kfac"]["overflow"]) > 0
        # what did not fit runs at the end of the refresh: that step is longer
        assert simulate(fewer, costs).makespan / (k - 1) > simulate(build(name, 4, 8, costs=costs), costs).makespan


def test_a_piece_goes_into_a_gap_only_with_the_margin_to_spare():
    # gpipe, 2 ranks, 1 microbatch: rank 0 waits 3 time units between its F and its backward
    def overflow(kfac_a, margin):
        costs = Costs(f=1, b=1, w=1, extra={"kfac_a": kfac_a})
        return build("gpipe", 2, 1, costs=costs, transforms=[Kfac(margin=margin, every=1)]).options["kfac"]["overflow"]
    assert overflow(2.9, 0.0)[0] == 0
    assert overflow(2.9, 0.05)[0] == 3  # 2.9 x 1.05 > 3: A, then its sync and the inverse, at the end
    assert overflow(2.8, 0.05)[0] == 0


def test_one_rank_has_no_bubble_and_runs_every_piece_on_the_critical_path():
    costs = Costs(f=1, b=1, w=1, extra={"kfac_a": 0.1, "kfac_g": 0.2, "kfac_inv": 0.5, "kfac_pre": 0.3})
    schedule = build("1f1b", 1, 4, costs=costs, transforms=[Kfac(units=2, every=1)])
    kfac = schedule.options["kfac"]
    assert kfac["every"] == 1 and kfac["overflow"] == [2 * (2 * 4 + 3)]
    assert simulate(schedule, costs).makespan == pytest.approx(4 * 3 + 2 * (4 * 0.3 + 0.5) + 0.3)


def _follows_its_producer(schedule, rank: int, piece) -> bool:
    """Whether ``piece`` comes right after the capture step's action that made its capture (or after
    other curvature pieces right after it: a DualPipeV pair makes two microbatches' captures)."""
    actions = list(schedule.ranks[rank])
    k = actions.index(piece)
    while actions[k - 1].kind in (KFAC_A, KFAC_G):
        k -= 1
    before = actions[k - 1]
    made = Dependencies(schedule).backward(piece.stage, piece.microbatch) if piece.kind == KFAC_G else \
        Action("F", piece.stage, piece.microbatch)
    return made in (parts(before) if before.kind in COMPOUND else (before,))


@pytest.mark.parametrize("name,pp,every", [("1f1b", 1, None), ("zb-h1", 1, 3), ("1f1b", 2, 1), ("zb-v", 2, 1),
                                           ("dualpipev", 2, 1), ("2bw", 2, 1)])
def test_curvature_that_fits_no_bubble_runs_right_after_its_producer(name, pp, every):
    """Its capture is freed at once; the syncs and inversions that fit nowhere still end the cycle."""
    costs = _costs(pp, FAMILIES[name].default_chunks, kfac_a=0.9, kfac_g=1.0)  # too long for most bubbles
    schedule = build(name, pp, 4, costs=costs, transforms=[Kfac(units=2, every=every)])
    kfac = schedule.options["kfac"]
    assert all(kfac["inline"]) and (every is None or kfac["every"] == every)
    base = build(name, pp, 4, costs=costs)
    for rank, inline in enumerate(kfac["inline"]):
        pieces = [Action(kind, s, j, (u,)) for kind, s, j, u in inline]
        assert all(a.microbatch < base.microbatches for a in pieces)
        assert all(_follows_its_producer(schedule, rank, a) for a in pieces)
        actions = schedule.ranks[rank]
        late = kfac["overflow"][rank] - len(inline)
        last = next(k for k, a in enumerate(actions) if a.kind == KFAC_PRE and a.microbatch == schedule.steps - 1)
        assert all(a.kind in (KFAC_SYNC_A, KFAC_SYNC_G, KFAC_INV) for a in actions[last - late:last])


def test_curvature_after_its_producer_costs_the_cycle_what_it_did_at_its_end():
    """pp 1: the same work on the critical path wherever it runs, so the same k and step."""
    costs = Costs(f=1, b=1, w=1, extra={"kfac_a": 0.1, "kfac_g": 0.2, "kfac_inv": 0.5, "kfac_pre": 0.3})
    schedule = build("1f1b", 1, 4, costs=costs, transforms=[Kfac(units=2)])
    late = curvature_late(schedule)
    assert validate(late).steps == schedule.steps
    assert simulate(schedule, costs).makespan == pytest.approx(simulate(late, costs).makespan)


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_the_peak_counts_the_captures_until_their_curvature(model):
    """pp 1, 1f1b 4 x 2: with the curvature at the end of the cycle every capture of the capture step
    waits beside the next steps' activations (with the factors and the inverses in use; the refresh's
    third copy only from the first curvature piece on); right after their producers, one microbatch's
    inputs at most (the forward's end), beside all three copies."""
    spec, seq, size = get_model(model), 256, 2
    costs = costs_from_model(spec, 1, seq, size, "h100", kfac=True)
    schedule = build("1f1b", 1, 4, costs=costs, transforms=[Kfac(KFAC_UNITS_PER_LAYER * spec.layers)])

    def peak(s):
        return peak_memory_bytes(spec, simulate(s, costs), seq, microbatch_size=size)[0]
    bare = peak(build("1f1b", 1, 4, costs=costs))
    captured = kfac_capture_bytes(spec, seq, size)
    inputs, grads = (spec.layers * sum(c[n] for c in captured) for n in (0, 1))
    copy = spec.layers * sum(a + g for a, g in kfac_factor_bytes(spec))
    assert peak(curvature_late(schedule)) == pytest.approx(bare + 2 * copy + 4 * (inputs + grads), rel=1e-9)
    assert peak(schedule) == pytest.approx(bare + KFAC_STATE_COPIES * copy + inputs, rel=1e-9)


def test_captures_are_the_bytes_the_hooks_keep():
    """Under bf16 autocast a norm's output is fp32, the attention's output, the MLP's activation and the
    output gradients bf16 (checked on the CPU against KFAC's hooks); all fp32 without autocast."""
    spec = get_model("llama-tiny")
    h, kv, f, rows = spec.hidden, spec.kv_width, spec.mlp_width, 2 * 256
    assert kfac_capture_bytes(spec, 256, 2) == [(4 * rows * h, 2 * rows * (h + 2 * kv)), (2 * rows * h, 2 * rows * h),
                                                (4 * rows * h, 2 * rows * 2 * f), (2 * rows * f, 2 * rows * h)]
    assert kfac_capture_bytes(spec, 256, 2, autocast=False)[3] == (4 * rows * f, 4 * rows * h)
    assert kfac_capture_bytes(spec, 256, 2, sp=2)[0] == (2 * rows * h, rows * (h + 2 * kv))


@pytest.mark.parametrize("inverse", [0.5, 5.0, 50.0])
def test_without_bubbles_the_default_interval_keeps_the_step_within_ten_percent(inverse):
    """pp 1: every piece runs at the end of the cycle; by default the cycle is the fewest steps that
    keep the mean step within 1.10x of the step without K-FAC (at most MAX_SPREAD), and the report
    says why."""
    from pipeloom.schedule.transforms.kfac import MAX_SPREAD
    from pipeloom.sim import kfac_report
    from pipeloom.techniques import TECHNIQUES

    costs = Costs(f=1, b=1, w=1, extra={"kfac_a": 0.1, "kfac_g": 0.2, "kfac_inv": inverse, "kfac_pre": 0.3})
    base = simulate(build("1f1b", 1, 4, costs=costs), costs)
    result = simulate(build("1f1b", 1, 4, costs=costs, transforms=[Kfac(units=2)]), costs)
    report = kfac_report(base, result)
    k = report["every"]
    assert report["spread"] and not report["forced"]
    assert report["ranks"][0]["overflow_time"] == pytest.approx(report["ranks"][0]["kfac_time"])  # none in bubbles
    line = TECHNIQUES["kfac"].report_lines({"kfac": report})[0]
    if k == MAX_SPREAD:  # 2 x 50 of inversions: over 100 steps still 8.5% of a step, 11% with the preconditioning
        assert report["step_time_after"] > 1.10 * base.makespan and "spread over the most steps, 100" in line
        return
    assert report["step_time_after"] <= 1.10 * base.makespan + 1e-9
    shorter = simulate(build("1f1b", 1, 4, costs=costs, transforms=[Kfac(units=2, every=k - 1)]), costs)
    assert k == 1 or shorter.makespan / (k - 1) > 1.10 * base.makespan  # the fewest such steps
    assert (f"refresh every {k} steps (some pieces fit no bubble: spread to keep the step within 1.10x of "
            "AdamW's)") in line


def test_the_last_step_preconditions_after_every_inverse_and_a_missing_piece_is_named():
    schedule = build("1f1b", 2, 4, costs=_costs(2), transforms=[Kfac(units=2, every=2)])
    ranks = [list(actions) for actions in schedule.ranks]
    actions = ranks[1]
    last_pre = actions.index(next(a for a in actions if a.kind == KFAC_PRE and a.microbatch == 1))
    inverse = next(a for a in actions if a.kind == KFAC_INV)
    actions.remove(inverse)
    with pytest.raises(ScheduleError, match="KFAC_INV of stage 1"):
        validate(replace(schedule, ranks=tuple(map(tuple, ranks))))
    actions.insert(last_pre, inverse)  # after the last preconditioning, which needs it
    with pytest.raises(ScheduleError, match="runs before"):
        validate(replace(schedule, ranks=tuple(map(tuple, ranks))))


def test_json_round_trip_keeps_the_pieces():
    schedule = build("zb-h1", 2, 4, costs=_costs(2), transforms=[Kfac(units=2)])
    assert Schedule.from_json(schedule.to_json()) == schedule


def test_bad_settings_are_named():
    with pytest.raises(PipeloomError, match="every=0"):
        Kfac(every=0)
    for units in ([1, 2, 3], [1, -1], [True, 1], 1.5):
        with pytest.raises(PipeloomError, match=r"units=.* must be a whole number >= 0 per stage"):
            build("1f1b", 2, 4, transforms=[Kfac(units=units)])


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-half"])
def test_a_stage_without_units_only_preconditions(name):
    """A stage with no linear layer (redis's last stage with a large vocabulary) has no piece to place:
    only its preconditioning each step, which the other stages' pieces and the flush still follow."""
    schedule = build(name, 2, 4, costs=_costs(2, 2 if name == "v-half" else 1),
                     transforms=[Kfac(units=[2, 0, 1, 0] if name == "v-half" else [2, 0])])
    empty = {1, 3} if name == "v-half" else {1}
    kinds = {(a.stage, a.kind) for actions in schedule.ranks for a in actions if a.kind in Kfac.kinds}
    assert {kind for s, kind in kinds if s in empty} == {KFAC_PRE}
    assert {kind for s, kind in kinds if s == 0} == set(Kfac.kinds)
    with pytest.raises(ScheduleError, match="K-FAC work already"):
        Kfac().apply(build("1f1b", 2, 4, transforms=[Kfac()]))


def test_piece_costs_follow_the_formulas():
    spec, device = ModelSpec("small", 2, 64, 4, 100), get_device("a100")
    got = kfac_costs(spec, 32, 2, device)
    rows, h = 64, 64
    inputs, grads = [h + 1, h + 1, h + 1, 4 * h + 1], [3 * h, h, 4 * h, h]
    # K-FAC is fp32 work: its products in TF32 (a bf16 run's KFAC(tf32=True)), the A100's 156 TFLOP/s at 0.5;
    # its inversions without tensor cores (19.5 TFLOP/s) at INVERSION_EFFICIENCY of that
    tf32_ms, fp32_ms = 1e3 / (156e12 * 0.5), 1e3 / (19.5e12 * 0.5)
    assert got["kfac_a"] == pytest.approx(tf32_ms * sum(2 * rows * d * d for d in inputs))
    assert got["kfac_g"] == pytest.approx(tf32_ms * sum(2 * rows * d * d for d in grads))
    shapes = list(zip(inputs, grads))
    assert got["kfac_pre"] == pytest.approx(tf32_ms * sum(2 * (g * g * a + g * a * a) for a, g in shapes))
    assert got["kfac_inv"] == pytest.approx(fp32_ms * sum(d ** 3 for d in inputs + grads) / INVERSION_EFFICIENCY)
    no_tf32 = kfac_costs(spec, 32, 2, "v100")  # products at the fp32 rate (15.7 TFLOP/s, at 0.4)
    assert no_tf32["kfac_a"] == pytest.approx(1e3 / (15.7e12 * 0.4) * sum(2 * rows * d * d for d in inputs))
    assert got["kfac_sync_a"] == got["kfac_sync_g"] == 0  # one replica
    assert kfac_costs(spec, 32, 2, device, dp=4)["kfac_sync_a"] > 0
    costs = costs_from_model(spec, 2, 32, 2, device, kfac=True)
    assert costs.extra["kfac_a"] == pytest.approx(got["kfac_a"] / KFAC_UNITS_PER_LAYER)
    assert costs.extra["kfac_pre"] == pytest.approx([got["kfac_pre"]] * 2)


@pytest.mark.parametrize("model", ["gpt-350m", "llama-8b"])
def test_each_unit_costs_its_share_of_the_layer(model):
    """A layer's four units (q/k/v, the attention's output, the MLP's two) cost by their factors'
    sizes, not a quarter each: together the layer's pieces; the MLP's two hold most of the
    inversion (d³); the weights cycle over a stage's units, and a sync weighs as its factor."""
    device = get_device("a100")
    layer = kfac_costs(model, 1024, 1, device, dp=2)
    costs = costs_from_model(model, 2, 1024, 1, device, kfac=True, dp=2)
    per_stage = costs.per_stage(2, 1)
    units = KFAC_UNITS_PER_LAYER * stage_layers(model, 2, 1024)[0]

    def unit(kind, u):
        return per_stage.duration(Action(kind, 0, 0, (u,)))

    for kind, name in ((KFAC_A, "kfac_a"), (KFAC_G, "kfac_g"), (KFAC_SYNC_A, "kfac_sync_a"),
                       (KFAC_SYNC_G, "kfac_sync_g"), (KFAC_INV, "kfac_inv")):
        times = [unit(kind, u) for u in range(KFAC_UNITS_PER_LAYER)]
        assert sum(times) == pytest.approx(layer[name])
        assert [unit(kind, u) for u in range(KFAC_UNITS_PER_LAYER, 2 * KFAC_UNITS_PER_LAYER)] == times
        assert unit(kind, units - 1) == times[-1]
    inversions = [unit(KFAC_INV, u) for u in range(KFAC_UNITS_PER_LAYER)]
    assert sum(inversions[2:]) > 0.75 * sum(inversions) and len(set(inversions)) >= 3
    with pytest.raises(PipeloomError, match="kfac_unit_inv weighs a stage's units: give a list of numbers"):
        Costs(extra={"kfac_unit_inv": 2.0}).per_stage(2, 1)
    even = Costs(extra={"kfac_inv": 3.0}).per_stage(2, 1)  # no weights: every unit the average
    assert even.duration(Action(KFAC_INV, 1, 0, (5,))) == 3.0


BERT = {"bert-base": ModelSpec("bert-base", 12, 768, 12, 30522),
        "bert-large": ModelSpec("bert-large", 24, 1024, 16, 30522)}


@pytest.mark.parametrize("model", sorted(BERT))
@pytest.mark.parametrize("pp", [4, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_paper_like_settings_refresh_within_a_few_steps_and_fill_bubbles(model, pp, name):
    """PipeFisher's BERT pretraining (sequences of 128, microbatches of 32) on V100s, its K-FAC work at
    the rate of its compute (its profile's pieces are 0.9-7.8 forward times); pipeloom's runtime runs
    K-FAC in fp32 beside 16-bit compute, which the v100 preset's fp32 rate prices 8x dearer."""
    spec = BERT[model]
    costs = costs_from_model(spec, pp, 128, 32, replace(get_device("v100"), fp32_flops=None), kfac=True)
    units = [KFAC_UNITS_PER_LAYER * n for n in stage_layers(spec, pp, 128)]
    base = simulate(build(name, pp, pp, costs=costs), costs)
    result = simulate(build(name, pp, pp, costs=costs, transforms=[Kfac(units)]), costs)
    report = kfac_report(base, result)
    assert 1 <= report["every"] <= 6 and report["overflow_pieces"] == 0
    assert 0 < report["makespan_change"] < 0.05  # the preconditioning only
    for row in report["ranks"]:
        assert row["utilisation_after"] > row["utilisation_before"]
        assert row["overflow_time"] == 0
    assert max(row["bubble_filled"] for row in report["ranks"]) > 0.5


def test_simulate_kfac_json(capsys):
    args = ["simulate", "--schedule", "gpipe", "--pp", "4", "--microbatches", "4", "--model", "gpt-125m",
            "--seq", "512", "--microbatch-size", "4", "--hardware", "v100", "--optimizer", "kfac", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    kfac = out["kfac"]
    assert out["steps"] == kfac["every"] >= 1
    assert kfac["step_time_after"] >= kfac["step_time_before"]
    fields = {"utilisation_before", "utilisation_after", "bubble_filled"}
    assert len(kfac["ranks"]) == 4 and fields <= set(kfac["ranks"][0])
    assert main([*args[:-1], "--kfac-every", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kfac"]["every"] == 1
    assert main(["simulate", "--kfac-every", "2"]) == 2
    assert "--kfac-every 2 goes with --optimizer kfac" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--model", "gpt-125m", "--pp", "4", "--microbatches", "8", "--vocab-parallel", "vocab-1"],
    ["--model", "tiny", "--seq", "64", "--vocab-parallel", "vocab-2", "--kfac-every", "2"],
])
def test_pieces_never_land_after_the_vocabulary_passes_that_follow_a_step(capsys, args):
    """The vocabulary passes can follow a step's preconditioning on the last stage's rank: a piece in the
    idle time before them would come after the overflow and the cycle's last preconditioning, which need it
    (the validator named such an order: 'KFAC_SYNC_A0 runs before KFAC_A2, which it needs')."""
    assert main(["simulate", *args, "--optimizer", "kfac", "--json"]) == 0
    kfac = json.loads(capsys.readouterr().out)["kfac"]
    assert kfac["every"] >= 2 and sum(row["kfac_time"] for row in kfac["ranks"]) > 0


@pytest.mark.parametrize("model,pp", [("bert-base", 4), ("bert-large", 4), ("bert-large", 8)])
def test_interleaved_ranks_use_the_bubble_after_their_preconditioning(model, pp):
    """A rank of two stages ends its step with two preconditionings: the idle time after them still
    takes pieces (left out, the refresh took 13-20 steps instead of 5-7)."""
    spec = BERT[model]
    costs = costs_from_model(spec, pp, 128, 32, replace(get_device("v100"), fp32_flops=None), chunks=2, kfac=True)
    units = [KFAC_UNITS_PER_LAYER * n for n in stage_layers(spec, 2 * pp, 128)]
    result = simulate(build("interleaved-1f1b", pp, pp, 2, costs=costs, transforms=[Kfac(units)]), costs)
    assert result.schedule.options["kfac"]["every"] <= 8
