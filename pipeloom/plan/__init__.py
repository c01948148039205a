"""The planner (layer 3): the layout that trains a model fastest on a cluster within its memory.

From a model, a sequence length, a global batch and a cluster (GPUs, memory,
two tiers of links), optionally a measured profile, it searches pipeline
depth, data- and sequence-parallel widths, microbatch size and count, schedule
family and chunks, recomputation, vocabulary parallelism, offload and, where
asked, the optimizer (K-FAC); each layout is costed with the simulator
(:mod:`pipeloom.plan.evaluate`) and the search is pruned by bounds
(:mod:`pipeloom.plan.search`). Pure Python: nothing here imports torch.
"""

from .cluster import Cluster
from .command import candidate_of, command
from .evaluate import Costing, Plan, evaluate, schedule_of
from .search import Search, exhaustive, search
from .space import Candidate, PlanRequest, candidates

__all__ = ["Candidate", "Cluster", "Costing", "Plan", "PlanRequest", "Search", "candidate_of", "candidates",
           "command", "evaluate", "exhaustive", "schedule_of", "search"]
