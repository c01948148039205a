"""A decoder's weights in Hugging Face's safetensors checkpoints: read lazily by Hugging Face's
names (a stage's tensors when it is built, a vocabulary shard's rows alone), written back, and
the model of a Hugging Face directory (:func:`from_hf`).

Each family names its weights' tensors (:meth:`~pipeloom.nn.decoder.Decoder.hf_names`): a
fused weight is its parts stacked by rows (Llama's q, k and v), and GPT-2's ``Conv1D``
weights are stored transposed. The directory's ``config.json`` is :mod:`pipeloom.hf`'s.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..errors import PipeloomError
from ..hf import INDEX, read_size, weight_files
from .decoder import Decoder, HFTensor


def from_hf(directory: str | Path, device: str | torch.device | None = None) -> Decoder:
    """The model of a Hugging Face directory (a Llama or a GPT-2; :func:`pipeloom.hf.read_size`):
    built from its ``config.json`` on ``device``, its weights from its safetensors files
    (:meth:`~pipeloom.nn.decoder.Decoder.load_safetensors`). On ``"meta"`` nothing is read yet:
    a pipeline's ranks each read their own stages' tensors as they build them."""
    from .models import size_config

    model = size_config(read_size(directory, "from_hf")).build(device="meta")
    model.load_safetensors(directory)
    if device is None or torch.device(device).type != "meta":
        model.build_stages(1, [0], device=device)
    return model


def load(model: Decoder, path: Path) -> None:
    """:meth:`~pipeloom.nn.decoder.Decoder.load_safetensors`."""
    safe_open = safetensors().safe_open
    if (path / INDEX).is_file():
        files = weight_files(path)
    else:
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise PipeloomError(f"load_safetensors: {path} is not a safetensors file or a directory holding some")
    shapes, where = {}, {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                shapes[key], where[key] = tuple(handle.get_slice(key).get_shape()), file
    names = model.hf_names()
    found = {part.name: _stored_as(part.name, shapes) for parts in names.values() for part in parts}
    wanted = {part.name: _shape(part, model.get_parameter(name).shape) for name, parts in names.items()
              for part in parts}
    missing = [hf for hf in wanted if found[hf] is None]
    if missing:
        hint = (" (a checkpoint with tied embeddings: use tie_embeddings=True)"
                if missing == ["lm_head.weight"] else "")
        raise PipeloomError(f"load_safetensors: {path} has no tensor {missing[0]}"
                            f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}{hint}")
    ignored = {"lm_head.weight"} if model.config.tie_embeddings else set()
    unknown = [k for k in shapes if k not in found.values() and k not in ignored and not k.endswith(model.hf_extras)]
    if unknown:
        raise PipeloomError(f"load_safetensors: {path} holds {unknown[0]}, which this model "
                            f"({model.config.n_layer} layers) has no place for"
                            f"{f' (nor {len(unknown) - 1} more)' if len(unknown) > 1 else ''}")
    for hf, shape in wanted.items():
        if shapes[found[hf]] != shape:
            raise PipeloomError(f"load_safetensors: {found[hf]} in {where[found[hf]]} has shape "
                                f"{list(shapes[found[hf]])}; this model's is {list(shape)}")
    for name, parts in names.items():
        model.sources[name] = partial(read, [(where[found[p.name]], found[p.name], p.rows, p.transposed)
                                             for p in parts])
        param = model.get_parameter(name)
        if not param.is_meta:
            with torch.no_grad():
                param.copy_(model.sources[name]())


def _stored_as(name: str, shapes: dict) -> str | None:
    """The name under which a checkpoint holds the tensor ``name``: itself, or without the LM
    model's prefix (``transformer.``: GPT-2's base model checkpoints), or None."""
    return next((key for key in (name, name.removeprefix("transformer.")) if key in shapes), None)


def _shape(part: HFTensor, shape: torch.Size) -> tuple[int, ...]:
    """The stored shape of ``part`` of a weight of ``shape``."""
    return (*shape[1:], part.rows) if part.transposed else (part.rows, *shape[1:])


def read(parts: list[tuple[Path, str, int, bool]], rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The tensors ``parts`` ((file, name, rows, transposed) each) stacked by rows, or only the
    rows ``rows`` (start, end) of that stack: each file is read lazily, those rows alone."""
    safe_open = safetensors().safe_open
    start, end = rows or (0, sum(n for _, _, n, _ in parts))
    pieces, offset = [], 0
    for file, key, n, transposed in parts:
        low, high = max(start - offset, 0), min(end - offset, n)
        if low < high or (not pieces and offset + n >= end):  # an empty range: an empty first piece
            with safe_open(file, framework="pt") as handle:
                stored = handle.get_slice(key)
                pieces.append(stored[:, low:max(low, high)].t() if transposed else stored[low:max(low, high)])
        offset += n
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def save(model: Decoder, weights: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    """Write ``weights`` (CPU tensors by ``model``'s unsplit names, as
    :meth:`~pipeloom.runtime.Pipeline.gather_weights` gives them) to the safetensors file ``path``
    by Hugging Face's names (:meth:`~pipeloom.nn.decoder.Decoder.hf_names`), with ``metadata``
    (str to str) in its header."""
    tensors = {}
    for name, parts in model.hf_names().items():
        for part, piece in zip(parts, weights[name].split([p.rows for p in parts])):
            tensors[part.name] = (piece.t() if part.transposed else piece).contiguous()
    safetensors().torch.save_file(tensors, str(path), metadata={**(metadata or {}), "format": "pt"})


def safetensors():
    """The safetensors package, or the line that installs it."""
    try:
        import safetensors.torch
    except ImportError:
        raise PipeloomError("reading and writing safetensors files needs the safetensors package: "
                            "pip install safetensors") from None
    return safetensors
