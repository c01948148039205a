"""PipeOffload in the runtime: the saved-tensor hooks on one process, and parity of offloaded pipelines."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from parity import (autocast_reference, check, cheap_recompute_run, make_batch, max_rel_error,  # noqa: E402
                    parity_worker)
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn.linear import Linear, WeightGradStore, defer_weight_grads  # noqa: E402
from pipeloom.runtime.handlers.offload import SMALL, Offloader, _Range, _Reloaded, _Saved, _unpack  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.schedule import (OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, Action, Costs, F, Offload,  # noqa: E402
                               build)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
PAIR = (0, 0)


def _offloader(device="cpu"):
    """An offloader of one rank whose schedule offloads (stage 0, microbatch 0), on a bare context."""
    context = SimpleNamespace(schedule=SimpleNamespace(ranks=[(Action(F, *PAIR), Action(RELOAD, *PAIR))], options={}),
                              mesh=SimpleNamespace(pp_rank=0), device=torch.device(device), extras={})
    offloader = Offloader(context)
    _new_step(offloader)
    return offloader


def _new_step(offloader, x=None):
    offloader.context.step = SimpleNamespace(slots={PAIR: SimpleNamespace(input=x, output=None)})


def _block(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(64), Linear(64, 256), torch.nn.GELU(approximate="tanh"),
                               Linear(256, 64)).to(device)


def _grads(block, x, offloader=None, split=False, recompute=False):
    """Gradients of the block's parameters and of ``x`` for one step, through ``offloader``'s
    F, OFFLOAD, RELOAD and backward (with the B/W split: W after the hooks let go; with
    ``recompute``: the block checkpointed, its input offloaded and read again to recompute it)."""
    x = x.clone().requires_grad_()

    def forward():
        h = x * 2
        return checkpoint(block, h, use_reentrant=False) if recompute else block(h)

    if offloader:
        _new_step(offloader, x)
        with offloader.hooks(Action(F, *PAIR)):
            y = forward()
        offloader.offload(Action(OFFLOAD, *PAIR))
        offloader.reload(Action(RELOAD, *PAIR))
    else:
        y = forward()
    store = WeightGradStore(eager=not split)
    with defer_weight_grads(store):
        y.square().sum().backward()
    store.run()
    grads = [p.grad.clone() for p in block.parameters()] + [x.grad]
    block.zero_grad()
    if offloader:
        offloader.context.step.slots.clear()  # as the runtime lets go of the input after the backward
    return grads


def test_parameters_and_small_tensors_pass_through():
    offloader = _offloader()
    weight = torch.nn.Parameter(torch.randn(64, 64))
    pack = offloader.hooks(Action(F, *PAIR)).pack_hook
    small = torch.randn(SMALL)
    assert pack(weight) is weight and pack(weight.t())._base is weight and pack(small) is small
    assert offloader.stats.device == 0 and not offloader.captures[PAIR].ranges


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_comes_back_as_a_view_of_its_reloaded_base(device):
    offloader = _offloader(device)
    base = torch.randn(64, 48, device=device)
    pack = offloader.hooks(Action(F, *PAIR)).pack_hook
    packed = [pack(base[8:40, 1:]), pack(base.t()), pack(base)]  # views first, the whole last
    offloader.offload(Action(OFFLOAD, *PAIR))
    assert len(offloader.captures[PAIR].ranges) == 1  # one copy of the storage
    offloader.reload(Action(RELOAD, *PAIR))
    *views, whole = (_unpack(p) for p in packed)
    assert whole.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    for view, expected in zip(views, (base[8:40, 1:], base.t())):
        assert view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert view.stride() == expected.stride() and torch.equal(view, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_a_pairs_storages_of_one_dtype_go_and_come_back_in_one_buffer(device):
    """Five storages of two dtypes: one host buffer and one device tensor per dtype, each saved tensor
    a view of its dtype's reloaded tensor, equal to what was saved; and freed together."""
    offloader = _offloader(device)
    pack = offloader.hooks(Action(F, *PAIR)).pack_hook
    saved = [torch.randn(40, 30, device=device).to(dtype) for dtype in (torch.float32, torch.bfloat16) * 2]
    saved.append(torch.randn(80, 80, device=device)[5:75:2, 3:])  # a strided view inside its storage
    packed = [pack(t) for t in saved]
    offloader.offload(Action(OFFLOAD, *PAIR))
    capture, kept = offloader.captures[PAIR], offloader.stats.device  # the test's own references to the originals
    assert [len(b.ranges) for b in capture.blocks] == [3, 2] and offloader.stats.host_allocations == 2
    offloader.reload(Action(RELOAD, *PAIR))
    back = [_unpack(p) for p in packed]
    for got, want in zip(back, saved):
        assert got.dtype == want.dtype and got.stride() == want.stride() and torch.equal(got, want)
    assert len({t.untyped_storage().data_ptr() for t in back}) == 2
    reloaded = sum(b.numel * b.ranges[0].tensor.element_size() for b in capture.blocks)
    assert offloader.stats.device - kept == reloaded == offloader.stats.offloaded
    del back, packed, capture, got, pack  # the pack hook holds the capture, as F's hooks do until F ends
    assert offloader.stats.device == kept


def test_a_reloads_event_is_waited_for_once(monkeypatch):
    """The compute stream waits for a reload's copy at the first saved tensor unpacked, of whichever
    range; the others follow it on that stream (one wait per saved tensor cost the backward host time)."""
    waits = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=waits.append))
    storages = [torch.arange(12.0), torch.arange(8.0)]
    views = [storages[0][:6], storages[0][6:].view(2, 3), storages[1][2:]]
    saved = [_Saved(v) for v in views]
    reloaded = _Reloaded("the reload's event")
    for storage, group in ((storages[0], saved[:2]), (storages[1], saved[2:])):
        where = _Range(0, storage.numel(), storage)
        for each in group:
            each.place(where)
        where.ready = reloaded
    assert all(torch.equal(each.unpack(), view) for each, view in zip(saved, views))
    assert waits == ["the reload's event"]


@pytest.mark.parametrize("device", DEVICES)
def test_bytes_leave_the_device_with_offload_and_come_back_with_reload(device):
    offloader = _offloader(device)
    stats = offloader.stats
    with offloader.hooks(Action(F, *PAIR)):
        y = torch.randn(64, 64, device=device, requires_grad=True).exp().sum()  # exp saves its output, held there only
    size = 64 * 64 * 4
    assert (stats.device, stats.host) == (size, 0)
    offloader.offload(Action(OFFLOAD, *PAIR))
    assert (stats.device, stats.host, stats.offloaded) == (0, size, size)
    offloader.reload(Action(RELOAD, *PAIR))
    assert (stats.device, stats.host, stats.device_peak, stats.host_peak) == (size, 0, size, size)
    y.backward()
    del y
    assert stats.device == 0


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_as_without_hooks_and_the_pool_reused_across_steps(device):
    block, x = _block(device), torch.randn(4, 32, 64, device=device)
    plain = _grads(block, x)
    offloader = _offloader(device)
    assert all(torch.allclose(a, b) for a, b in zip(_grads(block, x, offloader), plain))
    allocations = offloader.stats.host_allocations
    assert allocations > 0
    assert all(torch.allclose(a, b) for a, b in zip(_grads(block, x, offloader, split=True), plain))
    assert offloader.stats.host_allocations == allocations  # the second step took every buffer from the pool
    assert all(torch.allclose(a, b) for a, b in zip(_grads(block, x, offloader, recompute=True), plain))
    assert offloader.stats.offloaded == x.numel() * 4  # the checkpoint's input, read again to recompute
    assert offloader.stats.offloaded > 0 and offloader.stats.device == offloader.stats.host == 0


@pytest.mark.parametrize("device", DEVICES)
def test_what_b_queues_for_w_goes_to_host_and_back(device):
    """OFFLOAD_W copies the layers' inputs and output gradients that B queued for W to host and
    frees them on the device; RELOAD_W brings them back and W computes the same gradients."""
    block, x = _block(device), torch.randn(4, 32, 64, device=device)
    plain = _grads(block, x)
    offloader, store = _offloader(device), WeightGradStore()
    _new_step(offloader)
    offloader.context.step.slots[PAIR].weights = store
    y = block(x.clone().requires_grad_() * 2)  # as _grads computes it
    with defer_weight_grads(store):
        y.square().sum().backward()
    del y
    queued = 4 * 32 * (64 + 256 + 256 + 64) * 4  # each Linear's input and output gradient, fp32
    stats = offloader.stats
    offloader.offload_w(Action(OFFLOAD_W, *PAIR))
    assert (stats.host, stats.offloaded, stats.device) == (queued, queued, 0)
    assert store.held() and not any(isinstance(t, torch.Tensor) for t in store.held())  # each packed
    offloader.reload_w(Action(RELOAD_W, *PAIR))
    assert (stats.host, stats.device) == (0, queued)
    store.run()
    assert all(torch.allclose(p.grad, g) for p, g in zip(block.parameters(), plain))
    assert stats.device == 0


def test_a_backward_without_its_reload_is_named():
    offloader = _offloader()
    with offloader.hooks(Action(F, *PAIR)):
        y = torch.randn(64, 64, requires_grad=True).exp()
    offloader.offload(Action(OFFLOAD, *PAIR))
    with pytest.raises(PipeloomError, match="not reloaded"):
        y.sum().backward()


def test_cheap_recompute_keeps_less_and_gives_the_same_gradients():
    """A GPT block with the norms' and GELU's outputs rebuilt in the backward: the same
    gradients, bit for bit, and exactly those three outputs fewer bytes kept."""
    from pipeloom.nn.gpt import Block, GPTConfig

    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=16, block_size=32))
    x = torch.randn(2, 32, 64)

    (kept, plain), (kept_cheap, rebuilt) = cheap_recompute_run(block, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, rebuilt))
    assert kept - kept_cheap == 4 * 2 * 32 * (64 + 64 + 4 * 64)  # ln_1, ln_2 and GELU outputs, fp32


# -- parity on gloo ranks ------------------------------------------------------------------------
def _stats(pipe):
    return pipe.offload_stats()


def _offload_cases(pp, cases):
    """(label, Pipeline options) of each (family, policy, other options): 4 microbatches, "selective" at 0.5."""
    return [(f"{family} {policy} {extra}", dict(schedule=family, pp=pp, microbatches=4, timeout=30, offload=policy,
                                                offload_ratio=0.5 if policy == "selective" else None, **extra))
            for family, policy, extra in cases]


def _check_offloaded(results):
    """Parity, and every case moved bytes to host (with recompute: the stage inputs, all a
    recomputed stage saves) and brought them all back."""
    check(results)
    for case in results[0]:
        assert sum(rank[case][2]["offloaded"] for rank in results) > 0, case
        assert all(rank[case][2]["host"] == 0 for rank in results), case


@pytest.mark.timeout(200)
def test_two_ranks_match_one_process():
    cases = [("1f1b", "full", {}), ("zb-v", "full", {}), ("v-half", "selective", {}), ("dualpipev", "full", {}),
             ("interleaved-1f1b", "full", {"recompute": True}), ("1f1b", "full", {"vocab_parallel": "vocab-2"}),
             ("zb-v", "full", {"recompute": "cheap"}),
             ("zb-v", "selective", {"vocab_parallel": "vocab-2"}), ("dualpipev", "full", {"vocab_parallel": "vocab-1"})]
    # forwards paced to a slow copy stream (each waits for an earlier pair's OFFLOAD), as the transform builds them
    paced = Offload("full").apply(build("interleaved-1f1b", 2, 4, 2),
                                  Costs(f=1, b=2, comm=0.1, m_b=1, extra={"offload": 1.8}))
    assert paced.options["offload"]["waits"]
    runs = [*_offload_cases(2, cases), ("interleaved-1f1b paced", dict(schedule=paced, timeout=30))]
    _check_offloaded(spawn(2, parity_worker, runs, {}, 8, 32, None, _stats, timeout=150))


@pytest.mark.timeout(200)
def test_two_ranks_match_one_process_with_what_b_keeps_for_w_offloaded():
    """Split-backward families whose costs make B's queued tensors worth copying (OFFLOAD_W after
    B, RELOAD_W before W), with cheap recomputation (B rebuilds what W reads): parity. v-half and
    zb-v also move Ws right after their Bs where the copies cannot take what they hold."""
    costs = Costs(m_b=1, m_w=1.5, extra={"offload": 0.1})
    runs = []
    for family, moved in (("zb-h1", False), ("v-half", True), ("zb-v", True)):
        schedule = build(family, 2, 4, transforms=[Offload("full")], costs=costs)
        assert any(a.kind == OFFLOAD_W for actions in schedule.ranks for a in actions), family
        assert bool(schedule.options["offload"].get("moved")) == moved, family
        runs.append((f"{family} full", dict(schedule=schedule, recompute="cheap", timeout=30)))
    _check_offloaded(spawn(2, parity_worker, runs, {}, 8, 32, None, _stats, timeout=150))


@pytest.mark.timeout(200)
def test_four_ranks_match_one_process():
    cases = [("1f1b", "full", {}), ("zb-v", "full", {}), ("v-half", "selective", {})]
    _check_offloaded(spawn(4, parity_worker, _offload_cases(4, cases), {"n_layer": 8}, 8, 32, None, _stats,
                           timeout=150))


def _autocast_worker(rank):
    """A bf16-autocast step with full offload against the one-process model under the same autocast."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 32)
    ref_loss, ref_grads = autocast_reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=4, autocast=torch.bfloat16,
                             offload="full", timeout=30)
    loss = pipe.step(tokens, targets)
    return abs(loss - ref_loss) / ref_loss, max_rel_error(pipe.gather_grads(), ref_grads), pipe.offload_stats()


@pytest.mark.timeout(120)
def test_bf16_autocast_with_offload():
    results = spawn(2, _autocast_worker, timeout=90)
    for loss_err, grad_err, _ in results:
        assert loss_err < 2e-2 and grad_err < 5e-2, (loss_err, grad_err)
    assert results[0][2]["offloaded"] > 0


def _errors_worker(rank):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.schedule import build

    model = GPT(GPTConfig.preset("tiny"))
    messages = []
    for options in (dict(offload="most"), dict(offload="full", offload_ratio=0.5), dict(offload_ratio=0.5),
                    dict(offload="selective", offload_ratio=1.5), dict(schedule=build("1f1b", 2, 4), offload="full")):
        try:
            pipeloom.Pipeline(model, **{"schedule": "1f1b", "pp": 2, "microbatches": 4, **options})
        except PipeloomError as err:
            messages.append(str(err))
    return messages


@pytest.mark.timeout(60)
def test_bad_offload_options_are_named():
    messages = spawn(1, _errors_worker, timeout=45)[0]  # refused before the mesh is checked
    assert len(messages) == 5
    for message, named in zip(messages, ("'most'", "0.5", "0.5", "1.5", "'full'")):
        assert named in message and "\n" not in message, message
