"""PipeFisher's convergence: K-FAC refreshed as often as pipeline bubbles allow, against AdamW.

    python bench/kfac.py [--quick] [--out FILE]

Training (one process, one thread, no torch.distributed): the ``tiny`` GPT on
the built-in corpus (bytes), seed 0, the same batches (``TokenData.batch``)
for every run; per step ``lr`` follows ``pipeloom.train.learning_rate`` (linear
warm-up over a tenth of the steps, cosine decay to a tenth of the peak). AdamW
against ``KFAC`` around SGD (momentum 0.9) and around AdamW, each over a small
grid of peak LRs (and K-FAC dampings); the best of each by final smoothed loss.
K-FAC refreshes its factors and inverses every k steps, in use k - 1 steps
later (``update_every = invert_every = k``, ``delay = k - 1``), with k the
refresh interval that the simulator's ``Kfac`` transform finds for the same
model in a pipeline: pp = 4, ``microbatches`` of ``batch / microbatches``
sequences, gpipe and 1f1b, on the ``h100`` device preset. So K-FAC trains with
the refresh pattern the pipeline would run.

Time: AdamW's simulated step is the schedule's without K-FAC, K-FAC's the one
with its pieces in the bubbles (the overflow on the critical path).
Per K-FAC variant the target is a loss both it and AdamW reach: the higher of
their final smoothed losses (trailing mean of SMOOTH steps) + MARGIN.
Time-to-target = steps until the smoothed loss reaches it x simulated step
time; the ratio K-FAC / AdamW per family is set beside PipeFisher's 50-75%
(BERT pretraining, another model and scale: the comparison is qualitative).
Beside it, simulation only: the refresh interval and step times of gpt-350m at
pp = 4 and 8 with p, 2p and 4p microbatches. Writes bench/results/kfac.json and
kfac.png (``--quick``: 40 steps, one grid point each, into a temp folder);
asserts nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_results  # noqa: E402

MODEL, PP, FAMILIES, DEVICE, SEED, THREADS = "tiny", 4, ("gpipe", "1f1b"), "h100", 0, 1
PAPER_RATIO = [0.5, 0.75]
DECAY, MARGIN, SMOOTH = 0.95, 0.05, 50  # K-FAC factor decay; target margin (nats); smoothing window (steps)
SWEEP = (0.1, 0.2, 0.3, 0.5)  # looser targets (nats above the target) for the steps ratio's sensitivity
FULL = dict(seq=128, batch=16, microbatches=8, steps=600, grid={
    "adamw": [{"lr": lr} for lr in (3e-3, 1e-2, 3e-2)],
    "kfac-sgd": [{"lr": lr, "damping": 1e-3} for lr in (0.01, 0.03, 0.1)],
    "kfac-adamw": [{"lr": lr, "damping": 1e-3} for lr in (3e-3, 1e-2, 3e-2)]
    + [{"lr": 1e-2, "damping": d} for d in (1e-2, 1e-1)],
})
QUICK = dict(seq=128, batch=16, microbatches=8, steps=40, grid={
    "adamw": [{"lr": 3e-3}], "kfac-sgd": [{"lr": 0.1, "damping": 1e-2}]})
PAPER_LIKE = dict(model="gpt-350m", seq=1024, microbatch_size=1, pps=(4, 8), microbatches_per_stage=(1, 2, 4))


def simulated(model: str, pp: int, seq: int, microbatch_size: int, microbatches: int, family: str) -> dict:
    """One schedule without and with PipeFisher's pieces, simulated on DEVICE."""
    from pipeloom.schedule import Kfac, build
    from pipeloom.sim import costs_from_model, kfac_report, simulate, stage_layers
    from pipeloom.sim.model import KFAC_UNITS_PER_LAYER

    costs = costs_from_model(model, pp, seq, microbatch_size, DEVICE, kfac=True)
    units = [KFAC_UNITS_PER_LAYER * n for n in stage_layers(model, pp, seq)]
    base = build(family, pp, microbatches, costs=costs)
    with_kfac = build(family, pp, microbatches, costs=costs, transforms=[Kfac(units=units)])
    report = kfac_report(simulate(base, costs), simulate(with_kfac, costs))
    ranks = report["ranks"]
    return {"every": report["every"], "step_ms_adamw": report["step_time_before"],
            "step_ms_kfac": report["step_time_after"], "makespan_change": report["makespan_change"],
            "overflow_pieces": report["overflow_pieces"],
            **{key: [round(r[key], 4) for r in ranks] for key in ("bubble_filled", "utilisation_before",
                                                                  "utilisation_after")}}


def train(name: str, setting: dict, every: int, cfg: dict, data) -> list[float]:
    """Losses per step of one run (shorter than ``steps`` if the loss stopped being finite)."""
    import torch

    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.optim.kfac import KFAC
    from pipeloom.train import learning_rate

    torch.manual_seed(SEED)
    model = GPT(GPTConfig.preset(MODEL, vocab_size=data.vocab_size))
    sgd = name == "kfac-sgd"
    base = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), setting["lr"],
                                                          **({"momentum": 0.9} if sgd else {}))
    opt = base if name == "adamw" else KFAC(model, base, damping=setting["damping"], decay=DECAY,
                                           update_every=every, invert_every=every, delay=every - 1,
                                           exclude=["lm_head"])
    schedule = SimpleNamespace(lr=setting["lr"], steps=cfg["steps"], warmup=cfg["steps"] // 10)
    losses = []
    for step in range(cfg["steps"]):
        for group in base.param_groups:
            group["lr"] = learning_rate(step, schedule)
        tokens = torch.from_numpy(data.batch(step, cfg["batch"], cfg["seq"], SEED))
        loss = model(tokens[:, :-1], tokens[:, 1:])
        if not math.isfinite(loss.item()):
            break
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def smooth(losses: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing mean over ``window`` steps."""
    return [sum(losses[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(losses))]


def steps_to(losses: list[float], target: float) -> int | None:
    """Steps until the smoothed loss first reaches ``target`` (None: never)."""
    return next((i + 1 for i, x in enumerate(smooth(losses)) if x <= target), None)


def grid_search(cfg: dict, every: int, data) -> tuple[dict, dict]:
    """Every grid point's final smoothed loss, and the best run of each optimizer."""
    grid, best = {}, {}
    for name, settings in cfg["grid"].items():
        grid[name] = []
        for setting in settings:
            start = time.perf_counter()
            losses = train(name, setting, every, cfg, data)
            final = smooth(losses)[-1] if len(losses) == cfg["steps"] else None  # None: diverged
            wall = round(time.perf_counter() - start, 1)
            grid[name].append({**setting, "final_loss": final, "steps_run": len(losses), "wall_s": wall})
            print(f"{name:<10} {setting} final {final} ({wall} s)", flush=True)
            if final is not None and (name not in best or final < best[name]["final_loss"]):
                best[name] = {**setting, **({"every": every} if name != "adamw" else {}), "final_loss": final,
                              "loss": [round(x, 5) for x in losses]}
    return grid, best


def targets(best: dict) -> dict:
    """Per K-FAC variant: a loss it and AdamW both reach (the higher of their final smoothed
    losses + MARGIN), the steps each takes to reach it, K-FAC's steps over AdamW's, and that
    ratio for the looser targets of SWEEP."""
    out = {}
    for name, run in best.items():
        if name != "adamw":
            loss = max(best["adamw"]["final_loss"], run["final_loss"]) + MARGIN
            steps = {n: steps_to(best[n]["loss"], loss) for n in ("adamw", name)}
            sweep = {f"+{d}": steps_to(run["loss"], loss + d) / steps_to(best["adamw"]["loss"], loss + d)
                     for d in SWEEP}
            out[name] = {"loss": loss, "steps": steps, "steps_ratio": steps[name] / steps["adamw"],
                         "steps_ratio_looser": sweep}
    return out


def time_to_target(goals: dict, sim: dict) -> dict:
    """Per family: each comparison's simulated times to its target and K-FAC's ratio to AdamW."""
    out = {}
    for family, s in sim.items():
        times = {variant: {n: steps * (s["step_ms_adamw"] if n == "adamw" else s["step_ms_kfac"])
                           for n, steps in goal["steps"].items()} for variant, goal in goals.items()}
        out[family] = {**s, "time_to_target_ms": times, "ratio": {v: t[v] / t["adamw"] for v, t in times.items()}}
    return out


def plot(best: dict, sim: dict, goals: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend

    fig = Figure(figsize=(12, 4.5))
    by_step, by_time = fig.subplots(1, 2)
    for name, run in best.items():
        curve = smooth(run["loss"])
        (line,) = by_step.plot(range(1, len(curve) + 1), curve, label=name)
        for family, s in sim.items():
            step_ms = s["step_ms_adamw"] if name == "adamw" else s["step_ms_kfac"]
            by_time.plot([step_ms * (i + 1) for i in range(len(curve))], curve, label=f"{name} ({family})",
                         color=line.get_color(), linestyle="-" if family == FAMILIES[0] else "--")
    for ax, xlabel in ((by_step, "step"), (by_time, f"simulated time (ms, pp={PP}, {DEVICE})")):
        for variant, goal in goals.items():
            ax.axhline(goal["loss"], color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"target vs {variant}", (0.5, goal["loss"]), xycoords=("axes fraction", "data"), fontsize=7)
        ax.set(xlabel=xlabel, ylabel=f"training loss (trailing mean of {SMOOTH})")
        ax.legend(fontsize=8)
    by_step.set_title(f"{MODEL} GPT, built-in corpus: loss by step")
    by_time.set_title("loss by simulated pipeline time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def paper_like() -> list[dict]:
    """Simulation only: PipeFisher's refresh interval and step time for a bigger model."""
    p = PAPER_LIKE
    return [{"model": p["model"], "pp": pp, "microbatches": per * pp, "family": family,
             **simulated(p["model"], pp, p["seq"], p["microbatch_size"], per * pp, family)}
            for pp in p["pps"] for per in p["microbatches_per_stage"] for family in FAMILIES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, one grid point each, into a temp folder")
    parser.add_argument("--out", help="the JSON's path (the plot goes beside it)")
    args = parser.parse_args()
    import torch

    from pipeloom.data import load_data

    torch.set_num_threads(THREADS)
    start, cfg = time.perf_counter(), QUICK if args.quick else FULL
    mbs = cfg["batch"] // cfg["microbatches"]
    sim = {f: simulated(MODEL, PP, cfg["seq"], mbs, cfg["microbatches"], f) for f in FAMILIES}
    ks = {s["every"] for s in sim.values()}
    if len(ks) > 1:
        raise SystemExit(f"the families refresh every {sorted(ks)} steps; this bench trains one K-FAC per run")
    grid, best = grid_search(cfg, ks.pop(), load_data())
    goals = targets(best)
    for variant, goal in goals.items():
        for name, n in goal["steps"].items():
            best[name].setdefault("steps_to_target", {})[variant] = n
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp()) if args.quick else RESULTS) / "kfac.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(best, sim, goals, out.with_suffix(".png"))
    results = {
        "model": MODEL, "seq": cfg["seq"], "batch": cfg["batch"], "microbatches": cfg["microbatches"],
        "microbatch_size": mbs, "steps": cfg["steps"], "pp": PP, "device": DEVICE, "threads": THREADS,
        "seed": SEED, "kfac_decay": DECAY, "smooth_window": SMOOTH, "grid": grid, "optimizers": best,
        "targets": goals, "target_rule": f"per K-FAC variant: the higher final smoothed loss of it and AdamW "
                                         f"+ {MARGIN} nats, so both reach it",
        "simulated": time_to_target(goals, sim), "paper_ratio": PAPER_RATIO,
        "paper_like_sim": {**{k: v for k, v in PAPER_LIKE.items() if k in ("seq", "microbatch_size")},
                           "rows": paper_like()},
        "notes": [
            "The grid's ranges were set after exploratory runs of the same length; each best LR lies inside its "
            "grid, K-FAC's best damping (1e-3) at the grid's low end.",
            "wall_s per grid point: this CPU run unpipelined (K-FAC's inversion and preconditioning on the "
            "critical path), with other jobs sharing the 2 cores; the simulated times are what compares.",
            "Simulated step times only: AdamW's is the schedule's makespan without K-FAC, K-FAC's with its pieces; "
            "the optimizer's own update (AdamW's, SGD's) is not modelled, nor is the LM head preconditioned.",
            "On the h100 preset the tiny model's transfers (0.44 us) outweigh its compute (F 0.05 us a stage), "
            "so its bubbles are large and K-FAC's pieces nearly free; gpt-350m shows a realistic scale, where "
            "every refresh piece fits the bubbles (overflow_pieces 0) and the step grows by the per-step "
            "preconditioning, which runs after each stage's last backward, before the flush.",
            "paper_ratio: PipeFisher (Osawa et al. 2023), BERT pretraining to a target; a qualitative comparison.",
            "Training loss on the training stream (every batch new, same batches for every run); no held-out set.",
        ],
    }
    results["wall_s"] = round(time.perf_counter() - start, 1)
    path = write_results("kfac", results, str(out))
    for family, s in results["simulated"].items():
        print(f"{family}: k={s['every']} step ms adamw {s['step_ms_adamw']:.5f} kfac {s['step_ms_kfac']:.5f}, "
              f"time to target {s['time_to_target_ms']}, ratio {s['ratio']}")
    print(f"targets {goals}; wrote {path} and {path.with_suffix('.png')} in {results['wall_s']} s")


if __name__ == "__main__":
    main()
