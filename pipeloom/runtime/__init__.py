"""The runtime (layer 6): executes any valid schedule on torch.distributed."""

from .p2p import PeerTimeout
from .pipeline import Pipeline, TimedAction

__all__ = ["Pipeline", "PeerTimeout", "TimedAction"]
