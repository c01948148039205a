"""PipeDream-2BW's findings, asked of the planner: 2BW against GPipe and 1F1B (PipeDream-Flush).

    python bench/plan_2bw.py [--gpus 8 16 32 64] [--batches 64 512] [--memories 8 16 64] [--out FILE]

The setting of "Memory-Efficient Pipeline-Parallel DNN Training" (Narayanan
et al., ICML 2021): GPT models of 1.3B-3.8B parameters, sequences of 512
tokens, servers of 8 V100s with NVLink (the ``v100`` preset: its FLOP rate,
efficiency and NVLink P2P bandwidth), 25 Gb/s between servers. The paper's
cluster was AWS p3.16xlarge servers (8 x V100-16GB, 25 Gb/s networking); the
paper's GPT shapes could not be read from any source reachable when this was
written (the text of the evaluation and the ``pipedream_2bw`` branch's
planner are not stored), so the models are GPT shapes of its sizes: the
``gpt-1.3b`` preset (24 layers, h 2048, 16 heads, GPT-3 XL), a 2.2B model
with the same width and 42 layers, and a 3.8B model of 32 layers, h 3072,
24 heads; all with the GPT-2 vocabulary padded to 50304, tied embeddings.

For every model x GPU count x global batch x GPU memory, the planner
(:func:`pipeloom.plan.search`) is run three times, each restricted to one
schedule family (``gpipe``, ``1f1b``, ``2bw``), with no offload,
recomputation (none, cheap, full), pipeline depth, data- and
sequence-parallel widths and microbatch size left to it. Two passes: without
vocabulary parallelism (the paper's setting; the embedding and the LM head
on the end stages make those stages the slowest), and with it searched
(``vocab-1``, ``vocab-2``), which balances the stages as the paper's planner
assumes them (equal stages of transformer blocks).
Per family it records the best plan (throughput, layout, microbatch size,
recomputation, peak memory per rank, bubble rate) or the planner's one-line
"none fits", and the search's time; per setting the throughput ratios
2BW / 1F1B and 2BW / GPipe. The planner costs 2bw's steady state (no flush
ever); ``pipeloom train`` runs 2bw in calls of 4 steps that each end in a
flush, so 2bw's best plan is also simulated that way ("per call") and its
ratio to 1F1B given too. Planned, not measured: the cost model is the FLOP
formulas on the ``v100`` preset (no profile). Writes
bench/results/plan_2bw.json and prints a markdown table per pass.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.plan import Cluster, Costing, PlanRequest, search  # noqa: E402
from pipeloom.sim import simulate  # noqa: E402
from pipeloom.sim.model import VERSION_BYTES_PER_PARAM, ModelSpec, get_model  # noqa: E402

_GiB = 2**30
SEQ = 512
FAMILIES = ("gpipe", "1f1b", "2bw")
#: AWS p3.16xlarge: 25 Gb/s between servers.
INTER_BANDWIDTH = 25e9 / 8
MODELS = (
    get_model("gpt-1.3b"),
    ModelSpec("gpt-2.2b", 42, 2048, 16, 50304, tied_embeddings=True),
    ModelSpec("gpt-3.8b", 32, 3072, 24, 50304, tied_embeddings=True),
)
#: A ratio within this much of 1 counts as a tie.
TIE = 0.01


def best(model: ModelSpec, gpus: int, batch: int, memory_gib: float, family: str, vocab: tuple[str, ...]) -> dict:
    """The planner's best plan of one family (vocabulary parallelism among ``vocab``), or its reason for none."""
    cluster = Cluster.of("v100", gpus, gpus_per_node=8, memory=memory_gib * _GiB, inter_bandwidth=INTER_BANDWIDTH)
    request = PlanRequest(model=model, seq=SEQ, global_batch=batch, cluster=cluster, schedules=(family,),
                          vocab_parallel=vocab, offload=("none",), top=1)
    started = time.perf_counter()
    try:
        found = search(request)
    except PipeloomError as err:
        return {"fits": False, "reason": str(err), "search_s": round(time.perf_counter() - started, 3)}
    plan = found.plans[0]
    c = plan.candidate
    searched = time.perf_counter() - started
    if c.schedule == "2bw":  # as pipeloom train runs it: calls of several steps, each ending in a flush
        costing = Costing(request)
        steps = costing.schedule(c).steps
        call = (simulate(costing.schedule(c, steps), costing.costs(c)).makespan / steps + plan.allreduce_ms
                + plan.optimizer_ms)
        as_run = {"steps_per_call": steps, "per_call_step_ms": round(call, 2),
                  "per_call_samples_per_s": round(batch / call * 1e3, 2)}
    else:
        as_run = {}
    return {
        "fits": True, "pp": c.pp, "dp": c.dp, "sp": c.sp, "chunks": c.chunks, "microbatch_size": c.microbatch_size,
        "microbatches": c.microbatches, "recompute": c.recompute, "vocab_parallel": c.vocab_parallel,
        "step_ms": round(plan.step_ms, 2),
        "samples_per_s": round(plan.samples_per_s, 2), "tokens_per_s": round(plan.tokens_per_s, 1),
        "mfu": round(plan.mfu, 4), "peak_memory_gib": round(max(plan.peak_memory_bytes) / _GiB, 2),
        "bubble_rate": round(plan.bubble_rate, 4), "allreduce_ms": round(plan.allreduce_ms, 2),
        "search_s": round(searched, 3), "candidates": found.candidates, "simulated": found.simulated, **as_run,
    }


def ratio(ours: dict, theirs: dict) -> float | None:
    """2bw's throughput over another family's, None unless both fit."""
    if ours["fits"] and theirs["fits"]:
        return round(ours["samples_per_s"] / theirs["samples_per_s"], 4)
    return None


def verdict(ours: dict, theirs: dict) -> str:
    if ours["fits"] and theirs["fits"]:
        r = ours["samples_per_s"] / theirs["samples_per_s"]
        return "2bw faster" if r > 1 + TIE else "2bw slower" if r < 1 - TIE else "tie"
    if ours["fits"]:
        return "only 2bw fits"
    return "only the other fits" if theirs["fits"] else "neither fits"


def summarise(rows: list[dict], group) -> dict:
    """Per group of rows (``group(row)`` names it) and per rival: how the comparisons went, and the
    geometric mean, least and largest of the ratios where both fit."""
    out: dict[str, dict] = {}
    for name in dict.fromkeys(group(r) for r in rows):
        at = [r for r in rows if group(r) == name]
        entry = {}
        for rival in ("1f1b", "gpipe"):
            verdicts = [r[f"vs_{rival}"] for r in at]
            ratios = [r[f"2bw_over_{rival}"] for r in at if r[f"2bw_over_{rival}"] is not None]
            entry[rival] = {
                "settings": len(at), **{v: verdicts.count(v) for v in sorted(set(verdicts))},
                "geomean_ratio": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 4) if ratios else None,
                "min_ratio": min(ratios, default=None), "max_ratio": max(ratios, default=None),
            }
            if rival == "1f1b":
                calls = [r["2bw_per_call_over_1f1b"] for r in at if "2bw_per_call_over_1f1b" in r]
                entry[rival]["geomean_per_call_ratio"] = (
                    round(math.exp(sum(map(math.log, calls)) / len(calls)), 4) if calls else None)
        out[name] = entry
    return out


def cell(p: dict) -> str:
    if not p["fits"]:
        return "none fits"
    return (f"{p['samples_per_s']:.1f} ({p['pp']}x{p['dp']}x{p['sp']}, b{p['microbatch_size']}, "
            f"{p['recompute']}, {p['peak_memory_gib']:.1f}G)")


def show(r: float | None, v: str) -> str:
    return f"{r:.2f}" if r is not None else v


def table(rows: list[dict]) -> str:
    lines = ["| model | GPUs | batch | GiB | GPipe | 1F1B | 2BW | 2BW/1F1B | 2BW/GPipe | 2BW per call/1F1B |",
             "|---" * 10 + "|"]
    for r in rows:
        f = r["plans"]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['global_batch']} | {r['memory_gib']:g} | {cell(f['gpipe'])} | "
                     f"{cell(f['1f1b'])} | {cell(f['2bw'])} | {show(r['2bw_over_1f1b'], r['vs_1f1b'])} | "
                     f"{show(r['2bw_over_gpipe'], r['vs_gpipe'])} | {show(r.get('2bw_per_call_over_1f1b'), '')} |")
    return "\n".join(lines)


#: The passes: the paper's setting (the embedding and head on the end stages, as pipeloom train
#: places them without vocabulary parallelism), and with vocabulary parallelism searched too, which
#: balances the stages as the paper's planner assumes (d equal stages of transformer blocks).
VOCAB = {"none": ("none",), "searched": ("none", "vocab-1", "vocab-2")}


def compare(models: list[ModelSpec], args, vocab: tuple[str, ...]) -> dict:
    """Every setting's best plan per family and the ratios, their summaries and the search times."""
    rows = []
    for model in models:
        for gpus in args.gpus:
            for batch in args.batches:
                for memory in args.memories:
                    plans = {family: best(model, gpus, batch, memory, family, vocab) for family in FAMILIES}
                    row = {"model": model.name, "gpus": gpus, "global_batch": batch, "memory_gib": memory,
                           "plans": plans}
                    for rival in ("1f1b", "gpipe"):
                        row[f"2bw_over_{rival}"] = ratio(plans["2bw"], plans[rival])
                        row[f"vs_{rival}"] = verdict(plans["2bw"], plans[rival])
                    if plans["2bw"]["fits"] and plans["1f1b"]["fits"]:
                        row["2bw_per_call_over_1f1b"] = round(
                            plans["2bw"]["per_call_samples_per_s"] / plans["1f1b"]["samples_per_s"], 4)
                    rows.append(row)
                    print(f"vocab {'/'.join(vocab)}: {model.name} {gpus} GPUs batch {batch} {memory:g} GiB: "
                          + ", ".join(f"{f} {cell(p)} [{p['search_s']:.2f}s]" for f, p in plans.items()),
                          file=sys.stderr, flush=True)
    times = {f: [r["plans"][f]["search_s"] for r in rows] for f in FAMILIES}
    return {
        "vocab_parallel_searched": list(vocab),
        "rows": rows,
        "summary_by_memory": summarise(rows, lambda r: f"{r['memory_gib']:g} GiB"),
        "summary_by_memory_and_batch": summarise(rows, lambda r: f"{r['memory_gib']:g} GiB, batch {r['global_batch']}"),
        "search_seconds": {f: {"median": round(median(t), 3), "max": round(max(t), 3), "total": round(sum(t), 2)}
                           for f, t in times.items()},
    }


def report(name: str, result: dict) -> None:
    """Print one pass's table, summaries and search times."""
    print(f"## vocabulary parallelism: {name} ({', '.join(result['vocab_parallel_searched'])})")
    print(table(result["rows"]))
    print()
    for key in ("summary_by_memory", "summary_by_memory_and_batch"):
        for group, entry in result[key].items():
            for rival, s in entry.items():
                counts = ", ".join(f"{k} {v}" for k, v in s.items()
                                   if k not in ("settings", "geomean_ratio", "max_ratio", "min_ratio",
                                                "geomean_per_call_ratio"))
                call = f"; per call {s['geomean_per_call_ratio']}" if "geomean_per_call_ratio" in s else ""
                print(f"{group}: 2bw vs {rival}: {counts}; geomean ratio {s['geomean_ratio']} "
                      f"(min {s['min_ratio']}, max {s['max_ratio']}){call}")
    print("search seconds per call: " + "; ".join(f"{f} median {s['median']} max {s['max']}"
                                                   for f, s in result["search_seconds"].items()))
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512], help="global batches (sequences)")
    parser.add_argument("--memories", type=float, nargs="+", default=[8, 16, 64],
                        help="GPU memory in GiB: below the paper's, the paper's V100-16GB, ample")
    parser.add_argument("--models", nargs="+", default=[m.name for m in MODELS])
    parser.add_argument("--vocab", nargs="+", choices=list(VOCAB), default=list(VOCAB),
                        help="passes: without vocabulary parallelism (the paper's setting), and with it searched")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    models = [m for m in MODELS if m.name in args.models]
    started = time.perf_counter()
    passes = {name: compare(models, args, VOCAB[name]) for name in args.vocab}
    results = {
        "setting": {
            "seq": SEQ, "device": "v100", "gpus_per_node": 8, "inter_bandwidth_bytes_per_s": INTER_BANDWIDTH,
            "models": [{"name": m.name, "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "vocab": m.vocab,
                        "parameters": m.parameters(SEQ)} for m in models],
            "gpus": args.gpus, "global_batches": args.batches, "memories_gib": args.memories,
            "searched": "recompute none/cheap/full, pp, dp, sp, microbatch size; offload none; vocabulary "
                        "parallelism per pass",
            "costs": "FLOP formulas on the v100 preset (no profile)",
            "2bw_extra_bytes_per_param": VERSION_BYTES_PER_PARAM,  # its second weight version
        },
        "passes": passes,
        "seconds": round(time.perf_counter() - started, 1),
    }
    path = write_results("plan_2bw", results, args.out)
    for name, result in passes.items():
        report(name, result)
    print(f"wrote {path} in {results['seconds']} s")


if __name__ == "__main__":
    main()
