"""Datasets of documents for ``pipeloom train --data``: each record's text field is one document.

Three kinds, found by :func:`open_documents`:

- JSON lines (``*.jsonl``, ``*.json``): one JSON object per line, blank lines skipped;
- Parquet (``*.parquet``): a column, read a row group at a time (the ``pyarrow`` package);
- a directory saved by the ``datasets`` package's ``save_to_disk`` (it holds ``state.json``, or
  ``dataset_dict.json`` for a ``DatasetDict``, whose ``train`` split is read), loaded with
  ``datasets.load_from_disk``;

and a directory whose files are all JSON lines or Parquet files, in sorted path order.
The packages are imported only to read the documents,
and a missing one is refused in one line with its ``pip install``.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import PipeloomError

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"
BATCH = 1000  # documents read (and tokenized) at a time
_DATASETS_MARKS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Documents:
    """The documents at ``path``: the texts of ``field`` in ``files`` (JSON lines or Parquet), or in
    the ``datasets`` directory ``path`` when ``saved`` (``files``: everything under it)."""

    path: Path
    field: str
    files: tuple[Path, ...]
    saved: bool = False

    @property
    def source(self) -> str:
        kind = ("a datasets directory" if self.saved else f"{len(self.files)} files of documents"
                if self.path.is_dir() else "documents")
        return f"{self.path} ({kind}, field {self.field!r})"

    def count(self) -> int | None:
        """How many records there are, when that is known without reading them (Parquet, datasets)."""
        if self.saved:
            return self._dataset().num_rows
        if any(f.suffix != PARQUET_SUFFIX for f in self.files):
            return None
        return sum(_parquet_file(f).metadata.num_rows for f in self.files)

    def batches(self) -> Iterator[list[str]]:
        """The texts (a null one as None), in order, up to :data:`BATCH` at a time."""
        if self.saved:
            dataset = self._dataset()
            feature = dataset.features.get(self.field)
            _check_field(self.path, self.field, dataset.column_names, getattr(feature, "dtype", type(feature).__name__))
            for batch in dataset.select_columns([self.field]).iter(batch_size=BATCH):
                yield batch[self.field]
            return
        for f in self.files:
            yield from (_parquet_batches if f.suffix == PARQUET_SUFFIX else _json_batches)(f, self.field)

    def _dataset(self):
        datasets = _package("datasets", self.path, "a datasets directory", "datasets")
        try:
            loaded = datasets.load_from_disk(str(self.path))
        except Exception as err:  # noqa: BLE001 -- the datasets package's own errors
            raise PipeloomError(f"--data {self.path}: the datasets directory cannot be read: {err}") from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                splits = ", ".join(loaded)
                raise PipeloomError(f"--data {self.path} holds the splits {splits} and no train split; "
                                    f"give one split's directory, e.g. --data {self.path / next(iter(loaded))}")
            loaded = loaded["train"]
        return loaded


def open_documents(path: Path, field: str) -> Documents | None:
    """The documents at ``path`` (see the module docstring), or None when it is no dataset of documents."""
    if path.is_dir():
        if any((path / mark).is_file() for mark in _DATASETS_MARKS):
            return Documents(path, field, tuple(_files_under(path)), saved=True)
        files = _files_under(path)
        if files and all(_is_documents_file(f) for f in files):
            return Documents(path, field, tuple(files))
        return None
    return Documents(path, field, (path,)) if _is_documents_file(path) else None


def _is_documents_file(path: Path) -> bool:
    return path.suffix in JSON_SUFFIXES or path.suffix == PARQUET_SUFFIX


def _files_under(root: Path) -> list[Path]:
    """The files under ``root``, hidden ones left out, in sorted path order."""
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(folder, n) for n in sorted(names) if not n.startswith(".")]
    return files


def _json_batches(path: Path, field: str) -> Iterator[list[str]]:
    batch = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise PipeloomError(f"--data {path}, line {number}: not JSON ({err.msg}); "
                                    "JSON lines hold one object per line") from None
            if not isinstance(record, dict):
                raise PipeloomError(f"--data {path}, line {number}: a JSON {type(record).__name__}, not an "
                                    "object; JSON lines hold one object per line")
            text = record.get(field)
            if field not in record or not isinstance(text, (str, type(None))):
                _check_field(f"{path}, line {number}", field, list(record), type(text).__name__)
            batch.append(text)
            if len(batch) == BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def _parquet_file(path: Path):
    parquet = _package("pyarrow.parquet", path, "Parquet", "pyarrow")
    try:
        return parquet.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 -- pyarrow's own errors
        raise PipeloomError(f"--data {path}: not a Parquet file that can be read: {err}") from None


def _parquet_batches(path: Path, field: str) -> Iterator[list[str]]:
    table = _parquet_file(path)
    schema = table.schema_arrow
    _check_field(path, field, schema.names, str(schema.field(field).type) if field in schema.names else None)
    for batch in table.iter_batches(batch_size=BATCH, columns=[field]):
        yield batch.column(0).to_pylist()


def _check_field(where, field: str, fields: list[str], dtype: str | None = None) -> None:
    """Refuse a dataset without a text field ``field`` in one line, naming the fields it has."""
    if field not in fields:
        raise PipeloomError(f"--data {where}: no field {field!r}; its fields: {', '.join(map(str, fields)) or 'none'}; "
                            "choose the text with --text-field")
    if dtype not in (None, "string", "large_string", "string_view"):
        raise PipeloomError(f"--data {where}: field {field!r} holds {dtype}, not text; "
                            "choose a text field with --text-field")


def _package(name: str, path: Path, what: str, package: str):
    """The module ``name``, or a one-line refusal naming the ``pip install`` that brings it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise PipeloomError(f"--data {path} is {what}, which needs the {package} package: "
                            f"pip install 'pipeloom[data]' (or pip install {package})") from None
