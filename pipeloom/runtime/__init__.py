"""The runtime (layer 6): executes any valid schedule on torch.distributed."""

from .p2p import PeerTimeout
from .context import TimedAction
from .pipeline import Pipeline

__all__ = ["Pipeline", "PeerTimeout", "TimedAction"]
