"""Every model family by preset name: one path from a preset (or any model size) to its config,
whose ``build`` gives the model."""

from __future__ import annotations

from ..errors import PipeloomError
from ..presets import SIZES, ModelSize
from ..sim.specs import ModelSpec, decoder_spec
from . import gpt, llama
from .gpt import GPTConfig
from .llama import LlamaConfig

#: The config class of each family of :data:`pipeloom.presets.FAMILIES`.
CONFIGS = {"gpt": GPTConfig, "llama": LlamaConfig}
#: Each family's config fields of a :class:`~pipeloom.presets.ModelSize`.
_FIELDS = {"gpt": gpt.config_fields, "llama": llama.config_fields}


def preset_config(name: str, **overrides) -> GPTConfig | LlamaConfig:
    """The config of the preset ``name`` (any family; see :data:`pipeloom.presets.SIZES`) with
    ``overrides`` applied; ``preset_config(name).build(device)`` makes its model."""
    if name not in SIZES:
        raise PipeloomError(f"unknown model preset {name!r}; presets: {', '.join(SIZES)}")
    return CONFIGS[SIZES[name].family].preset(name, **overrides)


def size_config(size: ModelSize, **overrides) -> GPTConfig | LlamaConfig:
    """The config of the model ``size`` (a preset's, or a Hugging Face directory's) with ``overrides`` applied."""
    return CONFIGS[size.family](**{**_FIELDS[size.family](size), **overrides})


def model_spec(config: GPTConfig | LlamaConfig, name: str = "custom") -> ModelSpec:
    """The simulator's model of ``config`` (what a profile says it measured)."""
    family = next(f for f, kind in CONFIGS.items() if isinstance(config, kind))
    return decoder_spec(name, family, config.n_layer, config.n_embd, config.n_head, config.vocab_size,
                        config.tie_embeddings, getattr(config, "n_kv_head", None), getattr(config, "ffn_hidden", None))
