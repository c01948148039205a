"""Vocabulary Parallelism in the runtime: loss and every gradient against the one-process GPT."""

import pytest

torch = pytest.importorskip("torch")

from parity import Products, autocast_reference, check, make_batch, max_rel_error, parity_worker  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

ALGORITHMS = ["naive", "vocab-1", "vocab-2"]


def _cases(families_and_algorithms, pp, dp, microbatches):
    return [((family, algorithm), dict(schedule=family, pp=pp, microbatches=microbatches, dp=dp,
                                       vocab_parallel=algorithm, timeout=30))
            for family, algorithm in families_and_algorithms]


def _run(world, cases, pp, dp, microbatches, config_overrides):
    # vocabulary 203: shards of uneven real rows, with padding
    check(spawn(world, parity_worker, _cases(cases, pp, dp, microbatches), {"vocab_size": 203, **config_overrides},
                dp * microbatches * 2, 16, timeout=240))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_two_ranks_every_algorithm_on_1f1b_gpipe_v_half_zb_auto_and_dualpipev(tied):
    cases = [(family, algorithm) for family in ("1f1b", "gpipe", "v-half", "zb-auto", "dualpipev")
             for algorithm in ALGORITHMS]
    _run(2, cases, 2, 1, 4, {"tie_embeddings": tied})


@pytest.mark.timeout(300)
def test_four_ranks_and_data_parallel():
    _run(4, [("1f1b", a) for a in ALGORITHMS] + [("v-half", "vocab-2")], 4, 1, 8, {"n_layer": 8})
    _run(4, [("1f1b", "vocab-2"), ("1f1b", "vocab-1")], 2, 2, 4, {"tie_embeddings": True})


def _autocast_worker(rank):
    """Per algorithm: the dtypes of every product a bf16-autocast step ran, its loss and gradients'
    error against the one-process model under the same autocast."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", vocab_size=203)
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = autocast_reference(config, tokens, targets)
    out = {}
    for algorithm in ALGORITHMS:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=4, autocast=torch.bfloat16,
                                 vocab_parallel=algorithm, timeout=30)
        with Products() as products:
            loss = pipe.step(tokens, targets)
        out[algorithm] = (set(products.dtypes), abs(loss - ref_loss) / ref_loss,
                          max_rel_error(pipe.gather_grads(), ref_grads))
    return out


@pytest.mark.timeout(120)
def test_bf16_autocast_runs_the_vocabulary_products_in_bf16():
    for rank_result in spawn(2, _autocast_worker, timeout=90):
        for algorithm, (dtypes, loss_err, grad_err) in rank_result.items():
            assert dtypes == {(torch.bfloat16,) * 2, (torch.bfloat16,) * 3}, (algorithm, dtypes)  # mm, addmm
            assert loss_err < 2e-2 and grad_err < 5e-2, (algorithm, loss_err, grad_err)
