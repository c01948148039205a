"""Generators of every schedule family; importing this registers them all."""

from . import classic  # noqa: F401
from . import vshape  # noqa: F401
from . import auto, zero_bubble  # noqa: F401
from . import dualpipe  # noqa: F401
