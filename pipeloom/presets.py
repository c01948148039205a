"""Model sizes by name: the one table that the GPT model and the simulator read.

Every preset is a simulator model (:data:`pipeloom.sim.MODELS`) and a GPT
config (:data:`pipeloom.nn.gpt.PRESETS`); those without a ``block_size`` take
their context length from the run (``pipeloom train --seq``).
Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# GPT-2 BPE vocabulary (50257) padded by Megatron-LM to a multiple of 128.
_GPT2_VOCAB = 50304


@dataclass(frozen=True)
class ModelSize:
    """A GPT-style decoder's sizes: ``layers`` layers of width ``hidden`` with
    ``heads`` heads, a ``vocab``-token embedding (the LM head's weight when
    ``tied``) and an MLP 4 times as wide; ``block_size``, the longest sequence,
    for the presets that :class:`~pipeloom.nn.GPT` runs (None: simulator only)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    tied: bool = False
    block_size: int | None = None


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
}
