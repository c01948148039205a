"""The built-in techniques, registered in the order their flags are listed."""

from . import compile, kfac, offload, recompute, sequence, versions, vocab  # noqa: F401 -- each registers itself
