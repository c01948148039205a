"""zb-auto against the zero-bubble paper's automatic schedules (ZB-1p, ZB-2p).

    python bench/zb_auto.py [--out FILE]

For each model and m of the paper's Table 5 ("Zero Bubble Pipeline
Parallelism", Qi et al., ICLR 2024), with the paper's profiled T_F, T_B,
T_W, T_comm and M_W / M_B = 32h / (34h + 5as) (its Table 1, s = 1024):
zb-auto's bubble rate at 2p·M_B (the paper's ZB-2p) and at p·M_B (ZB-1p),
pipeloom's ZB-H1 and ZB-H2 under the same costs, the paper's four figures,
and the seconds zb-auto's search took. The paper's rate, (cost - m(T_F +
T_B + T_W)) / cost with cost the longest time of a stage from its first
pass to its last, is pipeloom's bubble rate for these uniform stages. Then
zb-auto's build time at p = 64, m = 512 (unit costs, as
bench/simulate_scale.py builds it, and the 28.3B costs). Writes
bench/results/zb_auto.json. Simulated, not measured on GPUs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.schedule import Costs, build  # noqa: E402
from pipeloom.sim import simulate  # noqa: E402

# model: (p, T_F, T_B, T_W, T_comm in ms, h, a), {m: Table 5's (ZB-H1, ZB-H2, ZB-1p, ZB-2p)}
PAPER = {
    "1.5B": ((8, 18.522, 18.086, 9.337, 0.601, 2304, 24), {
        24: (0.1585, 0.1083, 0.1585, 0.0433), 32: (0.1242, 0.0837, 0.1242, 0.0039),
        64: (0.0674, 0.0444, 0.0674, 0.0026)}),
    "6.2B": ((8, 29.718, 29.444, 19.927, 0.527, 4096, 32), {
        24: (0.1323, 0.0698, 0.1323, 0.0029), 32: (0.1045, 0.0559, 0.1045, 0.0022),
        64: (0.0554, 0.0294, 0.0554, 0.0010)}),
    "14.6B": ((16, 11.347, 11.248, 8.132, 0.377, 5120, 40), {
        48: (0.1397, 0.0672, 0.1397, 0.0066), 64: (0.1088, 0.0516, 0.1088, 0.0054),
        128: (0.0576, 0.0266, 0.0576, 0.0028)}),
    "28.3B": ((32, 10.419, 10.207, 7.715, 0.408, 6144, 48), {
        96: (0.1421, 0.0641, 0.1421, 0.0038), 128: (0.1106, 0.0490, 0.1106, 0.0029),
        256: (0.0594, 0.0257, 0.0594, 0.0018)}),
}
SEQ = 1024


def costs_of(model: str) -> tuple[int, Costs]:
    (p, f, b, w, comm, h, a), _ = PAPER[model]
    return p, Costs(f=f, b=b, w=w, comm=comm, m_w=32 * h / (34 * h + 5 * a * SEQ))


def auto(p: int, m: int, costs: Costs | None, limit: float | None) -> tuple[float, float]:
    """(zb-auto's bubble rate, seconds its build took)."""
    start = time.perf_counter()
    schedule = build("zb-auto", p, m, costs=costs, memory_limit=limit, check=False)
    seconds = time.perf_counter() - start
    return simulate(schedule, costs).bubble_rate, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<6} {'p':>3} {'m':>4}  {'ZB-H1':>13} {'ZB-H2':>13} {'zb-auto 1p':>17} {'zb-auto 2p':>17} "
          f"{'search s':>8}   (ours / paper's)")
    for model, (_, table) in PAPER.items():
        p, costs = costs_of(model)
        for m, (h1, h2, zb_1p, zb_2p) in table.items():
            one, _ = auto(p, m, costs, p)
            two, seconds = auto(p, m, costs, 2 * p)
            row = {
                "model": model, "p": p, "m": m, "m_w": round(costs.m_w, 4),
                "zb_h1": simulate(build("zb-h1", p, m), costs).bubble_rate,
                "zb_h2": simulate(build("zb-h2", p, m), costs).bubble_rate,
                "zb_auto_1p": one, "zb_auto_2p": two,
                "paper": {"zb_h1": h1, "zb_h2": h2, "zb_1p": zb_1p, "zb_2p": zb_2p},
                "zb_auto_2p_minus_paper": round(two - zb_2p, 4), "search_s": round(seconds, 3),
            }
            rows.append(row)
            print(f"{model:<6} {p:>3} {m:>4}  {row['zb_h1']:.4f}/{h1:.4f} {row['zb_h2']:.4f}/{h2:.4f} "
                  f"{one:>8.4f}/{zb_1p:.4f} {two:>8.4f}/{zb_2p:.4f} {seconds:>8.3f}")
    scale = []
    _, big = costs_of("28.3B")
    for label, costs, limit in (("unit costs, ZB-H2's memory", None, None), ("28.3B, 2p", big, 128),
                                ("28.3B, p", big, 64)):
        bubble, seconds = auto(64, 512, costs, limit)
        scale.append({"costs": label, "pp": 64, "microbatches": 512, "build_s": round(seconds, 3),
                      "bubble_rate": bubble})
        print(f"p = 64, m = 512, {label}: build {seconds:.2f} s, bubble {bubble:.4f}")
    out = write_results("zb_auto", {"seq": SEQ, "rows": rows, "scale": scale}, args.out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
