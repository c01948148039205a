"""What the simulator costs: a decoder (:class:`ModelSpec`) on an accelerator (:class:`Device`), and their presets.

:mod:`.formulas` costs one layer of a model on a device, :mod:`.model` its stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PipeloomError
from ..presets import SIZES


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: ``layers`` transformer layers of width ``hidden`` with
    ``heads`` attention heads, a ``vocab``-token embedding, an LM head and an
    MLP ``ffn`` times as wide as ``hidden``.

    ``tied_embeddings`` shares the LM head with the token embedding in the
    parameter count; a pipeline still keeps a copy of it on the last stage
    (as Megatron-LM does), so per-stage memory is the same either way.

    The defaults describe a GPT. A Llama-style layer sets ``kv_heads``
    (grouped-query attention: keys and values of that many heads; None:
    ``heads``), ``ffn_hidden`` (the MLP's width, instead of ``ffn`` times
    ``hidden``), ``gated`` (a SwiGLU MLP: three matrices), ``bias`` False (no
    biases in the linear layers, norms of one weight vector: RMSNorm) and
    ``rotary`` (rotary positions: no position embeddings).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int = 4
    tied_embeddings: bool = False
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated: bool = False
    bias: bool = True
    rotary: bool = False

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "ffn", "kv_heads", "ffn_hidden"):
            value = getattr(self, field)
            if value is None and field in ("kv_heads", "ffn_hidden"):
                continue
            if not isinstance(value, int) or value < 1:
                raise PipeloomError(f"model {self.name!r}: {field} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise PipeloomError(
                f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}"
            )
        if self.heads % (self.kv_heads or self.heads):
            raise PipeloomError(f"model {self.name!r}: kv_heads {self.kv_heads} does not divide heads {self.heads}")

    @property
    def kv_width(self) -> int:
        """Width of a layer's keys (and of its values): ``kv_heads`` heads of ``hidden / heads``."""
        return self.hidden // self.heads * (self.kv_heads or self.heads)

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: ``ffn_hidden``, or ``ffn`` times ``hidden``."""
        return self.ffn_hidden or self.ffn * self.hidden

    @property
    def matrix_params(self) -> int:
        """Weights of one layer's matrices: q, k, v and the output projection, the MLP's
        two (three when ``gated``). Each does 2 FLOPs per weight and token in F, B and W."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_width + (3 if self.gated else 2) * h * self.mlp_width

    @property
    def norm_params(self) -> int:
        """One norm's parameters: a LayerNorm's weight and bias (2h), without ``bias`` a weight (h)."""
        return 2 * self.hidden if self.bias else self.hidden

    @property
    def layer_params(self) -> int:
        h, f = self.hidden, self.mlp_width
        biases = 3 * h + 2 * self.kv_width + (2 if self.gated else 1) * f if self.bias else 0
        return self.matrix_params + 2 * self.norm_params + biases

    def parameters(self, seq: int) -> int:
        """Distinct parameters: layers, token and position embeddings (``seq``
        positions), LM head (unless tied) and final norm."""
        head = self.head_params - (self.hidden * self.vocab if self.tied_embeddings else 0)
        return self.layers * self.layer_params + self.embedding_params(seq) + head

    def position_params(self, seq: int) -> int:
        """Learned position embeddings of ``seq`` positions (none with ``rotary``)."""
        return 0 if self.rotary else self.hidden * seq

    def embedding_params(self, seq: int) -> int:
        return self.hidden * self.vocab + self.position_params(seq)

    @property
    def head_params(self) -> int:
        """LM head weights (hV) plus the final norm (2h; h without ``bias``)."""
        return self.hidden * self.vocab + self.norm_params

    def vocab_shard_params(self, ranks: int) -> int:
        """Parameters of one rank's vocabulary shard (V/p rows, padded) of the
        token embedding and the LM head (one matrix when they are tied)."""
        return -(-self.vocab // ranks) * self.hidden * (1 if self.tied_embeddings else 2)


#: What each family's layer is, in :class:`ModelSpec`'s terms.
FAMILY_LAYERS = {"gpt": {"gated": False, "bias": True, "rotary": False},
                 "llama": {"gated": True, "bias": False, "rotary": True}}


def decoder_spec(name: str, family: str, layers: int, hidden: int, heads: int, vocab: int, tied: bool = False,
                 kv_heads: int | None = None, ffn_hidden: int | None = None) -> ModelSpec:
    """The simulator's model of a decoder of ``family`` (:data:`FAMILY_LAYERS`) with these sizes."""
    return ModelSpec(name, layers, hidden, heads, vocab, tied_embeddings=tied, kv_heads=kv_heads, ffn_hidden=ffn_hidden,
                     **FAMILY_LAYERS[family])


def size_spec(name: str, size) -> ModelSpec:
    """The simulator's model of the :class:`~pipeloom.presets.ModelSize` ``size``."""
    return decoder_spec(name, size.family, size.layers, size.hidden, size.heads, size.vocab, size.tied,
                        size.kv_heads, size.ffn_hidden)


#: Model presets by lowercase name: every size of :data:`pipeloom.presets.SIZES`.
MODELS: dict[str, ModelSpec] = {name: size_spec(name, size) for name, size in SIZES.items()}


@dataclass(frozen=True)
class Device:
    """One accelerator: dense 16-bit peak FLOP/s, memory bytes, achievable
    point-to-point bandwidth to the next pipeline rank and to host memory
    (bytes/s), ``efficiency``, the fraction of peak a transformer layer
    reaches (MFU-like; every FLOP count is divided by ``peak_flops * efficiency``),
    ``memory_bandwidth`` (bytes/s), which times the optimizer step (None: not timed),
    ``fp32_flops``, dense fp32 FLOP/s without tensor cores, K-FAC's inversions (None: ``peak_flops``), and
    ``tf32_flops``, dense TF32 FLOP/s, K-FAC's products in a 16-bit run (None: the device has no TF32,
    ``fp32_flops``)."""

    name: str
    peak_flops: float
    memory: float
    link_bandwidth: float
    host_bandwidth: float
    efficiency: float = 0.5
    memory_bandwidth: float | None = None
    fp32_flops: float | None = None
    tf32_flops: float | None = None

    def __post_init__(self):
        for field in ("peak_flops", "memory", "link_bandwidth", "host_bandwidth"):
            if not getattr(self, field) > 0:
                raise PipeloomError(f"device {self.name!r}: {field} must be positive, got {getattr(self, field)!r}")
        for field in ("memory_bandwidth", "fp32_flops", "tf32_flops"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise PipeloomError(f"device {self.name!r}: {field} must be positive or None, got {value!r}")
        if not 0 < self.efficiency <= 1:
            raise PipeloomError(f"device {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")

    def ms(self, flops: float, fp32: bool = False, tf32: bool = False) -> float:
        """Milliseconds to run ``flops`` at the achievable rate (``fp32``: of fp32 work without tensor
        cores; ``tf32``: of fp32 products in TF32, without it where the device has none)."""
        peak = self.peak_flops
        if tf32:
            peak = self.tf32_flops or self.fp32_flops or peak
        elif fp32:
            peak = self.fp32_flops or peak
        return 1e3 * flops / (peak * self.efficiency)


_GiB = 2**30

#: See :data:`DEVICES`.
CPU_MEMORY_BANDWIDTH = 7e9

#: Device presets by lowercase name. Link bandwidths are what pipeline P2P
#: achieves, not the NVLink headline: the zero-bubble paper's profiled T_comm
#: move a 2bsh activation at about 48 GB/s inside an A100 node;
#: H100 and V100 scale that by their NVLink generation (450 and 150 GB/s per
#: direction against the A100's 300). Host links: the ~15 GB/s for A100
#: (PCIe 4) of "PipeOffload: Improving Scalability of Pipeline Parallelism with
#: Memory Optimization"; H100: 46 GB/s, pinned copies of 512 MiB each way while
#: both ways copy (offload's two streams), measured on an H100 (PCIe 5) for this
#: project (54 GB/s one way alone; an H200 moved 55); ~10 GB/s for PCIe 3.
#: fp32 without tensor cores (K-FAC's inversions): the datasheets' A100 19.5,
#: H100 SXM 67, V100 15.7 TFLOP/s; on the H100 a gpt-350m layer's K-FAC pieces,
#: all fp32 then, took 11-13x the bf16-rate formulas. TF32 (K-FAC's products in a
#: bf16 run): dense A100 156, H100 SXM 495 TFLOP/s; the V100 has none.
#: Memory bandwidth: the HBM datasheet figures (A100 80 GB 2.0 TB/s, H100 SXM
#: 3.35, V100 0.9); the CPU's is what one thread's clipping and AdamW step
#: achieve over :data:`~pipeloom.sim.model.OPTIMIZER_BYTES_PER_PARAM` on the development VM (about
#: 5 ns per parameter: ``pipeloom train``'s measured step less its actions' span).
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        # A100 SXM 80 GB: 312 TFLOP/s dense bf16. Efficiency 0.5 puts the
        # zero-bubble paper's four models within ~20% of their profiled T_F.
        Device("a100", 312e12, 80 * _GiB, 50e9, 15e9, 0.5, 2.0e12, 19.5e12, 156e12),
        # H100 SXM 80 GB: 989 TFLOP/s dense bf16. Efficiency measured: one
        # layer's F, B and W (bench/gpu_layer.py, bf16, on an H200, the same
        # compute) of the zero-bubble 1.5B and 6.2B shapes and gpt-1.3b reach
        # 0.42-0.63 of peak, 0.53 over their summed time; the H100
        # figures for the 6.2B layer (T_F 2.07 ms) give 0.62 for F.
        Device("h100", 989e12, 80 * _GiB, 75e9, 46e9, 0.53, 3.35e12, 67e12, 495e12),
        # V100 SXM2 32 GB: 125 TFLOP/s fp16 tensor cores (no bf16 on V100).
        Device("v100", 125e12, 32 * _GiB, 25e9, 10e9, 0.4, 0.9e12, 15.7e12),
        # A small x86 VM (2 AVX-512 cores): ~0.26 TFLOP/s fp32 matmul measured
        # with numpy on the development machine; gloo over loopback between ranks.
        Device("cpu", 0.26e12, 16 * _GiB, 5e9, 10e9, 0.5, CPU_MEMORY_BANDWIDTH),
    )
}


def get_model(model: ModelSpec | str) -> ModelSpec:
    """``model`` itself, or the preset of that name."""
    return _preset(model, ModelSpec, MODELS, "model")


def get_device(device: Device | str) -> Device:
    """``device`` itself, or the preset of that name."""
    return _preset(device, Device, DEVICES, "device")


def _preset(value, kind: type, presets: dict, what: str):
    if isinstance(value, kind):
        return value
    if value not in presets:
        raise PipeloomError(f"unknown {what} {value!r}; presets: {', '.join(presets)}")
    return presets[value]


def _positive(**values) -> None:
    """Refuse any of ``values`` that is not a positive integer, naming it."""
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise PipeloomError(f"{name} must be a positive integer, got {value!r}")
