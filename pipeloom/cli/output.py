"""What the commands say about the files they write."""

from __future__ import annotations

import sys


def wrote(path) -> None:
    """Say on stderr that ``path`` was written."""
    print(f"wrote {path}", file=sys.stderr)
