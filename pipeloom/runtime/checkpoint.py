"""Checkpoints with ``torch.distributed.checkpoint``, resumable with another pp/dp split.

Every tensor is stored under its name in the unsplit model: ``model/<name>``
for a weight, ``optim/<name>/<key>`` for its optimizer state (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``), and with weight versions (2bw)
``version<j>/<name>`` for the weights the next steps run with (j = 0, 1, ...),
and with K-FAC ``kfac/<layer>/<factors|inverses>/<A|G>`` (saved between its
refresh cycles, when nothing else of it is pending).
Vocabulary-parallel shards are gathered and saved whole under the same names,
so a checkpoint resumes with or without vocabulary parallelism. Each rank saves what its stages hold
(replicas and tied copies are written once) and loads what its stages need,
whatever split saved them. A checkpoint is a directory; ``pipeloom.json``
beside the tensor files holds the caller's metadata and is written last, so
its presence marks a complete checkpoint (the caller's other files, such as a
run's ``tokenizer.json``, are written before it). :func:`load_weights` loads
the weights into an unsplit model on one process, without a process group
(``pipeloom generate``).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import PipeloomError, first_line
from ..techniques import size_text
from .handlers.vocab import SHARDS

META = "pipeloom.json"


def save(pipe, optimizer: torch.optim.Optimizer, directory: str | Path, meta: dict,
         files: dict[str, bytes] | None = None) -> None:
    """Save this pipeline's weights and ``optimizer`` state, with ``meta`` and ``files``
    (name -> contents, written by rank 0); every rank calls this."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        (directory / META).unlink(missing_ok=True)  # an overwritten checkpoint is incomplete until the end
    state = _state(pipe, optimizer)[0]
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, overwrite=True))
    except CheckpointException as err:  # each rank's failure, gathered by DCP (a BaseException)
        raise PipeloomError(_unwritten(directory, err, state)) from None
    dist.barrier()
    if dist.get_rank() == 0:
        for name, contents in (files or {}).items():
            (directory / name).write_bytes(contents)
        partial = directory / (META + ".partial")
        partial.write_text(json.dumps(meta, indent=1))
        os.replace(partial, directory / META)
    dist.barrier()


def _unwritten(directory: Path, err: CheckpointException, state: dict) -> str:
    """One line for a checkpoint DCP could not write: the cause (an OSError, such as a full disk,
    before what followed from it), the space this rank's share needs and what the disk has."""
    rank, (cause, _) = min(err.failures.items(), key=lambda item: (not isinstance(item[1][0], OSError), item[0]))
    need = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    free = shutil.disk_usage(directory if directory.exists() else directory.parent).free
    return (f"checkpoint {directory}: rank {rank} could not write it ({type(cause).__name__}: {first_line(cause)}); "
            f"rank {dist.get_rank()}'s share needs {size_text(need)} and the disk has {size_text(free)} free; "
            f"--resume ignores the incomplete {directory.name}")


def load(pipe, optimizer: torch.optim.Optimizer, directory: str | Path) -> dict:
    """Load weights and optimizer state saved by :func:`save` (under any split) into
    this pipeline's stages; every rank calls this. Returns the saved metadata."""
    meta = read_meta(directory)
    _create_optimizer_state(optimizer)
    if pipe.versions:
        pipe.steps_done = meta["step"]
        pipe.versions.restart(pipe.steps_done)  # tensors for the saved versions to load into
    saved = _tensor_index(directory).state_dict_metadata
    state, shards = _state(pipe, optimizer, saved)
    state = {k: v for k, v in state.items() if k in saved or not k.startswith("version")}
    try:
        dcp.load(state, checkpoint_id=Path(directory))
    except CheckpointException as err:  # each rank's failure, gathered by DCP (a BaseException)
        rank, (cause, _) = min(err.failures.items())
        raise PipeloomError(f"--resume {directory}: rank {rank} could not load it ({type(cause).__name__}: "
                            f"{first_line(cause).split('. ')[0]}); a tensor file is damaged or does not fit this model "
                            "and optimizer; resume from another checkpoint") from None
    except Exception as err:
        raise PipeloomError(f"--resume {directory} does not fit this model and optimizer: {first_line(err)}") from None
    for shard, full in shards:
        pipe.vocab.load_rows(shard, full)
    by_name: dict[str, list[torch.nn.Parameter]] = {}
    for name, p in pipe.named_parameters():
        by_name.setdefault(name, []).append(p)
    with torch.no_grad():
        for original, *copies in by_name.values():  # a tied copy beside its original takes its values
            for p in copies:
                p.copy_(original)
                for key, value in optimizer.state[original].items():
                    optimizer.state[p][key] = value.clone() if torch.is_tensor(value) else value
    if pipe.versions and not any(key.startswith("version") for key in saved):
        pipe.versions.restart(pipe.steps_done)  # a synchronous run's checkpoint: every version is its weights
    return meta


def read_meta(directory: str | Path) -> dict:
    """The metadata of the checkpoint at ``directory``, or a clear error if there is none."""
    path = Path(directory) / META
    if not path.is_file():
        raise PipeloomError(f"{directory} is not a complete pipeloom checkpoint (no {META})")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise PipeloomError(f"{directory}: its {META} cannot be read ({err}); resume from another checkpoint") from None


def check_fits(directory: str | Path, model: torch.nn.Module, hint: str = "", flag: str = "--resume") -> None:
    """Refuse, in one line, a checkpoint whose weights do not fit ``model`` (an unsplit
    model; a ``meta``-device one is enough) or whose tensor files are missing or cut
    short. ``hint`` says what the saving run used, ``flag`` what named the checkpoint, for the message."""
    index = _tensor_index(directory, flag)
    saved = index.state_dict_metadata
    fits = f" (it was saved {hint})" if hint else ""
    for name, p in model.named_parameters():
        entry = saved.get(f"model/{name}")
        if entry is None:
            raise PipeloomError(f"{flag} {directory}: it holds no weight {name}, which this model has{fits}")
        if tuple(entry.size) != tuple(p.shape):
            raise PipeloomError(f"{flag} {directory}: {name} is {list(entry.size)} there but {list(p.shape)} "
                                f"in this model{fits}")
    ends: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for file, end in sorted(ends.items()):
        path = Path(directory) / file
        size = path.stat().st_size if path.is_file() else None
        if size is None or size < end:
            state = "is missing" if size is None else f"has {size} bytes of the {end} its index names"
            raise PipeloomError(f"{flag} {directory}: its tensor file {file} {state} (cut short or corrupted); "
                                f"{_another(flag)}")


def load_weights(directory: str | Path, model: torch.nn.Module, hint: str = "", flag: str = "--checkpoint") -> None:
    """Load the weights of the checkpoint at ``directory`` into ``model``, an unsplit model on
    this process (its parameters on any device, allocated), by their names, with no process
    group (``torch.distributed.checkpoint``'s ``no_dist`` load). A checkpoint that does not fit
    is refused in one line (:func:`check_fits`, with ``hint`` and ``flag``)."""
    check_fits(directory, model, hint, flag)
    state = {f"model/{name}": p.detach() for name, p in model.named_parameters()}
    try:
        with warnings.catch_warnings():  # that no process group is used is the point here
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=Path(directory), no_dist=True)
    except CheckpointException as err:
        _, (cause, _) = min(err.failures.items())
        raise PipeloomError(f"{flag} {directory}: it cannot be loaded ({type(cause).__name__}: "
                            f"{first_line(cause).split('. ')[0]}); a tensor file is damaged; {_another(flag)}") from None
    except Exception as err:
        raise PipeloomError(f"{flag} {directory}: it cannot be loaded ({type(err).__name__}: {first_line(err)}); "
                            f"{_another(flag)}") from None


def _another(flag: str) -> str:
    return "resume from another checkpoint" if flag == "--resume" else "use another checkpoint"


def _tensor_index(directory: str | Path, flag: str = "--resume"):
    """DCP's index of the checkpoint's tensors, or one line saying why it cannot be read."""
    try:
        return dcp.FileSystemReader(directory).read_metadata()
    except Exception as err:  # a missing or damaged .metadata: pickle's or the filesystem's error
        raise PipeloomError(f"{flag} {directory}: its tensor index (.metadata) cannot be read "
                            f"({type(err).__name__}: {first_line(err)}); {_another(flag)}") from None


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the highest ``step`` in its metadata."""
    found = [d for d in Path(root).iterdir() if (d / META).is_file()] if Path(root).is_dir() else []
    return max(found, key=lambda d: read_meta(d).get("step", -1), default=None)


def _state(pipe, optimizer, saved=None) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors to save or load by key, and the (shard, unsplit tensor) pairs of the
    vocabulary shards: they are saved whole, and a load copies each rank's rows back.
    ``saved``: the keys of the checkpoint a load reads (K-FAC's tensors are made for them)."""
    state, shards = {}, []
    for name, p in pipe.named_parameters():
        if f"model/{name}" in state:
            continue  # a tied copy on the same rank: saved and loaded once
        state[f"model/{name}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                state[f"optim/{name}/{key}"] = value

    def whole(shard: torch.Tensor) -> torch.Tensor:
        """The unsplit tensor of a vocabulary ``shard`` (every pipeline rank calls this in one order)."""
        shards.append((shard, pipe.vocab.full(shard)))
        return shards[-1][1]

    for name, p in pipe.vocab.named_shards() if pipe.vocab else ():
        for key, shard in [("model", p.detach()), *((k, v) for k, v in optimizer.state.get(p, {}).items()
                                                     if torch.is_tensor(v))]:
            state[f"model/{name}" if key == "model" else f"optim/{name}/{key}"] = \
                whole(shard) if shard.shape == p.shape else shard  # AdamW's step: one number
    if pipe.kfac is not None:
        state.update(_kfac_state(pipe, saved))
    if pipe.versions:
        for (s, t), weights in pipe.versions.weights.items():
            module = pipe.versions.stages[s]  # a stage, or the vocabulary shards (saved whole)
            for local, tensor in weights.items():
                key = f"version{t - pipe.steps_done}/{module.param_names[local]}"
                if key not in state:  # a tied copy beside its original: once
                    state[key] = whole(tensor.detach()) if s == SHARDS else tensor.detach()
    return state, shards


def _kfac_state(pipe, saved=None) -> dict[str, torch.Tensor]:
    """K-FAC's factors and inverses in use, ``kfac/<layer's unsplit name>/<factors|inverses>/<A|G>``:
    those the layers hold (a save, between refresh cycles: nothing else is pending), or for a load
    (``saved``: the checkpoint's keys) a tensor to read into for each of those the checkpoint holds."""
    names = {id(p): name for name, p in pipe.named_parameters()}
    state = {}
    for layer in pipe.kfac.layers.values():
        owner = names[id(layer.module.weight)].removesuffix(".weight")
        for part in ("factors", "inverses"):
            held = getattr(layer, part)
            for factor in ("A", "G"):
                key = f"kfac/{owner}/{part}/{factor}"
                if saved is None and factor in held:
                    state[key] = held[factor]
                elif saved is not None and key in saved:
                    d = layer.dim(factor)
                    held[factor] = state[key] = torch.empty(d, d, dtype=layer.dtype, device=layer.module.weight.device)
    return state


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (so a load has tensors to fill) by one
    step with zero gradients at learning rate 0, which leaves the weights unchanged."""
    fresh = [p for group in optimizer.param_groups for p in group["params"] if p not in optimizer.state]
    if not fresh:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in fresh:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for p in fresh:
        p.grad = None
