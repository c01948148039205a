"""Output paths checked before any work, so a bad one stops a run at once, in one line.

A missing parent directory is created (as torchtitan and Megatron-LM do); a
path that cannot be written raises :class:`PipeloomError` naming the flag,
the path and why. Nothing here imports torch.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .errors import PipeloomError


def prepare_output(flag: str, path: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path`` ready to be written as a file (its name ending in one of ``suffixes``, if given)."""
    out = Path(path)
    if out.is_dir():
        raise PipeloomError(f"{flag} {path}: is a directory; give a file name")
    if suffixes and (why := suffix_problem(out, suffixes)):
        raise PipeloomError(f"{flag} {path}: {why}")
    _make_dir(flag, path, out.parent)
    existed = out.exists()
    try:
        with open(out, "a"):  # append: an existing file keeps its contents until it is written
            pass
    except OSError as err:
        raise PipeloomError(f"{flag} {path}: cannot write it: {err.strerror}") from None
    if not existed:
        out.unlink(missing_ok=True)  # another rank may have checked the same path
    return out


def prepare_output_dir(flag: str, path: str) -> Path:
    """``path`` as a directory that exists and can be written to."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise PipeloomError(f"{flag} {path}: is a file, not a directory")
    _make_dir(flag, path, out)
    try:
        tempfile.TemporaryFile(dir=out).close()  # a probe that leaves nothing behind
    except OSError as err:
        raise PipeloomError(f"{flag} {path}: cannot write in it: {err.strerror}") from None
    return out


def suffix_problem(path: Path, suffixes: tuple[str, ...]) -> str:
    """Why ``path`` does not end in one of ``suffixes`` ('' when it does)."""
    if path.suffix.lower() in suffixes:
        return ""
    got = repr(path.suffix) if path.suffix else "no suffix"
    return f"the file name must end in {' or '.join(suffixes)}, not {got}"


def _make_dir(flag: str, path: str, directory: Path) -> None:
    """Create ``directory`` and its parents, or say in one line why it cannot be."""
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p == p.parent)
    if existing.exists() and not existing.is_dir():
        raise PipeloomError(f"{flag} {path}: {existing} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PipeloomError(f"{flag} {path}: cannot create directory {directory}: {err.strerror}") from None
