"""Sequence parallelism in the runtime: loss and every gradient against the one-process GPT."""

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.local import spawn  # noqa: E402


def _sp_worker(rank, cases, pp, dp, sp, microbatches, config_overrides):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", **config_overrides)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (dp * microbatches * 2, 33), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    torch.manual_seed(0)
    ref = GPT(config)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for family, attention in cases:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), schedule=family, pp=pp, microbatches=microbatches, dp=dp, sp=sp,
                                 attention=attention, timeout=30)
        loss = pipe.step(tokens, targets)
        grads = pipe.gather_grads()
        assert set(grads) == set(ref_grads)
        grad_err = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in ref_grads)
        out[family, attention] = (abs(loss - ref_loss.item()) / ref_loss.item(), grad_err)
    return out


def _check(results):
    for rank_result in results:
        for case, (loss_err, grad_err) in rank_result.items():
            assert loss_err < 1e-5 and grad_err < 1e-4, (case, loss_err, grad_err)


@pytest.mark.timeout(300)
def test_sequence_parallel_alone_on_four_ranks():
    _check(spawn(4, _sp_worker, [("1f1b", "ring"), ("1f1b", "rsa")], 1, 1, 4, 2, {}, timeout=240))


@pytest.mark.timeout(300)
def test_pipeline_times_sequence_parallel():
    cases = [("1f1b", "ring"), ("zb-v", "ring"), ("1f1b", "rsa")]
    _check(spawn(4, _sp_worker, cases, 2, 1, 2, 4, {"tie_embeddings": True}, timeout=240))


@pytest.mark.timeout(300)
def test_data_pipeline_and_sequence_parallel_together():
    _check(spawn(8, _sp_worker, [("1f1b", "ring")], 2, 2, 2, 2, {}, timeout=240))
