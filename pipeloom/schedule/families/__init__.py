"""Generators of every schedule family; importing this registers them all."""

from . import classic  # noqa: F401
