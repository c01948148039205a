"""Every model family by preset name: one path from a preset to its config, whose ``build`` gives the model."""

from __future__ import annotations

from ..errors import PipeloomError
from ..presets import SIZES
from .gpt import GPTConfig
from .llama import LlamaConfig

#: The config class of each family of :data:`pipeloom.presets.FAMILIES`.
CONFIGS = {"gpt": GPTConfig, "llama": LlamaConfig}


def preset_config(name: str, **overrides) -> GPTConfig | LlamaConfig:
    """The config of the preset ``name`` (any family; see :data:`pipeloom.presets.SIZES`) with
    ``overrides`` applied; ``preset_config(name).build(device)`` makes its model."""
    if name not in SIZES:
        raise PipeloomError(f"unknown model preset {name!r}; presets: {', '.join(SIZES)}")
    return CONFIGS[SIZES[name].family].preset(name, **overrides)
