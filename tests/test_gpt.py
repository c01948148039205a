"""The GPT reference model, its split into stages, and the deferred weight gradients."""

import threading

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import PRESETS, GPT, GPTConfig, Linear, WeightGradStore, defer_weight_grads, preset_config  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.sim import MODELS, ModelSpec, stage_parameters  # noqa: E402


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", **overrides))


def batch(config, b=3, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (b, t + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def grads(named_params):
    return {name: p.grad.clone() for name, p in named_params if p.grad is not None}


def unsplit_step(model, tokens, targets):
    model.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), grads(model.named_parameters())


def pipeline_step(stages, tokens, targets):
    """Run the stages as a pipeline would: detach at every boundary, then
    backward stage by stage with the received output gradient. Gradients by
    unsplit name, summed where two stage parameters map to the same name."""
    for stage in stages:
        stage.zero_grad()
    inputs, outputs, x = [], [], tokens
    for stage in stages:
        x = x.detach().requires_grad_(x.is_floating_point())
        inputs.append(x)
        x = stage(x)
        outputs.append(x)
    logits = x
    loss = GPT.loss(logits, targets)
    loss.backward()
    for k in reversed(range(len(stages) - 1)):
        outputs[k].backward(inputs[k + 1].grad)
    summed = {}
    for stage in stages:
        for local, p in stage.named_parameters():
            name = stage.param_names[local]
            summed[name] = summed[name] + p.grad if name in summed else p.grad.clone()
    return logits.detach(), loss.detach(), summed


def assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)


def test_loss_is_cross_entropy_of_logits():
    model = tiny()
    tokens, targets = batch(model.config)
    logits = model(tokens)
    assert logits.shape == (3, 16, 256)
    expected = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    torch.testing.assert_close(model(tokens, targets), expected)


def test_same_seed_same_weights_and_causal():
    a, b = tiny(seed=5), tiny(seed=5)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    tokens, _ = batch(a.config)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    torch.testing.assert_close(a(tokens)[:, :10], a(changed)[:, :10])


def test_every_linear_layer_is_pipeloom_linear():
    model = tiny()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears)
    assert len(linears) == 4 * model.config.n_layer + 1


@pytest.mark.parametrize(
    "n_stages, layers_per_stage",
    [(1, None), (2, None), (3, None), (4, None), (2, [1, 3]), (3, [0, 3, 1]), (4, [2, 0, 1, 1]), (3, [1, 1, 2])],
)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_split_matches_unsplit(n_stages, layers_per_stage, tied, preset):
    torch.manual_seed(0)
    model = preset_config(preset, tie_embeddings=tied).build()
    tokens, targets = batch(model.config)
    want_loss, want_grads = unsplit_step(model, tokens, targets)
    want_logits = model(tokens).detach()
    stages = model.split(n_stages, layers_per_stage)
    logits, loss, got_grads = pipeline_step(stages, tokens, targets)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(loss, want_loss)
    assert_same_grads(got_grads, want_grads)


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_split_leaves_out_the_embedding_and_head(tied):
    model = tiny(tie_embeddings=tied)
    tokens, _ = batch(model.config)
    stages = model.split(3, vocab_parallel=True)
    names = {n for stage in stages for n, _ in stage.named_parameters()}
    assert "wte.weight" not in names and "lm_head.weight" not in names and "wpe.weight" in names
    assert all(stage.tied == {} for stage in stages)
    x = F.embedding(tokens, model.wte.weight)
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(F.linear(x, model.lm_head.weight), model(tokens))


def test_stages_share_the_unsplit_parameters():
    model = tiny()
    by_name = dict(model.named_parameters())
    stages = model.split(3, [1, 2, 1])
    assert [list(s.layers) for s in stages] == [[0], [1, 2], [3]]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False), (False, True)]
    seen = []
    for stage in stages:
        assert stage.tied == {}
        for local, p in stage.named_parameters():
            assert local == stage.param_names[local]
            assert p is by_name[local]
            seen.append(local)
    assert sorted(seen) == sorted(by_name)


def test_tied_split_metadata():
    model = tiny(tie_embeddings=True)
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    (only,) = model.split(1)
    assert only.tied == {} and only.lm_head.weight is model.wte.weight
    first, middle, last = model.split(3)
    assert first.tied == {"wte.weight": "wte.weight"} and middle.tied == {}
    assert last.tied == {"lm_head.weight": "wte.weight"}
    assert last.param_names["lm_head.weight"] == "wte.weight"
    assert last.lm_head.weight is not model.wte.weight
    assert torch.equal(last.lm_head.weight, model.wte.weight)


def test_default_split_is_the_simulators():
    model = tiny(n_layer=10)
    assert [len(s.layers) for s in model.split(4)] == [2, 3, 3, 2]
    for tied in (False, True):
        model = tiny(n_layer=6, tie_embeddings=tied)
        c = model.config
        counts = [sum(p.numel() for p in s.parameters()) for s in model.split(3)]
        spec = ModelSpec("t", c.n_layer, c.n_embd, c.n_head, c.vocab_size, tied_embeddings=tied)
        assert counts == stage_parameters(spec, 3, c.block_size)


@pytest.mark.parametrize("tied", [False, True])
def test_deferred_weight_grads_match_plain_backward(tied):
    model = tiny(tie_embeddings=tied)
    tokens, targets = batch(model.config)
    _, want = unsplit_step(model, tokens, targets)
    model.zero_grad()
    store = WeightGradStore()
    with defer_weight_grads(store):
        model(tokens, targets).backward()
    assert store.work
    assert model.blocks[0].attn.qkv.weight.grad is None
    store.run()
    assert not store.work
    assert_same_grads(grads(model.named_parameters()), want)


def test_deferred_weight_grads_keep_no_history():
    """W runs outside the backward, where autograd would record the GEMM on the kept inputs
    (which require grad): each gradient would then hold the microbatch's output gradients."""
    model = tiny()
    tokens, targets = batch(model.config)
    for _ in range(2):  # the second microbatch adds into the gradient (addmm_)
        store = WeightGradStore()
        with defer_weight_grads(store):
            model(tokens, targets).backward()
        store.run()
    for name, p in model.named_parameters():
        assert p.grad.grad_fn is None and not p.grad.requires_grad, name


@pytest.mark.parametrize("eager", [False, True])
def test_deferral_follows_the_backward_not_the_thread(eager):
    """On CUDA autograd runs a backward's nodes on its own device thread, not on the
    thread that opened the deferral: here the backward runs on a worker thread."""
    model = tiny()
    tokens, targets = batch(model.config)
    _, want = unsplit_step(model, tokens, targets)
    model.zero_grad()
    loss = model(tokens, targets)
    store = WeightGradStore(eager=eager)
    with defer_weight_grads(store):
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    weight = model.blocks[0].attn.qkv.weight
    if eager:
        assert not store.work and weight.grad is not None
    else:
        assert len(store.work) == sum(isinstance(m, Linear) for m in model.modules())
        assert weight.grad is None  # deferred until W
        store.run()
    assert_same_grads(grads(model.named_parameters()), want)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_match_the_simulators_parameter_count(name):
    config = GPTConfig.preset(name, **({} if PRESETS[name]["block_size"] else {"block_size": 2048}))
    with torch.device("meta"):
        model = GPT(config)
    spec = MODELS[name]
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab) == (
        config.n_layer, config.n_embd, config.n_head, config.vocab_size)
    assert config.tie_embeddings == spec.tied_embeddings
    assert sum(p.numel() for p in model.parameters()) == spec.parameters(config.block_size)


def test_preset_overrides():
    config = GPTConfig.preset("gpt-125m", n_layer=2, dropout=0.1)
    assert (config.n_layer, config.n_embd, config.dropout) == (2, 768, 0.1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: GPTConfig.preset("gpt-7b"), r"unknown GPT preset 'gpt-7b'; presets: 1.5b, .*tiny, gpt-125m"),
        (lambda: GPTConfig.preset("tiny", n_layers=2), r"unknown GPTConfig field\(s\) n_layers"),
        (lambda: GPTConfig.preset("tiny", n_embd=30), r"n_embd 30 is not divisible by n_head 4"),
        (lambda: GPTConfig.preset("tiny", n_layer=0), r"n_layer must be a positive integer, got 0"),
        (lambda: GPTConfig.preset("tiny", dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (lambda: tiny().split(0), r"n_stages must be a positive integer, got 0"),
        (lambda: tiny().split(5), r"4 layers cannot fill 5 stages"),
        (lambda: tiny().split(2, [1, 2]), r"layers_per_stage \[1, 2\]: need 2 non-negative .* summing to n_layer 4"),
        (lambda: tiny().split(2, [5, -1]), r"layers_per_stage \[5, -1\]"),
        (lambda: tiny().split(3, [2, 2]), r"layers_per_stage \[2, 2\]: need 3"),
        (lambda: tiny()(torch.zeros(2, 257, dtype=torch.long)), r"257 tokens exceeds block_size 256"),
        (lambda: tiny().split(2)[0](torch.zeros(2, 257, dtype=torch.long)), r"257 tokens exceeds block_size 256"),
        (lambda: tiny()(torch.zeros(65, dtype=torch.long)), r"shape \[batch, time\], got \[65\]"),
    ],
)
def test_bad_inputs(call, match):
    with pytest.raises(PipeloomError, match=match):
        call()


def _torch_pipelining_worker(rank, world, n_micro):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    model = tiny(tie_embeddings=True)
    stage = model.split(world)[rank]
    tokens, targets = batch(model.config, b=4)
    pipe = PipelineStage(stage, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(pipe, n_micro, loss_fn=GPT.loss)
    losses = []
    if rank == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=targets, losses=losses)
    tied = [stage.get_parameter(local).grad for local in stage.tied]
    for grad in tied:  # the embedding group: first and last stage
        dist.all_reduce(grad)
    return {"grads": {stage.param_names[n]: p.grad for n, p in stage.named_parameters()}, "losses": losses}


@pytest.mark.timeout(120)
def test_stages_run_under_torch_distributed_pipelining():
    world, n_micro = 2, 2
    results = spawn(world, _torch_pipelining_worker, world, n_micro, timeout=90)
    model = tiny(tie_embeddings=True)
    tokens, targets = batch(model.config, b=4)
    want_loss, want_grads = unsplit_step(model, tokens, targets)
    torch.testing.assert_close(torch.stack(results[-1]["losses"]).mean(), want_loss)
    got = {}
    for result in results:
        for name, grad in result["grads"].items():
            if name in got:  # the tied copies: both hold the summed gradient
                torch.testing.assert_close(grad, got[name])
            got[name] = grad
    assert_same_grads(got, want_grads)
