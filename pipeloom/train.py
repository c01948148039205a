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

import dataclasses
import importlib
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from statistics import median

from .data import load_data
from .errors import PipeloomError, first_line
from .modes import RECOMPUTE
from .paths import prepare_output, prepare_output_dir
from .schedule import FAMILIES, Offload, build
from .sim.plot import SUFFIXES

#: Steps whose timelines feed ``--report`` (the last ones of the run).
REPORT_STEPS = 5
#: The metrics ``--tensorboard`` writes as scalars, by their names in ``--metrics``.
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss")


def under_torchrun() -> bool:
    """True in a process torchrun (or its launcher API) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args) -> int:
    """The command: launch the workers, or be one."""
    if under_torchrun():
        return _worker(args)
    world = args.pp * (args.dp or 1) * args.sp
    check(args, world)
    if args.device == "cuda":
        from .runtime.device import check_gpus

        check_gpus(world)  # the launcher starts every rank on this machine
    data = load_data(args.data, args.token_dtype, args.vocab_size, args.tokenizer)  # a bad path stops here
    _split(data, args)
    if args.resume:
        _check_resume(args, data.vocab_size)
    from .launch import launch

    return launch(args.argv, world)


def check(args, world: int):
    """Every mistake in the arguments, but the data's, that can be found before training
    on ``world`` processes; the run's layout and schedule."""
    from .presets import SIZES
    from .runtime.mesh import Layout

    for flag in ("microbatches", "microbatch_size", "steps", "seq"):
        if getattr(args, flag) < 1:
            raise PipeloomError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    layout = Layout.of(world, args.pp, args.sp, dp=args.dp)
    if args.seq % (2 * args.sp):
        raise PipeloomError(f"--seq {args.seq} does not split into 2 x --sp {args.sp} equal chunks (each "
                            f"sequence-parallel rank holds an early and a late one); use a multiple of {2 * args.sp}")
    if args.model not in SIZES:
        raise PipeloomError(f"unknown --model {args.model!r}; presets: {', '.join(SIZES)}")
    block = SIZES[args.model].block_size
    if block is not None and args.seq > block:
        raise PipeloomError(f"--seq {args.seq} is longer than the {block} positions --model {args.model} learns; "
                            f"use --seq {block} or less")
    if not args.clip >= 0:  # nan too
        raise PipeloomError(f"--clip {args.clip:g}: a gradient norm cannot be negative or nan; "
                            "give a positive norm, or 0 (or none) for no clipping")
    if args.warmup is not None and not 0 <= args.warmup <= args.steps:
        raise PipeloomError(f"--warmup {args.warmup}: use 0 to --steps {args.steps} warm-up steps"
                            + (" (the learning rate would never reach --lr)" if args.warmup > args.steps else ""))
    if args.weight_decay < 0:
        raise PipeloomError(f"--weight-decay must be at least 0, got {args.weight_decay:g}")
    for flag in ("lr", "timeout"):
        if not getattr(args, flag) > 0:
            raise PipeloomError(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.optimizer != "kfac" and (args.kfac_every is not None or args.kfac_damping != 1e-3):
        raise PipeloomError("--kfac-every and --kfac-damping go with --optimizer kfac")
    if args.optimizer == "kfac" and (args.checkpoint_dir or args.resume):
        raise PipeloomError("--optimizer kfac does not save its curvature in checkpoints yet: train without "
                            "--checkpoint-dir and --resume")
    if args.optimizer == "kfac" and (args.report or args.trace or args.plot):
        raise PipeloomError("--optimizer kfac cannot draw or report its measured steps yet (each step of its refresh "
                            "runs other pieces): drop --report, --trace and --plot, and see them simulated with "
                            "pipeloom simulate --kfac")
    if args.optimizer == "kfac" and not args.kfac_damping > 0:
        raise PipeloomError(f"--kfac-damping must be positive, got {args.kfac_damping:g}")
    if args.eval_every is not None and args.eval_every < 1:
        raise PipeloomError(f"--eval-every must be at least 1, got {args.eval_every}")
    if args.eval_batches < 1:
        raise PipeloomError(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if not 0 <= args.val_fraction < 1:  # nan too
        raise PipeloomError(f"--val-fraction {args.val_fraction:g}: hold out a share of the data in [0, 1)")
    if args.eval_every and args.val_fraction == 0:
        raise PipeloomError("--eval-every needs held-out data: give a --val-fraction above 0")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise PipeloomError(f"--checkpoint-every must be at least 1, got {args.checkpoint_every}")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise PipeloomError("--checkpoint-every needs --checkpoint-dir")
    if args.resume == "latest" and not args.checkpoint_dir:
        raise PipeloomError("--resume without a path needs --checkpoint-dir to look in")
    if args.resume and args.resume != "latest":
        from .runtime.checkpoint import read_meta

        read_meta(args.resume)
    vocab = None if args.vocab_parallel == "none" else args.vocab_parallel
    schedule = build(args.schedule, args.pp, args.microbatches, args.chunks,
                     transforms=[Offload(args.offload, args.offload_ratio)],
                     **({"vocab_parallel": vocab} if vocab else {}))
    if args.steps % schedule.steps:
        raise PipeloomError(f"{args.schedule} runs {schedule.steps} steps per call without a flush; "
                            f"use a --steps that is a multiple of {schedule.steps}")
    if args.checkpoint_every and args.checkpoint_every % schedule.steps:
        raise PipeloomError(f"{args.schedule} can save only between its calls of {schedule.steps} steps; "
                            f"use a --checkpoint-every that is a multiple of {schedule.steps}")
    if args.eval_every and args.eval_every % schedule.steps:
        raise PipeloomError(f"{args.schedule} can evaluate only between its calls of {schedule.steps} steps; "
                            f"use an --eval-every that is a multiple of {schedule.steps}")
    layers = SIZES[args.model].layers
    if schedule.stages > layers:
        raise PipeloomError(f"--model {args.model} has {layers} layers, too few for the {schedule.stages} stages of "
                            f"{args.schedule} at --pp {args.pp}; use a larger model or a smaller --pp")
    # last, when the rest is right: a missing directory is created; one that cannot be stops the run here
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace), ("--plot", args.plot)):
        if path:
            prepare_output(flag, path, SUFFIXES if flag == "--plot" else ())
    if args.checkpoint_dir:
        prepare_output_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.save:
        _installed("safetensors", "--save")
        prepare_output("--save", args.save, (".safetensors",))
    if args.tensorboard:
        _installed("tensorboard", "--tensorboard")
        prepare_output_dir("--tensorboard", args.tensorboard)
    return layout, schedule


def _installed(package: str, flag: str) -> None:
    """Refuse ``flag`` in one line when the optional ``package`` it needs is not installed."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise PipeloomError(f"{flag} needs the {package} package, which is not installed: "
                            f"pip install {package}") from None


def _split(data, args):
    """(training data, validation data): the last --val-fraction of the stream held out, refused in
    one line when --eval-every needs more of it than one sequence holds."""
    train, val = data.split(args.val_fraction)
    if args.eval_every and len(val) < args.seq + 1:
        raise PipeloomError(f"--val-fraction {args.val_fraction:g} holds out {len(val)} tokens of {data.source}, "
                            f"fewer than one sequence of --seq {args.seq} plus its target; hold out at least "
                            f"{(args.seq + 1) / len(data):.2g}, or use more data")
    return train, val


def _positions(args) -> dict:
    """The context length of a preset that has none (a simulator-sized model): --seq."""
    from .presets import SIZES

    return {} if SIZES[args.model].block_size else {"block_size": args.seq}


def learning_rate(step: int, args) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine decay to a tenth at ``--steps``."""
    warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _worker(args) -> int:
    from .runtime.interrupt import StopRequest

    stop = StopRequest()  # first: from now on a signal stops the run at a step boundary
    import torch
    import torch.distributed as dist

    from .runtime.device import pipeline_device
    from .runtime.heartbeat import record_failure
    from .runtime.p2p import PeerTimeout

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        layout, schedule = check(args, world)
        device = pipeline_device(args.device, backend)
    except PipeloomError as err:
        if rank == 0:
            print(f"pipeloom train: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # torch's own timeout (30 min on gloo) bounds a wait for a busy peer; --timeout is when a rank looks at it
    dist.init_process_group(backend)
    code = 1
    try:
        code = Trainer(args, device, stop, layout, schedule).train()
    except PeerTimeout as err:
        _say(_after_failure(rank) or str(err))
    except PipeloomError as err:  # the same on every rank: said once
        if rank == 0:
            _say(f"error: {err}")
    except dist.DistError as err:
        _say(_after_failure(rank) or f"rank {rank}: a collective failed (is every rank alive?): {first_line(err)}")
    except Exception as err:  # noqa: BLE001 -- one line here, the traceback in a file
        cause = f"{type(err).__name__}: {first_line(err)}"
        record_failure(rank, cause)
        _say(f"rank {rank} failed: {cause} (traceback in {_keep_traceback(rank)})")
    finally:
        stop.close()
        if code != 1:  # every rank finished or stopped at the same step: the group can be torn down
            dist.destroy_process_group()
    return code


def _say(text: str) -> None:
    print(f"pipeloom train: {text}", file=sys.stderr, flush=True)


def _after_failure(rank: int) -> str | None:
    """What a rank that lost its peers says when another rank failed first, if one did."""
    from .runtime.heartbeat import first_failure

    failed = first_failure()
    if failed is None or failed[0] == rank:
        return None
    return f"rank {rank} stopped: rank {failed[0]} failed first ({failed[1]})"


def _keep_traceback(rank: int) -> str:
    """Write the exception being handled to a file; its path."""
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix=f"pipeloom-rank{rank}-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(traceback.format_exc())
    return path


def _check_resume(args, vocab_size: int) -> Path:
    """The checkpoint --resume names, checked to fit this run (metadata, weight shapes,
    tensor files)."""
    import torch

    from .nn import preset_config
    from .runtime import checkpoint

    directory = checkpoint.latest(args.checkpoint_dir) if args.resume == "latest" else Path(args.resume)
    if directory is None:
        raise PipeloomError(f"--resume: no complete checkpoint under {args.checkpoint_dir}")
    saved = checkpoint.read_meta(directory)
    hint = f"with --model {saved.get('model')}, vocabulary {saved.get('vocab_size')}"
    if (saved.get("model"), saved.get("vocab_size")) != (args.model, vocab_size):
        raise PipeloomError(f"--resume {directory}: it was saved {hint}; this run has --model {args.model}, "
                            f"vocabulary {vocab_size} (from its data and tokenizer); resume with those")
    with torch.device("meta"):
        model = preset_config(args.model, vocab_size=vocab_size, **_positions(args)).build()
    checkpoint.check_fits(directory, model, hint)
    return directory


class Trainer:
    """One rank's training run on ``layout`` with ``schedule``: model, pipeline,
    optimizer, data, and the loop."""

    def __init__(self, args, device, stop, layout, schedule):
        import torch
        import torch.distributed as dist

        from .nn import preset_config
        from .runtime import Pipeline
        from .runtime.memory import PeakMemory

        self.args, self.device, self.stop = args, device, stop
        self.last_saved: Path | None = None  # the newest checkpoint this run saved or resumed from
        self.rank = dist.get_rank()
        self.data = load_data(args.data, args.token_dtype, args.vocab_size, args.tokenizer)
        self.memory = PeakMemory(device)  # from here: what the model and its training add
        self.config = preset_config(args.model, vocab_size=self.data.vocab_size, **_positions(args))
        dp = layout.dp
        torch.manual_seed(args.seed)  # the same weights on every rank
        precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
        autocast = torch.bfloat16 if precision == "bf16" else None
        model = self.config.build(device="meta")  # each rank materialises only its own stages
        self.n_params = sum(p.numel() for p in model.parameters())
        vocab = None if args.vocab_parallel == "none" else args.vocab_parallel
        self.pipe = Pipeline(model, schedule, dp=dp, sp=layout.sp, attention=args.attention, timeout=args.timeout,
                             autocast=autocast, device=device, recompute=RECOMPUTE[args.recompute],
                             layers_per_stage=_redistributed(self.config, args, schedule) if vocab == "redis" else None,
                             **_kfac(args, self.config, schedule, device))
        params = self.pipe.parameters()
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=args.lr, betas=(0.9, 0.95),
        )
        self.batch = args.microbatch_size * args.microbatches * dp
        self.data, self.val = _split(self.data, args)  # training draws from the first part only
        self.val_batches = None  # the validation batches, drawn on the first evaluation
        if self.rank == 0:
            sp = f", sp={args.sp} ({self.pipe.attention})" if args.sp > 1 else ""
            vocab_parallel = f", vocab-parallel {vocab}" if vocab else ""
            offload = f", offload {args.offload}" if args.offload != "none" else ""
            offload += f" {args.offload_ratio:g}" if args.offload_ratio is not None else ""
            if self.pipe.kfac is not None:
                offload += f", K-FAC refreshed every {self.pipe.schedule.options['kfac']['every']} steps"
            micro = f"{args.microbatches} microbatch{'es' if args.microbatches > 1 else ''}"
            print(f"pipeloom train: {args.model} ({_count(self.n_params)} parameters), {args.schedule}, pp={args.pp}, "
                  f"dp={dp}{sp}{vocab_parallel}{offload}, {micro} of {args.microbatch_size} x {args.seq} tokens, "
                  f"{precision} on {device.type}; data: {self.data.source}", file=sys.stderr, flush=True)
        self.start = self._resume() if args.resume else 0

    def train(self) -> int:
        """Run the steps; the exit code: 0, or 128 + the signal that stopped the run."""
        from .runtime.timeline import gather_timeline

        args, pipe = self.args, self.pipe
        lead = self.rank == 0
        metrics = open(args.metrics, "a" if args.resume else "w") if lead and args.metrics else None
        progress = _Progress(args.steps, self.start) if lead else None
        board = _board(args.tensorboard, self.start) if lead and args.tensorboard else None
        per_call = pipe.context.schedule.steps  # 2bw runs several steps per call, without a flush
        times, timelines = [], []
        done, stopped = self.start, 0
        try:
            for first in range(self.start, args.steps, per_call):
                # every rank stops after the same step
                stopped = self.stop.agreed(self.device, pipe.channel, first + 1)
                if stopped:
                    break
                started = time.perf_counter()
                records = self._call(first)
                elapsed = (time.perf_counter() - started) / per_call
                times.append(elapsed)
                if args.report and first + per_call > args.steps - REPORT_STEPS:
                    timelines.append(gather_timeline(pipe))
                measure = args.metrics and self.memory.measurable
                peaks = self.memory.per_pipeline_rank(pipe.pp_rank, args.pp, pipe.channel) if measure else None
                last = first + per_call  # the 1-based number of the call's last step
                if args.eval_every and (last % args.eval_every == 0 or last == args.steps):
                    records[-1]["val_loss"] = round(self._evaluate(), 6)
                for record in records:
                    record.update(step_time=round(elapsed, 6), tokens_per_s=round(self.batch * args.seq / elapsed, 1))
                    if peaks:
                        record["peak_memory_bytes"] = peaks
                    if metrics:
                        metrics.write(json.dumps(record) + "\n")
                        metrics.flush()
                    if board:
                        for key in SCALARS:
                            if key in record:
                                board.add_scalar(key, record[key], record["step"])
                    if progress:
                        progress.update(record)
                done = first + per_call
                every = args.checkpoint_every
                if args.checkpoint_dir and (done == args.steps or (every and done // every > first // every)):
                    self._save(done)
        finally:
            if metrics:
                metrics.close()
            if board:
                board.close()
            if progress:
                progress.close()
        if stopped:
            return self._stopped(stopped, done)
        if args.save:
            self._save_weights(done)
        if self.start < args.steps:
            self._write_timeline()
        if timelines and lead:
            print(report(pipe.schedule, timelines, times[1:] or times), flush=True)
        return 0

    def _stopped(self, code: int, done: int) -> int:
        """After a stop request: on SIGTERM save a checkpoint (with --checkpoint-dir), then
        say where the run stopped and what it can resume from; the exit code."""
        import signal

        from .runtime import checkpoint
        from .runtime.interrupt import StopRequest

        args = self.args
        if code == signal.SIGTERM and args.checkpoint_dir and done > self.start:
            self._save(done)
        last = self.last_saved or (checkpoint.latest(args.checkpoint_dir) if args.checkpoint_dir else None)
        if self.rank == 0:
            resume = (f"resume from {last} (--resume {last})" if last
                      else "no checkpoint to resume from (--checkpoint-dir saves them)")
            _say(f"stopped by {StopRequest.describe(code)} after step {done} of {args.steps}; {resume}")
        return StopRequest.exit_code(code)

    def _call(self, first: int) -> list[dict]:
        """Train the steps of one call of the schedule from step ``first`` (0-based);
        a record per step: step (1-based), loss, lr, and grad_norm where the update is global."""
        import numpy as np
        import torch

        from .runtime.p2p import PeerTimeout

        args, pipe = self.args, self.pipe
        steps = range(first, first + pipe.context.schedule.steps)
        lr = learning_rate(first, args)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tokens = torch.from_numpy(np.concatenate([self.data.batch(t, self.batch, args.seq, args.seed) for t in steps]))
        hint = f"Lower --lr (now {args.lr:g}) or check the data"
        if pipe.versions:  # each stage updates as it finishes a step: no global norm, no clipping
            losses = pipe.run_steps(tokens[:, :-1], tokens[:, 1:], self.optimizer)
            for t, loss in zip(steps, losses):
                if not math.isfinite(loss):
                    raise PipeloomError(f"step {t + 1}: the loss is {loss}. {hint}")
            return [{"step": t + 1, "loss": round(loss, 6), "lr": lr} for t, loss in zip(steps, losses)]
        loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
        if not math.isfinite(loss):
            raise PipeloomError(f"step {first + 1}: the loss is {loss}; the update was not applied. {hint}")
        try:
            norm = pipe.optimizer_step(self.optimizer, max_norm=args.clip or None)  # 0: no clipping
        except PeerTimeout:
            raise
        except PipeloomError as err:  # a non-finite gradient norm
            raise PipeloomError(f"step {first + 1}: {err}. {hint}") from None
        return [{"step": first + 1, "loss": round(loss, 6), "lr": lr,
                 **({"grad_norm": round(norm, 6)} if norm is not None else {})}]

    def _evaluate(self) -> float:
        """The mean loss on the --eval-batches validation batches (the same every time),
        forward only through the pipeline; every rank calls it."""
        import torch

        args = self.args
        if self.val_batches is None:
            self.val_batches = [torch.from_numpy(self.val.batch(k, self.batch, args.seq, args.seed))
                                for k in range(args.eval_batches)]
        return sum(self.pipe.evaluate(b[:, :-1], b[:, 1:]) for b in self.val_batches) / len(self.val_batches)

    def _save_weights(self, step: int) -> None:
        """--save: the model's weights by their unsplit names, gathered from every rank and
        written by rank 0 with the run's metadata (and a BPE run's tokenizer)."""
        from .generate import META_KEY, TOKENIZER_KEY

        weights = self.pipe.gather_weights(to=0)
        if self.rank != 0:
            return
        from safetensors.torch import save_file

        extra = {META_KEY: json.dumps(self._meta(step))}
        if self._tokenizer() == "bpe":
            extra[TOKENIZER_KEY] = Path(self.data.tokenizer).read_text()
        with _output("--save", self.args.save, True):
            save_file(weights, self.args.save, metadata=extra)
            _Progress.note(f"saved the weights of step {step} to {self.args.save}")

    def _tokenizer(self) -> str | None:
        """How the run's text became tokens: bytes, bpe (its tokenizer.json), or None (a token file)."""
        return {"bytes": "bytes", None: None}.get(self.data.tokenizer, "bpe")

    def _write_timeline(self) -> None:
        """``--trace`` and ``--plot``: the last step's measured timeline (every rank takes part)."""
        from .runtime.timeline import gather_timeline, measured_result, write_trace
        from .sim import plot_schedule

        args, lead = self.args, self.rank == 0
        if args.trace:
            with _output("--trace", args.trace, lead):
                write_trace(self.pipe, args.trace)
                if lead:
                    print(f"wrote the measured timeline of step {args.steps} to {args.trace}", file=sys.stderr)
        if args.plot:
            result = measured_result(gather_timeline(self.pipe), self.pipe.schedule)
            if lead:
                with _output("--plot", args.plot, lead):
                    plot_schedule(result, args.plot)
                    print(f"drew the measured timeline of step {args.steps} in {args.plot}", file=sys.stderr)

    def _meta(self, step: int) -> dict:
        args = self.args
        return {"step": step, "model": args.model, "vocab_size": self.config.vocab_size, "seq": args.seq,
                "schedule": args.schedule, "pp": args.pp, "dp": self.pipe.dp, "sp": args.sp, "microbatches": args.microbatches,
                "microbatch_size": args.microbatch_size, "seed": args.seed, "data": self.data.source,
                "tokenizer": self._tokenizer()}

    def _save(self, step: int) -> None:
        from .runtime import checkpoint

        directory = Path(self.args.checkpoint_dir) / f"step_{step:07d}"
        files = {"tokenizer.json": Path(self.data.tokenizer).read_bytes()} if self._tokenizer() == "bpe" else None
        checkpoint.save(self.pipe, self.optimizer, directory, self._meta(step), files)
        self.last_saved = directory
        if self.rank == 0:
            _Progress.note(f"saved checkpoint {directory}")

    def _resume(self) -> int:
        from .runtime import checkpoint

        directory = _check_resume(self.args, self.config.vocab_size)  # again: under torchrun no launcher did
        meta = checkpoint.load(self.pipe, self.optimizer, directory)
        self.last_saved = directory
        if self.rank == 0:
            print(f"resumed from {directory} (step {meta['step']}, saved with pp={meta['pp']}, dp={meta['dp']})",
                  file=sys.stderr, flush=True)
        return meta["step"]


@contextmanager
def _output(flag: str, path: str, lead: bool):
    """Writing an output at the end of a run: a failure is one line, and the run's outcome stands."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- matplotlib's and the filesystem's errors alike
        if lead:
            _say(f"could not write {flag} {path}: {type(err).__name__}: {first_line(err)}")


def report(schedule, timelines, step_times) -> str:
    """The measured step beside the simulator's prediction from the measured costs,
    and what the simulator predicts for the other families with those costs."""
    from .runtime.timeline import full_stage_costs, measured_costs, measured_result, median_costs
    from .sim import simulate

    costs = median_costs([measured_costs(events, schedule) for events in timelines])
    seen = [measured_result(events, schedule) for events in timelines]
    own = simulate(schedule, costs)
    step_ms, span = 1e3 * median(step_times), median(r.makespan for r in seen)
    lines = [
        f"report: {schedule.family}, pp={schedule.pp}, {schedule.microbatches} microbatches "
        f"(timelines of the last {len(timelines)} steps)",
        f"  measured step   {step_ms:9.2f} ms   (with the optimizer step; the schedule's actions span "
        f"{span:.2f} ms, bubble seen {median(r.bubble_rate for r in seen):.1%})",
        f"  simulated       {own.makespan:9.2f} ms   (the actions, from the measured costs; bubble "
        f"{own.bubble_rate:.1%}; simulated / measured span {own.makespan / span:.3f})",
        "  measured costs per stage (ms): " + ", ".join(
            f"{k} {' '.join(f'{v:.2f}' for v in getattr(costs, k))}" for k in ("f", "b", "w", "comm")),
        *(["  vocabulary passes per rank (ms): " + ", ".join(
            f"{k} {' '.join(f'{v:.2f}' for v in getattr(costs, k))}" for k in ("s", "t", "c", "e_f", "e_b"))]
          if schedule.vocab_parallel else []),
        "  the simulator's prediction for other schedules with these costs:",
    ]
    full = full_stage_costs(costs, schedule)
    for name in FAMILIES:
        if name == schedule.family:
            continue
        options = {"costs": full} if name == "zb-auto" else {}
        if schedule.vocab_parallel:
            options["vocab_parallel"] = schedule.vocab_parallel
        try:
            other = build(name, schedule.pp, schedule.microbatches, **options)
        except PipeloomError as err:
            lines.append(f"    {name:<18} cannot run here: {err}")
            continue
        if full.w == 0 and any(a.kind == "W" for actions in other.ranks for a in actions):
            lines.append(f"    {name:<18} needs T_W: train with a split-backward schedule (zb-h1) to measure it")
            continue
        result = simulate(other, full)
        lines.append(f"    {name:<18} {result.makespan / other.steps:9.2f} ms   bubble {result.bubble_rate:.1%}"
                     + (f"   (a step of {other.steps} without a flush)" if other.steps > 1 else ""))
    return "\n".join(lines)


def _kfac(args, config, schedule, device) -> dict:
    """Pipeline's K-FAC arguments for --optimizer kfac: the pieces placed by the model's costs on
    this kind of device (the ``cpu`` or ``h100`` preset)."""
    if args.optimizer != "kfac":
        return {}
    from .sim.model import costs_from_model
    from .sim.specs import MODELS

    spec = dataclasses.replace(MODELS[args.model], vocab=config.vocab_size)
    costs = costs_from_model(spec, args.pp, args.seq, args.microbatch_size, "h100" if device.type == "cuda" else "cpu",
                             chunks=schedule.chunks, kfac=True, dp=args.dp or 1)
    return {"optimizer": "kfac", "kfac": {"damping": args.kfac_damping, "every": args.kfac_every}, "costs": costs}


def _redistributed(config, args, schedule) -> tuple[int, ...]:
    """The ``redis`` baseline's layers per stage: the simulator's balance of compute
    with the embedding on the first stage and the LM head on the last."""
    from .partition import balanced_layers
    from .sim.specs import MODELS

    spec = dataclasses.replace(MODELS[args.model], vocab=config.vocab_size)
    return balanced_layers(spec, schedule.stages, args.seq)


def _board(directory: str, start: int):
    """rank 0's TensorBoard writer; a resumed run hides what an earlier run logged after its start."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(directory, purge_step=start + 1 if start else None)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


class _Progress:
    """rank 0's progress: a bar rewritten in place on a terminal, a line per tenth of the run otherwise."""

    def __init__(self, total: int, start: int):
        self.total, self.start, self.began = total, start, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.open = False  # a bar on a terminal waits to be rewritten
        self.every = max(1, (total - start) // 10)

    def update(self, record: dict) -> None:
        step = record["step"]
        done = (step - self.start) / max(1, self.total - self.start)
        left = (time.perf_counter() - self.began) * (1 - done) / done if done else 0.0
        bar = "#" * round(20 * step / self.total)
        val = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{bar:<20}] loss {record['loss']:.4f}{val}  "
                f"{record['tokens_per_s']:,.0f} tok/s  {left:4.0f}s left")
        if self.tty:
            print("\r" + line, end="\n" if val else "", file=sys.stderr, flush=True)  # a validation line stays
            self.open = not val
        elif val or step == self.total or (step - self.start) % self.every == 0 or step == self.start + 1:
            print(line, file=sys.stderr, flush=True)

    @staticmethod
    def note(text: str) -> None:
        end = "\n" if sys.stderr.isatty() else ""
        print(end + text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.open:
            print(file=sys.stderr, flush=True)
