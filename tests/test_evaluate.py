"""Forward-only evaluation and the unsplit weights: Pipeline.evaluate and gather_weights against one process."""

from dataclasses import replace

import pytest

from pipeloom.errors import ScheduleError
from pipeloom.schedule import FAMILIES, Offload, build, forward_only, lower, validate
from pipeloom.schedule.ir import parts


def test_forward_only_keeps_the_forwards_of_one_step_in_the_family_order():
    for name in FAMILIES:
        schedule = build(name, 2, 4)
        only = forward_only(schedule)
        assert only.forward_only and only.steps == 1 and only.weight_versions == 1
        for actions, kept in zip(schedule.ranks, only.ranks):
            forwards = [p for a in actions for p in parts(a) if p.kind == "F" and p.microbatch < 4]
            assert list(kept) == forwards, name
        lower(only)  # its messages: the forwards' only
    vocab = forward_only(build("zb-v", 2, 4, vocab_parallel="naive", transforms=[Offload("full")]))
    assert {a.kind for r in vocab.ranks for a in r} == {"F", "IF", "S", "C", "Z", "CZ"}
    assert "offload" not in vocab.options and vocab.vocab_parallel == "naive"
    with pytest.raises(ScheduleError, match="in a forward-only schedule"):
        validate(replace(build("1f1b", 2, 4), options={"forward_only": True}))


def _worker(rank, cases):
    """Per case: the relative error of evaluate() on a fresh pipeline, and of the training step
    after it, against the one-process loss; whether evaluate() left every gradient alone; after a training step, the relative error of
    evaluate() on another batch against the one-process model holding gather_weights(), and
    whether gather_weights() named exactly the unsplit model's parameters (and gave them to
    pipeline rank 1 alone with ``to=1``)."""
    import torch

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from parity import make_batch

    out = {}
    for label, overrides, options in cases:
        config = GPTConfig.preset("tiny", **overrides)
        batch, other = make_batch(config, 8, 16, seed=1), make_batch(config, 8, 16, seed=2)
        torch.manual_seed(0)
        reference = GPT(config)
        with torch.no_grad():
            ref = reference(*batch).item()
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config, device="meta"), pp=2, microbatches=4, timeout=30, **options)
        fresh = abs(pipe.evaluate(*batch) - ref) / ref
        untouched = all(p.grad is None for p in pipe.parameters())
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        if pipe.versions:  # 2bw: its steps' updates land in the stages' parameters, the newest weights
            steps = pipe.schedule.steps
            tokens = torch.cat([make_batch(config, 8, 16, seed=10 + t)[0] for t in range(steps)])
            targets = torch.cat([make_batch(config, 8, 16, seed=10 + t)[1] for t in range(steps)])
            first = pipe.run_steps(tokens, targets, optimizer)[0]
            with torch.no_grad():
                ref = reference(*make_batch(config, 8, 16, seed=10)).item()
        else:
            first = pipe.step(*batch)
            pipe.optimizer_step(optimizer)
        fresh = max(fresh, abs(first - ref) / ref)  # the step after evaluate() trained from the same weights
        weights = pipe.gather_weights()
        only = pipe.gather_weights(to=1)  # on pipeline rank 1 alone
        alone = only == {} if rank == 0 else only.keys() == weights.keys() and all(
            torch.equal(only[n], weights[n]) for n in weights)
        trained = GPT(config)
        names = {n for n, _ in trained.named_parameters()}
        with torch.no_grad():
            for name, p in trained.named_parameters():
                p.copy_(weights[name])
            after_ref = trained(*other).item()
        after = pipe.evaluate(*other)
        out[label] = (fresh, untouched, abs(after - after_ref) / after_ref, set(weights) == names and alone)
    return out


CASES = [
    ("1f1b", {}, dict(schedule="1f1b")),
    ("zb-v tied", {"tie_embeddings": True}, dict(schedule="zb-v")),
    ("1f1b vocab-1", {"vocab_size": 203}, dict(schedule="1f1b", vocab_parallel="vocab-1")),
    ("zb-v vocab-2 tied", {"vocab_size": 203, "tie_embeddings": True}, dict(schedule="zb-v", vocab_parallel="vocab-2")),
    ("1f1b naive", {"vocab_size": 203}, dict(schedule="1f1b", vocab_parallel="naive")),
    ("2bw", {}, dict(schedule="2bw")),
    ("dualpipev", {}, dict(schedule="dualpipev")),
    ("dualpipev vocab-1", {"vocab_size": 203}, dict(schedule="dualpipev", vocab_parallel="vocab-1")),
    ("interleaved offload", {}, dict(schedule="interleaved-1f1b", offload="full", recompute=True)),
    ("1f1b kfac", {}, dict(schedule="1f1b", optimizer="kfac")),
]


@pytest.mark.timeout(120)
def test_evaluate_and_gather_weights_match_one_process():
    pytest.importorskip("torch")
    from pipeloom.runtime.local import spawn

    for result in spawn(2, _worker, CASES, timeout=100):
        for label, (fresh, untouched, after, names) in result.items():
            assert fresh < 1e-5 and after < 1e-5, (label, fresh, after)
            assert untouched and names, label
