"""The planner: its pruned search against brute force, its commands against a re-simulation, its
bounds, its cluster tiers and its command line."""

import gc
import json
import os
import random
import re
import shlex
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from pipeloom.cli import _parser
from pipeloom.errors import PipeloomError
from pipeloom.plan import (
    Candidate, Cluster, Costing, PlanRequest, candidate_of, candidates, command, exhaustive, search,
)
from pipeloom.builder import build_run, costs_of
from pipeloom.cli.flags import spec_of
from pipeloom.plan.command import run_spec
from pipeloom.plan.evaluate import evaluate as plan_evaluate
from pipeloom.schedule import FAMILIES
from pipeloom.sim.model import ModelSpec, get_device, get_model

GiB = 2**30
SMALL = ModelSpec("small", 8, 512, 8, 8192)


def request(gpus=4, memory=80, batch=16, model=SMALL, **kwargs):
    links = {"inter_bandwidth": kwargs.pop("inter_bandwidth")} if "inter_bandwidth" in kwargs else {}
    cluster = Cluster.of("a100", gpus, gpus_per_node=kwargs.pop("per_node", 8), memory=memory * GiB, **links)
    return PlanRequest(model, kwargs.pop("seq", 1024), batch, cluster, **kwargs)


def test_a_cpu_clusters_plans_are_priced_in_fp32_as_simulate_prices_their_commands():
    """On the cpu preset the planner prices the run train makes there, in fp32 (16 bytes of state a
    parameter, 4-byte activations), as simulate prices each plan's command: the same peaks and step."""
    from pipeloom.cli.simulate import simulate_spec
    from pipeloom.plan.evaluate import allreduce_ms, optimizer_ms

    want = PlanRequest(get_model("gpt-125m"), 256, 8, Cluster.of("cpu", 2), schedules=("1f1b", "zb-h1"), top=3)
    assert want.bytes_per_param == 16
    for plan in search(want).plans:
        c, line = plan.candidate, command(want, plan.candidate)
        spec = spec_of(_parser().parse_args(["simulate", *shlex.split(line)[shlex.split(line).index("train") + 1:]]))
        assert spec.costed_precision == spec.training_precision == "fp32"
        report, result = simulate_spec(spec)
        assert report["peak_memory_bytes"] == plan.peak_memory_bytes
        tails = [a + o for a, o in zip(allreduce_ms(want, c), optimizer_ms(want, c))]
        assert plan.step_ms == pytest.approx(max(e[-1] + t for e, t in zip(result.ends, tails)), rel=1e-12)
        bf16 = simulate_spec(replace(spec, precision="bf16"))[0]
        assert max(bf16["peak_activation_bytes"]) < 0.6 * max(report["peak_activation_bytes"])


def settings(plans):
    return [(p.candidate, p.step_ms) for p in plans]


@pytest.mark.parametrize("gpus,memory,batch", [pytest.param(4, 80, 16, marks=pytest.mark.slow),
                                               pytest.param(4, 0.6, 16, marks=pytest.mark.slow),
                                               pytest.param(8, 0.3, 16, marks=pytest.mark.slow), (2, 0.4, 8),
                                               pytest.param(8, 80, 8, marks=pytest.mark.slow)])
def test_search_equals_brute_force(gpus, memory, batch):
    """The pruned search returns exactly the plans (and order) simulating every candidate gives,
    with ample memory and with memory so tight that recomputation or offload must be chosen."""
    want = request(gpus, memory, batch, top=6)
    assert settings(search(want).plans) == settings(exhaustive(want))


@pytest.mark.parametrize("want", [
    PlanRequest(ModelSpec("m12x512", 12, 512, 8, 8192), 512, 8, Cluster.of("h100", 4, gpus_per_node=2, memory=80 * GiB),
                schedules=("zb-auto",), top=3),
    PlanRequest(ModelSpec("m8x256", 8, 256, 4, 8192), 512, 16, Cluster.of("h100", 8, memory=1.569 * GiB),
                schedules=("2bw",), vocab_parallel=("vocab-1",), top=2)], ids=["zb-auto", "2bw"])
def test_the_bare_layout_is_taken_where_it_fits_though_a_saver_models_faster(want):
    """A memory saver only adds work, but the model can step a saver's variant faster: zb-auto's memory
    limit (ZB-H2's peak under the costs) admits a 5% shorter step with recomputation's smaller
    activations here, and 2bw's steady step, two steps' time less one's, comes out 0.9% shorter with
    full recomputation's added work.
    The layout's plan is still the bare layout, in the search as in simulating every candidate."""
    costing = Costing(want)
    plans = search(want).plans
    assert settings(plans) == settings(exhaustive(want))
    fits = [costing.attempt(c) for c in candidates(want)]
    faster = [p for p in fits if p is not None and p.fits and p.candidate != p.candidate.base
              and (bare := costing.attempt(p.candidate.base)) is not None and bare.fits and p.step_ms < bare.step_ms]
    assert faster  # the model's artefact the rule is for is there
    layouts = {p.candidate.base for p in faster}
    assert all(p.candidate == p.candidate.base for p in plans if p.candidate.base in layouts)
    assert layouts & {p.candidate.base for p in plans}


def test_a_layout_whose_bare_plan_would_not_make_the_list_is_not_listed_by_a_faster_saver():
    """zb-auto's bare layout fits and steps 1.410 ms, slower than the 2bw plan on the list (1.408); with
    recomputation it models 1.345 ms (its memory limit admits a shorter order), but the layout's plan
    is its bare layout, so the 2bw plan stays first: the search asks the bare layout although its
    bound would not make the list (it used to skip it and list the faster variant)."""
    want = PlanRequest(ModelSpec("m8x512", 8, 512, 4, 8192), 1024, 8,
                       Cluster.of("h100", 4, gpus_per_node=2, memory=1.104 * GiB), schedules=("2bw", "zb-auto"), top=1)
    (plan,) = search(want).plans
    assert settings([plan]) == settings(exhaustive(want))
    assert (plan.candidate.schedule, plan.candidate.recompute) == ("2bw", "none")


def _random_request(rng: random.Random) -> PlanRequest:
    """A small request: a model of 4-12 layers, 2-4 GPUs, ample or tight memory, some schedules, maybe K-FAC."""
    model = ModelSpec("random", rng.choice([4, 6, 8, 12]), rng.choice([256, 512]), rng.choice([4, 8]),
                      rng.choice([4096, 8192, 32000]))
    cluster = Cluster.of(rng.choice(["a100", "h100"]), rng.choice([2, 4]), gpus_per_node=rng.choice([2, 8]),
                         memory=rng.choice([80, round(10 ** rng.uniform(-1.3, 0.5), 3)]) * GiB)
    schedules = tuple(rng.sample(sorted(FAMILIES), 3)) if rng.random() < 0.5 else tuple(FAMILIES)
    kfac = {"optimizer": ("adamw", "kfac"), "kfac_every": 2} if rng.random() < 0.2 else {}
    return PlanRequest(model, rng.choice([512, 1024]), 8, cluster, schedules=schedules, top=rng.choice([1, 3, 6]),
                       **kfac)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [1, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15])  # of 0-15, those under 11 s
def test_search_equals_brute_force_on_random_requests(seed):
    """Random small requests (how the variants that model faster than the bare layout were found);
    an infeasible one says so in one line, as simulating every candidate finds none."""
    want = _random_request(random.Random(seed))
    best = settings(exhaustive(want))
    if best:
        assert settings(search(want).plans) == best
    else:
        with pytest.raises(PipeloomError, match=f"^no layout of random on {want.cluster.gpus} GPUs fits "):
            search(want)


def test_candidates_that_cost_the_same_share_one_simulation():
    """redis where its balanced split is the even one (SMALL at pp 2) costs as none does: the planner
    simulates one for both, and each plan, shared or not, is what costing that candidate alone gives."""
    want = request(4, 0.6, 16)
    costing = Costing(want)
    shared = alone = 0
    for c in list(candidates(want))[::5]:
        if c.vocab_parallel != "redis":
            continue
        try:
            own = plan_evaluate(want, c, costing.costs(c))
        except PipeloomError:  # a family's own limit, which the costing raises too
            with pytest.raises(PipeloomError):
                costing.evaluate(c)
            continue
        plan = costing.evaluate(c)
        same = costing.same(c)
        shared += same is not c
        alone += same is c
        assert (plan.candidate, plan.fits) == (c, own.fits) and same.vocab_parallel == ("none" if c.pp * c.chunks == 2 else "redis")
        assert plan.step_ms == pytest.approx(own.step_ms, rel=1e-12)
        assert plan.peak_memory_bytes == pytest.approx(own.peak_memory_bytes, rel=1e-12)
        assert (plan.bubble_rate, plan.allreduce_ms, plan.optimizer_ms) == pytest.approx(
            (own.bubble_rate, own.allreduce_ms, own.optimizer_ms), rel=1e-12)
    assert shared >= 3 and alone >= 3


@pytest.mark.parametrize("gpus,memory,kfac", [(2, 80, dict(optimizer=("kfac",), recompute=("none",), offload=("none",))),
                                               (2, 1.2, dict(optimizer=("kfac",), kfac_every=2)),
                                               (2, 80, dict(optimizer=("adamw", "kfac"), kfac_every=2, top=30))])
def test_search_equals_brute_force_with_kfac(gpus, memory, kfac):
    """With K-FAC's axis the bounds (AdamW's work, and each stage's preconditioning every step)
    stay lower bounds: the refresh chosen by the bubbles, a forced one with memory so tight that
    savers must be chosen, and both optimizers ranked together."""
    want = request(gpus, memory, 8, **{"schedules": ("1f1b", "zb-h1", "2bw"), "vocab_parallel": ("none", "vocab-1"),
                                       "microbatch_sizes": (1, 2), "top": 4, **kfac})
    plans = search(want).plans
    assert settings(plans) == settings(exhaustive(want))
    assert {p.candidate.optimizer for p in plans} == set(want.optimizer)
    if memory < 80:
        assert any((p.candidate.recompute, p.candidate.offload) != ("none", "none") for p in plans)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("want", [request(8, 80, 16), request(2, 0.4, 8, top=6),
                                  request(2, 1.2, 8, optimizer=("kfac",), kfac_every=2, schedules=("1f1b", "2bw"))],
                         ids=["ample", "tight", "kfac"])
def test_workers_ahead_give_the_plans_one_process_gives(want):
    """With worker processes costing candidates ahead, the search decides as it does alone: the
    same plans in the same order (each plan's every figure), from the same simulations."""
    alone, ahead = search(want), search(want, jobs=2)
    assert ahead.jobs == 2 and alone.jobs == 1
    assert ahead.plans == alone.plans and ahead.simulated == alone.simulated


@pytest.mark.timeout(60)
def test_a_dead_or_failing_worker_is_said_not_waited_for(monkeypatch):
    """A worker that dies (killed, out of memory) ends the search in one line naming the candidate
    and the way round; a worker's error is raised as it would be without workers."""
    monkeypatch.setattr(Costing, "attempt", lambda self, c: os._exit(3))
    with pytest.raises(PipeloomError, match=r"a planner worker died while costing Candidate\(pp=.*pipeloom plan "
                                            r"--jobs 1\)$"):
        search(request(2, 80, 8), jobs=2)

    def fails(self, c):
        raise ValueError(f"no costs for {c.schedule}")
    monkeypatch.setattr(Costing, "attempt", fails)
    with pytest.raises(ValueError, match="no costs for "):
        search(request(2, 80, 8), jobs=2)
    with pytest.raises(PipeloomError, match=r"^jobs=0: the search needs a whole number >= 1 of worker processes$"):
        search(request(2, 80, 8), jobs=0)


def test_the_default_jobs_are_the_usable_cpus_at_most_eight(monkeypatch):
    """``pipeloom plan`` forks a worker per CPU it may use, but no more than 8 (each keeps its own caches)."""
    from pipeloom.plan.ahead import default_jobs

    for cpus, jobs in ((1, 1), (2, 2), (8, 8), (64, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)), raising=False)
        assert default_jobs() == jobs


@pytest.mark.parametrize("want", [request(8, 0.5, 8, top=3), request(8, 0.4, 32, top=3)],
                         ids=["unbuildable", "offloaded"])
def test_a_search_leaves_nothing_to_the_collector(want):
    """What a search keeps (its costing's caches, the errors of schedules that cannot be built,
    offload's sweeps, the likely candidates it names ahead) goes by reference counting as it
    returns: with the collector off, as the search runs, its costing is gone after it, and a
    collection finds none of its objects in cycles (one after the largest requests walked millions of
    objects, for seconds)."""
    from pipeloom.plan.ahead import Ahead
    from pipeloom.plan.evaluate import Costing

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        search(want)
        alive = [type(o).__name__ for o in gc.get_objects() if type(o) in (Costing, Ahead)]
        gc.collect()
        cycles = Counter(type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("pipeloom"))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert not alive and not cycles


def test_search_says_how_far_it_is():
    """With progress, each simulation past the interval says how many of the layouts are done;
    the plans are those found without it."""
    heard = []
    found = search(request(8, 80, 16), progress=heard.append, every=0)
    assert heard and all(re.fullmatch(rf"\d+ of {found.candidates} layouts simulated after \d+ s(; the best so far "
                                      r"[\d.]+ ms a step)?", text) for text in heard)
    assert [int(text.split()[0]) for text in heard] == sorted(int(text.split()[0]) for text in heard)
    assert settings(found.plans) == settings(search(request(8, 80, 16)).plans)


@pytest.mark.timeout(120)
def test_an_infeasible_search_says_how_far_its_hunt_is():
    """Where nothing fits, the hunt for the least memory says how far it is too, and ends in
    the same one line as without progress, its workers working out the next bounds ahead as
    one process alone."""
    heard = []
    with pytest.raises(PipeloomError) as quiet:
        search(request(4, 0.01, 16))
    with pytest.raises(PipeloomError) as told:
        search(request(4, 0.01, 16), progress=heard.append, every=0, jobs=2)
    assert told.value.args == quiet.value.args and "the smallest needs" in quiet.value.args[0]
    assert heard and all(re.fullmatch(r"no layout fits: looking for the least memory one needs, \d+ memory bounds? "
                                      r"tightened and \d+ layouts? simulated after \d+ s(; the least so far "
                                      r"[\d.]+ GiB)?", text) for text in heard), heard[:3]
    assert "the least so far" in heard[-1]


def test_float_noise_ties_break_on_memory():
    """2bw plans whose steps differ only by rounding: the top plan does not depend on ``top``."""
    model = ModelSpec("gpt-1.3b", 24, 2048, 16, 50304, tied_embeddings=True)
    cluster = Cluster.of("v100", 8, memory=16 * GiB, inter_bandwidth=3.125e9)
    want = [PlanRequest(model, 512, 64, cluster, schedules=("2bw",), vocab_parallel=("none",), offload=("none",),
                        top=top) for top in (1, 3)]
    assert search(want[0]).plans[0].candidate == search(want[1]).plans[0].candidate == exhaustive(want[0])[0].candidate


def test_tight_memory_picks_memory_savers():
    ample, tight = (search(request(4, m, 16, top=1)).plans[0] for m in (80, 0.35))
    assert max(tight.peak_memory_bytes) <= 0.35 * GiB < max(ample.peak_memory_bytes)
    assert tight.step_ms >= ample.step_ms


@pytest.mark.parametrize("links", ["fast", pytest.param("slow", marks=pytest.mark.slow)])
def test_bounds_hold_for_every_candidate(links):
    """Neither bound exceeds what simulation gives, also once critical paths have raised them: every
    family, vocabulary placement and memory saver, with links that cost little or as much as compute."""
    slow = {"per_node": 2, "inter_bandwidth": 2e8} if links == "slow" else {}
    want = request(8 if slow else 4, 80, 16, **slow)
    costing = Costing(want)
    plans = {}
    for c in list(candidates(want))[::11 if slow else 7]:
        try:
            plans[c] = costing.evaluate(c)
        except PipeloomError:  # a family's own limit (2bw: microbatches >= pp), which the search skips too
            continue
    assert len(plans) > 20
    for c, plan in plans.items():
        assert costing.bound_ms(c) <= plan.step_ms * (1 + 1e-9)
        assert costing.memory_lower_bound(c) <= costing.activation_memory_bound(c) <= max(plan.peak_memory_bytes)


@pytest.mark.parametrize("every,sample", [pytest.param(None, 29, marks=pytest.mark.slow), (3, 7)])
def test_bounds_hold_with_kfac(every, sample):
    """The bounds of K-FAC candidates (AdamW's, with each stage's preconditioning every step, and
    the critical path of the schedule without K-FAC) are within their refresh cycle's mean step,
    whichever family, placement and saver; their memory bounds count the factors and stay within the
    simulated peak."""
    want = request(4, 80, 16, optimizer=("kfac",), kfac_every=every, microbatch_sizes=(2,))
    costing = Costing(want)
    plans = {}
    for c in list(candidates(want))[::sample]:
        try:
            costing.evaluate(costing.bare(c))  # without K-FAC and offload: its critical path bounds c
            plans[c] = costing.evaluate(c)
        except PipeloomError:
            continue
    assert len(plans) > 20 and sum(costing.has_path(c) for c in plans) > 20
    assert {p.result.schedule.options["kfac"]["every"] for p in plans.values()} != {1}
    for c, plan in plans.items():
        assert costing.bound_ms(c) <= plan.step_ms * (1 + 1e-9)
        assert costing.memory_lower_bound(c) <= costing.activation_memory_bound(c) <= max(plan.peak_memory_bytes)
        # the factors count from the first bound on: a layout whose state and factors overflow is dropped unbuilt
        assert costing.memory_lower_bound(c) > costing.memory_lower_bound(replace(c, optimizer="adamw"))


def test_dualpipev_is_searched_with_the_vocabulary_passes():
    """The planner prices dualpipev with vocab-1 and vocab-2 (the room the passes ask for) as brute
    force does, and train builds the schedule each plan was priced with."""
    want = request(4, 80, 16, schedules=("dualpipev",), vocab_parallel=("vocab-1", "vocab-2"), top=4)
    plans = search(want).plans
    assert settings(plans) == settings(exhaustive(want))
    assert {plan.candidate.vocab_parallel for plan in plans} == {"vocab-1", "vocab-2"}
    costing = Costing(want)
    for plan in plans:
        spec = run_spec(want, plan.candidate)
        assert build_run(spec).digest() == costing.schedule(plan.candidate).digest()


def _train_args(line: str):
    words = shlex.split(line)
    assert words[0] == "torchrun"
    return _parser().parse_args(words[words.index("pipeloom") + 1:])


@pytest.mark.parametrize("memory", [80, pytest.param(0.4, marks=pytest.mark.slow)])  # 0.4: an offload search
def test_the_command_reruns_the_plan(memory):
    """The printed command carries every setting: parsed by pipeloom train's own parser and
    re-simulated, it gives the plan's step and memory exactly, and train builds that schedule."""
    want = request(8, memory, 32, model="gpt-125m", seq=512, top=3)
    for plan in search(want).plans:
        spec = spec_of(_train_args(command(want, plan.candidate)))
        assert (spec.model, spec.seq, spec.device, spec.hardware) == ("gpt-125m", 512, "cuda", "a100")
        assert spec == run_spec(want, plan.candidate)
        costing = Costing(want)
        again = costing.evaluate(candidate_of(spec))
        assert (again.step_ms, again.peak_memory_bytes) == (plan.step_ms, plan.peak_memory_bytes)
        assert costs_of(spec) == costing.costs(plan.candidate)  # train prices the run as the plan did
        assert build_run(spec).digest() == costing.schedule(plan.candidate).digest()


@pytest.mark.parametrize("every", [None, 2])
def test_kfac_plans_are_what_simulate_and_train_make_of_their_command(capsys, every):
    """A K-FAC plan's command (its refresh passed through: as train would choose it, or forced) is
    the run simulate prices and train builds: the same schedule digest, peak memory and step (the
    refresh cycle's mean: each rank's end over the cycle's steps, then its all-reduce and optimizer step)."""
    from pipeloom.cli import main
    from pipeloom.cli.simulate import simulate_spec
    from pipeloom.plan.evaluate import allreduce_ms, optimizer_ms

    want = request(4, 80, 8, model="gpt-125m", seq=512, optimizer=("kfac",), kfac_every=every,
                   schedules=("1f1b", "2bw"), vocab_parallel=("none", "vocab-2"), top=2)
    costing = Costing(want)
    for plan in search(want).plans:
        c, line = plan.candidate, command(want, plan.candidate)
        assert ("--optimizer kfac" in line) and (f"--kfac-every {every}" in line) == (every is not None)
        flags = shlex.split(line)[shlex.split(line).index("train") + 1:]
        report, result = simulate_spec(spec_of(_parser().parse_args(["simulate", *flags])))
        steps = result.schedule.steps
        assert report["kfac"]["every"] == (every or report["kfac"]["every"]) and steps == report["kfac"]["every"] * (
            4 if c.schedule == "2bw" else 1)
        assert report["schedule_digest"] == costing.schedule(c).digest()
        assert main(["train", *flags, "--dry-run", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["schedule_digest"] == report["schedule_digest"]
        assert report["peak_memory_bytes"] == plan.peak_memory_bytes
        tails = [a + o for a, o in zip(allreduce_ms(want, c), optimizer_ms(want, c))]
        ends = [max(e) / steps for e in result.ends]
        assert report["kfac"]["step_time_after"] == result.makespan / steps == max(ends)
        assert plan.step_ms == (max(ends) + max(tails) if c.schedule == "2bw" else
                                max(e + t for e, t in zip(ends, tails)))


def test_kfac_memory_is_its_factors_inverses_and_captures():
    """A K-FAC plan holds, beyond the same layout's AdamW plan, 3 fp32 copies of each linear layer's
    factors (A: inputs + bias squared, G: outputs squared) for each layer of the rank, and at the peak
    the captures of a microbatch's forward (its inputs) and part of its backward's (output gradients)
    waiting for their curvature pieces: gpt-125m (h 768, MLP 3072) on pp 2, 6 layers a rank, on A100s
    whose K-FAC runs in fp32 (an fp32 run: pieces too long for the bubbles, each curvature right after
    its producer; in TF32 some fit the bubbles, their captures held till then)."""
    fp32 = replace(get_device("a100"), tf32_flops=None)
    want = PlanRequest("gpt-125m", 512, 8, Cluster.of(fp32, 2, memory=80 * GiB), optimizer=("adamw", "kfac"),
                       kfac_every=1)
    base = Candidate(2, 1, 1, "1f1b", 1, 1, 8, "none", "none", "none", "adamw")
    adamw, kfac = (Costing(want).evaluate(replace(base, optimizer=o)) for o in ("adamw", "kfac"))
    factors = (769**2 + 2304**2) + (769**2 + 768**2) + (769**2 + 3072**2) + (3073**2 + 768**2)
    inputs = 512 * (4 * 768 + 2 * 768 + 4 * 768 + 2 * 3072)  # a norm's output fp32, the rest bf16
    grads = 512 * 2 * (2304 + 768 + 3072 + 768)
    for k, a in zip(kfac.peak_memory_bytes, adamw.peak_memory_bytes):
        assert 6 * (3 * 4 * factors + inputs) < k - a < 6 * (3 * 4 * factors + inputs + grads)
    assert kfac.step_ms > adamw.step_ms


def test_command_launches_every_node():
    want = request(32, 80, 64, top=1)
    line = command(want, search(want).plans[0].candidate)
    assert line.startswith("torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d")
    args = _train_args(line)
    assert args.pp * args.dp * args.sp == 32


def test_2bw_wins_at_small_batches_where_flushes_cost_most():
    """2BW's steady state has no flush: with few microbatches per step it beats 1F1B."""
    flush, no_flush = (search(request(8, 80, 8, schedules=(name,), top=1, vocab_parallel=("none",))).plans[0]
                       for name in ("1f1b", "2bw"))
    assert no_flush.step_ms < flush.step_ms
    assert no_flush.bubble_rate < flush.bubble_rate  # the steady step's idle share: no fill, no drain


def test_cluster_tiers_follow_the_mesh():
    """Ranks are laid out (dp, pp, sp) row-major; 8 to a node."""
    cluster = Cluster.of("a100", 16, gpus_per_node=8, inter_bandwidth=10e9)
    intra = cluster.intra
    assert cluster.bandwidth(8, 2, 1, "pp") == intra  # each pipeline fills one node
    assert cluster.bandwidth(8, 2, 1, "dp") == 10e9  # replicas are a node apart
    assert cluster.bandwidth(16, 1, 1, "pp") == 10e9
    assert cluster.bandwidth(2, 2, 4, "sp") == intra and cluster.bandwidth(2, 2, 4, "dp") == 10e9
    assert cluster.bandwidth(1, 2, 8, "dp") == 10e9 and cluster.bandwidth(1, 1, 8, "dp") == intra


def test_infeasible_requests_say_what_would_fit():
    with pytest.raises(PipeloomError, match=r"fits 0\.0 GiB per GPU; the smallest needs [0-9.]+ GiB \(pp"):
        search(request(4, 0.01, 16))
    # pp <= 2 layers, dp | 2 sequences, sp | 4 (seq 8 in 2 x sp chunks): 16 GPUs at most
    with pytest.raises(PipeloomError, match=r"cannot use 64 GPUs .*; at most 16 GPUs would"):
        search(request(64, 80, 2, model=ModelSpec("two", 2, 256, 4, 1024), seq=8))


@pytest.mark.slow
def test_infeasible_names_the_least_memory_any_candidate_needs():
    """The pruned hunt for the smallest layout names one that simulating every candidate finds
    the smallest."""
    want = request(4, 0.5, 16, model=ModelSpec("mid", 8, 2048, 16, 32000))
    costing = Costing(want)
    peaks = {}
    for c in candidates(want):
        try:
            peaks[c] = max(costing.evaluate(c).peak_memory_bytes)
        except PipeloomError:
            continue
    with pytest.raises(PipeloomError) as error:
        search(want)
    found = re.search(r"the smallest needs ([0-9.]+) GiB \(pp (\d+), dp (\d+), sp (\d+), ([\w-]+), chunks (\d+), "
                      r"microbatch size (\d+), recompute (\w+), vocab-parallel ([\w-]+), offload (\w+), "
                      r"optimizer (\w+)\)$",
                      error.value.args[0])
    pp, dp, sp, schedule, chunks, b, recompute, vocab, offload, optimizer = found.groups()[1:]
    named = Candidate(int(pp), int(dp), int(sp), schedule, int(chunks), int(b), 16 // int(dp) // int(b), recompute,
                      vocab, offload, optimizer)
    assert peaks[named] == min(peaks.values()) and found[1] == f"{peaks[named] / GiB:.1f}"


def test_bad_requests_one_line():
    with pytest.raises(PipeloomError, match="unknown schedule family 'nope'|nope"):
        request(schedules=("nope",))
    with pytest.raises(PipeloomError, match="global_batch must be a positive integer"):
        request(batch=0)
    with pytest.raises(PipeloomError, match="do not fill whole nodes of 8"):
        Cluster.of("a100", 12)
    with pytest.raises(PipeloomError, match="unknown optimizer 'sgd'; choose from adamw, kfac$"):
        request(optimizer=("sgd",))
    with pytest.raises(PipeloomError, match="--kfac-every 2 goes with --optimizer kfac or any$"):
        request(kfac_every=2)
    with pytest.raises(PipeloomError, match="--kfac-every must be a whole number >= 1, got 0$"):
        request(optimizer=("kfac",), kfac_every=0)


@pytest.mark.timeout(30)
def test_too_many_gpus_say_at_once_the_most_that_would():
    """The most GPUs a request could use is found among its layouts' counts, not by trying every
    count below (a million GPUs took hours), and is the largest count some layout fills."""
    from pipeloom.plan.space import layouts

    want = request(1000, 80, 7)
    with pytest.raises(PipeloomError, match=r"cannot use 1000 GPUs .*; at most (\d+) GPUs would$") as small:
        search(want)
    most = int(re.search(r"at most (\d+) GPUs", small.value.args[0]).group(1))
    assert most == next(n for n in range(999, 0, -1) if any(layouts(want, n)))
    with pytest.raises(PipeloomError, match=r"cannot use 1000000 GPUs .*; at most \d+ GPUs would$"):
        search(request(10**6, 80, 7))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeloom", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_json_has_the_plan_fields():
    done = run_cli("--model", "gpt-125m", "--gpus", "8", "--global-batch", "32", "--seq", "512", "--top", "3",
                   "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["costs"] == "formulas, device preset a100" and report["search"]["seconds"] > 0
    fields = {"pp", "dp", "sp", "schedule", "chunks", "microbatch_size", "microbatches", "recompute",
              "vocab_parallel", "offload", "optimizer", "kfac_every", "step_ms", "tokens_per_s", "peak_memory_bytes",
              "command"}
    assert len(report["plans"]) == 3 and all(fields <= set(plan) for plan in report["plans"])
    first = report["plans"][0]
    assert first["pp"] * first["dp"] * first["sp"] == 8
    assert first["microbatches"] * first["microbatch_size"] * first["dp"] == 32
    assert first["tokens_per_s"] == pytest.approx(32 * 512 / (first["step_ms"] / 1e3))
    steps = [p["step_ms"] for p in report["plans"]]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:]))  # fastest first, ties (9 digits) on memory


def test_cli_optimizer_any_ranks_both():
    """``--optimizer any`` plans each layout with AdamW and with K-FAC (its ``--kfac-every`` passed
    into the commands), in the table's optimizer column and the JSON's fields."""
    flags = ("--model", "gpt-125m", "--gpus", "2", "--global-batch", "8", "--seq", "256", "--schedules", "1f1b",
             "--vocab-parallel", "none", "--microbatch-sizes", "1", "--top", "6", "--optimizer", "any",
             "--kfac-every", "4")
    table, done = run_cli(*flags), run_cli(*flags, "--json")
    assert table.returncode == done.returncode == 0, table.stderr + done.stderr
    header, *rows = table.stdout.splitlines()[3:10]
    assert header.split()[9:11] == ["offload", "optimizer"]
    assert [row.split()[10] for row in rows] == ["adamw"] * 3 + ["kfac"] * 3
    plans = json.loads(done.stdout)["plans"]
    assert [(p["optimizer"], p["kfac_every"]) for p in plans] == [("adamw", None)] * 3 + [("kfac", 4)] * 3
    assert all(("--optimizer kfac --kfac-every 4" in p["command"]) == (p["optimizer"] == "kfac") for p in plans)


def test_cli_infeasible_is_one_line():
    done = run_cli("--model", "28.3b", "--gpus", "8", "--global-batch", "8", "--gpu-memory", "16")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "the smallest needs" in lines[0], done.stderr
    done = run_cli("--gpus", "8", "--schedules", "1f1b,nope")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "nope" in done.stderr


def test_cli_names_a_listed_value_twice_in_one_line(capsys):
    from pipeloom.cli import main

    for flag, text in (("--schedules", "1f1b,1f1b"), ("--optimizer", "kfac,kfac"), ("--microbatch-sizes", "2,2"),
                       ("--recompute", ",")):
        assert main(["plan", "--model", "tiny", "--gpus", "2", "--global-batch", "8", flag, text]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"pipeloom plan: error: {flag} {text!r}: "), err


def test_cli_table_shows_a_tiny_models_step_and_memory(capsys):
    """A tiny model's step (microseconds) and peak (MiB) show to two significant digits, not as 0.0,
    and its millions of samples a second fit their column."""
    from pipeloom.cli import main

    flags = ["plan", "--model", "tiny", "--gpus", "2", "--global-batch", "8", "--schedules", "1f1b", "--top", "2"]
    assert main([*flags, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert main(flags) == 0
    header, row = capsys.readouterr().out.splitlines()[3:5]
    cells = dict(zip(["step", "tokens", "samples", "mfu", "peak"], row.split()[-6:-1]))
    assert best["step_ms"] < 0.1 and float(cells["step"]) == pytest.approx(best["step_ms"], rel=0.05)
    assert float(cells["peak"]) == pytest.approx(max(best["peak_memory_bytes"]) / GiB, rel=0.05)
    assert float(cells["samples"].replace(",", "")) == pytest.approx(best["samples_per_s"], rel=1e-3)
    assert len(row) == len(header)


def test_each_rank_ends_its_step_with_the_all_reduce_and_its_optimizer_step():
    """The step is the slowest rank's last action, gradient all-reduce and AdamW over its parameters
    (at the device's memory bandwidth: 32 bytes a parameter)."""
    from pipeloom.plan.evaluate import allreduce_ms, optimizer_ms, stages_of_ranks
    from pipeloom.sim.model import stage_parameters

    want = request(4, 80, 16, schedules=("1f1b",), recompute=("none",), vocab_parallel=("none",), offload=("none",))
    plan = next(p for p in exhaustive(want) if (p.candidate.pp, p.candidate.dp) == (2, 2))
    c, params = plan.candidate, stage_parameters(SMALL, 2, 1024)
    device = want.cluster.device
    assert optimizer_ms(want, c) == pytest.approx([1e3 * 32 * params[s] / device.memory_bandwidth for s in (0, 1)])
    ends = [max(e) for e in plan.result.ends]
    tails = [a + o for a, o in zip(allreduce_ms(want, c), optimizer_ms(want, c))]
    assert plan.step_ms == pytest.approx(max(e + t for e, t in zip(ends, tails)))
    assert plan.optimizer_ms == pytest.approx(max(optimizer_ms(want, c))) and plan.optimizer_ms > 0
    assert stages_of_ranks(c) == ((0,), (1,))


def test_steps_that_agree_to_six_digits_are_equal_speed_and_the_bound_rounds_alike():
    """At equal speed the plan with less memory comes first, though its step is 2.7e-8 longer (as
    2bw's at b=1 against b=8 on 64 GPUs); a difference in the sixth digit is not equal speed; and a
    bound that rounds above a plan's step is beaten, one that rounds to it is not."""
    from pipeloom.plan.evaluate import Plan

    def plan(step, gib, microbatch_size):
        c = Candidate(8, 8, 1, "2bw", 1, microbatch_size, 64 // microbatch_size, "none", "vocab-2", "none", "adamw")
        return Plan(c, step, 0.0, 0.0, 0.0, [gib * GiB], 0.0, 0.0, 0.0, True)

    big, small = plan(499.2964433657452, 18.0, 8), plan(499.2964568090249, 5.2, 1)
    assert small.key < big.key
    assert plan(499.2964, 5.2, 1).key > plan(499.2954, 18.0, 8).key  # 2e-6 apart: the faster first
    assert small.key[0] == 499.296  # so a step up to 499.2965 ties with it
    assert not small.beats(499.2964999) and small.beats(499.29651) and small.beats(499.3)
