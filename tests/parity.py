"""Shared by the runtime tests: pipelines against the one-process model (a GPT, or any preset's) on the same batch."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Products(TorchDispatchMode):
    """Records the operand dtypes of every matrix product run under it."""

    NAMES = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "dot"}

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.NAMES:
            self.dtypes.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


#: Every synchronous schedule family (a flush per step), which must reproduce the one-process model.
SYNCHRONOUS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-min", "v-half", "v-zb", "zb-auto",
               "dualpipev"]


def make_batch(config, batch, seq, seed=1):
    """``batch`` random sequences of ``seq`` tokens and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference(config, tokens, targets):
    """The one-process model's loss and gradients (seed 0, as every pipeline in the tests)."""
    torch.manual_seed(0)
    model = config.build()
    loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def autocast_reference(config, tokens, targets, dtype=torch.bfloat16):
    """The one-process model's loss and gradients under CPU autocast to ``dtype`` (seed 0)."""
    torch.manual_seed(0)
    model = config.build()
    with torch.autocast("cpu", dtype=dtype):
        loss = model(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def step_failure(pipe, config):
    """Run a step expected to stop with a PeerTimeout: (its message, seconds until then),
    or ("no error", 0.0)."""
    import time

    from pipeloom.runtime import PeerTimeout

    start = time.monotonic()
    try:
        pipe.step(*make_batch(config, 8, 16))
    except PeerTimeout as err:
        return str(err), time.monotonic() - start
    return "no error", 0.0


def stall_until(path, limit=30.0):
    """Do nothing until ``path`` exists (``limit`` seconds at most): a rank that stalls until its peer
    has stopped (and left ``path``), not for a fixed time."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + limit
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def max_rel_error(grads, ref):
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    return max(((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n in ref)


def parity_worker(rank, cases, config_overrides, batch, seq, model_device=None, observe=None, preset="tiny"):
    """For each (label, Pipeline keyword arguments): the relative errors of one step's
    loss and of every gradient against :func:`reference`, the pipeline made from the model
    of ``preset`` (with ``config_overrides``) built on ``model_device`` (``"meta"``: each rank
    materialises its own stages); with ``observe`` (module-level), ``observe(pipe)`` after the
    step as a third item."""
    import pipeloom
    from pipeloom.nn import preset_config

    config = preset_config(preset, **config_overrides)
    tokens, targets = make_batch(config, batch, seq)
    ref_loss, ref_grads = reference(config, tokens, targets)
    out = {}
    for label, options in cases:
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(config.build(model_device), **options)
        loss = pipe.step(tokens, targets)
        out[label] = (abs(loss - ref_loss) / abs(ref_loss), max_rel_error(pipe.gather_grads(), ref_grads))
        if observe:
            out[label] += (observe(pipe),)
    return out


def check(results):
    """Every rank's every case: loss within 1e-5 and every gradient within 1e-4 (relative)."""
    for rank_result in results:
        for case, (loss_err, grad_err, *_) in rank_result.items():
            assert loss_err < 1e-5 and grad_err < 1e-4, (case, loss_err, grad_err)


def cheap_recompute_run(block, x):
    """``block`` run on ``x`` as a rank's F and backward through an offloader's hooks, without
    and with cheap recomputation: for each, (activation bytes the forward kept, the gradients
    of the parameters and of ``x``)."""
    from types import SimpleNamespace

    from pipeloom.runtime.handlers.offload import Offloader
    from pipeloom.schedule import F
    from pipeloom.schedule.ir import Action

    def run(cheap):
        context = SimpleNamespace(schedule=SimpleNamespace(ranks=[(Action(F, 0, 0),)], options={}), step=None,
                                  mesh=SimpleNamespace(pp_rank=0), device=torch.device("cpu"), extras={})
        offloader = Offloader(context, cheap)
        leaf = x.clone().requires_grad_()
        with offloader.forward(Action(F, 0, 0)):
            y = block(leaf)
        kept = offloader.stats.device
        y.square().sum().backward()
        grads = [p.grad.clone() for p in block.parameters()] + [leaf.grad]
        block.zero_grad()
        return kept, grads

    return run(False), run(True)
