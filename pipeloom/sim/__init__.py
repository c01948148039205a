"""The simulator (layer 2): predicted time and memory of schedules, and their pictures.

Pure Python: nothing here imports torch.
"""

from ..partition import balanced_layers, split_layers
from ..schedule.costs import Costs, StageCosts
from .simulate import Event, RankStats, Result, simulate
from .grid import text_grid
from .plot import plot_rank_comparison, plot_schedule, plot_schedules
from .trace import Transfer, chrome_trace, chrome_trace_events, transfers_of, write_chrome_trace
from .kfac import kfac_report, without_pieces
from .specs import DEVICES, MODELS, Device, ModelSpec, get_device, get_model
from .formulas import ATTENTIONS, SequenceParallelCosts, kfac_costs, layer_flops, sequence_parallel_costs
from .stages import stage_layers, stage_parameters
from .memory import BYTES_PER_PARAM, peak_memory_bytes
from .model import costs_from_model, longest_sequence
from .profile import Profile, load_profile

__all__ = ["Costs", "StageCosts", "Event", "RankStats", "Result", "simulate"]
__all__ += [
    "BYTES_PER_PARAM", "DEVICES", "MODELS", "Device", "ModelSpec", "balanced_layers", "costs_from_model", "get_device",
    "get_model", "kfac_costs",
    "layer_flops", "peak_memory_bytes", "split_layers", "stage_parameters",
    "ATTENTIONS", "SequenceParallelCosts", "kfac_report", "without_pieces", "longest_sequence", "sequence_parallel_costs", "stage_layers",
    "Profile", "load_profile",
]
__all__ += [
    "text_grid", "plot_schedule", "plot_schedules", "plot_rank_comparison", "Transfer", "chrome_trace",
    "chrome_trace_events", "transfers_of", "write_chrome_trace",
]
