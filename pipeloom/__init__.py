"""pipeloom: plan, simulate, draw and run pipeline-parallel training.

``import pipeloom`` stays light: the torch runtime loads on first use of
:class:`Pipeline`, so the schedule, simulator and planner need no torch.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "Pipeline":
        from .runtime import Pipeline

        return Pipeline
    raise AttributeError(f"module 'pipeloom' has no attribute {name!r}")
