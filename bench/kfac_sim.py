"""PipeFisher in the simulator, on the paper's settings: refresh interval, bubble filling, step time.

    python bench/kfac_sim.py [--device v100] [--out FILE]

BERT-Base-like (12 layers, h 768) and BERT-Large-like (24 layers, h 1024)
decoders of this package's cost model (vocabulary 30522, sequences of 128,
microbatches of 32 sequences, the paper's phase-1 pretraining shape), at
p = 4 and 8 with m = p and 2p microbatches, under GPipe, 1F1B, interleaved
1F1B and ZB-H1: the K-FAC pieces (one set per linear layer) placed by the
``Kfac`` transform. Per setting: the refresh interval k, the step time
without and with K-FAC (the growth is the preconditioning), the pieces'
share of each rank's bubbles over the cycle, and the rank that sets k (the
one with the least idle time): its fill in each of the cycle's steps (the
first is limited by when the captures exist, the last is what is left; a
piece counts in the step it starts in, so one issued after a step's last
action can count in that step's tail) and their mean over the steps between.
K-FAC's pieces are priced at the rate of the compute, as the paper's profile has them (0.9-7.8
forward times): the preset without its fp32 rate, which prices pipeloom's fp32 K-FAC beside
16-bit compute about 8x dearer on a V100. Simulated, not measured. Writes bench/results/kfac_sim.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.schedule import Kfac, build  # noqa: E402
from pipeloom.schedule.transforms.kfac import PIECES  # noqa: E402
from pipeloom.sim import ModelSpec, costs_from_model, kfac_report, simulate, stage_layers, without_pieces  # noqa: E402
from pipeloom.sim.specs import get_device  # noqa: E402
from pipeloom.sim.model import KFAC_UNITS_PER_LAYER  # noqa: E402

MODELS = (ModelSpec("bert-base-like", 12, 768, 12, 30522), ModelSpec("bert-large-like", 24, 1024, 16, 30522))
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1))
SEQ, MICROBATCH = 128, 32


def per_step_fill(result, k: int, rank: int) -> list[float]:
    """The pieces' time in each step of the cycle over that step's idle time without them."""
    bare = without_pieces(result)
    period = bare.makespan / k

    def per_step(events, kinds):
        totals = [0.0] * k
        for e in events:
            if e.action.kind in kinds:
                totals[min(int(e.start // period), k - 1)] += e.end - e.start
        return totals
    busy = per_step(bare.events[rank], {e.action.kind for e in bare.events[rank]} - set(PIECES))
    return [round(p / (period - b), 3) for p, b in zip(per_step(result.events[rank], PIECES), busy)]


def run(spec, name, chunks, pp, microbatches, device):
    costs = costs_from_model(spec, pp, SEQ, MICROBATCH, device, chunks=chunks, kfac=True)
    units = [KFAC_UNITS_PER_LAYER * n for n in stage_layers(spec, pp * chunks, SEQ)]
    base = simulate(build(name, pp, microbatches, chunks, costs=costs), costs)
    started = time.perf_counter()
    schedule = build(name, pp, microbatches, chunks, costs=costs, transforms=[Kfac(units)])
    placed = time.perf_counter() - started
    result = simulate(schedule, costs)
    report = kfac_report(base, result)
    k = report["every"]
    setter = min(range(pp), key=lambda r: base.ranks[r].idle)
    fill = per_step_fill(result, k, setter)
    return {
        "model": spec.name, "schedule": name, "pp": pp, "microbatches": microbatches, "every": k,
        "overflow_pieces": report["overflow_pieces"],
        "step_ms_before": round(report["step_time_before"], 3), "step_ms_after": round(report["step_time_after"], 3),
        "makespan_change": round(report["makespan_change"], 4),
        "bubble_filled": [round(r["bubble_filled"], 3) for r in report["ranks"]],
        "utilisation_before": [round(r["utilisation_before"], 3) for r in report["ranks"]],
        "utilisation_after": [round(r["utilisation_after"], 3) for r in report["ranks"]],
        "rank_setting_k": setter, "its_fill_per_step": fill,
        "its_steady_fill": round(sum(fill[1:-1]) / (k - 2), 3) if k > 2 else None,
        "placement_s": round(placed, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="v100")
    parser.add_argument("--out")
    args = parser.parse_args()
    paper_rate = replace(get_device(args.device), fp32_flops=None)
    rows = []
    print(f"{'model':<16} {'schedule':<17} {'p':>2} {'m':>3} {'k':>3} {'step ms':>15} {'change':>7} "
          f"{'filled (min..max)':>18}  {'steady':>6}  fill per step of the rank setting k")
    for spec in MODELS:
        for pp in (4, 8):
            for microbatches in (pp, 2 * pp):
                for name, chunks in SCHEDULES:
                    if spec.layers < pp * chunks:
                        continue
                    row = run(spec, name, chunks, pp, microbatches, paper_rate)
                    rows.append(row)
                    filled = row["bubble_filled"]
                    print(f"{spec.name:<16} {name:<17} {pp:>2} {microbatches:>3} {row['every']:>3} "
                          f"{row['step_ms_before']:>7.1f}->{row['step_ms_after']:<7.1f} {row['makespan_change']:>7.1%} "
                          f"{min(filled):>8.0%}..{max(filled):<8.0%}  {row['its_steady_fill'] or '-':>6}  {row['its_fill_per_step']}")
    path = write_results("kfac_sim", {"device": args.device, "seq": SEQ, "microbatch_size": MICROBATCH,
                                      "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
