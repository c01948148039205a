"""``pipeloom train``'s own settings (:class:`TrainConfig`), their checks, and the values computed once
from them and the run spec."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, fields
from pathlib import Path

from ..data import TokenData, load_data
from ..errors import PipeloomError
from ..paths import prepare_output, prepare_output_dir
from ..sim.plot import SUFFIXES
from ..spec import RunSpec
from ..techniques import TECHNIQUES


@dataclass(frozen=True)
class TrainConfig:
    """What ``pipeloom train`` takes besides the run spec, read once from its flags: the
    optimisation (``steps``, ``lr``, ``warmup``, ``weight_decay``, ``clip``, ``seed``), the
    peers' ``timeout``, the data and validation, checkpoints and outputs, ``dry_run``/``json``,
    ``memory_check`` (refuse a run predicted not to fit, before launch), ``dp`` as given (None: what the world leaves) and the command's own ``argv`` (each worker
    gets it)."""

    steps: int = 200
    lr: float = 3e-3
    warmup: int | None = None
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    timeout: float = 60.0
    data: str | None = None
    token_dtype: str | None = None
    tokenizer: str = "bytes"
    text_field: str | None = None
    vocab_size: int | None = None
    val_fraction: float = 0.05
    eval_every: int | None = None
    eval_batches: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: str | None = None
    save: str | None = None
    save_hf: str | None = None
    metrics: str | None = None
    tensorboard: str | None = None
    trace: str | None = None
    plot: str | None = None
    report: bool = False
    dry_run: bool = False
    json: bool = False
    memory_check: bool = True
    dp: int | None = None
    argv: tuple[str, ...] = ()

    @classmethod
    def of(cls, args) -> TrainConfig:
        """The settings in a parsed ``pipeloom train`` command line; without --tokenizer, text is
        tokenized by the --init-from directory's tokenizer.json if it has one, else by bytes."""
        from ..hf import tokenizer_file

        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in ("argv", "tokenizer")}
        text = args.token_dtype is None and not str(args.data or "").endswith(".bin")  # not a token file
        tokenizer = args.tokenizer or (text and args.init_from and tokenizer_file(args.init_from)) or "bytes"
        return cls(**given, tokenizer=tokenizer, argv=tuple(args.argv))


def check(config: TrainConfig, spec: RunSpec) -> None:
    """Every mistake in the training flags (the run's own are :meth:`RunSpec.check_runnable`'s)
    that can be found before training and without the data."""
    for flag in ("steps",):
        if getattr(config, flag) < 1:
            raise PipeloomError(f"--{flag} must be at least 1, got {getattr(config, flag)}")
    if not config.clip >= 0:  # nan too
        raise PipeloomError(f"--clip {config.clip:g}: a gradient norm cannot be negative or nan; "
                            "give a positive norm, or 0 (or none) for no clipping")
    if config.warmup is not None and not 0 <= config.warmup <= config.steps:
        raise PipeloomError(f"--warmup {config.warmup}: use 0 to --steps {config.steps} warm-up steps"
                            + (" (the learning rate would never reach --lr)" if config.warmup > config.steps else ""))
    if config.weight_decay < 0:
        raise PipeloomError(f"--weight-decay must be at least 0, got {config.weight_decay:g}")
    for flag in ("lr", "timeout"):
        if not getattr(config, flag) > 0:
            raise PipeloomError(f"--{flag} must be positive, got {getattr(config, flag)}")
    for technique in TECHNIQUES.values():
        if technique.active(spec):
            technique.check_training(spec, config)
    if spec.init_from is not None:
        installed("safetensors", "--init-from")
    if config.json and not config.dry_run:
        raise PipeloomError("--json goes with --dry-run (a run's metrics go to --metrics)")
    if config.eval_every is not None and config.eval_every < 1:
        raise PipeloomError(f"--eval-every must be at least 1, got {config.eval_every}")
    if config.eval_batches < 1:
        raise PipeloomError(f"--eval-batches must be at least 1, got {config.eval_batches}")
    if not 0 <= config.val_fraction < 1:  # nan too
        raise PipeloomError(f"--val-fraction {config.val_fraction:g}: hold out a share of the data in [0, 1)")
    if config.eval_every and config.val_fraction == 0:
        raise PipeloomError("--eval-every needs held-out data: give a --val-fraction above 0")
    if config.checkpoint_every is not None and config.checkpoint_every < 1:
        raise PipeloomError(f"--checkpoint-every must be at least 1, got {config.checkpoint_every}")
    if config.checkpoint_every and not config.checkpoint_dir:
        raise PipeloomError("--checkpoint-every needs --checkpoint-dir")
    if config.resume == "latest" and not config.checkpoint_dir:
        raise PipeloomError("--resume without a path needs --checkpoint-dir to look in")
    if config.resume and config.resume != "latest":
        from ..runtime.checkpoint import read_meta

        read_meta(config.resume)
    if config.dry_run:  # the simulated step's picture and trace
        if config.plot:
            prepare_output("--plot", config.plot, SUFFIXES)
        if config.trace:
            prepare_output("--trace", config.trace)
        return
    # last, when the rest is right: a missing directory is created; one that cannot be stops the run here
    for flag, path in (("--metrics", config.metrics), ("--trace", config.trace), ("--plot", config.plot)):
        if path:
            prepare_output(flag, path, SUFFIXES if flag == "--plot" else ())
    if config.checkpoint_dir:
        prepare_output_dir("--checkpoint-dir", config.checkpoint_dir)
    if config.save:
        installed("safetensors", "--save")
        prepare_output("--save", config.save, (".safetensors",))
    if config.save_hf:
        installed("safetensors", "--save-hf")
        prepare_output_dir("--save-hf", config.save_hf)
    if config.tensorboard:
        installed("tensorboard", "--tensorboard")
        prepare_output_dir("--tensorboard", config.tensorboard)


def check_steps(config: TrainConfig, schedule) -> None:
    """The step counts that must be whole calls of a schedule that runs several steps per call (2bw),
    and whole K-FAC refreshes where they are saved or measured (a cycle of several calls)."""
    name, cycle = schedule.family, schedule.steps
    per_call = cycle // schedule.options.get("kfac", {}).get("every", 1)
    if config.steps % per_call:
        raise PipeloomError(f"{name} runs {per_call} steps per call without a flush; use a --steps that is a "
                            f"multiple of {per_call}, or a --schedule-steps that divides {config.steps}")
    if cycle > per_call:  # K-FAC's refresh runs over several calls
        why = f"K-FAC's refresh runs over {cycle} steps"
        saved = (("with --checkpoint-dir use a --steps", config.steps if config.checkpoint_dir else 0),
                 ("use a --checkpoint-every", config.checkpoint_every or 0))
        for use, value in saved:
            if value % cycle:
                raise PipeloomError(f"{why} and a checkpoint holds whole refreshes; {use} that is a multiple of "
                                    f"{cycle}, or a smaller --kfac-every")
        measured = [flag for flag, on in (("--report", config.report), ("--trace", config.trace),
                                          ("--plot", config.plot and not config.dry_run)) if on]
        if measured and config.steps < cycle:
            raise PipeloomError(f"{why} and {measured[0]} measures a whole one; use a --steps of {cycle} or more, "
                                "or a smaller --kfac-every")
    if config.checkpoint_every and config.checkpoint_every % per_call:
        raise PipeloomError(f"{name} can save only between its calls of {per_call} steps; "
                            f"use a --checkpoint-every that is a multiple of {per_call}")
    if config.eval_every and config.eval_every % per_call:
        raise PipeloomError(f"{name} can evaluate only between its calls of {per_call} steps; "
                            f"use an --eval-every that is a multiple of {per_call}")


def installed(package: str, flag: str) -> None:
    """Refuse ``flag`` in one line when the optional ``package`` it needs is not installed."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise PipeloomError(f"{flag} needs the {package} package, which is not installed: "
                            f"pip install {package}") from None


def with_vocab(spec: RunSpec, data_vocab: int) -> RunSpec:
    """``spec`` with the model's vocabulary: ``--vocab``, else the preset's, grown to the data's
    when its tokens need more; a ``--vocab`` (or an ``--init-from`` model's) that the data's tokens
    do not fit is refused."""
    if spec.init_from is not None and spec.size.vocab < data_vocab:
        raise PipeloomError(f"the data's vocabulary of {data_vocab} tokens is larger than the {spec.size.vocab} of "
                            f"--init-from {spec.init_from}; tokenize the data with its tokenizer.json")
    if spec.vocab is not None and spec.vocab < data_vocab:
        raise PipeloomError(f"--vocab {spec.vocab} is smaller than the data's vocabulary of {data_vocab} tokens; "
                            f"use --vocab {data_vocab} or more, or leave it out")
    if spec.vocab is None and data_vocab > spec.size.vocab:
        return spec.replace(vocab=data_vocab)
    return spec


def model_vocab(spec: RunSpec) -> int:
    """The vocabulary of the model ``spec`` trains: ``vocab``, else its preset's (or config's)."""
    return spec.vocab or spec.size.vocab


def model_config(spec: RunSpec):
    """The config of the model ``spec`` trains (its ``build`` makes it): the preset's, or the
    ``--init-from`` directory's, with the run's vocabulary; a preset without a context length
    takes --seq."""
    from ..nn.models import size_config

    positions = {} if spec.size.block_size else {"block_size": spec.seq}
    return size_config(spec.size, vocab_size=model_vocab(spec), **positions)


def check_weights(spec: RunSpec) -> None:
    """The tensors of the --init-from directory checked against the model its config describes:
    every one there, of its shape, none left over (from the files' headers; no weight is read)."""
    import torch

    with torch.device("meta"):
        model = model_config(spec).build()
    model.load_safetensors(spec.init_from)


def training_data(config: TrainConfig, progress: bool) -> TokenData:
    """The run's token stream, from its data flags; ``progress``: a bar on stderr while tokenizing."""
    return load_data(config.data, config.token_dtype, config.vocab_size, config.tokenizer, config.text_field, progress)


def split_data(data, config: TrainConfig, seq: int):
    """(training data, validation data): the last --val-fraction of the stream held out, refused in
    one line when the training part, or with --eval-every the held-out one, holds less than one
    sequence of ``seq`` tokens."""
    train, val = data.split(config.val_fraction)
    train.check_length(seq)
    if config.eval_every and len(val) < seq + 1:
        raise PipeloomError(f"--val-fraction {config.val_fraction:g} holds out {len(val)} tokens of {data.source}, "
                            f"fewer than one sequence of --seq {seq} plus its target; hold out at least "
                            f"{(seq + 1) / len(data):.2g}, or use more data")
    return train, val


def check_resume(config: TrainConfig, spec: RunSpec) -> tuple[Path, int]:
    """The checkpoint --resume names, checked to fit this run (metadata, weight shapes,
    tensor files), and the step it holds."""
    import torch

    from ..runtime import checkpoint

    directory = checkpoint.latest(config.checkpoint_dir) if config.resume == "latest" else Path(config.resume)
    if directory is None:
        raise PipeloomError(f"--resume: no complete checkpoint under {config.checkpoint_dir}")
    saved = checkpoint.read_meta(directory)
    hint = f"with --model {saved.get('model')}, vocabulary {saved.get('vocab_size')}"
    vocab = model_vocab(spec)
    if (saved.get("model"), saved.get("vocab_size")) != (spec.model, vocab):
        raise PipeloomError(f"--resume {directory}: it was saved {hint}; this run has {spec.model_flag}, "
                            f"vocabulary {vocab} (--vocab, else the preset's or its data's); resume with those")
    with torch.device("meta"):
        model = model_config(spec).build()
    checkpoint.check_fits(directory, model, hint)
    return directory, saved.get("step", 0)


def learning_rate(step: int, config) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine decay to a tenth at ``--steps``."""
    warmup = config.warmup if config.warmup is not None else min(100, config.steps // 10)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
