"""PipeDream-2BW's weight versions on one process: the delayed update, in V buffers of weights."""

import torch
from torch import nn

from pipeloom.runtime.versions import WeightVersions


def _storages(module: nn.Module, versions: WeightVersions) -> set[int]:
    """The distinct storages of the module's weights and of every version's."""
    tensors = [*module.parameters(), *(t for weights in versions.weights.values() for t in weights.values())]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _backward(versions: WeightVersions, t: int, x: torch.Tensor) -> torch.Tensor:
    """Run step ``t``'s forward on ``x``; the function that runs its backward."""
    loss = versions.module(0, t)(x).square().sum()
    return loss.backward


def test_the_update_is_delayed_and_a_stage_keeps_two_buffers_of_weights():
    torch.manual_seed(0)
    layer, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(layer.state_dict())
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    versions = WeightVersions({0: layer}, 2)
    assert len(_storages(layer, versions)) == 2 * 2  # two parameters, two buffers each
    xs = [torch.randn(5, 4) for _ in range(4)]

    w = [dict(reference.named_parameters())]  # W(0) = W(1); W(t+1) = W(t) - lr * grad f(W(t-1))
    grads = []
    for t, x in enumerate(xs):
        weights = {n: p.detach().clone().requires_grad_() for n, p in w[max(t - 1, 0)].items()}
        torch.func.functional_call(reference, weights, (x,)).square().sum().backward()
        grads.append({n: p.grad for n, p in weights.items()})
        if t >= 1:
            w.append({n: p - 0.1 * grads[t - 1][n] for n, p in w[-1].items()})

    backward = _backward(versions, 0, xs[0])
    pending = _backward(versions, 1, xs[1])  # step 1's forward runs before step 0's update
    backward()
    versions.update(0, 0, optimizer, lambda g: None)
    for t in range(1, 3):
        pending()  # autograd still finds step t's weights as its forward saw them
        pending = _backward(versions, t + 1, xs[t + 1])
        versions.update(0, t, optimizer, lambda g: None)
        for name, p in layer.named_parameters():
            assert torch.allclose(p, w[t + 1][name], atol=1e-6), (t, name)
            assert versions.weights[0, t + 2][name].data_ptr() == p.data_ptr()  # the newest: the module's
        assert len(_storages(layer, versions)) == 2 * 2
    pending()
    assert all(versions.weights[0, 3][n].grad is not None for n, _ in layer.named_parameters())
