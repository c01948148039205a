"""docs/benchmarks.md's result tables rebuilt from the JSON the benchmarks wrote.

    python bench/page.py [--check]

Each table the page generates sits between ``<!-- results: NAME -->`` and
``<!-- /results -->``; NAME names a JSON under bench/results/ and the
function below that renders it, with the machine and date of the run under
the table (a result not yet measured says which command measures it).
Rerun this after a benchmark; ``--check`` changes nothing and exits 1 naming
the tables that differ from their JSON (the test suite runs it). The prose
around the tables is written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def _table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def _ran(doc: dict) -> str:
    """The line under a table: when and on what the run was made."""
    m = doc["machine"]
    where = m.get("gpu") or f"{m['cpus']} CPUs ({m['processor']})"
    return f"*Run {doc['when'][:10]} on {where}, torch {m.get('torch', '?')}, Python {m['python']}.*"


def _x(value: float) -> str:
    return f"{value:.3f}x"


def sim_vs_measured(doc: dict) -> list[str]:
    return _table(["schedule", "measured step (ms)", "predicted (ms)", "predicted / measured"],
                  [[name, f"{r['measured_step_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{r['predicted_over_step']:.3f}"]
                   for name, r in doc["schedules"].items()])


def vs_torch_pipelining(doc: dict) -> list[str]:
    def floor(r: dict, key: str, scale: float = 1.0) -> str:
        """A floor figure, or a dash for a run from before the bench measured floors."""
        return f"{scale * r[key]:.{1 if scale > 1 else 3}f}" if key in r else "–"

    return _table(["pipeloom", "torch", "torch (ms)", "pipeloom (ms)", "ratio", "ratio of fastest steps",
                   "floor (ms)", "torch / floor", "pipeloom / floor"],
                  [[name, r["torch_schedule"], f"{1e3 * r['torch_s']:.1f}", f"{1e3 * r['pipeloom_s']:.1f}",
                    f"{r['ratio']:.3f}", f"{r['ratio_of_minimums']:.3f}",
                    floor(r, "floor_s", 1e3), floor(r, "torch_over_floor"), floor(r, "pipeloom_over_floor")]
                   for name, r in doc["schedules"].items()])


def executor_overhead(doc: dict) -> list[str]:
    families = list(doc["results"][0]["families"])
    return _table(["model", "tokens per step", "plain (ms)", *families],
                  [[r["model"], r["tokens_per_step"], f"{r['plain_ms']:.1f}",
                    *(_x(r["families"][f]["ratio"]) for f in families)] for r in doc["results"]])


def compiled_stages(doc: dict) -> list[str]:
    return _table(["model", "family", "eager (tokens/s)", "compiled (tokens/s)", "speed-up", "first compiled step (s)"],
                  [[r["model"], r["family"], r["eager_tokens_per_s"], r["compiled_tokens_per_s"], _x(r["speedup"]),
                    f"{r['first_compiled_step_s']:.2f}"] for r in doc["results"]])


def vocab_head(doc: dict) -> list[str]:
    def size(v: int) -> str:
        return f"{v // 1024}k"

    rows = []
    for r in doc["rows"]:
        ratios = r["ratios_vs_torch"]
        rows.append([size(r["vocab"]), r["dtype"], f"{r['cases']['torch']['ms']:.1f}",
                     f"{ratios['vocab-1']['time']:.2f}", f"{ratios['vocab-2']['time']:.2f}",
                     f"{r['cases']['gemms']['ms']:.1f}",
                     f"{ratios['vocab-1']['memory']:.2f} / {ratios['vocab-2']['memory']:.2f}"])
    return _table(["V", "dtype", "torch (ms)", "vocab-1 / torch", "vocab-2 / torch", "products alone (ms)",
                   "peak vs torch (vocab-1 / vocab-2)"], rows)


def plan_search(doc: dict) -> list[str]:
    rows = []
    for r in doc["requests"]:
        what = f"`{r['args']}`" if r["args"] else "defaults"
        request = f"{r['model']}, seq {r['seq']}, batch {r['global_batch']}"
        seconds = [f"{r['seconds']:.1f}", f"{r['seconds_one_job']:.1f}"] if "seconds_one_job" in r else [
            f"{r['seconds']:.1f}", "–"]
        if "infeasible" in r:
            rows.append([what, request, "–", "–", *seconds, "nothing fits"])
            continue
        b = r["best"]
        sp = f" sp {b['sp']}" if b["sp"] > 1 else ""
        settings = [f"{key} {b[key]}" for key in ("recompute", "offload") if b[key] != "none"]
        settings += [b["vocab_parallel"]] if b["vocab_parallel"] != "none" else []
        best = ", ".join([f"pp {b['pp']} dp {b['dp']}{sp} {b['schedule']}", f"{b['microbatches']} x {b['microbatch_size']}",
                          *settings, f"{b['step_ms']:.0f} ms"])
        rows.append([what, request, f"{r['candidates']:,}", r["simulated"], *seconds, best])
    jobs = doc["requests"][0].get("jobs", 1)
    return _table(["request (`pipeloom plan ...`)", "model, seq, global batch", "layouts", "simulated",
                   f"seconds ({jobs} jobs)", "seconds (one process)", "best plan"], rows)


def offload_sim(doc: dict) -> list[str]:
    cells: dict[tuple, dict] = {}
    for r in doc["rows"]:
        cells.setdefault((r["seq"], r["recompute"], r["k"]), {}).setdefault(r["schedule"], {})[r["policy"]] = r
    schedules = list(next(iter(cells.values())))

    def cell(by_policy: dict) -> str:
        full, half = by_policy["full"], by_policy["selective 0.5"]
        times = {f"{full['time_vs_none']:.3f}x", f"{half['time_vs_none']:.3f}x"}
        time = times.pop() if len(times) == 1 else f"{full['time_vs_none']:.3f}x / {half['time_vs_none']:.3f}x"
        return f"{full['peak_cut']:.2f}x / {half['peak_cut']:.2f}x, {time}"

    return _table(["seq, recompute", "k", *(f"{s} full / selective 0.5: peak cut, time" if i == 0 else s
                                           for i, s in enumerate(schedules))],
                  [[f"{seq}, {recompute}", f"{k:.2f}", *(cell(row[s]) for s in schedules)]
                   for (seq, recompute, k), row in cells.items()])


def plan_memory(doc: dict) -> list[str]:
    def per_rank(values: list, digits: int = 0) -> str:
        return " / ".join(f"{v:.{digits}f}" for v in values)

    floor = doc["floor_mib"]
    return _table(["layout", "measured less floor (MiB)", "predicted, profile", "/ measured",
                   "predicted, formulas", "/ measured"],
                  [[f"`{r['flags']}`", per_rank([m - floor for m in r["measured_mib"]]), per_rank(r["predicted_mib"]),
                    per_rank(r["predicted_over_measured_less_floor"], 3),
                    per_rank(r["formulas_mib"]) if "formulas_mib" in r else "–",
                    per_rank(r["formulas_over_measured_less_floor"], 3) if "formulas_mib" in r else "–"]
                   for r in doc["layouts"]])


#: The JSON a table's NAME reads with its renderer, and the command that writes it.
TABLES = {
    "sim_vs_measured": (sim_vs_measured, "python bench/sim_vs_measured.py"),
    "vs_torch_pipelining": (vs_torch_pipelining, "python bench/vs_torch_pipelining.py --steps 30"),
    "executor_overhead": (executor_overhead, "python bench/executor_overhead.py"),
    "executor_overhead_cuda": (executor_overhead, "python bench/executor_overhead.py --device cuda"),
    "compile": (compiled_stages, "python bench/compile.py"),
    "compile_cuda": (compiled_stages, "python bench/compile.py --device cuda"),
    "vocab_head": (vocab_head, "python bench/vocab_head.py"),
    "vocab_head_cuda": (vocab_head, "python bench/vocab_head.py --device cuda"),
    "offload_sim": (offload_sim, "python bench/offload_sim.py"),
    "plan_search": (plan_search, "python bench/plan_search.py"),
    "plan_memory": (plan_memory, "python bench/plan_memory.py"),
}


def rendered(name: str, results: Path = RESULTS) -> str:
    """The body of table ``name``: the table and the run's line, or which command would measure it."""
    if name not in TABLES:
        raise SystemExit(f"{PAGE.name}: no table named {name!r}; known: {', '.join(TABLES)}")
    render, command = TABLES[name]
    path = results / f"{name}.json"
    if not path.exists():
        return f"*Not measured yet: `{command}` writes `bench/results/{path.name}`.*\n"
    doc = json.loads(path.read_text())
    return "\n".join([*render(doc), "", _ran(doc)]) + "\n"


def rebuilt(text: str, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``text`` with every table rebuilt, and the names of those that changed."""
    changed: list[str] = []

    def body(match: re.Match) -> str:
        new = rendered(match["name"], results)
        if new != match["body"]:
            changed.append(match["name"])
        return match[1] + new + match[4]

    return BLOCK.sub(body, text), changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its JSON")
    args = parser.parse_args()
    text, changed = rebuilt(PAGE.read_text())
    if args.check:
        if changed:
            sys.exit(f"{PAGE.relative_to(ROOT)}: tables differ from their JSON: {', '.join(changed)} "
                     "(run python bench/page.py)")
        return
    PAGE.write_text(text)
    print(f"{PAGE.relative_to(ROOT)}: rebuilt {', '.join(changed) or 'nothing (all up to date)'}")


if __name__ == "__main__":
    main()
