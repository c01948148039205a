"""Training data for ``pipeloom train``: a token stream and deterministic batches from it.

Three sources, all one flat stream of token ids:

- the built-in corpus (no path): the Python standard library's own source
  files, present on every machine, read as bytes (a byte-level tokenizer:
  one token per byte, vocabulary 256);
- a text file, or a directory of them (every file without NUL bytes, in
  sorted path order), also as bytes;
- a binary token file (``*.bin``, or any file with ``token_dtype``): token ids
  as ``uint16`` or ``uint32``, memory-mapped, never read whole.

Batches are drawn at random positions from a generator seeded by (seed, step),
so step ``n`` sees the same batch in an uninterrupted run and after a resume.
Pure numpy: nothing here imports torch.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PipeloomError

BYTE_VOCAB = 256
TOKEN_DTYPES = ("uint16", "uint32")
# Library code only: the test suites and the IDE are left out of the default corpus.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True)
class TokenData:
    """A stream of token ids below ``vocab_size``, and where it came from."""

    tokens: np.ndarray
    vocab_size: int
    source: str

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, size: int, seq: int, seed: int = 0) -> np.ndarray:
        """``size`` windows of ``seq + 1`` consecutive tokens (int64 [size, seq + 1]),
        the same for the same (seed, step) on every rank and every run."""
        if len(self.tokens) < seq + 1:
            raise PipeloomError(
                f"{self.source} has {len(self.tokens)} tokens, fewer than one sequence of --seq {seq} "
                f"plus its target; use --seq {max(1, len(self.tokens) - 1)} or less, or more data"
            )
        starts = np.random.default_rng([seed, step]).integers(0, len(self.tokens) - seq, size=size)
        return np.stack([self.tokens[s:s + seq + 1] for s in starts]).astype(np.int64)


def load_data(path: str | os.PathLike | None = None, token_dtype: str | None = None,
              vocab_size: int | None = None) -> TokenData:
    """The token stream at ``path`` (see the module docstring); the built-in corpus if None.

    ``token_dtype`` reads ``path`` as a token file; ``vocab_size`` declares a
    token file's vocabulary (by default its largest id plus one).
    """
    if path is None:
        return _bytes_data(stdlib_sources(), "the built-in corpus (Python standard library sources)")
    path = Path(path)
    if not path.exists():
        raise PipeloomError(f"--data {path}: no such file or directory")
    if path.is_dir():
        files = _text_files(path)
        if not files:
            raise PipeloomError(f"--data {path}: the directory holds no non-empty text file")
        return _bytes_data(files, f"{path} ({len(files)} text files)")
    if path.stat().st_size == 0:
        raise PipeloomError(f"--data {path}: the file is empty")
    if token_dtype is not None or path.suffix == ".bin":
        return _token_file(path, token_dtype or "uint16", vocab_size)
    return _bytes_data([path], str(path))


def stdlib_sources() -> list[Path]:
    """The ``.py`` files of this Python's standard library (tests left out), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        files += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
    return files


def _bytes_data(files: list[Path], source: str) -> TokenData:
    data = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    if data.size == 0:
        raise PipeloomError(f"{source}: no text to train on")
    return TokenData(data, BYTE_VOCAB, source)


def _text_files(root: Path) -> list[Path]:
    """Non-empty files under ``root`` (hidden ones left out) whose first 8 KiB hold no NUL byte."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            f = Path(folder, name)
            if name.startswith(".") or not f.is_file() or f.stat().st_size == 0:
                continue
            with f.open("rb") as stream:
                if b"\0" not in stream.read(8192):
                    files.append(f)
    return files


def _token_file(path: Path, dtype: str, vocab_size: int | None) -> TokenData:
    if dtype not in TOKEN_DTYPES:
        raise PipeloomError(f"--token-dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise PipeloomError(f"--data {path}: {size} bytes is not a whole number of {dtype} tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    largest = int(tokens.max())
    if vocab_size is None:
        vocab_size = largest + 1
    elif vocab_size <= largest:
        raise PipeloomError(f"--vocab-size {vocab_size} is too small for {path}, whose largest token id is "
                            f"{largest}; use at least {largest + 1}")
    return TokenData(tokens, vocab_size, f"{path} ({len(tokens)} {dtype} tokens)")
