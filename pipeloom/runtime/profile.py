"""Measure what the simulator's costs need on the machine at hand: ``pipeloom profile``.

:func:`measure` times the runtime's own modules, cut as a pipeline cuts them
(:meth:`~pipeloom.nn.decoder.Decoder.build_stages` of a one-layer GPT or
Llama into the embedding stage, one layer, and the final norm + LM head
stage), and runs each as the compute handlers do (:mod:`.handlers.compute`):
F under autocast (bf16) with the output cast to the weights' dtype, the last
stage's cross-entropy on its logits; B under
:func:`~pipeloom.nn.linear.defer_weight_grads` (W: the queued store), BW with
an eager store. On a GPU each op is timed with CUDA events after a
synchronize; on a CPU on ``threads`` threads (the runtime's workers run
one), with one thread by its CPU time (other processes' turns on the core
not counted), else with the host clock. Each time is the median over ``repeats`` after
``warmup`` runs; weight gradients accumulate across repeats, as over a step's
microbatches. On a GPU a layer's times are its pace inside a stage: the host
queues kernels ahead of the device there, so one call's latency after a
synchronize (the host's dispatch plus the device's tail, twice the pace of a
24-layer stage on an H100 at gpt-350m's size) is not what it costs. The layer
runs as a chain of :data:`CHAIN` applications and as one, and the difference
per added layer is kept.

Memory is counted, not assumed: the storages that autograd's saved tensors
(``saved_tensors_hooks``) use in F, each once, parameters excluded; under
:func:`~pipeloom.nn.recompute.cheap_recompute` a marked tensor counts as its
recipe's inputs, as the runtime keeps it; B-to-W memory is the storages the
store's queued work holds. A stage-to-stage transfer is timed as gloo
send/recv ping-pong between two local processes and fitted to
``latency + bytes / bandwidth``; on a single GPU it cannot be (NCCL pairs no
two ranks on one device): it is left null with the reason, and pinned
host<->device copies are timed instead (the offload link). Bytes of model
state per parameter come from one AdamW step on a layer, as ``pipeloom train``
keeps it, and the optimizer step's time per parameter from clipping and
AdamW steps on the profiled layer's parameters. K-FAC's pieces (curvature,
inversion, preconditioning) are timed on the profiled layer's linear layers
with :class:`~pipeloom.optim.kfac.KFAC` itself (:func:`kfac_ms`), in TF32 where a
pipeline's would be (bf16 on CUDA).

The result is the JSON object of :mod:`pipeloom.sim.profile`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import platform
import statistics
import time
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import PipeloomError
from ..nn.decoder import Decoder
from ..nn.gpt import Block, GPTConfig
from ..nn.models import model_spec
from ..nn.linear import WeightGradStore, defer_weight_grads
from ..nn.recompute import cheap_recompute, recipe
from ..sim.profile import CAST_BYTES, FORMAT, model_fields
from .device import free_memory

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
#: Transfer sizes timed besides the activations' (at most the largest of these): small ones pin the
#: latency, large ones the bandwidth.
LINK_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20)
_GiB = 2**30
#: Layer applications in the chained run whose difference from one gives a layer's pace on a GPU.
CHAIN = 5


def measure(config, seq: int, microbatch_sizes=(1,), *, device: str = "cpu",
            precision: str | None = None, repeats: int = 10, warmup: int = 2, threads: int = 1,
            transfer: bool = True, name: str = "custom", progress=None) -> dict:
    """Profile the layer, embedding and output layer of ``config`` (a GPT's or a Llama's) at
    sequences of ``seq`` tokens and each of ``microbatch_sizes`` on ``device`` ("cpu", or "cuda": the current GPU) in ``precision``
    ("fp32", or "bf16" autocast; default fp32 on a CPU, bf16 on a GPU); ``transfer`` False skips the
    stage-to-stage transfer (then null); ``progress(text)``, if given, hears what is measured next.
    Returns the profile's JSON object (:mod:`pipeloom.sim.profile`)."""
    say = progress or (lambda text: None)
    where = _device(device)
    precision = precision or ("bf16" if where.type == "cuda" else "fp32")
    if precision not in PRECISIONS:
        raise PipeloomError(f"precision {precision!r}: choose {' or '.join(PRECISIONS)}")
    sizes = _sizes(microbatch_sizes)
    for label, value, low in (("seq", seq, 1), ("repeats", repeats, 1), ("warmup", warmup, 0), ("threads", threads, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise PipeloomError(f"{label} must be an integer >= {low}, got {value!r}")
    layers, config = config.n_layer, dataclasses.replace(config, n_layer=1, block_size=max(config.block_size, seq))
    _check_fits(config, seq, max(sizes), where, name)
    kept_threads = torch.get_num_threads()
    if where.type == "cpu":
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        stages = config.build(device="meta").build_stages(3, range(3), [0, 1, 0], device=where)
        run = _Runner(stages, where, PRECISIONS[precision], repeats, warmup, config.vocab_size, config.n_embd)
        samples = {}
        for k, b in enumerate(sizes):
            say(f"microbatch size {b} ({k + 1} of {len(sizes)}): F, B and W of the embedding, a layer and the head")
            samples[str(b)] = run.sample(b, seq)
        say("the optimizer step and the state's bytes per parameter")
        state = bytes_per_param(where, PRECISIONS[precision])
        optimizer = optimizer_ns_per_param(run.layer, run.timer, repeats, warmup)
        say("K-FAC's curvature, inversion and preconditioning")
        kfac = kfac_ms(run, sizes, seq)
    finally:
        torch.set_num_threads(kept_threads)
    messages = [samples[str(b)]["message_bytes"] for b in sizes]
    if where.type == "cuda":
        link = {"bandwidth": None, "latency_ms": None,
                "reason": "one GPU: NCCL cannot pair two ranks on one device; the device preset's link is used"}
        host = host_bandwidth(where, max(messages))
    else:
        if transfer:
            say("the stage-to-stage transfer between two processes")
        link = measure_link(messages, repeats) if transfer else {
            "bandwidth": None, "latency_ms": None, "reason": "not measured (transfer=False)"}
        host = None
    return {
        "format": FORMAT,
        "machine": {"device": where.type, "name": _machine_name(where), "torch": torch.__version__,
                    "threads": threads if where.type == "cpu" else torch.get_num_threads(), "precision": precision},
        "model": model_fields(model_spec(dataclasses.replace(config, n_layer=layers), name)),
        "seq": seq,
        "repeats": repeats,
        "bytes_per_param": state,
        "cast_bytes_per_param": CAST_BYTES[precision],
        "optimizer_ns_per_param": optimizer,
        "kfac": kfac,
        "link": link,
        "host_bandwidth": host,
        "microbatch_sizes": samples,
    }


class _Runner:
    """Times and counts the three stages (embedding, one layer, output layer) the way the
    compute handlers run them."""

    def __init__(self, stages, device: torch.device, autocast, repeats: int, warmup: int, vocab: int, hidden: int):
        self.embedding, self.layer, self.head = stages[0], stages[1], stages[2]
        self.device, self.autocast, self.repeats, self.warmup, self.vocab = device, autocast, repeats, warmup, vocab
        self.hidden = hidden
        self.dtype = next(self.layer.parameters()).dtype  # hidden states travel in the weights' dtype
        self.timer = Timer(device)
        self.chain = CHAIN if device.type == "cuda" else 1

    def autocasting(self):
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def sample(self, b: int, seq: int) -> dict:
        """The JSON entry of microbatch size ``b``: times (ms), message and memory bytes."""
        tokens = torch.randint(self.vocab, (b, seq), device=self.device)
        x = torch.randn(b, seq, self.hidden, device=self.device, dtype=self.dtype)
        grad = torch.randn_like(x)
        times: dict[str, list[float]] = {}
        collecting = gc.isenabled()
        gc.disable()  # no collection inside a timed op
        try:
            for k in range(self.warmup + self.repeats):
                for key, ms in self._once(tokens, x, grad).items():
                    if k >= self.warmup:
                        times.setdefault(key, []).append(ms)
        finally:
            if collecting:
                gc.enable()
        median = {key: statistics.median(values) for key, values in times.items()}
        layer = {key: median[f"layer_{key}"] for key in ("f", "b", "w", "bw")}
        if min(layer.values()) <= 0:
            raise PipeloomError(f"profile: a layer's times at microbatch size {b} came out as {layer} ms: the noise "
                                "is larger than the layer; raise --repeats")
        return {
            "layer": layer,
            "embedding": {key: median[f"embedding_{key}"] for key in ("f", "b")},
            "head": {key: median[f"head_{key}"] for key in ("f", "b", "w")},
            "message_bytes": x.numel() * x.element_size(),
            "memory": self._memory(tokens, x, grad),
        }

    def _once(self, tokens, x, grad) -> dict[str, float]:
        """One run of each op; its times (ms) by name."""
        timed, out, ms = self.timer, {}, {}
        ms["embedding_f"] = timed(lambda: out.update(e=self._forward(self.embedding, tokens)))
        ms["embedding_b"] = timed(lambda: torch.autograd.backward(out.pop("e"), grad))
        layer = self._layer(x, grad, 1)
        if self.chain > 1:
            longer = self._layer(x, grad, self.chain)
            layer = {key: (longer[key] - once) / (self.chain - 1) for key, once in layer.items()}
        ms.update(layer)
        ms.update(self._split(lambda: self._loss(self._leaf(x), tokens), None, "head"))
        return ms

    def _layer(self, x, grad, n: int) -> dict[str, float]:
        """F, B, W and BW of ``n`` layers in a row (ms)."""
        times = self._split(lambda: self._forward(self.layer, self._leaf(x), n), grad, "layer")
        times["layer_bw"] = self._fused(lambda: self._forward(self.layer, self._leaf(x), n), grad)
        return times

    def _split(self, forward, grad, name: str) -> dict[str, float]:
        """F, then B (weight gradients queued), then W (the queue) of one stage."""
        out, store = {}, WeightGradStore()
        f = self.timer(lambda: out.update(y=forward()))

        def backward():
            with defer_weight_grads(store):
                torch.autograd.backward(out.pop("y"), grad)
        b = self.timer(backward)
        if not store.work:
            raise PipeloomError(f"profile: B of the {name} deferred no weight gradient: the B/W split failed")
        return {f"{name}_f": f, f"{name}_b": b, f"{name}_w": self.timer(store.run)}

    def _fused(self, forward, grad) -> float:
        """BW of one stage: its backward with the weight gradients done at once (an eager store)."""
        y = forward()

        def backward():
            with defer_weight_grads(WeightGradStore(eager=True)):
                torch.autograd.backward(y, grad)
        return self.timer(backward)

    @staticmethod
    def _leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_()

    def _forward(self, stage, x, n: int = 1):
        """``stage`` applied ``n`` times in a row, as a stage runs its layers."""
        with self.autocasting():
            for _ in range(n):
                x = stage(x)
        return x.to(self.dtype)

    def _loss(self, x, tokens, recompute: bool = False):
        """The last stage's F and the mean cross-entropy on its logits (fp32 without autocast); with
        ``recompute`` both under ``torch.utils.checkpoint``, which keeps what the runtime's recomputing
        stage keeps: its input."""
        def head_and_loss(x):
            y = self.head(x)
            return Decoder.loss(y if self.autocast else y.float(), tokens)

        with self.autocasting():
            return checkpoint(head_and_loss, x, use_reentrant=False) if recompute else head_and_loss(x)

    def _memory(self, tokens, x, grad) -> dict:
        """Bytes kept from F to the backward and from B to W, of the layer and the output layer."""
        layer = {}
        for mode in ("none", "cheap"):
            layer[mode], y = saved_bytes(lambda: self._forward(self.layer, self._leaf(x)), cheap=mode == "cheap")
            del y
        layer["full"], y = saved_bytes(lambda: self._forward(partial(checkpoint, self.layer, use_reentrant=False),
                                                             self._leaf(x)))
        del y
        layer["w"] = _queued_bytes(lambda: self._forward(self.layer, self._leaf(x)), grad)
        head = {}
        for key, recompute in (("b", False), ("full", True)):
            head[key], loss = saved_bytes(lambda: self._loss(self._leaf(x), tokens, recompute))
            del loss
        head["w"] = _queued_bytes(lambda: self._loss(self._leaf(x), tokens), None)
        return {"layer": layer, "head": head}


class Timer:
    """Milliseconds a call takes: CUDA events after a synchronize on a GPU; on a CPU with one
    thread the calling thread's CPU time (what the op costs on an idle core: time the thread
    waits while other processes run is not counted), else the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter

    def __call__(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        began = self.clock()
        fn()
        return 1e3 * (self.clock() - began)


def _is_param(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (parameters left out)."""
    storages = {}
    for t in tensors:
        if not _is_param(t):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def saved_bytes(forward, cheap: bool = False) -> tuple[int, object]:
    """(bytes of the storages autograd saves while ``forward()`` runs, each once, parameters left
    out; its result, which holds them). With ``cheap``, under :func:`cheap_recompute`: a tensor
    the model marked rebuildable counts as its recipe's inputs, as the runtime keeps it."""
    saved = []

    def pack(tensor):
        found = recipe(tensor) if cheap else None
        if found is None:
            saved.append(tensor)
        else:
            for inp in found[1]:
                pack(inp)
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            cheap_recompute() if cheap else nullcontext():
        out = forward()
    return _storage_bytes(saved), out


def _queued_bytes(forward, grad) -> int:
    """Bytes the weight-gradient work that B queues holds until W (inputs and output gradients
    of the linear layers, :meth:`~pipeloom.nn.linear.WeightGradStore.held`); the queue is then run."""
    y, store = forward(), WeightGradStore()
    with defer_weight_grads(store):
        torch.autograd.backward(y, grad)
    del y
    held = _storage_bytes(store.held())
    store.run()
    return held


def bytes_per_param(device: torch.device, autocast) -> float:
    """Bytes of model state per parameter after one AdamW step on a small layer, as ``pipeloom
    train`` keeps it: weights, gradients and the optimizer's per-element state."""
    torch.manual_seed(0)
    block = Block(GPTConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=8, block_size=16)).to(device)
    optimizer = torch.optim.AdamW(block.parameters())
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        y = block(torch.randn(2, 16, 64, device=device))
    y.float().square().mean().backward()
    optimizer.step()
    params = list(block.parameters())
    total = 0
    for p in params:
        state = [v for v in optimizer.state[p].values() if torch.is_tensor(v) and v.numel() == p.numel()]
        total += sum(t.numel() * t.element_size() for t in (p, p.grad, *state))
    return total / sum(p.numel() for p in params)


def optimizer_ns_per_param(module: nn.Module, timer: Timer, repeats: int, warmup: int) -> float:
    """Nanoseconds per parameter of the optimizer step ``pipeloom train`` takes (clipping by
    the gradient norm, then AdamW) over ``module``'s parameters, the median over ``repeats``."""
    params = list(module.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-9)

    def step():
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    times = [timer(step) for _ in range(warmup + repeats)][warmup:]
    for p in params:
        p.grad = None
    return 1e6 * statistics.median(times) / sum(p.numel() for p in params)


def kfac_ms(run: _Runner, sizes, seq: int) -> dict:
    """K-FAC's pieces (:mod:`pipeloom.optim.kfac`) on the profiled layer, summed over its linear
    layers, each timed on its own (ms, the median over the repeats): per microbatch size the
    curvature of one microbatch's inputs (``a``) and output gradients (``g``), then both factors'
    damped inverses (``inv``) and the preconditioning of the layer's gradients (``pre``); and
    ``shares``, each linear layer's share of ``a`` and ``g`` (at the largest size) and of ``inv``."""
    from ..optim.kfac import KFAC, tf32_for

    kfac = KFAC(run.layer, None, tf32=tf32_for(run.device, run.autocast))  # as the pipeline's
    names = list(kfac.layers)
    timed = run.timer
    curvature: dict[str, dict[str, float]] = {"a": {}, "g": {}}
    shares = {}
    for b in sizes:
        x = torch.randn(b, seq, run.hidden, device=run.device, dtype=run.dtype)
        grad = torch.randn_like(x)
        times: dict[str, list[list[float]]] = {"a": [], "g": []}  # per repeat, per linear layer
        for k in range(run.warmup + run.repeats):
            torch.autograd.backward(run._forward(run.layer, run._leaf(x)), grad)  # captures, untimed
            for key, factor in (("a", "A"), ("g", "G")):
                each = [timed(lambda: kfac.curvature(name, factor, 0)) for name in names]
                if k >= run.warmup:
                    times[key].append(each)
            for name in names:
                kfac.reduce(name, "A")
                kfac.reduce(name, "G")
        for key, runs in times.items():
            curvature[key][str(b)] = statistics.median(sum(each) for each in runs)
            shares[key] = _shares(runs)
    inverse = [[timed(lambda: kfac.invert(name)) for name in names] for _ in range(run.warmup + run.repeats)]
    kfac.publish()
    grads = [p.grad.clone() for p in run.layer.parameters()]
    precondition = []
    for _ in range(run.warmup + run.repeats):
        for p, g in zip(run.layer.parameters(), grads):
            p.grad.copy_(g)  # each run on the same gradients
        precondition.append(timed(kfac.precondition))
    for p in run.layer.parameters():
        p.grad = None
    return {**curvature, "inv": statistics.median(sum(each) for each in inverse[run.warmup:]),
            "pre": statistics.median(precondition[run.warmup:]), "units": len(names),
            "shares": {**shares, "inv": _shares(inverse[run.warmup:])}}


def _shares(runs: list[list[float]]) -> list[float]:
    """Each unit's share of the total: its median time over ``runs`` (per run, per unit) over their sum."""
    medians = [statistics.median(times) for times in zip(*runs)]
    total = sum(medians)
    return [m / total if total > 0 else 1 / len(medians) for m in medians]


def measure_link(message_bytes, repeats: int = 10, timeout: float = 120.0) -> dict:
    """A stage-to-stage transfer between two local gloo processes: ping-pong of ``message_bytes``
    and of :data:`LINK_SIZES`, half the round trip each, fitted to latency + bytes / bandwidth."""
    from .local import spawn

    sizes = sorted({*LINK_SIZES, *(min(int(n), max(LINK_SIZES)) for n in message_bytes)})
    times = spawn(2, _ping_pong, sizes, max(repeats, 5), timeout=timeout)[0]
    return fit_link(sizes, times)


def fit_link(sizes, seconds) -> dict:
    """``seconds = latency + bytes / bandwidth`` over (``sizes``, ``seconds``), least squares of
    the relative error (so small messages set the latency, large ones the bandwidth); through the
    origin if the latency comes out negative; null with a reason if the times do not grow with
    the size."""
    weights = [1 / y**2 for y in seconds]
    s = sum(weights)
    sx = sum(w * x for w, x in zip(weights, sizes))
    sy = sum(w * y for w, y in zip(weights, seconds))
    sxx = sum(w * x * x for w, x in zip(weights, sizes))
    sxy = sum(w * x * y for w, x, y in zip(weights, sizes, seconds))
    spread = s * sxx - sx * sx
    slope = (s * sxy - sx * sy) / spread if spread > 0 else 0.0
    latency = (sy - slope * sx) / s
    if latency < 0:
        latency, slope = 0.0, sxy / sxx
    if slope <= 0:
        return {"bandwidth": None, "latency_ms": None,
                "reason": f"transfer times did not grow with the size (bytes {list(sizes)}, seconds {list(seconds)})"}
    return {"bandwidth": 1 / slope, "latency_ms": 1e3 * latency, "reason": None}


def _ping_pong(rank: int, sizes, repeats: int) -> list[float]:
    """Median one-way seconds of each size: rank 0 sends, rank 1 sends it back (after a warm-up)."""
    buffers = [torch.zeros(max(size // 4, 1)) for size in sizes]

    def trip(buffer):
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    for buffer in buffers:
        trip(buffer)
    medians = []
    for buffer in buffers:
        samples = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            trip(buffer)
            samples.append((time.perf_counter() - began) / 2)
        medians.append(statistics.median(samples))
    return medians


def host_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s each way of pinned host<->device copies of at least 64 MiB while both directions copy at
    once, on two streams, as offload's two copy streams do (an H100 moves 55 GB/s one way alone, 46 each
    way together): the best of ``repeats``."""
    n = max(int(nbytes), 64 * 2**20) // 4
    host = [torch.empty(n, dtype=torch.float32, pin_memory=True) for _ in range(2)]
    on_device = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(2)]
    streams = [torch.cuda.Stream(device) for _ in range(2)]
    best = math.inf
    for _ in range(repeats + 1):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            on_device[0].copy_(host[0], non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host[1].copy_(on_device[1], non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 4 * n / best


def _device(device) -> torch.device:
    where = torch.device(device)
    if where.type not in ("cpu", "cuda"):
        raise PipeloomError(f"device {device!r}: profile on cpu or cuda")
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise PipeloomError("device cuda: no CUDA device here; profile on cpu")
        where = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
    return where


def _sizes(microbatch_sizes) -> list[int]:
    sizes = list(microbatch_sizes)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise PipeloomError(f"microbatch sizes {sizes}: give one or more positive integers")
    if len(set(sizes)) != len(sizes):
        raise PipeloomError(f"microbatch sizes {sizes}: each size once")
    return sorted(sizes)


def _check_fits(config, seq: int, b: int, device: torch.device, name: str) -> None:
    """Refuse, in one line, a profile whose largest microbatch would not fit this device's free memory
    (a rough bound: fp32 weights and gradients of a layer and both ends, a layer's activations,
    and the logits three times over)."""
    h, v = config.n_embd, config.vocab_size
    params = 12 * h * h + 13 * h + 2 * (v + seq) * h
    need = 8 * params + 4 * b * seq * (40 * h + 3 * v) * 2
    free = free_memory(device)
    if free is not None and need > 0.9 * free:
        raise PipeloomError(f"profiling {name} (hidden {h}, vocab {v}) at seq {seq}, microbatch size {b} needs about "
                            f"{need / _GiB:.1f} GiB; {device.type} has {free / _GiB:.1f} GiB free: use smaller "
                            f"microbatch sizes or a shorter sequence")


def _machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
