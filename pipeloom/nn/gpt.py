"""The GPT reference model.

:class:`GPT` is a pre-LayerNorm decoder-only transformer (GPT-2 layout):
token and learned position embeddings, ``n_layer`` blocks
(``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``), a final LayerNorm and an
LM head. Every linear layer is a :class:`~pipeloom.nn.linear.Linear`, so a
runtime can defer its weight gradient (the B/W split).

The split into stages (:class:`GPTStage`, which is
:class:`~pipeloom.nn.decoder.DecoderStage`), the meta-device build and the
initialisation are every decoder's: :mod:`pipeloom.nn.decoder`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PipeloomError
from ..presets import SIZES
from .decoder import (CausalSelfAttention, Decoder, DecoderConfig, DecoderStage, HFTensor, PreNormBlock,
                      SequenceParallel, embedding, positions_of, sequence_length, set_sequence_parallel)
from .linear import Linear
from .recompute import mark

__all__ = ["PRESETS", "GPT", "GPTConfig", "GPTStage", "Block", "MLP", "CausalSelfAttention", "SequenceParallel",
           "set_sequence_parallel"]


def config_fields(size) -> dict:
    """The :class:`GPTConfig` fields of a GPT-family :class:`~pipeloom.presets.ModelSize`."""
    return dict(n_layer=size.layers, n_embd=size.hidden, n_head=size.heads, vocab_size=size.vocab,
                block_size=size.block_size, tie_embeddings=size.tied)


#: Config presets by name: every GPT size of :data:`pipeloom.presets.SIZES` (``block_size`` None where
#: the preset sets no context length: give one, as `pipeloom train` does with --seq).
PRESETS: dict[str, dict] = {name: config_fields(size) for name, size in SIZES.items() if size.family == "gpt"}

#: A GPT's pipeline stage: every decoder's (see :class:`~pipeloom.nn.decoder.DecoderStage`).
GPTStage = DecoderStage


@dataclass(frozen=True)
class GPTConfig(DecoderConfig):
    """Sizes of a :class:`GPT`. ``bias`` applies to the linear layers and
    LayerNorms (never the LM head); ``tie_embeddings`` makes the LM head
    weight the token embedding weight."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    presets = PRESETS

    def __post_init__(self):
        self._check_sizes(("n_layer", "n_embd", "n_head", "vocab_size", "block_size"))
        if not 0.0 <= self.dropout < 1.0:
            raise PipeloomError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")

    def build(self, device: str | torch.device | None = None) -> GPT:
        """The model of this config: ``GPT(self, device)``."""
        return GPT(self, device)


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with a 4x wider hidden layer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.drop(self.proj(mark(self.gelu(h), self.gelu, h)))


class Block(PreNormBlock):
    """One GPT layer: LayerNorms, multi-head attention, the GELU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__(lambda: nn.LayerNorm(config.n_embd, bias=config.bias),
                         CausalSelfAttention(config.n_embd, config.n_head, bias=config.bias, dropout=config.dropout),
                         MLP(config))


class GPT(Decoder):
    """The reference model: ``model(tokens)`` gives logits [B, T, V];
    ``model(tokens, targets)`` the mean cross-entropy over all tokens.

    Initialisation is GPT-2's (normal, std 0.02; residual projections scaled
    by ``1/sqrt(2 * n_layer)``; zero biases; LayerNorms one and zero). Each
    parameter is drawn from a generator of its own, seeded by its name and
    ``init_seed``, a number drawn from torch's default generator at
    construction: so the same seed gives the same weights on every rank, and
    on any device. ``device`` is where the parameters go (default: torch's
    default device); on ``"meta"`` (or under ``torch.device("meta")``) the
    model is only described, no storage allocated, and :meth:`build_stages`
    materialises the stages a rank runs with the weights the whole model
    would have had (:class:`~pipeloom.nn.decoder.Decoder`).
    """

    @staticmethod
    def block(config: GPTConfig) -> Block:
        return Block(config)

    @staticmethod
    def norm(config: GPTConfig) -> nn.Module:
        return nn.LayerNorm(config.n_embd, bias=config.bias)

    #: Tensors of GPT-2's checkpoints that are not weights: the causal masks older ones hold.
    hf_extras = (".attn.bias", ".attn.masked_bias")

    def hf_names(self) -> dict[str, list[HFTensor]]:
        """Each unsplit parameter's tensor in Hugging Face's GPT-2 checkpoints (``GPT2LMHeadModel``):
        the linear layers' weights are ``Conv1D``'s, stored transposed. A tied LM head has none."""
        c = self.config
        names = {"wte.weight": [HFTensor("transformer.wte.weight", c.vocab_size)],
                 "wpe.weight": [HFTensor("transformer.wpe.weight", c.block_size)]}
        if not c.tie_embeddings:
            names["lm_head.weight"] = [HFTensor("lm_head.weight", c.vocab_size)]
        for kind in ("weight", "bias") if c.bias else ("weight",):
            names[f"ln_f.{kind}"] = [HFTensor(f"transformer.ln_f.{kind}", c.n_embd)]
            for i in range(c.n_layer):
                for ours, (theirs, width) in _GPT2_BLOCK.items():
                    linear = kind == "weight" and not ours.startswith("ln_")
                    names[f"blocks.{i}.{ours}.{kind}"] = [
                        HFTensor(f"transformer.h.{i}.{theirs}.{kind}", width * c.n_embd, linear)]
        return names

    @staticmethod
    def inputs(config: GPTConfig) -> dict[str, nn.Module]:
        """The learned position embeddings ``wpe`` and the embeddings' dropout ``drop``."""
        return {"wpe": embedding(config.block_size, config.n_embd), "drop": nn.Dropout(config.dropout)}

    @staticmethod
    def add_positions(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``x`` [B, T, C] plus ``module``'s position embeddings, through its
        dropout: positions 0..T-1, or with sequence parallelism those of this rank's tokens."""
        sequence_length(module, x)
        return module.drop(x + module.wpe(positions_of(module, x)))


#: A GPT block's modules: their names in GPT-2's checkpoints and their output width in n_embd.
_GPT2_BLOCK = {"ln_1": ("ln_1", 1), "attn.qkv": ("attn.c_attn", 3), "attn.proj": ("attn.c_proj", 1),
               "ln_2": ("ln_2", 1), "mlp.fc": ("mlp.c_fc", 4), "mlp.proj": ("mlp.c_proj", 1)}
