"""K-FAC (pipeloom.optim.kfac) against factors, inverses and updates built by hand with plain torch."""

import io
import math

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import GPT, GPTConfig, Linear, WeightGradStore, defer_weight_grads  # noqa: E402
from pipeloom.optim import KFAC  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402


class Net(nn.Module):
    """Two linear layers, the first with a bias, the second without."""

    def __init__(self, linear=nn.Linear, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = linear(5, 7), linear(7, 3, bias=False)
        self.double()

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def loss_fn(out, y):
    """Squared error summed over features, mean over the batch × time rows."""
    return ((out - y) ** 2).sum(-1).mean()


def data(seed, b=4, t=6):
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(b, t, d, generator=g, dtype=torch.float64) for d in (5, 3))
    return x, y


def reference(net, x, y):
    """Factors A, G and gradients [∇W | ∇b] of ``net`` on (x, y), by hand: the
    layers' inputs by explicit matmuls, their output gradients by
    torch.autograd.grad, times the N rows of the mean (per-example gradients)."""
    w1, b1, w2 = net.fc1.weight, net.fc1.bias, net.fc2.weight
    a1 = x.reshape(-1, 5)
    z1 = a1 @ w1.T + b1
    a2 = torch.tanh(z1)
    z2 = a2 @ w2.T
    n = a1.shape[0]
    loss = ((z2 - y.reshape(-1, 3)) ** 2).sum(-1).mean()
    g1, g2, gw1, gb1, gw2 = torch.autograd.grad(loss, [z1, z2, w1, b1, w2])
    a1 = torch.cat([a1, torch.ones(n, 1, dtype=a1.dtype)], 1)
    a2, g1, g2 = a2.detach(), g1 * n, g2 * n
    factors = {"fc1": (a1.T @ a1 / n, g1.T @ g1 / n), "fc2": (a2.T @ a2 / n, g2.T @ g2 / n)}
    grads = {"fc1": torch.cat([gw1, gb1[:, None]], 1), "fc2": gw2}
    return factors, grads


def damped_inverses(a, g, damping):
    pi = math.sqrt((a.trace() / a.shape[0]) / (g.trace() / g.shape[0]))
    eye = lambda m: torch.eye(m.shape[0], dtype=m.dtype)  # noqa: E731
    return (torch.linalg.inv(a + math.sqrt(damping) * pi * eye(a)),
            torch.linalg.inv(g + math.sqrt(damping) / pi * eye(g)))


def kron_precondition(a, g, grad, damping):
    """vec(G⁻¹ ∇ A⁻¹) = (A⁻¹ ⊗ G⁻¹) vec(∇), column-major vec, A⁻¹ symmetric."""
    a_inv, g_inv = damped_inverses(a, g, damping)
    vec = torch.kron(a_inv, g_inv) @ grad.T.reshape(-1)
    return vec.reshape(grad.shape[1], grad.shape[0]).T


def train_step(net, opt, x, y):
    loss = loss_fn(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_factors_match_hand_built():
    net = Net()
    x, y = data(1)
    expected, _ = reference(net, x, y)
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.0))
    train_step(net, opt, x, y)
    assert list(opt.layers) == ["fc1", "fc2"]
    for name, (a, g) in expected.items():
        close(opt.layers[name].factors["A"], a)
        close(opt.layers[name].factors["G"], g)
    assert opt.layers["fc1"].factors["A"].shape == (6, 6)  # d_in + 1: the bias column


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook")
def test_factors_match_asdl():
    asdl = pytest.importorskip("asdl")
    net = Net()
    x, y = data(1)
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.0))
    train_step(net, opt, x, y)
    other = Net()
    maker = asdl.get_fisher_maker(other, asdl.FisherConfig(fisher_type=asdl.FISHER_EMP, fisher_shapes=["kron"],
                                                           data_size=x.shape[0] * x.shape[1]))
    maker.setup_model_call(other, x)
    maker.setup_loss_call(nn.functional.mse_loss, maker._dummy_logits, y)  # ASDL sums: reduction="sum"
    maker.forward_and_backward()
    for name in ("fc1", "fc2"):
        a = maker.get_fisher_tensor(getattr(other, name), "kron", "A")  # ASDL's A leaves out the bias column
        close(opt.layers[name].factors["A"][:a.shape[0], :a.shape[1]], a)
        close(opt.layers[name].factors["G"], maker.get_fisher_tensor(getattr(other, name), "kron", "B"))


def test_damped_inverses_split_damping_by_pi():
    net = Net()
    x, y = data(2)
    expected, _ = reference(net, x, y)
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.0), damping=0.05)
    train_step(net, opt, x, y)
    for name, (a, g) in expected.items():
        a_inv, g_inv = damped_inverses(a, g, 0.05)
        close(opt.layers[name].inverses["A"], a_inv)
        close(opt.layers[name].inverses["G"], g_inv)


def test_preconditioned_update_is_the_kronecker_solve():
    net = Net()
    x, y = data(3)
    expected, grads = reference(net, x, y)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=1.0), damping=0.01)
    train_step(net, opt, x, y)
    step1 = kron_precondition(*expected["fc1"], grads["fc1"], 0.01)
    close(before["fc1.weight"] - net.fc1.weight.detach(), step1[:, :5])
    close(before["fc1.bias"] - net.fc1.bias.detach(), step1[:, 5])
    close(before["fc2.weight"] - net.fc2.weight.detach(), kron_precondition(*expected["fc2"], grads["fc2"], 0.01))


@pytest.mark.parametrize("tf32", [False, True])
def test_tf32_covers_the_curvature_and_preconditioning_products_only(tf32):
    """``tf32`` puts torch's CUDA matmul setting at TF32 for the curvature's and the preconditioning's
    products, not the inversions', and puts it back after; without it the setting is left alone
    (on the CPU it changes no number: the update is the Kronecker solve either way)."""
    from torch.overrides import TorchFunctionMode

    matmul = torch.backends.cuda.matmul
    seen = []

    class Products(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func.__name__ in ("__matmul__", "matmul", "cholesky_inverse"):
                seen.append((func.__name__, matmul.fp32_precision))
            return func(*args, **(kwargs or {}))

    net = Net()
    x, y = data(3)
    expected, grads = reference(net, x, y)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=1.0), damping=0.01, tf32=tf32)
    was = matmul.fp32_precision
    loss_fn(net(x), y).backward()
    with Products():
        opt.step()
    assert matmul.fp32_precision == was
    products = [setting for name, setting in seen if name != "cholesky_inverse"]
    assert len(products) == 2 * 2 + 2 * 2  # each layer's two curvatures and its two preconditioning products
    assert set(products) == {"tf32" if tf32 else was}
    assert {setting for name, setting in seen if name == "cholesky_inverse"} == {was}
    step1 = kron_precondition(*expected["fc1"], grads["fc1"], 0.01)
    close(before["fc1.weight"] - net.fc1.weight.detach(), step1[:, :5])


def test_a_16_bit_run_on_cuda_takes_tf32():
    from pipeloom.optim.kfac import tf32_for

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert tf32_for(cuda, torch.bfloat16) and tf32_for(cuda, torch.float16)
    assert not tf32_for(cuda, None) and not tf32_for(cpu, torch.bfloat16) and not tf32_for(cpu, None)


def test_running_average_over_two_updates():
    net = Net()
    batches = [data(4), data(5)]
    refs = [reference(net, x, y)[0] for x, y in batches]
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.0), decay=0.7)
    for x, y in batches:
        train_step(net, opt, x, y)
    for name in ("fc1", "fc2"):
        for i, factor in enumerate("AG"):
            close(opt.layers[name].factors[factor], 0.7 * refs[0][name][i] + 0.3 * refs[1][name][i])


def test_factors_refresh_every_update_every_steps():
    net = Net()
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.01), update_every=2)
    train_step(net, opt, *data(6))
    factors = dict(opt.layers["fc1"].factors)
    assert not opt.capturing
    net(data(7)[0]).sum().backward()
    assert opt.layers["fc1"].captures == {"A": [], "G": []}  # nothing captured between refreshes
    opt.step()
    opt.zero_grad()
    assert all(opt.layers["fc1"].factors[f] is factors[f] for f in "AG")
    train_step(net, opt, *data(8))
    assert all(opt.layers["fc1"].factors[f] is not factors[f] for f in "AG")


def test_inverses_refresh_every_invert_every_steps():
    net = Net()
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.01), invert_every=2)
    train_step(net, opt, *data(6))
    inverses, factors = dict(opt.layers["fc2"].inverses), dict(opt.layers["fc2"].factors)
    train_step(net, opt, *data(7))
    assert all(opt.layers["fc2"].inverses[f] is inverses[f] and opt.layers["fc2"].factors[f] is not factors[f]
               for f in "AG")
    train_step(net, opt, *data(8))
    assert all(opt.layers["fc2"].inverses[f] is not inverses[f] for f in "AG")


@pytest.mark.parametrize("make_base", [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                       lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)],
                         ids=["sgd-momentum", "adamw"])
def test_base_optimizer_steps_on_preconditioned_gradients(make_base):
    """With decay 0 the factors are each step's own: the base optimizer, fed
    the hand-preconditioned gradients, must land on the same weights."""
    net, twin = Net(), Net()
    opt = KFAC(net, make_base(net.parameters()), damping=0.01, decay=0.0)
    base = make_base(twin.parameters())
    for seed in (9, 10, 11):
        x, y = data(seed)
        expected, grads = reference(twin, x, y)
        step = {name: kron_precondition(*expected[name], grads[name], 0.01) for name in expected}
        twin.fc1.weight.grad, twin.fc1.bias.grad = step["fc1"][:, :5].clone(), step["fc1"][:, 5].clone()
        twin.fc2.weight.grad = step["fc2"]
        base.step()
        base.zero_grad()
        train_step(net, opt, x, y)
    for p, q in zip(net.parameters(), twin.parameters()):
        close(p.detach(), q.detach())


def test_deferred_weight_grads_give_the_same_factors_and_update():
    plain, deferred = Net(), Net(linear=Linear)
    opt = KFAC(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    opt_deferred = KFAC(deferred, torch.optim.SGD(deferred.parameters(), lr=0.1, momentum=0.9))
    for seed in (12, 13):
        x, y = data(seed)
        train_step(plain, opt, x, y)
        store = WeightGradStore()
        with defer_weight_grads(store):
            loss_fn(deferred(x), y).backward()  # B
        assert deferred.fc1.weight.grad is None and len(opt_deferred.layers["fc1"].captures["G"]) == 1
        store.run()  # W
        opt_deferred.step()
        opt_deferred.zero_grad()
    for name in ("fc1", "fc2"):
        for f in "AG":
            close(opt_deferred.layers[name].factors[f], opt.layers[name].factors[f])
    for p, q in zip(plain.parameters(), deferred.parameters()):
        close(p.detach(), q.detach())


def test_kfac_trains_faster_than_sgd_at_the_same_lr():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g) * torch.tensor([3, 1, 0.3, 0.1, 2, 1, 0.5, 0.2])
    y = torch.tanh(x @ torch.randn(8, 2, generator=g))

    def losses(kfac):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        base = torch.optim.SGD(net.parameters(), lr=0.1)
        opt = KFAC(net, base, damping=0.01) if kfac else base
        return [train_step(net, opt, x, y) for _ in range(30)]

    sgd, kfac = losses(False), losses(True)
    assert kfac[-1] < kfac[0] / 10
    assert kfac[-1] < sgd[-1] / 2  # measured: 0.022 against 0.146


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_layers_tied_head_and_exclude(tied):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8, tie_embeddings=tied)
    model = GPT(config)
    opt = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), exclude=["blocks.0.mlp.fc"])
    expected = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.proj"] + ([] if tied else ["lm_head"])
    assert sorted(opt.layers) == sorted(expected)
    tokens = torch.randint(32, (2, 9))
    losses = []
    for _ in range(3):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def _dp_worker(rank):
    import torch.distributed as dist
    net = Net()
    x, y = data(14, b=4)
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.0), group=dist.group.WORLD)
    train_step(net, opt, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    return {name: {f: t.clone() for f, t in layer.factors.items()} for name, layer in opt.layers.items()}


def test_factors_reduced_over_data_parallel_replicas():
    """Two replicas, each with half the batch: the reduced factors are those of the whole batch."""
    net = Net()
    expected, _ = reference(net, *data(14, b=4))
    for factors in spawn(2, _dp_worker, timeout=90):
        for name, (a, g) in expected.items():
            close(factors[name]["A"], a)
            close(factors[name]["G"], g)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(damping=-1e-3), "damping -0.001"),
    (dict(decay=1.0), "decay 1.0"),
    (dict(decay=-0.5), "decay -0.5"),
    (dict(update_every=0), "update_every 0"),
    (dict(invert_every=1.5), "invert_every 1.5"),
    (dict(exclude=["fc3"]), "'fc3'"),
    (dict(exclude=["fc1", "fc2"]), "no linear layer"),
    (dict(grad_scale=0), "grad_scale 0"),
])
def test_bad_arguments(kwargs, needle):
    net = Net()
    with pytest.raises(PipeloomError, match=needle) as err:
        KFAC(net, torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)
    assert "\n" not in str(err.value)


def test_model_without_linear_layers_and_foreign_base_optimizer():
    conv = nn.Sequential(nn.Conv1d(2, 2, 3))
    with pytest.raises(PipeloomError, match="model Sequential has no linear layer"):
        KFAC(conv, torch.optim.SGD(conv.parameters(), lr=0.1))
    net = Net()
    with pytest.raises(PipeloomError, match="does not hold parameter fc1.weight"):
        KFAC(net, torch.optim.SGD(Net().parameters(), lr=0.1))


def test_pieces_refuse_out_of_order_calls():
    net = Net()
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = data(15)
    loss_fn(net(x), y).backward()
    with pytest.raises(PipeloomError, match=r"still holds captures \[0\] for A"):
        opt.reduce("fc1", "A")
    with pytest.raises(PipeloomError, match="no capture 1 for A"):
        opt.curvature("fc1", "A", 1)
    with pytest.raises(PipeloomError, match="factor 'B'"):
        opt.curvature("fc1", "B", 0)
    with pytest.raises(PipeloomError, match="'fc9' is not a managed layer"):
        opt.invert("fc9")
    with pytest.raises(PipeloomError, match="not both A and G"):
        opt.invert("fc1")
    opt.curvature("fc1", "A", 0)
    opt.reduce("fc1", "A")
    assert opt.layers["fc1"].captures["A"] == [] and "A" in opt.layers["fc1"].factors


def test_delayed_inverses_precondition_from_the_refresh_s_last_step():
    """PipeFisher's pattern: factors from step 0, their inverses in use from step k - 1 = 2 on."""
    net = Net()
    opt = KFAC(net, torch.optim.SGD(net.parameters(), lr=0.01), update_every=3, invert_every=3, delay=2)
    train_step(net, opt, *data(6))
    layer = opt.layers["fc2"]
    assert not layer.inverses and set(layer.pending) == {"A", "G"}  # computed at step 0, not used yet
    pending = dict(layer.pending)
    train_step(net, opt, *data(7))
    assert not layer.inverses and not opt.capturing  # step 1 neither captures nor preconditions
    train_step(net, opt, *data(8))
    assert all(layer.inverses[f] is pending[f] for f in "AG") and not layer.pending and opt.capturing
    with pytest.raises(PipeloomError, match="delay 3"):
        KFAC(net, torch.optim.SGD(net.parameters(), lr=0.01), invert_every=3, delay=3)


def test_state_dict_restores_factors_inverses_and_the_base_state():
    def make():
        net = Net()
        return net, KFAC(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), update_every=2, invert_every=2,
                         delay=1)
    net, opt = make()
    for seed in (6, 7, 8):
        train_step(net, opt, *data(seed))
    other_net, other = make()
    other_net.load_state_dict(net.state_dict())
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # as a checkpoint would: no tensor shared with the running optimizer
    saved.seek(0)
    other.load_state_dict(torch.load(saved))
    for seed in (9, 10):
        train_step(net, opt, *data(seed))
        train_step(other_net, other, *data(seed))
    for a, b in zip(net.parameters(), other_net.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fewer = Net()
    with pytest.raises(PipeloomError, match="layers"):
        KFAC(fewer, torch.optim.SGD(fewer.parameters(), lr=0.1), exclude=["fc1"]).load_state_dict(opt.state_dict())
