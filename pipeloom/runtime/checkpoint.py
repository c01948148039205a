"""Checkpoints with ``torch.distributed.checkpoint``, resumable with another pp/dp split.

Every tensor is stored under its name in the unsplit model: ``model/<name>``
for a weight, ``optim/<name>/<key>`` for its optimizer state (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``), and with weight versions (2bw)
``version<j>/<name>`` for the weights the next steps run with (j = 0, 1, ...).
Vocabulary-parallel shards are gathered and saved whole under the same names,
so a checkpoint resumes with or without vocabulary parallelism. Each rank saves what its stages hold
(replicas and tied copies are written once) and loads what its stages need,
whatever split saved them. A checkpoint is a directory; ``pipeloom.json``
beside the tensor files holds the caller's metadata and is written last, so
its presence marks a complete checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import PipeloomError

META = "pipeloom.json"


def save(pipe, optimizer: torch.optim.Optimizer, directory: str | Path, meta: dict) -> None:
    """Save this pipeline's weights and ``optimizer`` state; every rank calls this."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        (directory / META).unlink(missing_ok=True)  # an overwritten checkpoint is incomplete until the end
    dcp.save(_state(pipe, optimizer)[0], storage_writer=dcp.FileSystemWriter(directory, overwrite=True))
    dist.barrier()
    if dist.get_rank() == 0:
        partial = directory / (META + ".partial")
        partial.write_text(json.dumps(meta, indent=1))
        os.replace(partial, directory / META)
    dist.barrier()


def load(pipe, optimizer: torch.optim.Optimizer, directory: str | Path) -> dict:
    """Load weights and optimizer state saved by :func:`save` (under any split) into
    this pipeline's stages; every rank calls this. Returns the saved metadata."""
    meta = read_meta(directory)
    _create_optimizer_state(optimizer)
    if pipe.versions:
        pipe.steps_done = meta["step"]
        pipe.versions.restart(pipe.steps_done)  # versions the checkpoint lacks stay the newest weights
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    state, shards = _state(pipe, optimizer)
    state = {k: v for k, v in state.items() if k in saved or not k.startswith("version")}
    try:
        dcp.load(state, checkpoint_id=Path(directory))
    except Exception as err:  # DCP wraps each rank's failure; say which checkpoint did not fit
        raise PipeloomError(f"checkpoint {directory} does not fit this model and optimizer: {_first_line(err)}") from None
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
    return meta


def read_meta(directory: str | Path) -> dict:
    """The metadata of the checkpoint at ``directory``, or a clear error if there is none."""
    path = Path(directory) / META
    if not path.is_file():
        raise PipeloomError(f"{directory} is not a complete pipeloom checkpoint (no {META})")
    return json.loads(path.read_text())


def latest(root: str | Path) -> Path | None:
    """The complete checkpoint under ``root`` with the highest ``step`` in its metadata."""
    found = [d for d in Path(root).iterdir() if (d / META).is_file()] if Path(root).is_dir() else []
    return max(found, key=lambda d: read_meta(d).get("step", -1), default=None)


def _state(pipe, optimizer) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """The tensors to save or load by key, and the (shard, unsplit tensor) pairs of the
    vocabulary shards: they are saved whole, and a load copies each rank's rows back."""
    state, shards = {}, []
    for name, p in pipe.named_parameters():
        if f"model/{name}" in state:
            continue  # a tied copy on the same rank: saved and loaded once
        state[f"model/{name}"] = p.detach()
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                state[f"optim/{name}/{key}"] = value
    for name, p in pipe.vocab.named_shards() if pipe.vocab else ():
        for key, shard in [("model", p.detach()), *((k, v) for k, v in optimizer.state.get(p, {}).items()
                                                     if torch.is_tensor(v))]:
            whole = pipe.vocab.full(shard) if shard.shape == p.shape else shard  # AdamW's step: one number
            state[f"model/{name}" if key == "model" else f"optim/{name}/{key}"] = whole
            if whole is not shard:
                shards.append((shard, whole))
    if pipe.versions:
        for (s, t), weights in pipe.versions.weights.items():
            for local, tensor in weights.items():
                state.setdefault(f"version{t - pipe.steps_done}/{pipe.stages[s].param_names[local]}", tensor.detach())
    return state, shards


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


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
