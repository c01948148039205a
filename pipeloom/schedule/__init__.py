"""The schedule language (layer 1): actions, schedules, families, validator.

Pure Python: nothing here imports torch.
"""

from .costs import Costs, StageCosts
from .forward import forward_only
from .ir import BW, B, F, W, Action, Schedule, looped_placement, v_placement
from .kinds import KINDS, Kind
from .lower import RECV_B, RECV_F, SEND_B, SEND_F, lower
from .registry import FAMILIES, build, get_family
from .transforms import Transform
from .transforms.kfac import Kfac
from .transforms.offload import OFFLOAD, OFFLOAD_W, RELOAD, RELOAD_W, Offload
from .transforms.vocab import VOCAB_PASSES, VocabPasses, add_vocab_passes
from .torch_csv import TORCH_SCHEDULES, from_torch, to_torch_csv, write_torch_csv
from .validate import validate
from . import families  # noqa: E402,F401  (registers the built-in families)

__all__ = [
    "Action", "Schedule", "Costs", "StageCosts", "F", "B", "W", "BW",
    "FAMILIES", "build", "get_family", "validate", "forward_only", "looped_placement", "v_placement",
    "to_torch_csv", "write_torch_csv", "from_torch", "TORCH_SCHEDULES", "VOCAB_PASSES", "add_vocab_passes",
    "lower", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "KINDS", "Kind",
    "Transform", "VocabPasses", "Offload", "OFFLOAD", "RELOAD", "OFFLOAD_W", "RELOAD_W", "Kfac",
]
