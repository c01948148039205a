"""pipeloom against torch.distributed.pipelining: step time of GPipe, 1F1B and ZB-V on 2 CPU processes.

    python bench/vs_torch_pipelining.py [--layers 8] [--hidden 256] [--seq 128] [--microbatches 8] [--steps 10]

The same GPT weights, stage split and batch run under torch's ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleZBVZeroBubble`` and under pipeloom's ``gpipe``,
``1f1b`` and ``zb-v``, on 2 gloo processes with one thread each. The first
step's loss and gradients of the two must agree (else exit 1); then the two
alternate for the timed steps. Writes bench/results/vs_torch_pipelining.json
with the median step times and ratio = pipeloom / torch per schedule (goal:
<= 0.9), the ratio of the fastest steps (less sensitive to a noisy machine)
and every step's time. Asserts nothing about time.

The floor: each timed pipeloom step's schedule simulated on the durations
its own actions took in it (:func:`pipeloom.runtime.timeline.measured_costs`),
the step without any host work between actions; ``floor_s`` is their median,
``pipeloom_over_floor`` the median of each step over its own floor (the
executor's overhead, whatever the machine's noise from step to step). Both
sides run the same math, so ``torch_over_floor`` bounds what any executor
could gain over torch's: a ratio of 0.9 needs torch at 1.11x the floor or more.

Loss scaling: torch calls ``loss_fn`` (mean cross-entropy) per microbatch and,
with its default ``scale_grads=True``, divides the gradients by the number of
microbatches m after the step; pipeloom backpropagates each microbatch's mean
cross-entropy divided by m. Both give the gradient of the batch's mean loss;
the step loss is the mean of the microbatch losses on both sides.

torch's side runs the stock ``nn.Linear`` (the weights are the same): its B/W
split works on the autograd graph, so with pipeloom's ``Linear`` (a custom
autograd function) its B would compute the weight gradients and drop them and
its W would redo those layers' backward (ZB-V ~17% slower when measured).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import pipeloom
from pipeloom.nn import GPT, GPTConfig
from pipeloom.nn.linear import Linear
from pipeloom.runtime.local import spawn
from pipeloom.runtime.timeline import gather_timeline, measured_costs
from pipeloom.sim import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

#: pipeloom schedule name -> torch.distributed.pipelining schedule class name
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-v": "ScheduleZBVZeroBubble"}
TOLERANCE = 1e-4


def _model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


class _TorchSide:
    """One torch.distributed.pipelining schedule over this rank's stages of a fresh GPT."""

    def __init__(self, rank: int, name: str, config: GPTConfig, microbatches: int):
        model = _model(config)
        for module in model.modules():  # stock nn.Linear, the same weights (see the module docstring)
            if isinstance(module, Linear):
                module.__class__ = nn.Linear
        v_shape = name == "zb-v"
        n_stages = 4 if v_shape else 2
        indices = (rank, n_stages - 1 - rank) if v_shape else (rank,)
        parts = model.split(n_stages)
        self.modules = [parts[s] for s in indices]
        stages = [pipelining.PipelineStage(parts[s], s, n_stages, torch.device("cpu")) for s in indices]
        schedule_class = getattr(pipelining, SCHEDULES[name])
        self.schedule = schedule_class(stages if v_shape else stages[0], microbatches, loss_fn=GPT.loss)
        self.first = 0 in indices
        self.last = n_stages - 1 in indices

    def step(self, tokens, targets) -> float:
        """One step; the mean loss on every rank, as ``Pipeline.step`` returns it."""
        args = (tokens,) if self.first else ()
        kwargs = {"target": targets, "losses": []} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        loss = torch.stack(kwargs["losses"]).mean().detach() if self.last else torch.zeros(())
        dist.all_reduce(loss)
        return loss.item()

    def grads(self) -> dict:
        return {m.param_names[n]: p.grad for m in self.modules for n, p in m.named_parameters()}

    def zero_grad(self) -> None:
        for m in self.modules:
            m.zero_grad(set_to_none=True)


class _PipeloomSide:
    """A pipeloom Pipeline over a fresh GPT, with the same surface as :class:`_TorchSide`."""

    def __init__(self, name: str, config: GPTConfig, microbatches: int):
        self.pipe = pipeloom.Pipeline(_model(config), schedule=name, pp=2, microbatches=microbatches)

    def step(self, tokens, targets) -> float:
        return self.pipe.step(tokens, targets)

    def grads(self) -> dict:
        return {self.pipe.names[id(p)]: p.grad for p in self.pipe.parameters()}

    def zero_grad(self) -> None:
        self.pipe.zero_grad()


def _max_rel_error(grads: dict, ref: dict) -> float:
    """The largest relative gradient difference over all parameters of all ranks."""
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    worst = max(((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() for n in ref)
    worst = torch.tensor(worst)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def _timed(side, tokens, targets) -> float:
    """Seconds of one step, from a barrier; the gradients are dropped afterwards."""
    dist.barrier()
    start = time.perf_counter()
    side.step(tokens, targets)
    elapsed = time.perf_counter() - start
    side.zero_grad()
    return elapsed


def _worker(rank: int, args) -> dict:
    config = GPTConfig(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, vocab_size=args.vocab,
                       block_size=args.seq)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, config.vocab_size, (args.microbatches * args.microbatch_size, args.seq + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:]
    out = {}
    for name in SCHEDULES:
        ours, theirs = _PipeloomSide(name, config, args.microbatches), _TorchSide(rank, name, config, args.microbatches)
        loss_torch, loss_ours = theirs.step(tokens, targets), ours.step(tokens, targets)
        grad_error = _max_rel_error(ours.grads(), theirs.grads())
        for side in (ours, theirs):
            side.zero_grad()
            for _ in range(args.warmup - 1):
                _timed(side, tokens, targets)
        times, floors = {"torch": [], "pipeloom": []}, []
        for k in range(args.steps):  # alternate, each side first every other step
            order = [("torch", theirs), ("pipeloom", ours)][:: 1 if k % 2 == 0 else -1]
            for label, side in order:
                times[label].append(_timed(side, tokens, targets))
                if side is ours:
                    costs = measured_costs(gather_timeline(ours.pipe), ours.pipe.schedule)
                    floors.append(simulate(ours.pipe.schedule, costs).makespan / 1e3)
        torch_s, ours_s = statistics.median(times["torch"]), statistics.median(times["pipeloom"])
        floor_s = statistics.median(floors)
        out[name] = {
            "torch_schedule": SCHEDULES[name],
            "torch_s": round(torch_s, 5), "pipeloom_s": round(ours_s, 5), "ratio": round(ours_s / torch_s, 4),
            "ratio_of_minimums": round(min(times["pipeloom"]) / min(times["torch"]), 4),
            "floor_s": round(floor_s, 5), "torch_over_floor": round(torch_s / floor_s, 4),
            "pipeloom_over_floor": round(statistics.median(t / f for t, f in zip(times["pipeloom"], floors)), 4),
            "loss_torch": loss_torch, "loss_pipeloom": loss_ours, "max_grad_rel_error": grad_error,
            "torch_steps_s": [round(t, 5) for t in times["torch"]],
            "pipeloom_steps_s": [round(t, 5) for t in times["pipeloom"]],
        }
        if rank == 0:
            row = out[name]
            print(f"{name:<6} torch {torch_s * 1e3:8.1f} ms  pipeloom {ours_s * 1e3:8.1f} ms  ratio {row['ratio']:.3f}  "
                  f"floor {floor_s * 1e3:8.1f} ms  loss {loss_torch:.6f} / {loss_ours:.6f}  grad err {grad_error:.1e}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=1, help="sequences per microbatch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side, the loss check included")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = spawn(2, _worker, args, timeout=3600)[0]
    bad = {name: row for name, row in rows.items()
           if abs(row["loss_pipeloom"] - row["loss_torch"]) > TOLERANCE * abs(row["loss_torch"])
           or row["max_grad_rel_error"] > TOLERANCE}
    config = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "microbatches",
                                            "microbatch_size", "warmup", "steps")}
    config.update(processes=2, threads_per_process=1, backend="gloo", goal_ratio=0.9)
    out = write_results("vs_torch_pipelining", {"config": config, "schedules": rows}, args.out)
    print(f"wrote {out}")
    if bad:
        sys.exit(f"pipeloom and torch disagree (tolerance {TOLERANCE:g}): {bad}")


if __name__ == "__main__":
    main()
