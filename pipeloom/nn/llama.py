"""A Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases.

:class:`Llama` is a :class:`~pipeloom.nn.decoder.Decoder` as :class:`~pipeloom.nn.GPT`
is: the same stages, meta-device build, per-name seeded initialisation,
vocabulary parallelism, sequence parallelism and B/W split (every linear
layer is a :class:`~pipeloom.nn.linear.Linear`). Its blocks differ:
``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))`` with RMSNorms, attention
whose queries and keys turn by :class:`Rotary` (by the tokens' global
positions, also when a sequence-parallel rank holds only a share of them)
with ``n_kv_head`` key/value heads, and :class:`SwiGLU`. It has no position
embeddings, no dropout and no biases.

Parameter names are pipeloom's (``wte``, ``blocks.{i}.attn.qkv``, ...), the
q/k/v projections fused into one ``qkv`` and the MLP's gate and up
projections into one ``gate_up``, as GPT fuses q/k/v (one GEMM, one saved
input). :meth:`Llama.hf_names` gives Hugging Face's names of the weights
(``model.layers.{i}.self_attn.q_proj.weight``, ...), by which
:meth:`~pipeloom.nn.decoder.Decoder.load_safetensors` and
:meth:`~pipeloom.nn.decoder.Decoder.save_safetensors` read and write them
(:mod:`pipeloom.nn.hf`). Rotary runs in Hugging Face's "rotate_half" layout
(a head's dimension i pairs with i + head_dim/2), the layout its checkpoints
store q and k in, so they load without permuting any row (Meta's original checkpoints pair
dimensions 2i and 2i+1 instead; Hugging Face's conversion permutes them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PipeloomError
from ..presets import SIZES
from .decoder import CausalSelfAttention, Decoder, DecoderConfig, HFTensor, PreNormBlock
from .linear import Linear
from .recompute import mark


def config_fields(size) -> dict:
    """The :class:`LlamaConfig` fields of a Llama-family :class:`~pipeloom.presets.ModelSize`."""
    return dict(n_layer=size.layers, n_embd=size.hidden, n_head=size.heads, n_kv_head=size.kv_heads,
                ffn_hidden=size.ffn_hidden, vocab_size=size.vocab, block_size=size.block_size,
                tie_embeddings=size.tied, rope_theta=size.rope_theta, rope_scaling=size.rope_scaling,
                norm_eps=size.norm_eps)


#: Config presets by name: every Llama size of :data:`pipeloom.presets.SIZES`.
PRESETS: dict[str, dict] = {name: config_fields(size) for name, size in SIZES.items() if size.family == "llama"}


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Sizes of a :class:`Llama`. ``n_kv_head`` key/value heads (dividing
    ``n_head``; None: ``n_head``, plain multi-head attention); ``ffn_hidden``,
    the SwiGLU width (None: Llama's ``8/3·n_embd`` rounded up to a multiple
    of 256); ``rope_theta``, the rotary base; ``rope_scaling``, Llama 3.1's
    stretch of the rotary frequencies, (factor, low-frequency factor,
    high-frequency factor, original context) or None; ``norm_eps``, the
    RMSNorms' epsilon; ``tie_embeddings`` makes the LM head weight the token
    embedding weight."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    n_kv_head: int | None = None
    ffn_hidden: int | None = None
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5

    presets = PRESETS

    def __post_init__(self):
        if self.n_kv_head is None:
            object.__setattr__(self, "n_kv_head", self.n_head)
        if self.ffn_hidden is None and isinstance(self.n_embd, int):
            object.__setattr__(self, "ffn_hidden", 256 * -(-(8 * self.n_embd // 3) // 256))
        self._check_sizes(("n_layer", "n_embd", "n_head", "vocab_size", "block_size", "n_kv_head", "ffn_hidden"))
        if self.n_head % self.n_kv_head:
            raise PipeloomError(f"LlamaConfig: n_kv_head {self.n_kv_head} does not divide n_head {self.n_head}")
        if (self.n_embd // self.n_head) % 2:
            raise PipeloomError(f"LlamaConfig: the head size n_embd / n_head = {self.n_embd // self.n_head} must be "
                                "even (rotary positions turn pairs of dimensions)")
        if not self.rope_theta > 1:
            raise PipeloomError(f"LlamaConfig: rope_theta must be greater than 1, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            scaling = tuple(self.rope_scaling)
            if len(scaling) != 4 or not all(isinstance(x, (int, float)) and x > 0 for x in scaling) \
                    or not scaling[1] < scaling[2]:
                raise PipeloomError(f"LlamaConfig: rope_scaling must be (factor, low_freq_factor, high_freq_factor, "
                                    f"original context), positive, low < high; got {self.rope_scaling!r}")
            object.__setattr__(self, "rope_scaling", scaling)
        if not self.norm_eps > 0:
            raise PipeloomError(f"LlamaConfig: norm_eps must be positive, got {self.norm_eps!r}")

    def build(self, device: str | torch.device | None = None) -> Llama:
        """The model of this config: ``Llama(self, device)``."""
        return Llama(self, device)


@dataclass(frozen=True)
class Rotary:
    """Rotary position embeddings (RoFormer) of heads of ``head_dim``, in the
    "rotate_half" layout of Hugging Face's Llama: dimensions i and
    i + head_dim/2 of a head form a pair, turned at position p by the angle
    ``p · theta^(-2i/head_dim)`` (those frequencies stretched by Llama 3.1's
    ``scaling``, when given). Angles are computed in fp32, then cast to the
    queries' dtype."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[float, float, float, int] | None = None

    def frequencies(self, device=None) -> torch.Tensor:
        """The pairs' angular frequencies [head_dim / 2], fp32."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        frequencies = 1.0 / (self.theta ** exponents)
        return frequencies if self.scaling is None else _llama3_scaled(frequencies, *self.scaling)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """``q`` [B, H, T, D] and ``k`` [B, H_kv, T, D] turned by the global ``positions`` [T] of their tokens."""
        angles = positions.float()[:, None] * self.frequencies(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(-x2, x1)`` of ``x``'s last dimension cut in halves ``(x1, x2)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _llama3_scaled(frequencies: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original: int) -> torch.Tensor:
    """Llama 3.1's rotary frequencies for long contexts: wavelengths above ``original /
    low_freq_factor`` slowed by ``factor``, those below ``original / high_freq_factor`` kept,
    those between blended smoothly."""
    wavelengths = 2 * math.pi / frequencies
    slow = frequencies / factor
    smooth = (original / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slow + smooth * frequencies
    return torch.where(wavelengths > original / low_freq_factor, slow,
                       torch.where(wavelengths < original / high_freq_factor, frequencies, blended))


class SwiGLU(nn.Module):
    """``proj(silu(gate) * up)``, the gate and up projections fused into ``gate_up``
    (rows: the gate's ``hidden``, then the up projection's)."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.gate_up = Linear(n_embd, 2 * hidden, bias=False)
        self.proj = Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(mark(F.silu(gate), F.silu, gate) * up)


class LlamaBlock(PreNormBlock):
    """One Llama layer: RMSNorms, grouped-query attention with rotary positions, SwiGLU."""

    def __init__(self, config: LlamaConfig):
        rotary = Rotary(config.n_embd // config.n_head, config.rope_theta, config.rope_scaling)
        super().__init__(lambda: nn.RMSNorm(config.n_embd, eps=config.norm_eps),
                         CausalSelfAttention(config.n_embd, config.n_head, config.n_kv_head, bias=False, rotary=rotary),
                         SwiGLU(config.n_embd, config.ffn_hidden))


class Llama(Decoder):
    """A Llama-family model: ``model(tokens)`` gives logits [B, T, V];
    ``model(tokens, targets)`` the mean cross-entropy over all tokens.

    Built, split and initialised as every :class:`~pipeloom.nn.decoder.Decoder`
    (GPT-2's initialisation: std 0.02, the output projections ``attn.proj``
    and ``mlp.proj`` scaled by ``1/sqrt(2 * n_layer)``, RMSNorms one), or with
    the weights of a safetensors file (:meth:`load_safetensors`).
    """

    @staticmethod
    def block(config: LlamaConfig) -> LlamaBlock:
        return LlamaBlock(config)

    @staticmethod
    def norm(config: LlamaConfig) -> nn.Module:
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)

    #: Tensors of Hugging Face's checkpoints that are not weights: the rotary tables some hold.
    hf_extras = (".rotary_emb.inv_freq",)

    def hf_names(self) -> dict[str, list[HFTensor]]:
        """Each unsplit parameter's Hugging Face tensors, stacked by rows into it (the fused
        ``qkv``: q, k, v; ``gate_up``: gate, up). A tied LM head has none (Hugging Face's tied
        checkpoints hold only ``model.embed_tokens.weight``)."""
        c = self.config
        kv, f = c.n_kv_head * (c.n_embd // c.n_head), c.ffn_hidden
        names = {"wte.weight": [HFTensor("model.embed_tokens.weight", c.vocab_size)],
                 "ln_f.weight": [HFTensor("model.norm.weight", c.n_embd)]}
        if not c.tie_embeddings:
            names["lm_head.weight"] = [HFTensor("lm_head.weight", c.vocab_size)]
        for i in range(c.n_layer):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            names[ours + "ln_1.weight"] = [HFTensor(theirs + "input_layernorm.weight", c.n_embd)]
            names[ours + "attn.qkv.weight"] = [HFTensor(theirs + f"self_attn.{x}_proj.weight", rows)
                                               for x, rows in (("q", c.n_embd), ("k", kv), ("v", kv))]
            names[ours + "attn.proj.weight"] = [HFTensor(theirs + "self_attn.o_proj.weight", c.n_embd)]
            names[ours + "ln_2.weight"] = [HFTensor(theirs + "post_attention_layernorm.weight", c.n_embd)]
            names[ours + "mlp.gate_up.weight"] = [HFTensor(theirs + f"mlp.{x}_proj.weight", f) for x in ("gate", "up")]
            names[ours + "mlp.proj.weight"] = [HFTensor(theirs + "mlp.down_proj.weight", c.n_embd)]
        return names
