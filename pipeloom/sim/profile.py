"""Measured costs: the profile ``pipeloom profile`` writes and the simulator reads instead of formulas.

A profile is one JSON object (:data:`FORMAT` ``"pipeloom-profile/1"``),
measured on one machine (a CPU, or one GPU) with the runtime's own modules
(:mod:`pipeloom.runtime.profile`); times in milliseconds, sizes in bytes::

    {"format": "pipeloom-profile/1",
     "machine": {"device": "cpu"|"cuda", "name": str, "torch": str, "threads": int, "precision": "fp32"|"bf16"},
     "model": {"name": str, "layers": int, "hidden": int, "heads": int, "vocab": int, "ffn": int, "tied": bool,
               "kv_heads": int|null, "ffn_hidden": int|null, "gated": bool, "bias": bool, "rotary": bool},
     "seq": int,
     "repeats": int,
     "bytes_per_param": float,
     "cast_bytes_per_param": float,
     "optimizer_ns_per_param": float|null,
     "kfac": {"a": {"1": float, ...}, "g": {"1": float, ...}, "inv": float, "pre": float, "units": int,
              "shares": {"a": [float, ...], "g": [...], "inv": [...]}}|null,
     "link": {"bandwidth": float|null, "latency_ms": float|null, "reason": str|null},
     "host_bandwidth": float|null,
     "microbatch_sizes": {
       "1": {"layer": {"f", "b", "w", "bw"},
             "embedding": {"f", "b"},
             "head": {"f", "b", "w"},
             "message_bytes": float,
             "memory": {"layer": {"none", "cheap", "full", "w"}, "head": {"b", "w", "full"}}},
       ...}}

``model``'s ``kv_heads`` to ``rotary`` say what the layer is beyond a GPT's (a
Llama's: grouped-query heads, a SwiGLU MLP of ``ffn_hidden``, no biases,
rotary positions; :class:`~pipeloom.sim.specs.ModelSpec`); absent in older
profiles, which measured GPT layers. Per microbatch size (sequences of ``seq`` tokens): ``layer`` one transformer
layer's forward, input-gradient backward, weight-gradient backward (the B/W
split) and fused backward; ``embedding`` the token and position embeddings'
forward and backward (their weight gradients); ``head`` the final norm, LM
head and cross-entropy: forward, B and W (the LM head's weight gradient);
``message_bytes`` the hidden states one stage sends the next (in the weights'
dtype, as the runtime sends them). ``memory.layer``: bytes autograd saves in
a layer's forward with no recomputation (``none``), with the norms and GELU
rebuilt in B (``cheap``), under ``torch.utils.checkpoint`` (``full``: its
input, what a recomputed stage keeps), and what B leaves queued for W
(``w``: the linear layers' inputs and output gradients); ``memory.head``:
the output layer's ``b`` and ``w``, and ``full``, what its stage keeps when
recomputed (its input: the loss is rerun too). ``bytes_per_param``:
model state per parameter as the runtime keeps it (weights, gradients,
AdamW's moments); ``cast_bytes_per_param``: the low-precision copy of the
weights autocast keeps while a forward runs (2 under bf16, 0 in fp32; absent
in older profiles: from ``machine.precision``); ``optimizer_ns_per_param``: the optimizer step (gradient
clipping and AdamW, as ``pipeloom train`` runs it) per parameter, on one
layer's parameters (null or absent in older profiles: the device's memory
bandwidth times it then); ``kfac``: K-FAC's pieces on one layer, summed over
its ``units`` linear layers (:func:`~pipeloom.runtime.profile.kfac_ms`): per
microbatch size the curvature of one microbatch's inputs (``a``) and output
gradients (``g``), and the damped inverses of both factors (``inv``) and the
preconditioning of the layer's gradients (``pre``), and each linear layer's
share of ``a``, ``g`` and ``inv`` (``shares``, in module order; absent in older
profiles: shares by the layers' sizes then); null or absent in older
profiles: the formulas then. ``link``: a stage-to-stage transfer, ``latency_ms + bytes
/ bandwidth``, fitted to timed sends between two processes; null (with
``reason``) where it could not be measured, and then the device preset's
link is used. ``host_bandwidth``: pinned host<->device copies (offload), bytes/s
each way while both ways copy at once; null on a CPU.

:meth:`Profile.costs` (one layer and the ends) and :meth:`Profile.stages`
(per stage) give what :func:`~pipeloom.sim.model.costs_from_model` uses in
place of formulas: at a profiled microbatch size the measured values; at
another, the nearest profiled size's times scaled by FLOPs (its measured
FLOP rate) and its bytes by the tokens; with sequence parallelism (``sp``
ranks) a rank's FLOPs and bytes. A model of another vocabulary (a tokenizer's
own) scales the output layer's times and bytes by the vocabulary too (its
products and logits grow with it); of other layers, the stages add the
measured layer up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PipeloomError
from ..partition import stage_totals
from .formulas import layer_flops
from .specs import ModelSpec

#: The format tag of a profile.
FORMAT = "pipeloom-profile/1"
#: Bytes per parameter of autocast's copy of the weights, by the profile's precision.
CAST_BYTES = {"fp32": 0.0, "bf16": 2.0}

#: The numbers measured at each microbatch size: JSON path -> :class:`Sample` field.
SAMPLE_FIELDS = {
    ("layer", "f"): "layer_f", ("layer", "b"): "layer_b", ("layer", "w"): "layer_w", ("layer", "bw"): "layer_bw",
    ("embedding", "f"): "embedding_f", ("embedding", "b"): "embedding_b",
    ("head", "f"): "head_f", ("head", "b"): "head_b", ("head", "w"): "head_w",
    ("message_bytes",): "message_bytes",
    ("memory", "layer", "none"): "layer_m_none", ("memory", "layer", "cheap"): "layer_m_cheap",
    ("memory", "layer", "full"): "layer_m_full", ("memory", "layer", "w"): "layer_m_w",
    ("memory", "head", "b"): "head_m_b", ("memory", "head", "w"): "head_m_w", ("memory", "head", "full"): "head_m_full",
}
#: The model fields of a profile: JSON key -> :class:`~pipeloom.sim.specs.ModelSpec` field.
MODEL_FIELDS = {"name": "name", "layers": "layers", "hidden": "hidden", "heads": "heads", "vocab": "vocab",
                "ffn": "ffn", "tied": "tied_embeddings"}
#: The layer's shape beyond a GPT's, optional (a profile without them measured a GPT): JSON key
#: (the same as the :class:`~pipeloom.sim.specs.ModelSpec` field) -> its type.
LAYER_FIELDS = {"kv_heads": int, "ffn_hidden": int, "gated": bool, "bias": bool, "rotary": bool}
#: The model sizes a profile must share with the model it costs (the layers and the vocabulary may differ).
MATCHED = ("hidden", "heads", "ffn", "kv_heads", "ffn_hidden", "gated", "bias", "rotary")


def model_fields(model: ModelSpec) -> dict:
    """The ``model`` object of a profile of ``model``."""
    return {**{k: getattr(model, name) for k, name in MODEL_FIELDS.items()},
            **{k: getattr(model, k) for k in LAYER_FIELDS}}


@dataclass(frozen=True)
class Sample:
    """What one microbatch size measured (ms, bytes); see the module docstring."""

    layer_f: float
    layer_b: float
    layer_w: float
    layer_bw: float
    embedding_f: float
    embedding_b: float
    head_f: float
    head_b: float
    head_w: float
    message_bytes: float
    layer_m_none: float
    layer_m_cheap: float
    layer_m_full: float
    layer_m_w: float
    head_m_b: float
    head_m_w: float
    head_m_full: float


@dataclass(frozen=True)
class ProfiledCosts:
    """One transformer layer's and the two ends' costs for one microbatch on one rank (ms, bytes),
    from a profile, under a recomputation: ``layer_m_b`` what a layer keeps for its backward,
    ``head_m_b`` the output layer's (with whole-stage recomputation: its input); ``layer_fused`` a fused backward's time less B's and W's (measured ``bw - b - w``);
    ``comm_ms`` None where the profile has no measured link."""

    layer_f: float
    layer_b: float
    layer_w: float
    layer_fused: float
    embedding_f: float
    embedding_b: float
    head_f: float
    head_b: float
    head_w: float
    layer_m_b: float
    layer_m_w: float
    head_m_b: float
    head_m_w: float
    message_bytes: float
    comm_ms: float | None


@dataclass(frozen=True)
class ProfiledStages:
    """Per stage, what :func:`~pipeloom.sim.model.costs_from_model` takes from a profile: compute
    times ``f``, ``b``, ``w`` and ``fused`` (BW less B and W; ms; sequence parallelism's exposed
    transfers not included), activation bytes ``m_b``, ``m_w`` and, with whole-stage
    recomputation, ``m_rerun`` (a stage's activations
    while its forward reruns; else None); ``comm_ms`` as in :class:`ProfiledCosts`."""

    f: list[float]
    b: list[float]
    w: list[float]
    fused: list[float]
    m_b: list[float]
    m_w: list[float]
    m_rerun: list[float] | None
    message_bytes: float
    comm_ms: float | None


@dataclass(frozen=True)
class Profile:
    """A measured profile (see the module docstring); ``samples`` by microbatch size.
    ``source`` (the file it came from) only names it in messages."""

    machine: dict
    model: ModelSpec
    seq: int
    bytes_per_param: float
    cast_bytes_per_param: float
    link_bandwidth: float | None
    link_latency_ms: float | None
    link_reason: str | None
    host_bandwidth: float | None
    samples: dict[int, Sample]
    repeats: int | None = None
    optimizer_ns_per_param: float | None = None
    kfac: dict | None = None
    source: str = field(default="", compare=False)

    @property
    def label(self) -> str:
        """How messages name it: ``profile FILE``."""
        return f"profile {self.source}" if self.source else "the profile"

    @classmethod
    def from_dict(cls, data, source: str = "") -> Profile:
        """The profile ``data`` holds (parsed JSON), checked: a bad field raises one line naming it."""
        where = f"profile {source}" if source else "profile"
        read = _Reader(where)
        if not isinstance(data, dict):
            raise PipeloomError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise PipeloomError(f"{where}: field format is {data.get('format')!r}; expected {FORMAT!r}")
        machine = read.get(data, ("machine",), dict)
        for key in ("device", "precision"):
            read.get(data, ("machine", key), str)
        if machine["precision"] not in CAST_BYTES:
            raise PipeloomError(f"{where}: field machine.precision is {machine['precision']!r}; expected one of "
                                f"{', '.join(CAST_BYTES)}")
        read.get(data, ("model",), dict)
        sizes = {MODEL_FIELDS[k]: read.get(data, ("model", k), str if k == "name" else bool if k == "tied" else int)
                 for k in MODEL_FIELDS}
        sizes.update({k: read.get(data, ("model", k), kind, null=kind is int) for k, kind in LAYER_FIELDS.items()
                      if k in data["model"]})
        try:
            spec = ModelSpec(**sizes)
        except PipeloomError as err:
            raise PipeloomError(f"{where}: field model: {err}") from None
        link = read.get(data, ("link",), dict)
        samples_data = read.get(data, ("microbatch_sizes",), dict)
        if not samples_data:
            raise PipeloomError(f"{where}: field microbatch_sizes is empty; expected at least one size")
        samples = {}
        for key in samples_data:
            if not (key.isdigit() and int(key) > 0):
                raise PipeloomError(f"{where}: field microbatch_sizes.{key}: expected a positive integer size")
            samples[int(key)] = Sample(**{name: read.number(data, ("microbatch_sizes", key, *path))
                                          for path, name in SAMPLE_FIELDS.items()})
        return cls(
            machine=dict(machine), model=spec, seq=read.get(data, ("seq",), int, positive=True),
            bytes_per_param=read.number(data, ("bytes_per_param",), positive=True),
            cast_bytes_per_param=read.number(data, ("cast_bytes_per_param",))
            if "cast_bytes_per_param" in data else CAST_BYTES[machine["precision"]],
            link_bandwidth=read.number(data, ("link", "bandwidth"), positive=True, null=True),
            link_latency_ms=read.number(data, ("link", "latency_ms"), null=True),
            link_reason=link.get("reason") if isinstance(link.get("reason"), str) else None,
            host_bandwidth=read.number(data, ("host_bandwidth",), positive=True, null=True),
            samples=dict(sorted(samples.items())),
            repeats=data.get("repeats") if isinstance(data.get("repeats"), int) else None,
            optimizer_ns_per_param=read.number(data, ("optimizer_ns_per_param",), positive=True, null=True)
            if "optimizer_ns_per_param" in data else None,
            kfac=_kfac(read, data, samples) if data.get("kfac") is not None else None,
            source=source,
        )

    def to_dict(self) -> dict:
        """The JSON object of this profile (the module docstring's layout)."""
        sizes = {}
        for size, sample in self.samples.items():
            entry: dict = {}
            for path, name in SAMPLE_FIELDS.items():
                node = entry
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = getattr(sample, name)
            sizes[str(size)] = entry
        return {
            "format": FORMAT,
            "machine": dict(self.machine),
            "model": model_fields(self.model),
            "seq": self.seq,
            "repeats": self.repeats,
            "bytes_per_param": self.bytes_per_param,
            "cast_bytes_per_param": self.cast_bytes_per_param,
            "optimizer_ns_per_param": self.optimizer_ns_per_param,
            "kfac": self.kfac,
            "link": {"bandwidth": self.link_bandwidth, "latency_ms": self.link_latency_ms, "reason": self.link_reason},
            "host_bandwidth": self.host_bandwidth,
            "microbatch_sizes": sizes,
        }

    def check(self, model: ModelSpec, seq: int) -> None:
        """Refuse a model or sequence length other than the profiled ones (the layers and the
        vocabulary may differ)."""
        for key in MATCHED:
            mine, theirs = getattr(self.model, key), getattr(model, key)
            if mine != theirs:
                raise PipeloomError(f"{self.label} was measured with {key} {mine} ({self.model.name}); the model "
                                    f"{model.name} has {key} {theirs}: profile that model")
        if seq != self.seq:
            raise PipeloomError(f"{self.label} was measured at seq {self.seq}; costs were asked for seq {seq}: "
                                f"use --seq {self.seq} or profile at seq {seq}")

    def precision_for(self, asked: str | None) -> str:
        """The precision costs priced with this profile take: the one it was measured in, which a
        run's ``--precision`` (``asked``; None: not given) must be."""
        mine = self.machine["precision"]
        if asked is not None and asked != mine:
            raise PipeloomError(f"{self.label} was measured in {mine}; --precision {asked} needs a profile measured "
                                f"in {asked} (pipeloom profile --precision {asked}), or leave --precision out")
        return mine

    def nearest(self, microbatch_size: int) -> int:
        """The profiled microbatch size closest to ``microbatch_size`` by ratio (ties: the larger)."""
        return min(self.samples, key=lambda b: (abs(math.log(b / microbatch_size)), -b))

    def costs(self, model: ModelSpec, seq: int, microbatch_size: int, sp: int = 1,
              recompute: bool | str = False) -> ProfiledCosts:
        """A layer's and the ends' costs for microbatches of ``microbatch_size`` sequences on one of
        ``sp`` sequence-parallel ranks: measured at a profiled size, else the nearest size's times
        scaled by FLOPs (:func:`~pipeloom.sim.formulas.layer_flops`; the ends' FLOPs are linear in the
        tokens) and bytes by tokens. ``recompute`` True adds F to B and keeps the checkpointed
        input; "cheap" keeps what the cheap recomputation keeps."""
        self.check(model, seq)
        if recompute not in (False, True, "cheap"):
            raise PipeloomError(f"recompute={recompute!r}: choose False, True (whole layers) or 'cheap'")
        if microbatch_size < 1 or sp < 1 or seq % sp:
            raise PipeloomError(f"microbatch_size {microbatch_size} and sp {sp} must be positive, sp dividing "
                                f"seq {seq}")
        size = self.nearest(microbatch_size)
        sample = self.samples[size]
        tokens = microbatch_size / (size * sp)  # this rank's tokens over the profiled ones
        head = tokens * model.vocab / self.model.vocab  # the output layer's products and logits: by the vocabulary too
        wanted, measured = layer_flops(model, seq, microbatch_size, sp), layer_flops(model, seq, size)
        f, b, w = (t * x / y for t, x, y in zip((sample.layer_f, sample.layer_b, sample.layer_w), wanted, measured))
        bw = sample.layer_bw * (wanted[1] + wanted[2]) / (measured[1] + measured[2])
        kept = {False: sample.layer_m_none, "cheap": sample.layer_m_cheap, True: sample.layer_m_full}[recompute]
        message = sample.message_bytes * tokens
        comm = None
        if self.link_bandwidth is not None:
            comm = (self.link_latency_ms or 0.0) + 1e3 * message / self.link_bandwidth
        return ProfiledCosts(
            layer_f=f, layer_b=b + (f if recompute is True else 0.0), layer_w=w, layer_fused=bw - b - w,
            embedding_f=sample.embedding_f * tokens, embedding_b=sample.embedding_b * tokens,
            head_f=sample.head_f * head, head_b=sample.head_b * head, head_w=sample.head_w * head,
            layer_m_b=kept * tokens, layer_m_w=sample.layer_m_w * tokens,
            head_m_b=(sample.head_m_full if recompute is True else sample.head_m_b) * head,
            head_m_w=sample.head_m_w * head,
            message_bytes=message, comm_ms=comm,
        )

    def kfac_costs(self, model: ModelSpec, seq: int, microbatch_size: int, sp: int = 1) -> dict[str, float]:
        """One layer's K-FAC pieces measured (ms; :func:`~pipeloom.sim.formulas.kfac_costs`' names but
        the syncs): the curvature of the nearest profiled size scaled by this rank's rows, the
        inversion and the preconditioning as measured (they depend on the layer's shape alone)."""
        self.check(model, seq)
        size = self.nearest(microbatch_size)
        rows = microbatch_size / (size * sp)
        return {"kfac_a": self.kfac["a"][str(size)] * rows, "kfac_g": self.kfac["g"][str(size)] * rows,
                "kfac_inv": self.kfac["inv"], "kfac_pre": self.kfac["pre"]}

    def kfac_unit_weights(self) -> dict[str, tuple[float, ...]]:
        """The measured weights of a layer's K-FAC units (:func:`~pipeloom.sim.formulas.kfac_unit_weights`'
        names: each linear layer's share times their count), or {} where the profile has no shares."""
        shares = (self.kfac or {}).get("shares")
        if not shares:
            return {}
        return {f"kfac_unit_{key}": tuple(len(values) * x for x in values) for key, values in shares.items()}

    def stages(self, model: ModelSpec, seq: int, microbatch_size: int, split, sp: int = 1,
               recompute: bool | str = False, vocab_split: bool = False) -> ProfiledStages:
        """:meth:`costs` summed over stages of ``split`` layers: the embedding on the first, the
        output layer on the last (unless ``vocab_split``: then the last keeps only the final
        norm's input). With ``recompute`` True a stage keeps its input (the last also what the
        loss keeps) and B reruns the layers' F, as the formulas count it."""
        one = self.costs(model, seq, microbatch_size, sp, recompute)
        ends = 0.0 if vocab_split else 1.0

        def kept(costs: ProfiledCosts) -> list[float]:
            return stage_totals(split, costs.layer_m_b, last=costs.head_m_b if ends else costs.message_bytes)

        if recompute is True:
            m_b = [one.layer_m_b] * len(split)
            m_b[-1] = one.head_m_b if ends else one.layer_m_b
            rerun = kept(self.costs(model, seq, microbatch_size, sp))
        else:
            m_b, rerun = kept(one), None
        return ProfiledStages(
            f=stage_totals(split, one.layer_f, first=ends * one.embedding_f, last=ends * one.head_f),
            b=stage_totals(split, one.layer_b, first=ends * one.embedding_b, last=ends * one.head_b),
            w=stage_totals(split, one.layer_w, last=ends * one.head_w),
            fused=stage_totals(split, one.layer_fused),
            m_b=m_b, m_w=stage_totals(split, one.layer_m_w, last=ends * one.head_m_w), m_rerun=rerun,
            message_bytes=one.message_bytes, comm_ms=one.comm_ms,
        )


def _kfac(read: _Reader, data: dict, samples: dict) -> dict:
    """The profile's ``kfac`` object, checked: ``a`` and ``g`` (ms) for every profiled size."""
    for key in ("inv", "pre"):
        read.number(data, ("kfac", key))
    read.get(data, ("kfac", "units"), int, positive=True)
    for key in ("a", "g"):
        read.get(data, ("kfac", key), dict)
        for size in samples:
            read.number(data, ("kfac", key, str(size)))
    kept = {key: data["kfac"][key] for key in ("a", "g", "inv", "pre", "units")}
    if data["kfac"].get("shares") is not None:
        shares, units = read.get(data, ("kfac", "shares"), dict), kept["units"]
        for key in ("a", "g", "inv"):
            values = shares.get(key)
            if not (isinstance(values, list) and len(values) == units and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in values)):
                raise PipeloomError(f"{read.where}: field kfac.shares.{key} is {values!r}; expected {units} "
                                    "non-negative numbers, one per unit")
        kept["shares"] = {key: [float(x) for x in shares[key]] for key in ("a", "g", "inv")}
    return kept


class _Reader:
    """Typed reads of a profile's fields, each failure one line naming the field."""

    def __init__(self, where: str):
        self.where = where

    def _at(self, data, path: tuple[str, ...]):
        """The value at ``path`` in ``data`` (nested objects), or one line naming the first key missing."""
        node = data
        for depth, key in enumerate(path):
            if not isinstance(node, dict) or key not in node:
                raise PipeloomError(f"{self.where}: field {'.'.join(path[:depth + 1])} is missing")
            node = node[key]
        return node

    def get(self, data, path: tuple[str, ...], kind: type, positive: bool = False, null: bool = False):
        node = self._at(data, path)
        if node is None and null:
            return None
        ok = isinstance(node, kind) and (kind is bool or not isinstance(node, bool))
        if not ok or (positive and node <= 0):
            want = {dict: "an object", str: "a string", int: "an integer", bool: "true or false"}[kind]
            raise PipeloomError(f"{self.where}: field {'.'.join(path)} is {node!r}; expected "
                                f"{'a positive integer' if positive else want}" + (" or null" if null else ""))
        return node

    def number(self, data, path: tuple[str, ...], positive: bool = False, null: bool = False) -> float | None:
        node = self._at(data, path)
        if node is None and null:
            return None
        good = isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node)
        if not good or node < 0 or (positive and node == 0):
            want = "a positive number" if positive else "a non-negative number"
            raise PipeloomError(f"{self.where}: field {'.'.join(path)} is {node!r}; expected {want}"
                                + (" or null" if null else ""))
        return float(node)


def load_profile(path: str | Path) -> Profile:
    """The profile in the JSON file ``path``, checked (:meth:`Profile.from_dict`)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PipeloomError(f"profile {path}: cannot read it: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PipeloomError(f"profile {path}: not JSON ({err.msg} at line {err.lineno})") from None
    return Profile.from_dict(data, str(path))
