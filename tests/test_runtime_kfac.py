"""PipeFisher in the runtime: Pipeline(optimizer="kfac") against K-FAC on one process, same refresh pattern."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from parity import make_batch  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

STEPS, BATCH, SEQ, LR, DAMPING = 6, 8, 16, 0.05, 0.1


def _batches(config):
    """One batch, ``STEPS`` times: the loss must fall."""
    return [make_batch(config, BATCH, SEQ, seed=1)] * STEPS


def _reference(config_overrides, every):
    """Losses and final weights of K-FAC around SGD on the one-process GPT: factors from
    steps 0, k, 2k, ..., their inverses in use from the refresh's last step (delay k - 1)."""
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.optim.kfac import KFAC

    config = GPTConfig.preset("tiny", **config_overrides)
    torch.manual_seed(0)
    model = GPT(config)
    opt = KFAC(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), damping=DAMPING,
               update_every=every, invert_every=every, delay=every - 1, exclude=["lm_head"])
    losses = []
    for tokens, targets in _batches(config):
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank, cases, config_overrides):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", **config_overrides)
    out = {}
    for label, options in cases:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), optimizer="kfac", kfac={"damping": DAMPING, **options.pop("kfac")},
                                 **options)
        opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
        losses = []
        for tokens, targets in _batches(config):
            losses.append(pipe.step(tokens, targets))
            pipe.optimizer_step(opt)
        weights = {name: p.detach().clone() for name, p in pipe.named_parameters()}
        moved = pipe.offload_stats()["offloaded"] if "offload" in options else None  # bytes of the last step
        out[label] = (losses, weights, pipe.schedule.options["kfac"]["every"], moved)
    return out


def _check(results, config_overrides, want_every):
    for label, every in want_every.items():
        ref_losses, ref_weights = _reference(config_overrides, every)
        weights = {}
        for rank_result in results:
            losses, own, got_every, _ = rank_result[label]
            assert got_every == every, (label, got_every)
            assert losses == pytest.approx(ref_losses, rel=1e-5), (label, losses, ref_losses)
            weights.update(own)
        assert set(weights) <= set(ref_weights)
        for name, w in weights.items():
            err = ((w - ref_weights[name]).norm() / ref_weights[name].norm()).item()
            assert err < 1e-4, (label, name, err)
        # the update moved the weights: a K-FAC step that did nothing would fail above against the reference
        assert losses[-1] < losses[0]


@pytest.mark.timeout(240)
def test_two_ranks_match_kfac_on_one_process():
    from pipeloom.schedule import Costs

    slow = Costs(extra={"kfac_a": 0.05, "kfac_g": 0.05, "kfac_inv": 0.2})  # the pieces spill over 3 steps
    cases = [
        ("gpipe every 1", dict(schedule="gpipe", pp=2, microbatches=4, kfac={"every": 1})),
        ("1f1b auto", dict(schedule="1f1b", pp=2, microbatches=4, costs=slow, kfac={})),
        ("zb-h1 every 2, overflow", dict(schedule="zb-h1", pp=2, microbatches=4, costs=slow, kfac={"every": 2})),
        ("interleaved every 3", dict(schedule="interleaved-1f1b", pp=2, microbatches=4, chunks=2,
                                      kfac={"every": 3})),
        ("v-half every 2", dict(schedule="v-half", pp=2, microbatches=4, kfac={"every": 2})),
        ("dualpipev every 2", dict(schedule="dualpipev", pp=2, microbatches=4, kfac={"every": 2})),
    ]
    results = spawn(2, _worker, cases, {}, timeout=200)
    assert results[0]["1f1b auto"][2] == 3  # the pieces fill three steps' bubbles
    _check(results, {}, {"gpipe every 1": 1, "1f1b auto": 3, "zb-h1 every 2, overflow": 2, "interleaved every 3": 3,
                     "v-half every 2": 2, "dualpipev every 2": 2})


@pytest.mark.timeout(240)
def test_offloaded_and_recomputed_pipelines_match_kfac_on_one_process():
    """Offload moves the saved activations to host and back; K-FAC's captures keep their own references
    (the capture step's inputs stay on the device until their curvature piece), so the update is K-FAC's.
    Recomputation reruns a forward inside the backward, where nothing captures: each input once."""
    from pipeloom.schedule import Costs

    cheap = Costs(extra={"offload": 0.1})  # the copies fit: pairs are offloaded
    cases = [("1f1b every 2, offload full", dict(schedule="1f1b", pp=2, microbatches=4, offload="full", costs=cheap,
                                                 kfac={"every": 2})),
             ("zb-v every 1, selective", dict(schedule="zb-v", pp=2, microbatches=4, offload="selective",
                                              offload_ratio=0.5, costs=cheap, kfac={"every": 1})),
             ("1f1b every 2, recompute full", dict(schedule="1f1b", pp=2, microbatches=4, recompute=True,
                                                   kfac={"every": 2})),
             ("zb-h1 every 1, recompute cheap", dict(schedule="zb-h1", pp=2, microbatches=4, recompute="cheap",
                                                     kfac={"every": 1})),
             ("1f1b every 2, vocab-2", dict(schedule="1f1b", pp=2, microbatches=4, vocab_parallel="vocab-2",
                                            kfac={"every": 2})),
             ("v-half every 1, vocab-1", dict(schedule="v-half", pp=2, microbatches=4, vocab_parallel="vocab-1",
                                              kfac={"every": 1})),
             ("dualpipev every 2, vocab-1", dict(schedule="dualpipev", pp=2, microbatches=4, vocab_parallel="vocab-1",
                                                 kfac={"every": 2}))]
    results = spawn(2, _worker, cases, {}, timeout=200)
    _check(results, {}, {"1f1b every 2, offload full": 2, "zb-v every 1, selective": 1,
                         "1f1b every 2, recompute full": 2, "zb-h1 every 1, recompute cheap": 1,
                         "1f1b every 2, vocab-2": 2, "v-half every 1, vocab-1": 1, "dualpipev every 2, vocab-1": 2})
    assert all(results[0][label][3] > 0 for label, options in cases if "offload" in options)  # pairs went to host


@pytest.mark.timeout(240)
def test_a_stage_without_layers_preconditions_nothing_and_the_rest_match_one_process():
    """redis moves every layer off the last of 3 stages when the vocabulary is large (the pipeline
    splits the model so by itself): that stage has no K-FAC unit, its head is stepped by the base
    optimizer alone, and the others' update is K-FAC's."""
    from dataclasses import replace

    from pipeloom.sim.model import get_model
    from pipeloom.sim.stages import stage_layers

    wide = {"vocab_size": 8000}
    split = stage_layers(replace(get_model("tiny"), vocab=8000), 3, SEQ, vocab_parallel="redis")
    assert split == (2, 2, 0)
    cases = [("zb-h1 every 2, redis", dict(schedule="zb-h1", pp=3, microbatches=4, vocab_parallel="redis",
                                           kfac={"every": 2}))]
    results = spawn(3, _worker, cases, wide, timeout=200)
    held = [set(result["zb-h1 every 2, redis"][1]) for result in results]
    assert all(any(name.startswith("blocks.") for name in names) for names in held[:2])
    assert held[2] and not any(name.startswith("blocks.") for name in held[2])
    _check(results, wide, {"zb-h1 every 2, redis": 2})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sequence_parallel_ranks_sum_their_factors():
    """Each sp rank captures its chunk of every sequence: the factors are summed over the sp group
    (with the data-parallel replicas) and its output gradients scaled by the whole sequence's tokens."""
    cases = [("pp1 sp2 1f1b", dict(schedule="1f1b", pp=1, sp=2, microbatches=4, kfac={"every": 2}))]
    _check(spawn(2, _worker, cases, {}, timeout=200), {}, {"pp1 sp2 1f1b": 2})
    cases = [("pp2 sp2 zb-h1", dict(schedule="zb-h1", pp=2, sp=2, microbatches=4, kfac={"every": 1}))]
    _check(spawn(4, _worker, cases, {}, timeout=200), {}, {"pp2 sp2 zb-h1": 1})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_data_parallel_replicas_sum_their_factors():
    cases = [("dp2 pp2 zb-v", dict(schedule="zb-v", pp=2, dp=2, microbatches=4, kfac={"every": 2}))]
    _check(spawn(4, _worker, cases, {}, timeout=200), {}, {"dp2 pp2 zb-v": 2})


class _Delayed:
    """PipeDream-2BW's update around SGD with momentum: each step applies the previous step's
    (preconditioned) gradient, W(t+1) = W(t) - update(grad f(W(t-1))); :meth:`flush` the last."""

    def __init__(self, params):
        self.params = list(params)
        self.sgd = torch.optim.SGD(self.params, lr=LR, momentum=0.9)
        self.param_groups = self.sgd.param_groups  # what K-FAC checks it holds
        self.pending = None

    def step(self):
        grads = [p.grad for p in self.params]
        self.flush()
        self.pending = grads

    def flush(self):
        if self.pending is not None:
            for p, g in zip(self.params, self.pending):
                p.grad = g
            self.sgd.step()
        self.pending = None


def _two_bw_worker(rank, steps, every, calls):
    """2bw with K-FAC over ``calls`` calls of ``steps`` steps, and K-FAC around 2bw's delayed update on
    one process, factors from each cycle's first step, their inverses in use from its last (a cycle
    being ``every`` calls): (losses, reference losses, the largest relative weight error, k)."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.optim.kfac import KFAC

    config = GPTConfig.preset("tiny")
    batches = [make_batch(config, BATCH, SEQ, seed=1)] * (calls * steps)  # one batch: the loss must fall
    torch.manual_seed(0)
    ref = GPT(config)
    delayed, cycle = _Delayed(ref.parameters()), every * steps
    opt = KFAC(ref, delayed, damping=DAMPING, update_every=cycle, invert_every=cycle, delay=cycle - 1,
               exclude=["lm_head"])
    ref_losses = []
    for tokens, targets in batches:
        loss = ref(tokens, targets)
        loss.backward()
        opt.step()
        ref.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())
    delayed.flush()
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="2bw", pp=2, microbatches=4, steps=steps, optimizer="kfac",
                             kfac={"damping": DAMPING, "every": every})
    sgd = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    losses = []
    for c in range(calls):
        group = batches[c * steps:(c + 1) * steps]
        losses += pipe.run_steps(torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group]), sgd)
    weights, expected = pipe.gather_weights(), dict(ref.named_parameters())
    error = max(((weights[n] - expected[n]).norm() / expected[n].norm()).item() for n in expected)
    return losses, ref_losses, error, pipe.schedule.options["kfac"]["every"]


@pytest.mark.timeout(120)
def test_two_bw_preconditions_each_steps_gradient_in_its_version():
    """K-FAC with PipeDream-2BW: each step's gradient, in its weight version, preconditioned with the
    inverses in use at that step, then applied one step late, as on one process; two cycles of two
    calls of two steps. SGD would give other weights: the reference fails without the preconditioning."""
    for losses, ref_losses, error, every in spawn(2, _two_bw_worker, 2, 2, 4, timeout=100):
        assert every == 2
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert error < 1e-4, error
        assert losses[-1] < losses[0]


def _refusal_worker(rank):
    import pipeloom
    from pipeloom.errors import PipeloomError
    from pipeloom.nn import GPT, GPTConfig

    from pipeloom.schedule import Kfac, build

    config = GPTConfig.preset("tiny")
    messages = []
    for options in (dict(schedule=build("1f1b", 1, 2, transforms=[Kfac()])),
                    dict(schedule="1f1b", optimizer="adam"),
                    dict(schedule="1f1b", optimizer="kfac", kfac={"dampning": 1})):
        try:
            pipeloom.Pipeline(GPT(config), pp=1, microbatches=2, **options)
            messages.append("no error")
        except PipeloomError as err:
            messages.append(str(err))
    return messages


@pytest.mark.timeout(60)
def test_combinations_not_run_yet_are_refused_by_name():
    messages = spawn(1, _refusal_worker, timeout=45)[0]
    assert "holds K-FAC pieces" in messages[0]
    assert "'adam'" in messages[1]
    assert "'dampning'" in messages[2]


def _stalled_replica_worker(rank, done):
    from pathlib import Path

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    from parity import stall_until, step_failure

    config = GPTConfig.preset("tiny")
    pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=1, dp=2, microbatches=4, timeout=3, optimizer="kfac")
    if rank == 1:
        stall_until(done)  # stalls: never joins the sum of the curvature
        return None
    try:
        return step_failure(pipe, config)
    finally:
        Path(done).touch()


@pytest.mark.timeout(120)
def test_a_stalled_replica_is_named_at_the_curvature_sum(tmp_path):
    (message, waited), _ = spawn(2, _stalled_replica_worker, str(tmp_path / "rank 0 stopped"), timeout=60)
    assert "K-FAC's sum of the curvature over the data-parallel replicas" in message and "rank 1" in message
    assert waited < 3 + 5
