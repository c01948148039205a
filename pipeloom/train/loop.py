"""One rank of ``pipeloom train``: the worker's start and stop, the :class:`Trainer` and its loop."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..builder import build_run, costs_of
from ..errors import PipeloomError, first_line
from ..spec import RunSpec
from ..techniques import TECHNIQUES
from .config import (check, check_resume, check_steps, learning_rate, model_config, split_data, training_data,
                     with_vocab)
from .report import memory_lines, report


#: Steps whose timelines feed ``--report`` (the last ones of the run).
REPORT_STEPS = 5


#: The metrics ``--tensorboard`` writes as scalars, by their names in ``--metrics``.
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "val_loss")


def worker(make_spec, config) -> int:
    """One rank of the run: ``make_spec()`` gives the run spec (its mistakes are said by rank 0 alone)."""
    from ..runtime.interrupt import StopRequest

    stop = StopRequest()  # first: from now on a signal stops the run at a step boundary
    import torch
    import torch.distributed as dist

    from ..runtime.device import pipeline_device
    from ..runtime import heartbeat
    from ..runtime.p2p import PeerTimeout

    from ..runtime.mesh import Layout

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    try:
        spec = make_spec().check_runnable()
        layout = Layout.of(world, spec.pp, spec.sp, dp=config.dp)
        spec = spec.replace(dp=layout.dp)
        check(config, spec)
        backend = "nccl" if spec.device == "cuda" else "gloo"
        device = pipeline_device(spec.device, backend)
        threads = os.environ.get("OMP_NUM_THREADS", "1")
        if not (threads.isdigit() and int(threads) > 0):
            raise PipeloomError(f"OMP_NUM_THREADS={threads!r} is not a positive integer: set it to the threads "
                                "per rank (e.g. 1) or unset it")
    except PipeloomError as err:
        if rank == 0:
            print(f"pipeloom train: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(threads))
    for technique in TECHNIQUES.values():
        technique.setup_runtime()
    # torch's own timeout (30 min on gloo) bounds a wait for a busy peer; --timeout is when a rank looks at it
    dist.init_process_group(backend)
    code = 1
    try:
        code = Trainer(config, spec, device, stop, layout).train()
    except PeerTimeout as err:
        _say(_after_failure(rank) or str(err))
    except PipeloomError as err:  # the same on every rank: said once
        if rank == 0:
            _say(f"error: {err}")
    except dist.DistError as err:
        _say(_after_failure(rank) or f"rank {rank}: a collective failed (is every rank alive?): {first_line(err)}")
    except Exception as err:  # noqa: BLE001 -- one line here, the traceback in a file
        cause = f"{type(err).__name__}: {first_line(err)}"
        heartbeat.record_failure(rank, cause)
        _say(f"rank {rank} failed: {cause} (traceback in {_keep_traceback(rank)})")
    finally:
        stop.close()
        heartbeat.stop()  # its threads end here, not in the store's code while Python shuts down
        if code != 1:  # every rank finished or stopped at the same step: the group can be torn down
            # the pipeline's reference cycles hold subgroups, their gloo work and its tensors: freed now,
            # while Python is whole (freed while it shuts down, a gloo thread's release of a tensor
            # takes the GIL, and the process aborts: "terminate called without an active exception")
            gc.collect()
            dist.destroy_process_group()
    return code


def _say(text: str) -> None:
    print(f"pipeloom train: {text}", file=sys.stderr, flush=True)


def _after_failure(rank: int) -> str | None:
    """What a rank that lost its peers says when another rank failed first, if one did."""
    from ..runtime.heartbeat import first_failure

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


class Trainer:
    """One rank's training run of ``spec`` on ``layout``: model, pipeline, optimizer, data, and the loop."""

    def __init__(self, config, spec: RunSpec, device, stop, layout):
        import torch
        import torch.distributed as dist

        from ..runtime import Pipeline
        from ..runtime.memory import PeakMemory

        self.config, self.device, self.stop = config, device, stop
        self.last_saved: Path | None = None  # the newest checkpoint this run saved or resumed from
        self.rank = dist.get_rank()
        self.data = training_data(config, progress=self.rank == 0)
        self.spec = spec = with_vocab(spec, self.data.vocab_size)
        costs = costs_of(spec)
        runtime = tuple(t.name for t in TECHNIQUES.values() if t.placed_by_runtime)  # the pipeline places their work
        schedule = build_run(spec, costs, without=runtime)
        check_steps(config, schedule)
        self.memory = PeakMemory(device)  # from here: what the model and its training add
        self.model_config = model_config(spec)
        dp = layout.dp
        torch.manual_seed(config.seed)  # the same weights on every rank
        precision = spec.training_precision
        autocast = torch.bfloat16 if precision == "bf16" else None
        self.model = model = self.model_config.build(device="meta")  # each rank materialises its own stages
        if spec.init_from is not None:  # and reads only their tensors
            model.load_safetensors(spec.init_from)
        self.n_params = sum(p.numel() for p in model.parameters())
        options = {k: v for t in TECHNIQUES.values() for k, v in t.pipeline_options(spec, costs).items()}
        self.pipe = Pipeline(model, schedule, dp=dp, timeout=config.timeout, autocast=autocast, device=device, **options)
        self.pipe.record_memory = bool(config.trace or config.plot)  # the measured timeline's memory
        self.digest = _agreed_digest(self.pipe.schedule, build_run(spec, costs))
        params = self.pipe.parameters()
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=config.lr, betas=(0.9, 0.95),
        )
        self.batch = spec.microbatch_size * spec.microbatches * dp
        self.data, self.val = split_data(self.data, config, spec.seq)  # training draws from the first part only
        self.val_batches = None  # the validation batches, drawn on the first evaluation
        if self.rank == 0:
            techniques = "".join(t.describe(spec, self.pipe) for t in TECHNIQUES.values())
            micro = f"{spec.microbatches} microbatch{'es' if spec.microbatches > 1 else ''}"
            print(f"pipeloom train: {spec.model or spec.init_from} ({_count(self.n_params)} parameters, vocabulary "
                  f"{self.model_config.vocab_size}), {spec.schedule}, pp={spec.pp}, dp={dp}{techniques}, "
                  f"{micro} of {spec.microbatch_size} x {spec.seq} tokens, {precision} on {device.type}; "
                  f"data: {self.data.source}", file=sys.stderr, flush=True)
            print(f"pipeloom train: schedule sha256 {self.digest} (every rank's)", file=sys.stderr, flush=True)
        self.start = self._resume() if config.resume else 0

    def train(self) -> int:
        """Run the steps; the exit code: 0, or 128 + the signal that stopped the run."""
        from ..runtime.timeline import gather_timeline

        config, pipe = self.config, self.pipe
        lead = self.rank == 0
        metrics = open(config.metrics, "a" if config.resume else "w") if lead and config.metrics else None
        progress = _Progress(config.steps, self.start) if lead else None
        board = _board(config.tensorboard, self.start) if lead and config.tensorboard else None
        per_call = pipe.context.schedule.steps  # 2bw runs several steps per call, without a flush
        times, timelines = [], []
        done, stopped = self.start, 0
        # --report's memory: from the start of the last call (K-FAC: of the last whole refresh cycle)
        whole = -(-(config.steps - self.start) // per_call) // pipe.cycle * pipe.cycle  # the calls of whole cycles
        restart_at = whole - pipe.cycle if config.report and whole and self.memory.measurable else None
        try:
            for call, first in enumerate(range(self.start, config.steps, per_call)):
                # every rank stops after the same step
                stopped = self.stop.agreed(self.device, pipe.channel, first + 1)
                if stopped:
                    break
                if call == restart_at:
                    self.memory.restart()
                started = time.perf_counter()
                records = self._call(first)
                elapsed = (time.perf_counter() - started) / per_call
                times.append(elapsed)
                if config.report and pipe.cycle == 1 and first + per_call > config.steps - REPORT_STEPS:
                    timelines.append(gather_timeline(pipe))
                measure = config.metrics and self.memory.measurable
                peaks = self.memory.per_pipeline_rank(pipe.pp_rank, self.spec.pp, pipe.channel) if measure else None
                last = first + per_call  # the 1-based number of the call's last step
                if config.eval_every and (last % config.eval_every == 0 or last == config.steps):
                    records[-1]["val_loss"] = round(self._evaluate(), 6)
                for record in records:
                    record.update(step_time=round(elapsed, 6), tokens_per_s=round(self.batch * self.spec.seq / elapsed, 1))
                    if peaks:
                        record.update(peaks)
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
                every = config.checkpoint_every
                if config.checkpoint_dir and (done == config.steps or (every and done // every > first // every)):
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
        if config.save or config.save_hf:
            self._save_weights(done)
        if self.start < config.steps:
            self._write_timeline()
        if config.report and pipe.cycle > 1 and pipe.last_cycle:  # a K-FAC refresh: its last whole cycle
            end = len(times) - len(times) % pipe.cycle  # the run started at a cycle's start
            timelines, times = [gather_timeline(pipe, cycle=True)], [sum(times[end - pipe.cycle:end]) * per_call]
        if timelines:
            memory = self._memory_lines() if restart_at is not None else []  # every rank takes part
            if lead:
                print(report(pipe.schedule, timelines, times[1:] or times, memory), flush=True)
        return 0

    def _memory_lines(self) -> list[str]:
        """``--report``'s memory lines (:func:`~.report.memory_lines`) on the lead rank: the most the
        last call (K-FAC: the last whole refresh cycle) held above its start, and on a GPU the run's
        peaks, beside ``simulate``'s prediction for this run; every rank gathers its own."""
        from ..cli.simulate import simulate_spec

        peaks = self.memory.per_pipeline_rank(self.pipe.pp_rank, self.spec.pp, self.pipe.channel, stretch=True)
        if self.rank != 0:
            return []
        on_gpu = self.device.type == "cuda"
        return memory_lines(peaks["stretch_bytes"], peaks["peak_memory_bytes"] if on_gpu else None,
                            simulate_spec(self.spec)[0])

    def _stopped(self, code: int, done: int) -> int:
        """After a stop request: on SIGTERM save a checkpoint (with --checkpoint-dir), then
        say where the run stopped and what it can resume from; the exit code."""
        import signal

        from ..runtime import checkpoint
        from ..runtime.interrupt import StopRequest

        config, cycle = self.config, self.pipe.schedule.steps
        inside = ""
        if code == signal.SIGTERM and config.checkpoint_dir and done > self.start:
            if done % cycle == 0:
                self._save(done)
            else:  # K-FAC mid-refresh: its captures and partial sums are not saved, so no exact resume there
                inside = f" (step {done} is inside K-FAC's refresh of {cycle} steps: no checkpoint there)"
        last = self.last_saved or (checkpoint.latest(config.checkpoint_dir) if config.checkpoint_dir else None)
        if self.rank == 0:
            if last:
                resume = f"resume from {last} (--resume {last})"
            elif config.checkpoint_dir:
                resume = (f"no checkpoint saved under {config.checkpoint_dir} yet (SIGTERM saves one; "
                          "--checkpoint-every N saves every N steps)")
            else:
                resume = "no checkpoint to resume from (--checkpoint-dir saves them)"
            _say(f"stopped {StopRequest.describe(code)} after step {done} of {config.steps}{inside}; {resume}")
        return StopRequest.exit_code(code)

    def _call(self, first: int) -> list[dict]:
        """Train the steps of one call of the schedule from step ``first`` (0-based);
        a record per step: step (1-based), loss, lr, and grad_norm where the update is global."""
        import numpy as np
        import torch

        from ..runtime.p2p import PeerTimeout

        config, pipe = self.config, self.pipe
        steps = range(first, first + pipe.context.schedule.steps)
        lr = learning_rate(first, config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tokens = torch.from_numpy(np.concatenate([self.data.batch(t, self.batch, self.spec.seq, config.seed) for t in steps]))
        hint = f"Lower --lr (now {config.lr:g}) or check the data"
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
            norm = pipe.optimizer_step(self.optimizer, max_norm=config.clip or None)  # 0: no clipping
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

        config = self.config
        if self.val_batches is None:
            self.val_batches = [torch.from_numpy(self.val.batch(k, self.batch, self.spec.seq, config.seed))
                                for k in range(config.eval_batches)]
        return sum(self.pipe.evaluate(b[:, :-1], b[:, 1:]) for b in self.val_batches) / len(self.val_batches)

    def _save_weights(self, step: int) -> None:
        """--save and --save-hf: the model's weights by their unsplit names, gathered from every rank
        once and written by rank 0 with the run's metadata (and a BPE run's tokenizer)."""
        from ..generate import META_KEY, TOKENIZER_KEY

        weights = self.pipe.gather_weights(to=0)
        if self.rank != 0:
            return
        extra = {META_KEY: json.dumps(self._meta(step))}
        if self._tokenizer() == "bpe":
            extra[TOKENIZER_KEY] = Path(self.data.tokenizer).read_text()
        if self.config.save:
            from safetensors.torch import save_file

            with _output("--save", self.config.save, True):
                save_file(weights, self.config.save, metadata=extra)
                _Progress.note(f"saved the weights of step {step} to {self.config.save}")
        if self.config.save_hf:
            with _output("--save-hf", self.config.save_hf, True):
                self._save_hf(weights, extra)
                _Progress.note(f"saved the model of step {step} to {self.config.save_hf} (Hugging Face's layout)")

    def _save_hf(self, weights: dict, extra: dict) -> None:
        """Write --save-hf's directory: config.json (the --init-from directory's, with this model's
        sizes), model.safetensors by Hugging Face's names (the run's metadata in its header), and
        the tokenizer: a BPE run's tokenizer.json, with the --init-from directory's other tokenizer files."""
        from .. import hf
        from ..generate import TOKENIZER_KEY
        from ..nn.hf import save

        out, source = Path(self.config.save_hf), self.spec.init_from
        template = hf.read_config(source) if source else None
        config = hf.config_json(self.spec.size.family, self.model_config, template)
        (out / hf.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save(self.model, weights, out / hf.WEIGHTS, {k: v for k, v in extra.items() if k != TOKENIZER_KEY})
        if self._tokenizer() == "bpe":
            (out / hf.TOKENIZER).write_text(extra[TOKENIZER_KEY])
            if source and self.config.tokenizer == hf.tokenizer_file(source):  # the directory's own tokenizer
                for name in hf.TOKENIZER_FILES:
                    if (Path(source) / name).is_file():
                        shutil.copyfile(Path(source) / name, out / name)

    def _tokenizer(self) -> str | None:
        """How the run's text became tokens: bytes, bpe (its tokenizer.json), or None (a token file)."""
        return {"bytes": "bytes", None: None}.get(self.data.tokenizer, "bpe")

    def _write_timeline(self) -> None:
        """``--trace`` and ``--plot``: the last step's measured timeline, or with K-FAC the last
        refresh cycle's (every rank takes part)."""
        from ..runtime.timeline import MEMORY_COUNTER, first_start, gather_measured, measured_result, write_trace
        from ..sim import plot_schedule

        config, lead, pipe = self.config, self.rank == 0, self.pipe
        cycle = pipe.cycle > 1
        if cycle:  # the last whole one: the run started at a cycle's start
            steps = pipe.cycle * pipe.context.schedule.steps
            last = config.steps - (config.steps - self.start) % steps
            what = f"the last whole K-FAC cycle (steps {last - steps + 1}-{last})"
        else:
            what = f"step {config.steps}"
        if config.trace:
            with _output("--trace", config.trace, lead):
                write_trace(pipe, config.trace, cycle)
                if lead:
                    print(f"wrote the measured timeline of {what} to {config.trace}", file=sys.stderr)
        if config.plot:
            events, memory = gather_measured(pipe, cycle)
            result = measured_result(events, pipe.schedule)  # its times from its first action's start
            origin = first_start(events)
            held = {"memory_unit": "bytes", "memory_name": MEMORY_COUNTER,
                    "memory": [[(t - origin, level) for t, level in points] for points in memory]}
            if lead:
                with _output("--plot", config.plot, lead):
                    plot_schedule(result, config.plot, **(held if any(memory) else {}))
                    print(f"drew the measured timeline of {what} in {config.plot}", file=sys.stderr)

    def _meta(self, step: int) -> dict:
        spec = self.spec
        return {"step": step, "model": spec.model, "vocab_size": self.model_config.vocab_size, "seq": spec.seq,
                "schedule": spec.schedule, "pp": spec.pp, "dp": self.pipe.dp, "sp": spec.sp,
                "microbatches": spec.microbatches, "microbatch_size": spec.microbatch_size, "seed": self.config.seed,
                "data": self.data.source, "tokenizer": self._tokenizer(), "spec": spec.to_dict()}

    def _save(self, step: int) -> None:
        from ..runtime import checkpoint

        directory = Path(self.config.checkpoint_dir) / f"step_{step:07d}"
        files = {"tokenizer.json": Path(self.data.tokenizer).read_bytes()} if self._tokenizer() == "bpe" else None
        checkpoint.save(self.pipe, self.optimizer, directory, self._meta(step), files)
        self.last_saved = directory
        if self.rank == 0:
            _Progress.note(f"saved checkpoint {directory}")

    def _resume(self) -> int:
        from ..runtime import checkpoint

        directory, _ = check_resume(self.config, self.spec)  # again: under torchrun no launcher did
        meta = checkpoint.load(self.pipe, self.optimizer, directory)
        self.last_saved = directory
        if self.rank == 0:
            print(f"resumed from {directory} (step {meta['step']}, saved with pp={meta['pp']}, dp={meta['dp']})"
                  + self._batch_change(meta), file=sys.stderr, flush=True)
        return meta["step"]

    def _batch_change(self, meta: dict) -> str:
        """What the resumed run's steps take unlike the saving run's (sequences per step, tokens per
        sequence), or nothing: the same steps then see other data than the saving run would have."""
        if any(meta.get(key) is None for key in ("dp", "microbatches", "microbatch_size", "seq")):
            return ""  # an older checkpoint's facts
        spec = self.spec
        now = (self.pipe.dp * spec.microbatches * spec.microbatch_size, spec.seq)
        saved = (meta["dp"] * meta["microbatches"] * meta["microbatch_size"], meta["seq"])
        if now == saved:
            return ""
        return (f"; a step now takes {now[0]} sequences of {now[1]} tokens, the saving run's {saved[0]} of "
                f"{saved[1]} (dp x microbatches x microbatch size): the data from here on is not what it would have seen")


@contextmanager
def _output(flag: str, path: str, lead: bool):
    """Writing an output at the end of a run: a failure is one line, and the run's outcome stands."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 -- matplotlib's and the filesystem's errors alike
        if lead:
            _say(f"could not write {flag} {path}: {type(err).__name__}: {first_line(err)}")


def _agreed_digest(schedule, built) -> str:
    """The digest of the schedule the pipeline runs, checked to be that of the one ``built`` from
    the spec (what ``--dry-run`` shows) and every rank's."""
    import torch.distributed as dist

    digest = schedule.digest()
    if digest != built.digest():
        differ = [k for k in sorted({*schedule.options, *built.options}) if schedule.options.get(k) != built.options.get(k)]
        raise PipeloomError(f"the pipeline runs another schedule (sha256 {digest[:12]}) than the run spec's "
                            f"({built.digest()[:12]}); options that differ: {', '.join(differ) or 'none'}")
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if len(set(every)) > 1:
        other = next(r for r, d in enumerate(every) if d != digest)
        raise PipeloomError(f"rank {other} built another schedule (sha256 {every[other][:12]} against "
                            f"{digest[:12]}); every rank must run the same pipeloom with the same flags")
    return digest


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
