"""The simulator (layer 2): predicted time and memory of schedules, and their pictures.

Pure Python: nothing here imports torch.
"""

from ..schedule.costs import Costs, StageCosts
from .simulate import Event, RankStats, Result, simulate

__all__ = ["Costs", "StageCosts", "Event", "RankStats", "Result", "simulate"]
