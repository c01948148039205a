"""Each rank builds only its own stages: a GPT described on the meta device, materialised stage by stage
with the weights of the one-process model built with the same seed."""

import pytest

torch = pytest.importorskip("torch")

from parity import check, parity_worker  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import GPT, GPTConfig  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402


def tiny(device=None, seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", **overrides), device=device)


def test_a_meta_model_allocates_nothing():
    meta = tiny("meta", tie_embeddings=True)
    assert all(p.is_meta for p in meta.parameters()) and meta.lm_head.weight is meta.wte.weight
    torch.manual_seed(0)
    with torch.device("meta"):
        under = GPT(GPTConfig.preset("tiny"))
    assert all(p.is_meta for p in under.parameters()) and under.init_seed == meta.init_seed


def test_construction_draws_one_number_wherever_the_model_goes():
    """So ranks that build on the meta device and on the CPU go on drawing the same numbers."""
    states = []
    for device in ("meta", "cpu"):
        tiny(device)
        states.append(torch.get_rng_state())
    assert torch.equal(*states)


def test_initialisation_is_gpt2s_with_a_generator_per_name():
    model = tiny(n_embd=128, n_head=4)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert not p.any(), name
        elif ".ln_" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name
        else:
            std = 0.02 / (2 * model.config.n_layer) ** 0.5 if name.endswith("proj.weight") else 0.02
            assert p.std().item() == pytest.approx(std, rel=0.1), name
    draws = [p.flatten()[:8] for name, p in model.named_parameters() if name.endswith("weight") and p.dim() == 2]
    assert len({tuple(d.tolist()) for d in draws}) == len(draws)  # every name its own numbers
    assert not torch.equal(tiny(seed=1).wte.weight, tiny(seed=0).wte.weight)


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_meta_stages_equal_the_materialised_models(n_stages, tied, vocab_parallel):
    want = tiny(tie_embeddings=tied).split(n_stages, vocab_parallel=vocab_parallel)
    for k in range(n_stages):
        meta = tiny("meta", tie_embeddings=tied)
        (got,) = meta.build_stages(n_stages, [k], vocab_parallel=vocab_parallel).values()
        assert (got.param_names, got.tied) == (want[k].param_names, want[k].tied)
        for (name, p), (_, q) in zip(got.named_parameters(), want[k].named_parameters(), strict=True):
            assert not p.is_meta and torch.equal(p, q), name
        own = {id(p) for p in got.parameters()}
        assert all(p.is_meta for p in meta.parameters() if id(p) not in own)  # the other stages stay described


def test_stages_built_one_by_one_make_up_the_model():
    meta = tiny("meta", tie_embeddings=True)
    for k in (2, 0, 1):
        meta.build_stages(3, [k])
    for (name, p), (_, q) in zip(meta.named_parameters(), tiny(tie_embeddings=True).named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert meta.lm_head.weight is meta.wte.weight


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_value_is_the_materialised_models(tied):
    full, meta = tiny(tie_embeddings=tied), tiny("meta", tie_embeddings=tied)
    for name in ("wte.weight", "lm_head.weight", "wpe.weight", "blocks.2.mlp.proj.weight", "ln_f.bias"):
        value = meta.parameter_value(name)
        assert not value.is_meta and torch.equal(value, full.get_parameter(name)), name
        assert full.parameter_value(name).data_ptr() == full.get_parameter(name).data_ptr()


def test_stages_of_a_materialised_model_share_its_parameters():
    model = tiny()
    by_name = dict(model.named_parameters())
    stages = model.build_stages(3, [2, 1], device="cpu")
    assert list(stages) == [2, 1]
    assert all(p is by_name[n] for stage in stages.values() for n, p in stage.named_parameters())


@pytest.mark.parametrize("index", [2, -1, True, 1.0])
def test_a_stage_index_outside_the_cut_is_refused(index):
    with pytest.raises(PipeloomError, match=rf"stage index {index!r} is not a stage of 2: use 0 to 1"):
        tiny("meta").build_stages(2, [index])


def _held_worker(rank, vocab_parallel):
    """The unsplit names of what a pipeline from a meta model materialised on this rank."""
    import pipeloom

    model = tiny("meta", tie_embeddings=True)
    pipe = pipeloom.Pipeline(model, schedule="1f1b", pp=2, microbatches=2, vocab_parallel=vocab_parallel)
    held = {id(p) for p in pipe.parameters()}
    materialised = [(n, id(p) in held) for n, p in model.named_parameters() if not p.is_meta]
    return materialised, sorted(n for n, _ in pipe.named_parameters())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab_parallel", [None, "vocab-1"])
def test_each_rank_materialises_only_its_own_stages(vocab_parallel):
    first, last = spawn(2, _held_worker, vocab_parallel, timeout=90)
    assert all(kept for materialised, _ in (first, last) for _, kept in materialised)
    assert {n for n, _ in first[0]} == set(first[1])
    assert {n for n, _ in last[0]} == set(last[1]) - {"wte.weight"}  # the last stage's LM head is a copy
    assert {n.split(".")[1] for n in first[1] if n.startswith("blocks.")} == {"0", "1"}
    assert ("wte.weight" in first[1]) == (vocab_parallel is None)  # else the vocabulary shards only


def _cases(pp, microbatches):
    plain = [(name, dict(schedule=name, pp=pp, microbatches=microbatches)) for name in ("1f1b", "zb-v")]
    return plain + [(("1f1b", a), dict(schedule="1f1b", pp=pp, microbatches=microbatches, vocab_parallel=a, timeout=30))
                    for a in ("vocab-1", "vocab-2")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_a_pipeline_from_a_meta_model_matches_one_process(tied):
    check(spawn(2, parity_worker, _cases(2, 4), {"tie_embeddings": tied, "vocab_size": 203}, 8, 16, "meta",
                timeout=240))
