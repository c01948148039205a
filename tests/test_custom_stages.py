"""Your own stages (Pipeline.from_stages): a causal transformer of torch's own layers against one process."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from parity import cheap_recompute_run, max_rel_error  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

VOCAB, WIDTH, HEADS = 50, 32, 4


class CausalLayer(nn.Module):
    """``nn.TransformerEncoderLayer`` with a causal mask: a decoder-only layer of torch's."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                norm_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def build(n, meta=False):
    """``n`` stages: an embedding and a layer, layers, a layer and the norm and LM head."""
    with torch.device("meta") if meta else contextlib.nullcontext():
        return [nn.Sequential(nn.Embedding(VOCAB, WIDTH), CausalLayer()),
                *(CausalLayer() for _ in range(n - 2)),
                nn.Sequential(CausalLayer(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(rows=8, seq=8, seed=1):
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def reference(n, meta, tokens, targets):
    """The one-process model of the same seed: the stages run in turn (built on the meta device:
    materialised as the pipeline materialises them)."""
    from pipeloom.nn.stages import Stages

    torch.manual_seed(0)
    model = Stages(build(n, meta))
    model.build_stages(n, range(n))
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


class WatchW:
    """Around the first W of each stage on a rank: (a plain nn.Linear weight's gradient is None,
    a LayerNorm's is set) before it, and (the Linear's is set) after it."""

    def __init__(self):
        self.seen = {}

    def __call__(self, action, context):
        if action.stage in self.seen:
            return None
        stage = context.stages[action.stage]
        norm = next(m for m in stage.modules() if isinstance(m, nn.LayerNorm))
        return self.watch(action.stage, stage.linears[-1], norm)

    @contextlib.contextmanager
    def watch(self, s, linear, norm):
        before = linear.weight.grad is None, norm.weight.grad is not None
        yield
        self.seen[s] = (*before, linear.weight.grad is not None)


def _parity_worker(rank, cases, dp, trace):
    """Per case (label, stages, built on meta, options): the relative error of the loss and of
    every gradient against :func:`reference`, of evaluate() on the same batch after the step, and
    with ``watch`` in the options what :class:`WatchW` saw; on the last case the trace's note, and
    (``dp`` 1) how far the weights of its checkpoint, loaded into the stages on one process, are
    from its own."""
    import json

    import pipeloom
    from pipeloom.nn.stages import Stages
    from pipeloom.runtime.checkpoint import load_weights, save
    from pipeloom.runtime.handlers import AROUND, around
    from pipeloom.runtime.timeline import write_trace
    from pipeloom.schedule import W

    tokens, targets = batch(rows=8 * dp)
    out = {}
    for label, n, meta, options in cases:
        ref_loss, ref_grads = reference(n, meta, tokens, targets)
        torch.manual_seed(0)
        options = dict(options)
        watch = around(W, WatchW()) if options.pop("watch", False) else None
        pipe = pipeloom.Pipeline.from_stages(build(n, meta), lm_loss, pp=2, microbatches=4, dp=dp, timeout=60,
                                             **options)
        loss = pipe.step(tokens, targets)
        grads = max_rel_error(pipe.gather_grads(), ref_grads)
        evaluated = abs(pipe.evaluate(tokens, targets) - ref_loss) / ref_loss
        out[label] = (abs(loss - ref_loss) / ref_loss, grads, evaluated, watch and watch.seen)
        if watch:
            AROUND[W].remove(watch)
    write_trace(pipe, trace)
    out["note"] = json.loads(open(trace).read())["otherData"].get("weight_grads_in_B") if rank == 0 else None
    if dp > 1:
        return out
    # a checkpoint names the weights as the stages run in turn do: it loads into them on one process
    save(pipe, torch.optim.SGD(pipe.parameters()), trace + ".ckpt", {"step": 0})
    torch.manual_seed(1)
    unsplit = Stages(build(len(pipe.schedule.placement)))
    load_weights(trace + ".ckpt", unsplit)
    weights = pipe.gather_weights()
    out["checkpoint"] = max((weights[name] - p).abs().max().item() for name, p in unsplit.named_parameters())
    return out


def _two_bw_worker(rank, lr=0.5):
    """PipeDream-2BW, one call of two steps: both run the first weights (W(1) = W(0)), and the
    call ends with both steps' gradients applied, W(0) - lr * (g0 + g1) with plain SGD. The
    relative errors of the losses and of the weights against that, on one process."""
    import pipeloom
    from pipeloom.nn.stages import Stages

    batches = [batch(seed=1), batch(seed=2)]
    torch.manual_seed(0)
    model = Stages(build(2))
    ref_losses = []
    for tokens, targets in batches:
        loss = lm_loss(model(tokens), targets)
        loss.backward()  # the gradients of both batches add up
        ref_losses.append(loss.item())
    expected = {name: (p - lr * p.grad).detach() for name, p in model.named_parameters()}
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline.from_stages(build(2), lm_loss, "2bw", pp=2, microbatches=4, steps=2, timeout=60)
    losses = pipe.run_steps(*(torch.cat(part) for part in zip(*batches)), torch.optim.SGD(pipe.parameters(), lr=lr))
    return max(abs(a - b) / b for a, b in zip(losses, ref_losses)), max_rel_error(pipe.gather_weights(), expected)


def _check(results):
    for rank_result in results:
        for case, (loss_err, grad_err, eval_err, _) in rank_result.items():
            assert loss_err < 1e-5 and grad_err < 1e-4 and eval_err < 1e-5, (case, loss_err, grad_err, eval_err)


@pytest.mark.timeout(180)
def test_every_family_matches_one_process(tmp_path):
    """Two ranks: 1f1b, gpipe, zb-h1/h2, interleaved (2 chunks), zb-v (B/W split: W does the deferred
    nn.Linear work), v-half, dualpipev, recomputation (full, and cheap with offload), offload, and stages
    built on the meta device."""
    cases = [("1f1b", 2, False, {"schedule": "1f1b"}), ("gpipe", 2, False, {"schedule": "gpipe"}),
             ("zb-h1", 2, False, {"schedule": "zb-h1"}), ("zb-h2", 2, False, {"schedule": "zb-h2"}),
             ("interleaved", 4, False, {"schedule": "interleaved-1f1b", "chunks": 2}),
             ("v-half", 4, False, {"schedule": "v-half"}), ("dualpipev", 4, False, {"schedule": "dualpipev"}),
             ("recompute", 4, False, {"schedule": "zb-v", "recompute": True}),
             ("offload", 4, False, {"schedule": "v-half", "offload": "full"}),
             ("cheap", 4, False, {"schedule": "zb-v", "recompute": "cheap", "offload": "full"}),
             ("meta", 4, True, {"schedule": "interleaved-1f1b", "chunks": 2}),
             ("zb-v", 4, False, {"schedule": "zb-v", "watch": True})]
    results = spawn(2, _parity_worker, cases, 1, str(tmp_path / "trace.json"), timeout=150)
    notes = results[0].pop("note")
    results[1].pop("note")
    assert [result.pop("checkpoint") for result in results] == [0.0, 0.0]
    _check(results)
    for rank, result in enumerate(results):
        # every stage's first W: the Linear's weight gradient None after B (a LayerNorm's already
        # there), set after W
        assert set(result["zb-v"][3]) == {rank, 3 - rank}
        assert all(seen == (True, True, True) for seen in result["zb-v"][3].values()), result["zb-v"][3]
    assert notes == {f"stage {s}": ["Embedding"] * (s == 0) + ["LayerNorm", "MultiheadAttention",
                                                               "NonDynamicallyQuantizableLinear"] for s in range(4)}
    print({label: [f"{e:.1e}" for e in errs[:3]] for label, errs in results[0].items()})


@pytest.mark.timeout(120)
def test_two_bw_gives_its_delayed_update():
    for loss_err, weight_err in spawn(2, _two_bw_worker, timeout=90):
        assert loss_err < 1e-5 and weight_err < 1e-5, (loss_err, weight_err)


def _kfac_worker(rank, steps=4, every=2, lr=0.05, damping=0.1):
    """K-FAC on your own stages against K-FAC on one process with the same refresh (factors from steps
    0, 2, ..., inverses from each refresh's last step): the losses and the final weights' largest
    relative error. Neither manages nn.MultiheadAttention's out_proj (read, never called)."""
    import pipeloom
    from pipeloom.nn.stages import Stages
    from pipeloom.optim.kfac import KFAC

    tokens, targets = batch()
    torch.manual_seed(0)
    model = Stages(build(2))
    unused = [n for n, m in model.named_modules() if n.endswith("self_attn.out_proj")]
    opt = KFAC(model, torch.optim.SGD(model.parameters(), lr=lr), damping=damping, update_every=every,
               invert_every=every, delay=every - 1, exclude=unused)
    ref_losses = []
    for _ in range(steps):
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline.from_stages(build(2), lm_loss, "1f1b", pp=2, microbatches=4, timeout=60,
                                         optimizer="kfac", kfac={"every": every, "damping": damping})
    sgd = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(tokens, targets))
        pipe.optimizer_step(sgd)
    expected = {name: p.detach() for name, p in model.named_parameters()}
    return max(abs(a - b) / b for a, b in zip(losses, ref_losses)), max_rel_error(pipe.gather_weights(), expected), \
        losses


@pytest.mark.timeout(120)
def test_kfac_on_your_own_stages_matches_one_process():
    for loss_err, weight_err, losses in spawn(2, _kfac_worker, timeout=90):
        assert loss_err < 1e-5 and weight_err < 1e-4, (loss_err, weight_err)
        assert losses[-1] < losses[0]


@pytest.mark.timeout(180)
def test_data_parallel_matches_one_process(tmp_path):
    cases = [("1f1b", 2, False, {"schedule": "1f1b"}), ("zb-v", 4, True, {"schedule": "zb-v"})]
    results = spawn(4, _parity_worker, cases, 2, str(tmp_path / "trace.json"), timeout=150)
    for result in results:
        result.pop("note")
    _check(results)


def test_plain_linears_defer_their_weight_gradients_to_w():
    """One process: the stages run as the pipeline runs them, every plain nn.Linear's weight
    gradient queued by B and computed by W, equal to autograd's; the rest computed in B."""
    from pipeloom.nn import WeightGradStore, defer_weight_grads
    from pipeloom.nn.stages import Stages

    tokens, targets = batch()
    torch.manual_seed(0)
    model = Stages(build(3))
    lm_loss(model(tokens), targets).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    stages = model.build_stages(3, range(3))
    store = WeightGradStore()
    x = tokens
    for k in range(3):
        x = stages[k](x)
    with defer_weight_grads(store):
        lm_loss(x, targets).backward()
    # not nn.MultiheadAttention's out_proj: the attention reads its weight without calling it
    linears = [m for s in stages.values() for m in s.linears if type(m) is nn.Linear]
    assert len(store.work) == 7 and {id(m.weight) for m in linears} <= store.deferred
    assert all(m.weight.grad is None for m in linears) and model[0][0].weight.grad is not None
    store.run()
    assert max_rel_error({name: p.grad for name, p in model.named_parameters()}, expected) < 1e-6
    assert all("forward" not in m.__dict__ for m in linears)  # the swap is undone after each forward


def test_shapes_come_from_a_run_on_the_meta_device():
    from pipeloom.nn.stages import Stages

    model = Stages(build(3, meta=True))
    tokens = torch.zeros(4, 8, dtype=torch.long)
    assert [model.boundary_shape(k, tokens) for k in range(2)] == [(4, 8, WIDTH)] * 2
    with pytest.raises(PipeloomError, match=r"stage 0 \(Identity\) returns a torch.int64 tensor: a stage hands "
                                            r"on one floating-point tensor"):
        Stages([nn.Identity(), nn.Linear(4, 4)]).boundary_shape(0, tokens)
    with pytest.raises(PipeloomError, match=r"stage 0 \(Linear\) did not run on the meta device"):
        Stages([nn.Linear(3, 4), nn.Linear(4, 4)]).boundary_shape(0, torch.zeros(2, 5))


def test_meta_stages_materialise_as_one_process_would():
    """Each stage from its own seed: the same weights whichever stages a rank builds, in any order."""
    from pipeloom.nn.stages import Stages

    torch.manual_seed(0)
    every = Stages(build(3, meta=True))
    every.build_stages(3, range(3))
    torch.manual_seed(0)
    some = Stages(build(3, meta=True))
    some.build_stages(3, [2, 1])
    assert all(torch.equal(p, q) for p, q in zip(every[1].parameters(), some[1].parameters()))
    assert all(torch.equal(p, q) for p, q in zip(every[2].parameters(), some[2].parameters()))
    assert some[0][0].weight.is_meta
    attention = every[1].layer.self_attn
    assert not attention.out_proj.bias.any() and 0.05 < attention.in_proj_weight.std() < 0.3  # MHA's own init


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(4))

    def forward(self, x):
        return x * self.mask


@pytest.mark.parametrize("make,options,message", [
    (lambda: build(2), {"vocab_parallel": "vocab-1"}, "vocab_parallel='vocab-1' with your own stages: the vocab"),
    (lambda: build(2), {"sp": 2}, "sp=2 with your own stages: sequence parallelism needs"),
    (lambda: [], {}, "give a list of nn.Module, one per stage; got none"),
    (lambda: [nn.Linear(2, 2)] * 2, {}, r"stages share a parameter \(0.weight is 1.weight\)"),
])
def test_refused_in_one_line(make, options, message):
    import pipeloom

    with pytest.raises(PipeloomError, match=message):
        pipeloom.Pipeline.from_stages(make(), lm_loss, pp=2, microbatches=4, **options)


def test_cheap_recompute_rebuilds_torch_norms_and_activations():
    """Your own stage's torch.nn LayerNorm, GELU and SiLU outputs are rebuilt in the backward, not kept
    (a ReLU's, which keeps its output anyway, is left alone): the same gradients, bit for bit, and
    exactly those outputs fewer bytes kept."""
    from pipeloom.nn.recompute import mark_modules

    torch.manual_seed(0)
    block = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                          nn.SiLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    x = torch.randn(4, 16, WIDTH)  # every tensor above the size the offloader counts (SMALL)

    assert len(mark_modules(block)) == 3
    (kept, plain), (kept_cheap, rebuilt) = cheap_recompute_run(block, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, rebuilt))
    assert kept - kept_cheap == 4 * 4 * 16 * (WIDTH + 4 * WIDTH + WIDTH)  # the norm's, GELU's and SiLU's, fp32


def test_stages_that_do_not_fit_are_named():
    from pipeloom.nn.stages import Stages

    with pytest.raises(PipeloomError, match="3 stage modules for a schedule of 4 stages: give 4 modules"):
        Stages(build(3)).build_stages(4, [0])
    with torch.device("meta"):
        masked = Stages([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), _Masked())])
    with pytest.raises(PipeloomError, match=r"stage module 1.1 \(_Masked\) is on the meta device and has no "
                                            r"reset_parameters\(\): give its stage an init_weights\(\) method"):
        masked.build_stages(2, [1])
    half = nn.Linear(4, 4)
    half.bias = nn.Parameter(torch.empty(4, device="meta"))
    with pytest.raises(PipeloomError, match="stage 0 \\(Linear\\) holds both meta and materialised tensors"):
        Stages([half, nn.Linear(4, 4)]).build_stages(2, [0])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_example_trains():
    import os
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "custom_stages.py"
    proc = subprocess.run([sys.executable, str(example), "--steps", "4"], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 4 and losses[-1] < losses[0]
