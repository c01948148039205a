"""PipeOffload in the runtime: the OFFLOAD and RELOAD actions and what F saves; OFFLOAD_W and RELOAD_W.

While F of a (stage, microbatch) pair runs, ``saved_tensors_hooks`` (put
around F with :func:`~pipeloom.runtime.handlers.around`) capture the tensors
autograd saves for its backward. Parameters, their views and tensors of at
most :data:`SMALL` elements pass through. The saved tensors that share a
storage are offloaded as one range of it, the span of them all, and each comes
back as a view of that range (offset, size, stride): memory is copied once,
and views stay views.

OFFLOAD (:mod:`pipeloom.schedule.transforms.offload` places it after F)
copies the pair's ranges of each dtype into one host buffer (each range into
its slice, in one batched call: ``torch._foreach_copy_``) from a
:class:`HostPool` reused across steps and drops the device copies. The stage's input, a leaf the slot
keeps for its gradient, goes too: its ``data`` becomes a one-element
placeholder of its shape until RELOAD puts the reloaded view back (with
recomputation it is all a stage saves). The stage's output stays (the slot
holds it as the root of the backward). RELOAD copies each host buffer back
in one copy into one new device tensor, of which each range is a slice, and
the unpack hook (in B or BW) hands out each saved tensor again, a view rebuilt
with ``as_strided``. A pair's reloaded bytes are freed together, once its
backward has let go of them all. What a pair's copies cost the host grows with
its ranges (a GPT layer saves about nine storages), so a reload is one copy per
dtype.

On CUDA the host buffers are pinned and the copies run on two side streams,
offloads on one and reloads on the other (the host link carries both
directions at once), each in the schedule's order: an offload waits for an
event recorded after F, a reload for one recorded where the list reaches it
(after the compute before it: the simulator's copy starts no earlier, and the
placement counts on it); a device tensor dropped after its offload is kept
from reuse until the copy is done (``record_stream``); a reload's tensors are
allocated on its stream and marked used by the compute stream, which waits
for the reload's event before the backward reads them. A host buffer goes
back to the pool as its reload is issued, with the reload's event: the
offload that takes it next waits for that copy before writing into it.
A paced F (the schedule's ``waits``: Fs held back to the copy stream's pace in
a warm-up) waits on the host for the offload it names before it allocates.
On the CPU the same path copies synchronously into a separate pool, so tests
run it.

OFFLOAD_W (after B) moves what B queued for W in the same way: the tensors
the slot's :class:`~pipeloom.nn.linear.WeightGradStore` holds (each linear
layer's input and output gradient; parameters and small tensors stay) are
packed into a capture of their own (:meth:`~pipeloom.nn.linear.WeightGradStore.pack`),
copied to host on the offload stream and dropped; RELOAD_W copies them back
on the reload stream, and W's unpacking waits for that copy.

With ``Pipeline(recompute="cheap")`` the same hooks save the recipe of a
tensor the model marked rebuildable (:mod:`pipeloom.nn.recompute`: the
norms' and GELU's outputs) instead of the tensor, and unpacking reruns it.

:class:`OffloadStats` counts the bytes of captured activations on the device
(each storage until it is freed: a linear layer's input that B keeps for W
counts until W) and in host buffers, with peaks since the step began; a
pipeline made with ``offload`` counts them even with the policy "none"
(``Pipeline.offload_stats()``).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ...errors import PipeloomError
from ...nn.recompute import cheap_recompute, recipe
from ...schedule import OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, F
from ...schedule import Offload as Transform
from ...schedule.transforms.offload import paced
from ..parts import Part
from . import around, register

#: Saved tensors of at most this many elements stay on the device.
SMALL = 1024
#: The offloader's key in ``Context.extras``.
NAME = "offload"


@dataclass
class OffloadStats:
    """Bytes of one rank's captured activations: ``device`` and ``host`` now, their peaks since
    the step began, ``offloaded`` copied to host in the step; the pool's ``host_pool`` bytes and
    ``host_allocations`` (buffers allocated since the pipeline began)."""

    device: int = 0
    device_peak: int = 0
    host: int = 0
    host_peak: int = 0
    offloaded: int = 0
    host_pool: int = 0
    host_allocations: int = 0

    def new_step(self) -> None:
        self.device_peak, self.host_peak, self.offloaded = self.device, self.host, 0


class HostPool:
    """Host buffers by (dtype, elements), reused across steps; pinned for copies from a GPU. A buffer
    given back while a copy still reads it (a reload's, on the other stream) carries that copy's
    event: the stream that takes it next waits for it before writing."""

    def __init__(self, pinned: bool, stats: OffloadStats):
        self.pinned, self.stats = pinned, stats
        self.free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A buffer, safe to write from the current stream on."""
        stats, free = self.stats, self.free.get((dtype, numel))
        if free:
            buffer, read = free.pop()
            if read is not None:
                torch.cuda.current_stream().wait_event(read)
        else:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=self.pinned)
            stats.host_allocations += 1
            stats.host_pool += _nbytes(buffer)
        stats.host += _nbytes(buffer)
        stats.host_peak = max(stats.host_peak, stats.host)
        return buffer

    def give(self, buffer: torch.Tensor, read: torch.cuda.Event | None = None) -> None:
        """``buffer`` back, ``read`` the event of the last copy that reads it (None: nothing does)."""
        self.stats.host -= _nbytes(buffer)
        self.free.setdefault((buffer.dtype, buffer.numel()), []).append((buffer, read))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Range:
    """Elements ``start:end`` of a storage that a pair's saved tensors of one dtype use: ``tensor``
    on the device (None while offloaded; once reloaded, a slice of its block's device tensor),
    ``ready`` its reload's :class:`_Reloaded`."""

    __slots__ = ("start", "end", "tensor", "ready")

    def __init__(self, start: int, end: int, tensor: torch.Tensor):
        self.start, self.end, self.tensor = start, end, tensor
        self.ready = None


class _Reloaded:
    """A reload's CUDA event, shared by the ranges it copied, until the compute stream has waited for it:
    the first saved tensor unpacked waits, the others follow it on that stream (a wait per saved tensor,
    hundreds per pair, cost the backward more host time than the copy's issue)."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self, device: torch.device) -> None:
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)
            self.event = None


class _Block:
    """A pair's ranges of one dtype, copied together: ``host`` the one buffer they lie in while
    offloaded, one after another, ``sizes`` elements each, ``numel`` in all."""

    __slots__ = ("ranges", "sizes", "numel", "host")

    def __init__(self, ranges: list[_Range]):
        self.ranges, self.sizes, self.host = ranges, [where.end - where.start for where in ranges], None
        self.numel = sum(self.sizes)


def _blocks(ranges: list[_Range]) -> list[_Block]:
    """``ranges`` (on the device) as one block per dtype."""
    by_dtype: dict[torch.dtype, list[_Range]] = {}
    for where in ranges:
        by_dtype.setdefault(where.tensor.dtype, []).append(where)
    return [_Block(group) for group in by_dtype.values()]


class _Rebuilt:
    """A saved tensor kept as its recipe: ``rebuild`` run on the (packed) ``inputs`` when unpacked;
    ``hold`` counts the rebuilt tensor's storage."""

    __slots__ = ("rebuild", "inputs", "hold")

    def __init__(self, rebuild, inputs: tuple, hold):
        self.rebuild, self.inputs, self.hold = rebuild, inputs, hold

    def unpack(self) -> torch.Tensor:
        with torch.no_grad():
            tensor = self.rebuild(*(_unpack(saved) for saved in self.inputs))
        self.hold(tensor.untyped_storage())
        return tensor


class _Saved:
    """One saved tensor: itself until offloaded, then its place in its range."""

    __slots__ = ("tensor", "range", "offset", "size", "stride")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.range = tensor, None

    def place(self, where: _Range) -> None:
        """Let go of the tensor, keeping where it lies in ``where``."""
        tensor, self.range = self.tensor, where
        self.offset, self.size, self.stride = tensor.storage_offset() - where.start, tensor.size(), tensor.stride()
        self.tensor = None

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            where = self.range
            if where.tensor is None:
                raise PipeloomError("a backward read activations that were offloaded and not reloaded "
                                    "(its pair has an OFFLOAD and no RELOAD before the backward)")
            if where.ready is not None:
                where.ready.wait(where.tensor.device)
            self.tensor = self.view()
        return self.tensor

    def view(self) -> torch.Tensor:
        """Its view of the reloaded range, without waiting for the reload's copy."""
        tensor = self.range.tensor
        return tensor.as_strided(self.size, self.stride, tensor.storage_offset() + self.offset)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The elements ``start:end`` of its storage that ``tensor`` spans."""
    start = tensor.storage_offset()
    if tensor.is_contiguous():
        return start, start + tensor.numel()
    return start, start + 1 + sum((n - 1) * s for n, s in zip(tensor.size(), tensor.stride()))


class _Capture:
    """What one pair's F saved, by (storage address, dtype); its ranges once offloaded: one
    per storage and dtype, spanning every saved tensor in it; and their blocks."""

    def __init__(self):
        self.saved: dict[tuple[int, torch.dtype], list[_Saved]] = {}
        self.ranges: list[_Range] = []
        self.blocks: list[_Block] = []
        self.leaf: _Saved | None = None

    def save(self, tensor: torch.Tensor, address: int | None = None) -> _Saved:
        """``tensor`` saved, by its storage's ``address`` (None: read it)."""
        saved = _Saved(tensor)
        key = tensor.untyped_storage().data_ptr() if address is None else address, tensor.dtype
        group = self.saved.get(key)
        if group is None:
            self.saved[key] = [saved]
        else:
            group.append(saved)
        return saved

    def gather(self, kept: set[int], leaf: torch.Tensor | None) -> list[_Block]:
        """The blocks of the ranges of the saved tensors but those in the storages ``kept``; each
        saved tensor in one lets go of its device tensor. ``leaf`` (the stage input), when its storage is
        among them, is placed in its range too (:attr:`leaf`) and lets go of its data."""
        self.leaf = None
        leaf_key = leaf.untyped_storage().data_ptr() if leaf is not None else None
        for (key, _), group in self.saved.items():
            if key in kept:
                continue
            lent = key == leaf_key
            extents = [_extent(t) for t in [saved.tensor for saved in group] + ([leaf] if lent else [])]
            start, end = min(a for a, _ in extents), max(b for _, b in extents)
            where = _Range(start, end, group[0].tensor.detach().as_strided((end - start,), (1,), start))
            for saved in group:
                saved.place(where)
            if lent:
                self.leaf = _Saved(leaf.detach())
                self.leaf.place(where)
                leaf.data = torch.zeros((), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
            self.ranges.append(where)
        self.blocks = _blocks(self.ranges)
        return self.blocks


class Offloader:
    """One rank's offload state (in ``context.extras[NAME]``): the captures of the pairs its
    schedule offloads, from F to their RELOAD, the host pool, the side stream and the stats."""

    def __init__(self, context, cheap: bool = False):
        self.context, self.device, self.cheap = context, context.device, cheap
        rank = context.schedule.ranks[context.mesh.pp_rank]
        self.offloaded = frozenset((a.stage, a.microbatch) for a in rank if a.kind == RELOAD)
        #: a paced F's pair -> the pair whose OFFLOAD it waits for; the CUDA events of offloads they wait for
        self.waits = {pair: waited for pair, waited in paced(context.schedule).items() if waited in self.offloaded}
        self.waited = frozenset(self.waits.values())
        self.copied: dict[tuple[int, int], torch.cuda.Event] = {}
        self.cuda = self.device.type == "cuda"
        #: one copy stream per direction (device to host, host to device): the host link carries both at once
        self.out = torch.cuda.Stream(self.device) if self.cuda else None
        self.back = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = OffloadStats()
        self.pool = HostPool(self.cuda, self.stats)
        self.captures: dict[tuple[int, int], _Capture] = {}
        #: what the B of each pair whose W inputs are offloaded queued for W, from OFFLOAD_W to RELOAD_W
        self.queued: dict[tuple[int, int], _Capture] = {}
        self.held: dict[int, tuple] = {}  # address -> (bytes, weak reference) of each device storage counted
        self.step = None
        context.extras[NAME] = self

    @contextmanager
    def forward(self, action):
        """Around F ``action``: its hooks, and with ``cheap`` the model's rebuildable marks. A paced F
        first waits on the host for the offload it waits for, so that its allocations can reuse
        the memory that copy frees (the allocator hands a block back once the copy's stream is done)."""
        copied = self.copied.pop(self.waits.get((action.stage, action.microbatch)), None)
        if copied is not None:
            copied.synchronize()
        with self.hooks(action), cheap_recompute() if self.cheap else nullcontext():
            yield

    def hooks(self, action) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks of F ``action``: count what it saves; capture it if its pair is offloaded;
        with ``cheap``, keep the recipes of rebuildable tensors instead of them."""
        if self.context.step is not self.step:
            self._new_step()
        pair = action.stage, action.microbatch
        capture = _Capture() if pair in self.offloaded else None
        if capture is not None:
            self.captures[pair] = capture
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self._pack(tensor, capture), _unpack)

    def _pack(self, tensor: torch.Tensor, capture: _Capture | None):
        """What autograd keeps of ``tensor``: itself (counted), its capture, or its recipe."""
        found = recipe(tensor) if self.cheap else None
        if found is not None:
            rebuild, inputs = found
            return _Rebuilt(rebuild, tuple(self._pack(i, capture) for i in inputs), self.hold)
        if not self._moves(tensor):
            return tensor
        address = self.hold(tensor.untyped_storage())
        return tensor if capture is None else capture.save(tensor, address)

    def _moves(self, tensor: torch.Tensor) -> bool:
        """Whether an offload copies ``tensor``: not a parameter or a view of one, more than
        :data:`SMALL` elements, strided, on the offloader's device. (It runs for every tensor F saves:
        plain tensors, the activations, skip the parameter checks, which are slow.)"""
        if tensor.numel() <= SMALL or tensor.layout is not torch.strided or tensor.is_cuda is not self.cuda:
            return False
        base = tensor._base
        if type(tensor) is torch.Tensor and (base is None or type(base) is torch.Tensor):
            return True
        return not (isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter))

    def hold(self, storage) -> int:
        """Count ``storage`` as activation bytes on the device until it is freed; its address."""
        key = storage.data_ptr()
        if key not in self.held:
            stats = self.stats
            size = storage.nbytes()
            # a weak reference that calls back when the storage goes (kept here until then)
            self.held[key] = size, weakref.ref(storage, lambda _, key=key: self._freed(key))
            stats.device += size
            stats.device_peak = max(stats.device_peak, stats.device)
        return key

    def _freed(self, key: int) -> None:
        self.stats.device -= self.held.pop(key)[0]

    def _new_step(self) -> None:
        """Hand back the buffers of captures a failed step left, and start the step's peaks."""
        for capture in (*self.captures.values(), *self.queued.values()):
            for block in capture.blocks:
                if block.host is not None:
                    self.pool.give(block.host)
        self.captures.clear()
        self.queued.clear()
        self.copied.clear()
        self.stats.new_step()
        self.step = self.context.step

    def offload(self, action) -> tuple | None:
        """Copy the pair's ranges (but its output's) to host buffers; drop the device copies. On CUDA,
        the copies' start and end on the offload stream (:meth:`_out`)."""
        pair = action.stage, action.microbatch
        capture, slot = self.captures[pair], self.context.step.slots[pair]
        kept = {slot.output.untyped_storage().data_ptr()} if slot.output is not None else set()
        leaf = slot.input if slot.input is not None and slot.input.is_floating_point() else None
        moving = capture.gather(kept, leaf)
        marks = self._out(moving)
        if self.cuda and moving and pair in self.waited:
            self.copied[pair] = self.out.record_event()
        return marks

    def offload_w(self, action) -> tuple | None:
        """Copy what the pair's B queued for W (:meth:`_moves`) to host buffers; drop the device copies."""
        pair = action.stage, action.microbatch
        capture = self.queued[pair] = _Capture()
        self.context.step.slots[pair].weights.pack(lambda t: capture.save(t) if self._moves(t) else t, _unpack)
        return self._out(capture.gather(set(), None))

    def _out(self, moving: list[_Block]) -> tuple | None:
        """Copy ``moving`` to host buffers on the offload stream, after the compute so far, each block's
        ranges into slices of one buffer; drop the device copies. On CUDA, the timed events recorded on
        the offload stream before and after the copies (the action's time in the step's timeline)."""
        self._after_compute(self.out, moving)
        with self._on(self.out):
            began = self._mark(moving)
            for block in moving:
                block.host = host = self.pool.take(block.ranges[0].tensor.dtype, block.numel)
                sources = [where.tensor for where in block.ranges]
                torch._foreach_copy_(list(host.split(block.sizes)), sources, non_blocking=self.cuda)
                if self.cuda:
                    for source in sources:
                        source.record_stream(self.out)
                for where in block.ranges:
                    where.tensor = None
                self.stats.offloaded += _nbytes(host)
            return None if began is None else (began, self._mark(moving))

    def reload(self, action) -> tuple | None:
        """Copy the pair's offloaded ranges back to new device tensors; their buffers go back to the pool.
        On CUDA, the copies' start and end on the reload stream (:meth:`_back`)."""
        capture = self.captures.pop((action.stage, action.microbatch))
        marks = self._back(capture.blocks)
        if capture.leaf is not None:  # the stage input's data again, a view of its reloaded range: nothing
            # reads it before the backward, whose unpack waits for the copy (so this action does not)
            self.context.step.slots[action.stage, action.microbatch].input.data = capture.leaf.view()
        return marks

    def reload_w(self, action) -> tuple | None:
        """Copy what the pair's B queued for W back to new device tensors; W's unpacking waits for the copy."""
        return self._back(self.queued.pop((action.stage, action.microbatch)).blocks)

    def _back(self, back: list[_Block]) -> tuple | None:
        """Copy ``back`` to the device on the reload stream, after the compute so far: each block in one
        copy to one new device tensor, its ranges slices of it; the host buffers go back to the pool.
        On CUDA, the timed events recorded on the reload stream before and after the copies."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        self._after_compute(self.back, back)
        with self._on(self.back):
            began = self._mark(back)
            for block in back:
                device = torch.empty_like(block.host, device=self.device)
                device.copy_(block.host, non_blocking=self.cuda)
                self.hold(device.untyped_storage())
                if self.cuda:
                    device.record_stream(compute)  # read and freed there
                for where, piece in zip(block.ranges, device.split(block.sizes)):
                    where.tensor = piece
            done = self._mark(back)
        reloaded = _Reloaded(done) if done is not None else None
        for block in back:
            for where in block.ranges:
                where.ready = reloaded
            self.pool.give(block.host, done)
            block.host = None
        return None if began is None else (began, done)

    def _after_compute(self, stream, copies: list) -> None:
        """On CUDA with ``copies`` to make, ``stream`` waits for the compute issued so far: a copy starts no
        earlier than the compute before it in the list ends, as the simulator times it."""
        if self.cuda and copies:
            stream.wait_event(torch.cuda.current_stream(self.device).record_event())

    def _on(self, stream):
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def _mark(self, copies: list) -> torch.cuda.Event | None:
        """On CUDA with ``copies`` to make, a timed event recorded on the current (copy) stream; else None."""
        if not (self.cuda and copies):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def offloader_of(context) -> Offloader:
    """The rank's offloader, made on first use: offload and cheap recomputation share its hooks and stats."""
    return context.extras.get(NAME) or Offloader(context)


class OffloadPart(Part):
    """Offload in a pipeline: ``offload`` ("none", "full" or "selective", with ``offload_ratio``)
    builds a family with :class:`~pipeloom.schedule.Offload`; the rank's offloader runs where
    the schedule offloads, and counts where ``offload`` is given (:meth:`offload_stats`)."""

    keywords = {"offload": None, "offload_ratio": None}
    exposes = ("offloader", "offload_stats")
    context = None

    def check(self) -> None:
        if self.given["offload"] is None and self.given["offload_ratio"] is not None:
            raise PipeloomError(f"offload_ratio={self.given['offload_ratio']!r} goes with offload='selective'")

    def check_schedule(self, schedule) -> None:
        if self.given["offload"] is not None:
            raise PipeloomError(f"offload={self.given['offload']!r} goes with a family name: build a given Schedule "
                                "with transforms=[Offload(...)] instead")

    def build(self, options: dict) -> None:
        if self.given["offload"] is not None:
            options["transforms"] = [*options.get("transforms", ()), Transform(self.given["offload"],
                                                                               self.given["offload_ratio"])]

    def setup(self, pipe, model) -> None:
        self.context = pipe.context
        if self.given["offload"] or pipe.schedule.options.get("offload"):
            offloader_of(pipe.context)

    @property
    def offloader(self) -> Offloader | None:
        """The rank's offloader, if it has one."""
        return self.context.extras.get(NAME) if self.context else None

    def offload_stats(self) -> dict[str, int]:
        """This rank's activation bytes on the device and the host, now and at their peaks since
        the step began (:class:`OffloadStats`)."""
        if self.offloader is None:
            raise PipeloomError("offload_stats() counts with Pipeline(..., offload='none'|'full'|'selective')")
        return asdict(self.offloader.stats)


def _unpack(saved):
    return saved.unpack() if isinstance(saved, (_Saved, _Rebuilt)) else saved


def _hooks(action, context):
    offloader = context.extras.get(NAME)
    return offloader.forward(action) if offloader is not None else None


around(F, _hooks)
register(OFFLOAD, lambda action, context: context.extras[NAME].offload(action))
register(RELOAD, lambda action, context: context.extras[NAME].reload(action))
register(OFFLOAD_W, lambda action, context: context.extras[NAME].offload_w(action))
register(RELOAD_W, lambda action, context: context.extras[NAME].reload_w(action))
