"""``pipeloom train``: train a model (a GPT or a Llama preset) through a pipeline, one process per rank.

Run outside torchrun, :func:`run` checks the arguments and starts ``pp * dp``
worker processes itself with torchrun's launcher API; under torchrun (or as
one of those workers) it is a worker: it trains, rank 0 prints a progress
bar and writes the metrics, and every rank takes part in checkpoints, the
trace and the report.

A rank that waits ``--timeout`` seconds for a peer looks at the peer's
heartbeat: a peer that died, hangs or stalls stops it (a dead one at once: its
connections close) with a message naming the rank, the action and what it
waited for; one that is alive and busy is waited for (on gloo; a line on
stderr each ``--timeout``). A non-finite loss stops the run at that step
(before the update, but with 2bw, whose stages update as they go).

The last ``--val-fraction`` of the token stream is held out; with
``--eval-every`` the pipeline runs its schedule's forwards alone on
``--eval-batches`` batches of it (:meth:`~pipeloom.runtime.Pipeline.evaluate`)
and the mean is the step's ``val_loss``. ``--save`` writes the final weights
(safetensors, by their unsplit names) and ``--tensorboard`` the metrics'
scalars.
"""

from __future__ import annotations

import os
import sys

from ..builder import build_run
from ..cli.flags import spec_of
from .config import (TrainConfig, check, check_resume, check_steps, check_weights, learning_rate, split_data,
                     training_data, with_vocab)
from .loop import Trainer
from .report import dry_run, report

__all__ = ["TrainConfig", "Trainer", "check", "dry_run", "learning_rate", "report", "run", "under_torchrun"]


def under_torchrun() -> bool:
    """True in a process torchrun (or its launcher API) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args) -> int:
    """The command: launch the workers, or be one; with ``--dry-run`` show the run instead. The
    parsed flags become the run spec and the :class:`TrainConfig` here, once."""
    config = TrainConfig.of(args)
    if under_torchrun():
        from .loop import worker

        return worker(lambda: spec_of(args), config)
    spec = spec_of(args).check_runnable()
    check(config, spec)
    if spec.init_from is not None and not config.dry_run:
        check_weights(spec)  # before the data is tokenized
    data = training_data(config, progress=not config.json)  # a bad path stops here; tokenized (and cached) once
    spec = with_vocab(spec, data.vocab_size)
    if config.dry_run:
        return dry_run(config, spec)
    schedule = build_run(spec)
    check_steps(config, schedule)
    split_data(data, config, spec.seq)
    if config.resume:
        directory, step = check_resume(config, spec)
        if step >= config.steps:
            print(f"pipeloom train: nothing to do: {directory} holds step {step} and --steps is {config.steps}; "
                  f"give --steps above {step} to train on", file=sys.stderr)
            return 0
    if spec.device == "cuda":
        from ..runtime.device import check_gpus

        check_gpus(spec.world)  # the launcher starts every rank on this machine
    if config.memory_check or spec.offload == "selective":
        from ..cli.simulate import simulate_spec
        from ..techniques.offload import shortfall
        from .fits import available_memory, check_fits

        predicted = simulate_spec(spec)[0]  # once: the memory check and offload's line read it
        if config.memory_check:
            check_fits(spec, available_memory(spec.device, spec.world), predicted)
        line = shortfall(predicted)
        if line:
            print(line, file=sys.stderr)
    from ..launch import launch

    return launch(list(config.argv), spec.world)
