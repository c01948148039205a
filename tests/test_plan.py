"""The planner: its pruned search against brute force, its commands against a re-simulation, its
bounds, its cluster tiers and its command line."""

import json
import re
import shlex
import subprocess
import sys

import pytest

from pipeloom.cli import _parser
from pipeloom.errors import PipeloomError
from pipeloom.plan import (
    Candidate, Cluster, Costing, PlanRequest, candidate_of, candidates, command, exhaustive, search,
)
from pipeloom.builder import build_run, costs_of
from pipeloom.cli.flags import spec_of
from pipeloom.plan.command import run_spec
from pipeloom.sim.model import ModelSpec

GiB = 2**30
SMALL = ModelSpec("small", 8, 512, 8, 8192)


def request(gpus=4, memory=80, batch=16, model=SMALL, **kwargs):
    links = {"inter_bandwidth": kwargs.pop("inter_bandwidth")} if "inter_bandwidth" in kwargs else {}
    cluster = Cluster.of("a100", gpus, gpus_per_node=kwargs.pop("per_node", 8), memory=memory * GiB, **links)
    return PlanRequest(model, kwargs.pop("seq", 1024), batch, cluster, **kwargs)


def settings(plans):
    return [(p.candidate, p.step_ms) for p in plans]


@pytest.mark.parametrize("gpus,memory,batch", [pytest.param(4, 80, 16, marks=pytest.mark.slow), (4, 0.6, 16),
                                               pytest.param(8, 0.3, 16, marks=pytest.mark.slow), (2, 0.4, 8),
                                               pytest.param(8, 80, 8, marks=pytest.mark.slow)])
def test_search_equals_brute_force(gpus, memory, batch):
    """The pruned search returns exactly the plans (and order) simulating every candidate gives,
    with ample memory and with memory so tight that recomputation or offload must be chosen."""
    want = request(gpus, memory, batch, top=6)
    assert settings(search(want).plans) == settings(exhaustive(want))


def test_search_says_how_far_it_is():
    """With progress, each simulation past the interval says how many of the layouts are done;
    the plans are those found without it."""
    heard = []
    found = search(request(8, 80, 16), progress=heard.append, every=0)
    assert heard and all(re.fullmatch(rf"\d+ of {found.candidates} layouts simulated after \d+ s(; the best so far "
                                      r"[\d.]+ ms a step)?", text) for text in heard)
    assert [int(text.split()[0]) for text in heard] == sorted(int(text.split()[0]) for text in heard)
    assert settings(found.plans) == settings(search(request(8, 80, 16)).plans)


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


@pytest.mark.parametrize("links", ["fast", "slow"])
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


@pytest.mark.parametrize("memory", [80, 0.4])
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
                      r"microbatch size (\d+), recompute (\w+), vocab-parallel ([\w-]+), offload (\w+)\)$",
                      error.value.args[0])
    pp, dp, sp, schedule, chunks, b, recompute, vocab, offload = found.groups()[1:]
    named = Candidate(int(pp), int(dp), int(sp), schedule, int(chunks), int(b), 16 // int(dp) // int(b), recompute,
                      vocab, offload)
    assert peaks[named] == min(peaks.values()) and found[1] == f"{peaks[named] / GiB:.1f}"


def test_bad_requests_one_line():
    with pytest.raises(PipeloomError, match="unknown schedule family 'nope'|nope"):
        request(schedules=("nope",))
    with pytest.raises(PipeloomError, match="global_batch must be a positive integer"):
        request(batch=0)
    with pytest.raises(PipeloomError, match="do not fill whole nodes of 8"):
        Cluster.of("a100", 12)


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
              "vocab_parallel", "offload", "step_ms", "tokens_per_s", "peak_memory_bytes", "command"}
    assert len(report["plans"]) == 3 and all(fields <= set(plan) for plan in report["plans"])
    first = report["plans"][0]
    assert first["pp"] * first["dp"] * first["sp"] == 8
    assert first["microbatches"] * first["microbatch_size"] * first["dp"] == 32
    assert first["tokens_per_s"] == pytest.approx(32 * 512 / (first["step_ms"] / 1e3))
    steps = [p["step_ms"] for p in report["plans"]]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:]))  # fastest first, ties (9 digits) on memory


def test_cli_infeasible_is_one_line():
    done = run_cli("--model", "28.3b", "--gpus", "8", "--global-batch", "8", "--gpu-memory", "16")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "the smallest needs" in lines[0], done.stderr
    done = run_cli("--gpus", "8", "--schedules", "1f1b,nope")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "nope" in done.stderr


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
