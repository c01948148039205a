"""Model sizes by name: the one table that the torch models and the simulator read.

Every preset is a simulator model (:data:`pipeloom.sim.MODELS`) and a torch
model's config of its ``family``: a GPT (:data:`pipeloom.nn.gpt.PRESETS`) or a
Llama (:data:`pipeloom.nn.llama.PRESETS`); those without a ``block_size`` take
their context length from the run (``pipeloom train --seq``).
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PipeloomError

# GPT-2 BPE vocabulary (50257) padded by Megatron-LM to a multiple of 128.
_GPT2_VOCAB = 50304


#: The model families: GPT-2-style (LayerNorm, learned positions, GELU MLP 4x wide, biases) and
#: Llama-style (RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention, no biases).
FAMILIES = ("gpt", "llama")


@dataclass(frozen=True)
class ModelSize:
    """A decoder's sizes: ``layers`` layers of width ``hidden`` with ``heads``
    heads, a ``vocab``-token embedding (the LM head's weight when ``tied``);
    ``block_size``, the longest sequence, for the presets that the torch
    models run (None: simulator only).

    ``family`` "gpt": an MLP 4 times as wide. ``family`` "llama": ``kv_heads``
    key/value heads (grouped-query attention; None: ``heads``), a SwiGLU MLP
    of width ``ffn_hidden``, rotary positions of base ``rope_theta``, and
    ``rope_scaling``, Llama 3.1's stretch of the rotary frequencies for long
    contexts, as (factor, low-frequency factor, high-frequency factor, the
    original context length), or None, and RMSNorms of epsilon ``norm_eps``."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    tied: bool = False
    block_size: int | None = None
    family: str = "gpt"
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: tuple[float, float, float, int] | None = None
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise PipeloomError(f"ModelSize: family must be one of {', '.join(FAMILIES)}, got {self.family!r}")


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int, **options) -> ModelSize:
    """A Llama-family :class:`ModelSize`."""
    return ModelSize(layers, hidden, heads, vocab, family="llama", kv_heads=kv_heads, ffn_hidden=ffn_hidden, **options)


# Llama 3: the 128k tiktoken vocabulary (128000 tokens + 256 special ones), rotary base 500000.
_LLAMA3_VOCAB = 128_256
_LLAMA3_THETA = 500_000.0


#: Model sizes by lowercase name.
SIZES: dict[str, ModelSize] = {
    # Zero Bubble Pipeline Parallelism (Qi et al., ICLR 2024), the models of
    # its table of profiled costs: Megatron-LM GPT. The paper states no V;
    # 50304 is Megatron's padded GPT-2 size. Tied, Megatron's default: the
    # tied parameter counts match the names (1.52B, 6.25B, 14.7B, 28.4B).
    "1.5b": ModelSize(22, 2304, 24, _GPT2_VOCAB, tied=True),
    "6.2b": ModelSize(30, 4096, 32, _GPT2_VOCAB, tied=True),
    "14.6b": ModelSize(46, 5120, 40, _GPT2_VOCAB, tied=True),
    "28.3b": ModelSize(62, 6144, 48, _GPT2_VOCAB, tied=True),
    # Balancing Pipeline Parallelism with Vocabulary Parallelism (Yeung et
    # al., 2024), "Settings used in experiments on 1F1B" (8 / 16 / 32 GPUs);
    # the paper sweeps V over 32k/64k/128k/256k (k = 1000 in its artifact
    # configs); 128k is the preset here. Untied: its implementation needs that.
    "4b": ModelSize(32, 3072, 24, 128_000),
    "10b": ModelSize(48, 4096, 32, 128_000),
    "21b": ModelSize(64, 5120, 40, 128_000),
    # A model small enough for tests and a CPU run.
    "tiny": ModelSize(4, 32, 4, 256, block_size=256),
    # GPT-3 paper (Brown et al., 2020), Table 2.1: Small, Medium, XL, with
    # tied embeddings as in GPT-2/3. XL lists 24 heads, which do not divide
    # 2048; 16 heads keeps its d_head = 128. GPT-2 vocabulary as padded by
    # Megatron-LM.
    "gpt-125m": ModelSize(12, 768, 12, _GPT2_VOCAB, tied=True, block_size=1024),
    "gpt-350m": ModelSize(24, 1024, 16, _GPT2_VOCAB, tied=True, block_size=1024),
    "gpt-1.3b": ModelSize(24, 2048, 16, _GPT2_VOCAB, tied=True, block_size=1024),
    # Llama-style decoders. A small one for tests and a CPU run (rotary base 10000, as Llama 1 and 2).
    "llama-tiny": llama(4, 32, 4, 2, 96, 256, block_size=256),
    # Llama 3.2 1B (its Hugging Face config.json): tied embeddings, a 128k context by Llama 3.1's
    # rotary scaling (factor 32 of an 8192-token original).
    "llama-1b": llama(16, 2048, 32, 8, 8192, _LLAMA3_VOCAB, tied=True, block_size=131_072, rope_theta=_LLAMA3_THETA,
                      rope_scaling=(32.0, 1.0, 4.0, 8192)),
    # Llama 3 8B and 70B ("The Llama 3 Herd of Models", Table 3; Meta-Llama-3-8B/-70B config.json):
    # untied, an 8192-token context.
    "llama-8b": llama(32, 4096, 32, 8, 14336, _LLAMA3_VOCAB, block_size=8192, rope_theta=_LLAMA3_THETA),
    "llama-70b": llama(80, 8192, 64, 8, 28672, _LLAMA3_VOCAB, block_size=8192, rope_theta=_LLAMA3_THETA),
}
