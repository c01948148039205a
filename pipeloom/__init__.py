"""pipeloom: plan, simulate, draw and run pipeline-parallel training."""

__version__ = "0.1.0"
