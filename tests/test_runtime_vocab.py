"""Vocabulary Parallelism in the runtime: loss and every gradient against the one-process GPT."""

import pytest

torch = pytest.importorskip("torch")

from pipeloom.runtime.local import spawn  # noqa: E402

ALGORITHMS = ["naive", "vocab-1", "vocab-2"]


def _vocab_worker(rank, cases, pp, dp, microbatches, config_overrides):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", vocab_size=203, **config_overrides)  # 203: uneven shards, padding
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (dp * microbatches * 2, 17), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    torch.manual_seed(0)
    ref = GPT(config)
    ref_loss = ref(tokens, targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    out = {}
    for family, algorithm in cases:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), schedule=family, pp=pp, microbatches=microbatches, dp=dp,
                                 vocab_parallel=algorithm, timeout=30)
        loss = pipe.step(tokens, targets)
        grads = pipe.gather_grads()
        assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
        grad_err = max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in ref_grads)
        out[family, algorithm] = (abs(loss - ref_loss.item()) / ref_loss.item(), grad_err)
    return out


def _check(results):
    for rank_result in results:
        for case, (loss_err, grad_err) in rank_result.items():
            assert loss_err < 1e-5 and grad_err < 1e-4, (case, loss_err, grad_err)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_two_ranks_every_algorithm_on_1f1b_and_v_half(tied):
    cases = [(family, algorithm) for family in ("1f1b", "v-half") for algorithm in ALGORITHMS]
    _check(spawn(2, _vocab_worker, cases, 2, 1, 4, {"tie_embeddings": tied}, timeout=240))


@pytest.mark.timeout(300)
def test_four_ranks_and_data_parallel():
    _check(spawn(4, _vocab_worker, [("1f1b", a) for a in ALGORITHMS] + [("v-half", "vocab-2")], 4, 1, 8,
                 {"n_layer": 8}, timeout=240))
    _check(spawn(4, _vocab_worker, [("1f1b", "vocab-2"), ("1f1b", "vocab-1")], 2, 2, 4,
                 {"tie_embeddings": True}, timeout=240))
