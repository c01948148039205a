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


@pytest.mark.slow
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
@pytest.mark.parametrize("recompute", [False, True])
def test_a_compiled_block_leaves_its_weight_gradients_to_w(recompute):
    """B (the backward under a store) leaves every linear weight's gradient unset and the norms' set;
    W (the store's run) then gives the eager model's gradients; also where the forward reruns in B
    (checkpoint's saved-tensor hooks hand the compiled backward detached parameters)."""
    from torch.utils.checkpoint import checkpoint

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
        loss = checkpoint(compiled, tokens, targets, use_reentrant=False) if recompute else compiled(tokens, targets)
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


def _stages_worker(rank):
    """Your own stages compiled, zb-h1: the relative errors of the loss and every gradient against the
    eager one-process model, and whether W found each stage's plain nn.Linear weights still unset."""
    import pipeloom
    from test_custom_stages import WatchW, batch, build, lm_loss, reference

    from parity import max_rel_error
    from pipeloom.runtime.handlers import AROUND, around
    from pipeloom.schedule import W

    tokens, targets = batch()
    ref_loss, ref_grads = reference(2, False, tokens, targets)
    torch.manual_seed(0)
    watch = around(W, WatchW())
    try:
        pipe = pipeloom.Pipeline.from_stages(build(2), lm_loss, "zb-h1", pp=2, microbatches=4, timeout=60, compile=True)
        loss = pipe.step(tokens, targets)
    finally:
        AROUND[W].remove(watch)
    return abs(loss - ref_loss) / ref_loss, max_rel_error(pipe.gather_grads(), ref_grads), watch.seen


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_your_own_stages_compiled_match_one_process():
    for loss_err, grad_err, seen in spawn(2, _stages_worker, timeout=360):
        assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)
        assert seen and all(before_none and after_set for before_none, _, after_set in seen.values()), seen
