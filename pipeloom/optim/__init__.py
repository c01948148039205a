"""Optimizers: K-FAC preconditioning of linear layers around a base optimizer (PipeFisher's core)."""

from .kfac import KFAC, KFACLayer

__all__ = ["KFAC", "KFACLayer"]
