"""Training data for ``pipeloom train``: a token stream and deterministic batches from it.

Four sources, all one flat stream of token ids:

- the built-in corpus (no path): the Python standard library's own source
  files, present on every machine;
- a text file, or a directory of them (every file without NUL bytes, in
  sorted path order);
- a dataset of documents (:mod:`pipeloom.documents`: JSON lines, Parquet, a
  ``datasets`` directory): each document's text, tokenized, then the
  tokenizer's end-of-text token (:func:`end_of_text`), packed one after another;
- a binary token file (``*.bin``, or any file with ``token_dtype``): token ids
  as ``uint16`` or ``uint32``, memory-mapped, never read whole.

Text is tokenized by bytes (one token per byte, vocabulary 256) or by BPE:
a byte-level BPE tokenizer of the ``tokenizers`` package, trained on the text
itself to ``vocab_size`` tokens (``<|endoftext|>`` among them) or loaded from
a ``tokenizer.json``. A BPE tokenizer and the token stream it makes, and a
dataset's stream, are cached (``$PIPELOOM_CACHE``, default ``~/.cache/pipeloom``),
keyed by the files, their sizes and times, the tokenizer and the text field.

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
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .documents import Documents, open_documents
from .errors import PipeloomError

BYTE_VOCAB = 256
BYTE_EOS = 0  # the byte tokenizer's end of text: see end_of_text
#: End-of-text tokens by their usual names (GPT-2's, Llama 3's, Llama 2's and Mistral's, Gemma's).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
LARGE = 64 << 20  # bytes of data above which tokenizing shows its progress even where stderr is no terminal
_CACHE_FORMAT = 2  # bumped when the cached streams or tokenizers change their meaning
BPE_VOCAB = 32_000  # the default size of a trained BPE vocabulary
TOKEN_DTYPES = ("uint16", "uint32")
# Library code only: the test suites and the IDE are left out of the default corpus.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True)
class TokenData:
    """A stream of token ids below ``vocab_size``, and where it came from. ``tokenizer``
    made the ids from text: ``"bytes"``, the path of a BPE ``tokenizer.json``, or None
    (a token file: ids from elsewhere); ``eos`` ends each document of a dataset (else None)."""

    tokens: np.ndarray
    vocab_size: int
    source: str
    tokenizer: str | None = "bytes"
    eos: int | None = None

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
              vocab_size: int | None = None, tokenizer: str = "bytes", text_field: str | None = None,
              progress: bool = False) -> TokenData:
    """The token stream at ``path`` (see the module docstring); the built-in corpus if None.

    Args:
        token_dtype: read ``path`` as a token file of this type.
        vocab_size: a token file's vocabulary (by default its largest id plus one),
            or the size of a BPE vocabulary to train.
        tokenizer: "bytes", "bpe" (trained on the text), or the path of a ``tokenizer.json``.
        text_field: the field of a dataset's documents that holds their text (default ``text``).
        progress: show a bar on stderr while tokenizing, when stderr is a terminal or the
            corpus is over :data:`LARGE` bytes (and ``tqdm`` is installed).
    """
    if path is None:
        files, source = stdlib_sources(), "the built-in corpus (Python standard library sources)"
    else:
        path = Path(path)
        if not path.exists():
            raise PipeloomError(f"--data {path}: no such file or directory")
        documents = open_documents(path, text_field or "text")
        if documents is not None:
            if token_dtype is not None:
                raise PipeloomError(f"--data {path} is a dataset of documents, not a token file; drop --token-dtype")
            return _tokenized(documents, documents.source, tokenizer, vocab_size, progress)
        if text_field is not None:
            raise PipeloomError(f"--text-field {text_field}: --data {path} is not a dataset of documents "
                                "(JSON lines, Parquet or a datasets directory)")
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
    return _tokenized(_TextFiles(tuple(files)), source, tokenizer, vocab_size, progress)


def end_of_text(tokenizer: str | os.PathLike) -> int:
    """The id that ends each document of a dataset tokenized by ``tokenizer``.

    - ``"bytes"``: 0, the NUL byte. The 256 byte ids leave no spare one; NUL is a single token
      that text hardly ever holds (a file with one is skipped as binary here), where the
      other candidate, a blank line, is two tokens that most documents hold within them.
    - the path of a ``tokenizer.json``: the ``eos_token`` of the ``tokenizer_config.json``
      beside it (a Hugging Face model directory's), else the first of :data:`EOS_NAMES` in its
      vocabulary (pipeloom's trained BPE reserves ``<|endoftext|>``).
    """
    if str(tokenizer) == "bytes":
        return BYTE_EOS
    import tokenizers

    model = tokenizers.Tokenizer.from_file(str(tokenizer))
    config = Path(tokenizer).with_name("tokenizer_config.json")
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    if eos is not None:
        name = eos["content"] if isinstance(eos, dict) else eos
        if model.token_to_id(name) is None:
            raise PipeloomError(f"--tokenizer {tokenizer}: the eos_token {name!r} of {config} is not in its vocabulary")
        return model.token_to_id(name)
    for name in EOS_NAMES:
        if model.token_to_id(name) is not None:
            return model.token_to_id(name)
    raise PipeloomError(f"--tokenizer {tokenizer} has no end-of-text token to end each document with: no eos_token "
                        f"in a tokenizer_config.json beside it, and none of {', '.join(EOS_NAMES)} in its vocabulary")


def read_tokenizer(path: str | os.PathLike, flag: str):
    """The ``tokenizers.Tokenizer`` saved in ``path`` (a ``tokenizer.json``), or one line naming
    ``flag`` and the file where it is not one."""
    try:
        import tokenizers
    except ImportError:
        raise PipeloomError(f"{flag} needs the tokenizers package: pip install 'pipeloom[bpe]'") from None
    try:
        return tokenizers.Tokenizer.from_str(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise PipeloomError(f"{flag} {path}: not a tokenizer.json (not UTF-8 text)") from None
    except Exception as err:  # noqa: BLE001 -- the tokenizers package's own errors
        raise PipeloomError(f"{flag} {path}: not a tokenizers tokenizer.json ({err})") from None


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


@dataclass(frozen=True)
class _TextFiles:
    """Text files, each one text (bytes that are not UTF-8 replaced); :class:`Documents`' interface."""

    files: tuple[Path, ...]

    def count(self) -> int:
        return len(self.files)

    def batches(self):
        for f in self.files:
            yield [f.read_bytes().decode("utf-8", errors="replace")]


def _tokenized(texts: _TextFiles | Documents, source: str, tokenizer: str, vocab_size: int | None,
               progress: bool) -> TokenData:
    """``texts`` as tokens of ``tokenizer`` ("bytes", "bpe": a BPE trained on them, or the path of a
    ``tokenizer.json``), each document followed by the end-of-text token; the stream and a BPE
    tokenizer are cached."""
    documents = isinstance(texts, Documents)
    if tokenizer == "bytes":
        made_by = None
    else:
        try:
            import tokenizers
        except ImportError:
            raise PipeloomError("--tokenizer needs the tokenizers package: pip install 'pipeloom[bpe]'") from None
        if tokenizer != "bpe" and not Path(tokenizer).is_file():
            raise PipeloomError(f"--tokenizer {tokenizer}: no such file; use bytes, bpe, or the path of a tokenizer.json")
        vocab_size = vocab_size or BPE_VOCAB
        if tokenizer == "bpe" and vocab_size < BYTE_VOCAB:
            raise PipeloomError(f"--vocab-size {vocab_size}: a byte-level BPE vocabulary needs at least {BYTE_VOCAB}")
        made_by = [tokenizers.__version__, vocab_size if tokenizer == "bpe" else _stamp(Path(tokenizer))]
    key = hashlib.sha1(json.dumps([_CACHE_FORMAT, tokenizer, made_by, documents and texts.field,
                                   [_stamp(f) for f in texts.files]]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PIPELOOM_CACHE", Path.home() / ".cache" / "pipeloom")) / "tokens"
    cache.mkdir(parents=True, exist_ok=True)
    tokens_path, tokenizer_path = cache / f"{key}.tokens", cache / f"{key}.tokenizer.json"
    if tokenizer != "bytes" and not tokenizer_path.is_file():
        model = _train_bpe(texts, vocab_size) if tokenizer == "bpe" else read_tokenizer(tokenizer, "--tokenizer")
        _write_atomically(tokenizer_path, model.to_str().encode())
    named = "bytes" if tokenizer == "bytes" else str(tokenizer_path)
    eos = end_of_text(tokenizer_path if tokenizer == "bpe" else tokenizer) if documents else None
    vocab = BYTE_VOCAB if tokenizer == "bytes" else tokenizers.Tokenizer.from_file(named).get_vocab_size()
    if not tokens_path.is_file():
        _write_tokens(tokens_path, texts, source, named, _dtype(vocab), eos, progress)
    tokens = np.memmap(tokens_path, dtype=_dtype(vocab), mode="r")
    kind = "bytes" if tokenizer == "bytes" else f"BPE {vocab} tokens"
    return TokenData(tokens, vocab, f"{source}, {kind} ({len(tokens)} tokens)", named, eos)


def _write_tokens(path: Path, texts, source: str, tokenizer: str, dtype, eos: int | None, progress: bool) -> None:
    """Tokenize ``texts`` a batch at a time into ``path``, empty ones left out, each followed by ``eos``
    unless None (or it ends so already: a tokenizer that appends it itself)."""
    if tokenizer == "bytes":
        def encode(batch):
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in batch]
    else:
        import tokenizers

        model = tokenizers.Tokenizer.from_file(tokenizer)

        def encode(batch):
            return [np.asarray(e.ids, dtype=dtype) for e in model.encode_batch(batch)]
    end = None if eos is None else np.array([eos], dtype=dtype)
    written, bar = 0, _progress_bar(progress, texts, source)
    try:
        with _atomic(path) as out:
            for batch in texts.batches():
                pieces = []
                for ids in encode([t for t in batch if t]):
                    pieces.append(ids)
                    if end is not None and (not len(ids) or ids[-1] != eos):
                        pieces.append(end)
                chunk = np.concatenate(pieces).astype(dtype) if pieces else np.array([], dtype=dtype)
                out.write(chunk.tobytes())
                written += len(chunk)
                if bar is not None:
                    bar.update(len(batch))
            if not written:
                raise PipeloomError(f"{source}: no text to train on")
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(enabled: bool, texts, source: str):
    """A tqdm bar on stderr counting the texts tokenized, or None: only when ``enabled``, ``tqdm`` is
    installed and stderr is a terminal or the data is over :data:`LARGE` bytes."""
    if not enabled or not (sys.stderr.isatty() or sum(f.stat().st_size for f in texts.files) > LARGE):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=texts.count(), desc=f"tokenizing {source}", unit=" texts", file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 30)


def _dtype(vocab: int):
    return np.uint8 if vocab <= BYTE_VOCAB else np.uint16 if vocab <= 1 << 16 else np.uint32


def _train_bpe(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator((t for batch in texts.batches() for t in batch if t), trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[EOS_NAMES[0]],
        show_progress=False))
    return model


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


@contextmanager
def _atomic(path: Path):
    """A file to write ``path`` through, so that a concurrent reader (another rank) never sees half of it:
    it becomes ``path`` when the block ends without an error, and is removed when it raises."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            yield out
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _write_atomically(path: Path, data: bytes) -> None:
    with _atomic(path) as out:
        out.write(data)


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
