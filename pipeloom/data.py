"""Training data for ``pipeloom train``: a token stream and deterministic batches from it.

Three sources, all one flat stream of token ids:

- the built-in corpus (no path): the Python standard library's own source
  files, present on every machine;
- a text file, or a directory of them (every file without NUL bytes, in
  sorted path order);
- a binary token file (``*.bin``, or any file with ``token_dtype``): token ids
  as ``uint16`` or ``uint32``, memory-mapped, never read whole.

Text is tokenized by bytes (one token per byte, vocabulary 256) or by BPE:
a byte-level BPE tokenizer of the ``tokenizers`` package, trained on the text
itself to ``vocab_size`` tokens or loaded from a ``tokenizer.json``. A BPE
tokenizer and the token stream it makes are cached (``$PIPELOOM_CACHE``,
default ``~/.cache/pipeloom``), keyed by the files, their sizes and times,
and the tokenizer.

Batches are drawn at random positions from a generator seeded by (seed, step),
so step ``n`` sees the same batch in an uninterrupted run and after a resume.
:meth:`TokenData.split` holds out the end of the stream for validation.
:class:`TextCodec` turns text into a run's token ids and back (``pipeloom generate``).
Pure numpy: nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .errors import PipeloomError

BYTE_VOCAB = 256
BPE_VOCAB = 32_000  # the default size of a trained BPE vocabulary
TOKEN_DTYPES = ("uint16", "uint32")
# Library code only: the test suites and the IDE are left out of the default corpus.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True)
class TokenData:
    """A stream of token ids below ``vocab_size``, and where it came from. ``tokenizer``
    made the ids from text: ``"bytes"``, the path of a BPE ``tokenizer.json``, or None
    (a token file: ids from elsewhere)."""

    tokens: np.ndarray
    vocab_size: int
    source: str
    tokenizer: str | None = "bytes"

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, fraction: float) -> tuple[TokenData, TokenData]:
        """(training, validation): the stream without its last ``fraction`` (rounded to whole
        tokens), and that last part, held out; the same for the same data every time."""
        if not 0 <= fraction < 1:
            raise PipeloomError(f"--val-fraction {fraction:g}: hold out a share of the data in [0, 1)")
        cut = len(self.tokens) - round(len(self.tokens) * fraction)
        return (replace(self, tokens=self.tokens[:cut]),
                replace(self, tokens=self.tokens[cut:], source=f"the last {fraction:g} of {self.source}"))

    def check_length(self, seq: int) -> None:
        """Refuse a stream shorter than one sequence of ``seq`` tokens and its target."""
        if len(self.tokens) < seq + 1:
            raise PipeloomError(
                f"{self.source} has {len(self.tokens)} tokens, fewer than one sequence of --seq {seq} "
                f"plus its target; use --seq {max(1, len(self.tokens) - 1)} or less, or more data"
            )

    def batch(self, step: int, size: int, seq: int, seed: int = 0) -> np.ndarray:
        """``size`` windows of ``seq + 1`` consecutive tokens (int64 [size, seq + 1]),
        the same for the same (seed, step) on every rank and every run."""
        self.check_length(seq)
        starts = np.random.default_rng([seed, step]).integers(0, len(self.tokens) - seq, size=size)
        return np.stack([self.tokens[s:s + seq + 1] for s in starts]).astype(np.int64)


def load_data(path: str | os.PathLike | None = None, token_dtype: str | None = None,
              vocab_size: int | None = None, tokenizer: str = "bytes") -> TokenData:
    """The token stream at ``path`` (see the module docstring); the built-in corpus if None.

    ``token_dtype`` reads ``path`` as a token file; ``vocab_size`` declares a
    token file's vocabulary (by default its largest id plus one), or the size
    of a BPE vocabulary to train. ``tokenizer`` ("bytes", "bpe", or the path
    of a ``tokenizer.json``) tokenizes text.
    """
    if path is None:
        files, source = stdlib_sources(), "the built-in corpus (Python standard library sources)"
    else:
        path = Path(path)
        if not path.exists():
            raise PipeloomError(f"--data {path}: no such file or directory")
        if path.is_dir():
            files = _text_files(path)
            source = f"{path} ({len(files)} text files)"
            if not files:
                raise PipeloomError(f"--data {path}: the directory holds no non-empty text file")
        elif path.stat().st_size == 0:
            raise PipeloomError(f"--data {path}: the file is empty")
        elif token_dtype is not None or path.suffix == ".bin":
            if tokenizer != "bytes":
                raise PipeloomError(f"--data {path} is a token file, already tokenized; drop --tokenizer")
            return _token_file(path, token_dtype or "uint16", vocab_size)
        else:
            files, source = [path], str(path)
    if tokenizer == "bytes":
        return _bytes_data(files, source)
    return _bpe_data(files, source, tokenizer, vocab_size or BPE_VOCAB)


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
    return TokenData(data, BYTE_VOCAB, source, "bytes")


def _bpe_data(files: list[Path], source: str, tokenizer: str, vocab_size: int) -> TokenData:
    """``files`` as BPE tokens: a tokenizer trained on them (``tokenizer == "bpe"``) or
    loaded from ``tokenizer``; both it and the tokens are cached."""
    try:
        import tokenizers
    except ImportError:
        raise PipeloomError("--tokenizer needs the tokenizers package: pip install 'pipeloom[bpe]'") from None
    if tokenizer != "bpe" and not Path(tokenizer).is_file():
        raise PipeloomError(f"--tokenizer {tokenizer}: no such file; use bytes, bpe, or the path of a tokenizer.json")
    if tokenizer == "bpe" and vocab_size < BYTE_VOCAB:
        raise PipeloomError(f"--vocab-size {vocab_size}: a byte-level BPE vocabulary needs at least {BYTE_VOCAB}")
    key = hashlib.sha1(json.dumps([
        tokenizers.__version__, tokenizer, vocab_size if tokenizer == "bpe" else _stamp(Path(tokenizer)),
        [_stamp(f) for f in files]]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PIPELOOM_CACHE", Path.home() / ".cache" / "pipeloom")) / "bpe"
    tokens_path, tokenizer_path = cache / f"{key}.tokens", cache / f"{key}.tokenizer.json"
    if not tokens_path.is_file():
        model = _train_bpe(files, vocab_size) if tokenizer == "bpe" else tokenizers.Tokenizer.from_file(tokenizer)
        texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
        ids = np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in model.encode_batch(texts)])
        vocab = model.get_vocab_size()
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomically(tokenizer_path, model.to_str().encode())
        _write_atomically(tokens_path, ids.astype(np.uint16 if vocab <= 1 << 16 else np.uint32).tobytes())
    vocab = tokenizers.Tokenizer.from_file(str(tokenizer_path)).get_vocab_size()
    tokens = np.memmap(tokens_path, dtype=np.uint16 if vocab <= 1 << 16 else np.uint32, mode="r")
    return TokenData(tokens, vocab, f"{source}, BPE {vocab} tokens ({len(tokens)} tokens)", str(tokenizer_path))


def _train_bpe(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train([str(f) for f in files], trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return model


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a concurrent reader (another rank) never sees half of it."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


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


#: The largest vocabulary a token file may imply (the largest of published models are about 256k).
MAX_VOCAB = 2**20


def _token_file(path: Path, dtype: str, vocab_size: int | None) -> TokenData:
    if dtype not in TOKEN_DTYPES:
        raise PipeloomError(f"--token-dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise PipeloomError(f"--data {path}: {size} bytes is not a whole number of {dtype} tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    largest = int(tokens.max())
    if largest >= MAX_VOCAB:
        raise PipeloomError(f"--data {path} read as {dtype} tokens has ids up to {largest:,}, a vocabulary no model "
                            f"has (pipeloom takes up to {MAX_VOCAB:,} tokens): is it text (leave out --token-dtype) "
                            "or tokens of another --token-dtype?")
    if vocab_size is None:
        vocab_size = largest + 1
    elif vocab_size <= largest:
        raise PipeloomError(f"--vocab-size {vocab_size} is too small for {path}, whose largest token id is "
                            f"{largest}; use at least {largest + 1}")
    return TokenData(tokens, vocab_size, f"{path} ({len(tokens)} {dtype} tokens)", None)


class TextCodec:
    """Text to a run's token ids and back: by bytes (:meth:`by_bytes`), or by a BPE
    tokenizer (:meth:`by_bpe`, from its ``tokenizer.json`` text)."""

    def __init__(self, name: str, encode, decode):
        self.name, self._encode, self._decode = name, encode, decode

    @classmethod
    def by_bytes(cls) -> TextCodec:
        return cls("bytes", lambda text: list(text.encode("utf-8")),
                   lambda ids: bytes(ids).decode("utf-8", errors="replace"))

    @classmethod
    def by_bpe(cls, json_text: str) -> TextCodec:
        try:
            import tokenizers
        except ImportError:
            raise PipeloomError("this model's BPE tokenizer needs the tokenizers package: "
                                "pip install 'pipeloom[bpe]'") from None
        try:
            model = tokenizers.Tokenizer.from_str(json_text)
        except Exception as err:  # noqa: BLE001 -- the tokenizers package's own errors
            raise PipeloomError(f"the BPE tokenizer cannot be read: {err}") from None
        return cls("bpe", lambda text: model.encode(text).ids, lambda ids: model.decode(list(ids)))

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids) -> str:
        return self._decode([int(i) for i in ids])
