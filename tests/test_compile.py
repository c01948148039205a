"""Compiled stages (``--compile``): the same loss and gradients as the one-process eager model, the B/W split kept."""

import pytest

torch = pytest.importorskip("torch")

from parity import check, make_batch, parity_worker  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.spec import RunSpec  # noqa: E402


def _cases(*extras):
    return [(f"{family} {options}", dict(schedule=family, pp=2, microbatches=4, timeout=60, compile=True, **options))
            for family, options in extras]


def _compiled(pipe):
    """Whether every block of the rank's stages runs compiled."""
    return all(block._compiled_call_impl is not None for stage in pipe.stages.values()
               for block in stage.blocks.values())


@pytest.mark.timeout(400)
def test_compiled_stages_match_one_process_with_and_without_the_split():
    results = spawn(2, parity_worker, _cases(("1f1b", {}), ("zb-h1", {})), {}, 8, 16, None, _compiled, timeout=360)
    check(results)
    assert all(compiled for rank in results for *_, compiled in rank.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_stages_match_with_recomputation_and_offload():
    cases = _cases(("zb-h1", dict(recompute=True)), ("zb-h1", dict(recompute="cheap")), ("zb-h1", dict(offload="full")),
                   ("1f1b", dict(recompute="cheap", offload="full")))
    check(spawn(2, parity_worker, cases, {}, 8, 16, timeout=560))


@pytest.mark.timeout(300)
def test_a_compiled_block_leaves_its_weight_gradients_to_w():
    """B (the backward under a store) leaves every linear weight's gradient unset and the norms' set;
    W (the store's run) then gives the eager model's gradients."""
    from pipeloom.nn import Linear, WeightGradStore, defer_weight_grads, preset_config
    from pipeloom.runtime.compile import OPTIONS

    config = preset_config("tiny")
    tokens, targets = make_batch(config, 4, 16)
    torch.manual_seed(0)
    eager, compiled = config.build(), config.build()
    compiled.load_state_dict(eager.state_dict())
    for block in compiled.blocks:
        block.compile(options=OPTIONS)
    eager(tokens, targets).backward()
    store = WeightGradStore()
    with defer_weight_grads(store):
        loss = compiled(tokens, targets)
        loss.backward()
    linears = [m for m in compiled.blocks.modules() if isinstance(m, Linear)]
    assert all(m.weight.grad is None and m.bias.grad is None for m in linears)
    assert all(block.ln_1.weight.grad is not None for block in compiled.blocks)
    assert len(store.work) == len(linears) + 1  # and the eager LM head's
    store.run()
    reference = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, reference[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    assert loss.item() == pytest.approx(eager(tokens, targets).item(), rel=1e-6)


@pytest.mark.parametrize("changes, message", [
    (dict(sp=2), "--compile with --sp 2: ring attention"),
    (dict(schedule="2bw"), "--compile with --schedule 2bw: its weight versions"),
    (dict(optimizer="kfac"), "--compile with --optimizer kfac: its capture hooks"),
])
def test_compile_refuses_what_it_does_not_compose_with(changes, message):
    with pytest.raises(PipeloomError, match=message):
        RunSpec(compile=True, **changes).check()


def test_compile_takes_a_bool():
    from pipeloom.runtime.compile import CompilePart

    with pytest.raises(PipeloomError, match="compile='yes': give True or False"):
        CompilePart({"compile": "yes"}).check()
    assert RunSpec(compile=True).flags() == ["--compile"]
