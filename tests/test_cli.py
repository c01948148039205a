"""`pipeloom simulate` from the outside: JSON facts, files, and one-line errors."""

import json
import re
import subprocess
import sys

import pytest

from pipeloom.cli import main
from pipeloom.schedule import FAMILIES


def run_json(capsys, *args):
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_promised_fields(capsys):
    out = run_json(capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert out["schedule"] == "1f1b" and out["pp"] == 4 and out["microbatches"] == 8
    assert out["makespan"] == 33 and out["bubble_rate"] == pytest.approx(3 / 11)
    assert out["step_bubble_rate"] == pytest.approx(3 / 11)
    assert out["peak_activation"] == [4, 3, 2, 1]
    keys = {"busy", "idle", "bubble_rate", "step_bubble_rate", "peak_activation"}
    assert [set(r) >= keys for r in out["ranks"]] == [True] * 4
    assert sum(r["busy"] for r in out["ranks"]) == 4 * 8 * 3


def test_costs_flag_changes_times(capsys):
    out = run_json(capsys, "--schedule", "gpipe", "--pp", "2", "--microbatches", "2", "--costs", "f=2,b=3,w=0")
    assert out["makespan"] == (2 + 2 - 1) * 5


def test_table_and_grid(capsys):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    assert "span bubble=25.0% (worst rank)  step bubble=25.0%" in out and "peak act" in out
    assert len([line for line in out.splitlines() if line.strip().startswith("0 ")]) >= 1


def test_compare_lists_every_family(capsys):
    names = ["gpipe", "1f1b", "interleaved-1f1b"]
    out = run_json(capsys, "--compare", ",".join(names), "--pp", "4", "--microbatches", "8")
    assert [r["schedule"] for r in out["compare"]] == names
    assert main(["simulate", "--compare", ",".join(names), "--pp", "4", "--microbatches", "8"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in names)


def test_memory_limit_is_checked(capsys):
    assert main(["simulate", "--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--memory-limit", "3"]) == 2
    assert "exceeds the limit 3 M_B" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [2.5, 3.0, 4.0])
def test_zb_auto_searches_under_the_memory_limit_in_full_stages_m_b_with_a_model(capsys, limit):
    """With a model's costs (bytes), --memory-limit is still in full stages' M_B, the unit of the
    report's peak activation: zb-auto's every rank stays under it, and a limit below one
    microbatch's activations on the heaviest stage is refused naming that need in M_B too
    (it was compared with bytes: every limit was refused, needing millions)."""
    model = ["--model", "gpt-125m", "--schedule", "zb-auto", "--pp", "4", "--microbatches", "8"]
    out = run_json(capsys, *model, "--memory-limit", str(limit))
    assert max(out["peak_activation"]) <= limit + 1e-9
    assert main(["simulate", *model, "--memory-limit", "1"]) == 2
    need = float(re.search(r"it needs at least ([\d.e+]+)$", capsys.readouterr().err.strip()).group(1))
    assert 1 < need < 2.5  # the last stage's layers and head: more than a full stage's M_B


@pytest.mark.parametrize("args,message", [
    (["--schedule", "nope"], "valid schedules: " + ", ".join(FAMILIES)),
    (["--pp", "0"], "--pp must be a whole number >= 1, got 0"),
    (["--schedule", "1f1b", "--chunks", "3"], "1f1b uses chunks=1"),
    (["--costs", "f=1,x=2"], "bad cost 'x=2'"),
    (["--costs", "f=fast"], "'fast' is not a number"),
    (["--schedule", "2bw", "--pp", "4", "--microbatches", "2"], "2bw needs microbatches >= pp"),
    (["--pp", "1000000", "--microbatches", "1000000"], "has about 3e+12 actions; pipeloom builds at most 2,000,000"),
    (["--schedule", "interleaved-1f1b", "--chunks", "1000", "--pp", "64", "--microbatches", "64"], "about 1.23e+07 actions"),
])
def test_bad_input_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "pipeloom", "simulate", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


VOCAB_ARGS = ["--schedule", "1f1b", "--pp", "8", "--microbatches", "16", "--model", "4b", "--seq", "2048",
              "--vocab", "256000"]


def test_vocab_parallel_one_mode_json(capsys):
    out = run_json(capsys, *VOCAB_ARGS, "--vocab-parallel", "vocab-2")
    assert out["vocab_parallel"] == "vocab-2" and out["vocab"] == 256000
    assert len(out["peak_memory_bytes"]) == 8 and out["makespan"] > 0
    busy = [r["busy"] for r in out["ranks"]]
    assert max(busy) == pytest.approx(min(busy), rel=0.01)


def test_vocab_parallel_comparison(capsys, tmp_path):
    modes = ["none", "redis", "naive", "vocab-1", "vocab-2"]
    out = run_json(capsys, *VOCAB_ARGS, "--vocab-parallel", ",".join(modes))
    assert [r["vocab_parallel"] for r in out] == modes
    assert out[0]["relative_throughput"] == 1 and out[-1]["relative_throughput"] > 1.5
    assert all(r["busy_min"] <= r["busy_mean"] <= r["busy_max"] for r in out)
    plot = tmp_path / "vocab.png"
    assert main(["simulate", *VOCAB_ARGS, "--vocab-parallel", ",".join(modes), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert all(mode in table for mode in modes) and "max peak memory (GiB)" in table
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_any_compared_technique_flag_sets_its_values_side_by_side(capsys):
    """A technique's comma list (here recomputation) runs each value as its own run would."""
    args = ["--model", "gpt-1.3b", "--pp", "4", "--microbatches", "8"]
    out = run_json(capsys, *args, "--recompute", "full,none")
    assert [r["setting"] for r in out] == ["full", "none"] and all(r["relative_to"] == "none" for r in out)
    for r, value in zip(out, ["full", "none"]):
        alone = run_json(capsys, *args, "--recompute", value)
        assert (r["makespan"], r["schedule_digest"]) == (alone["makespan"], alone["schedule_digest"])
    assert out[0]["relative_throughput"] < 1 and max(out[0]["peak_memory_bytes"]) < max(out[1]["peak_memory_bytes"])
    assert main(["simulate", *args, "--offload", "none,full"]) == 0
    assert "--offload" in capsys.readouterr().out.splitlines()[3]


@pytest.mark.parametrize("args,message", [
    (["--vocab-parallel", "vocab-3"], "unknown vocab_parallel mode 'vocab-3'; choose one of none, redis, naive, vocab-1"),
    (["--schedule", "torch:Schedule1F1B", "--vocab-parallel", "vocab-1"],
     "torch:Schedule1F1B cannot take vocabulary passes (vocab-1)"),
    (["--vocab", "1000"], "--vocab sets the vocabulary that --model derives costs for"),
    (["--vocab-parallel", "none,vocab-2", "--compare", "1f1b,zb-h1"], "--compare takes one --vocab-parallel value"),
    (["--recompute", "none,full", "--offload", "none,full"], "compare one setting at a time"),
    (["--recompute", "full,most"], "--recompute 'most': choose from none, cheap, full"),
])
def test_vocab_parallel_bad_input_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "pipeloom", "simulate", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


SP_ARGS = ["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--model", "gpt-1.3b", "--seq", "32768",
           "--microbatch-size", "1", "--hardware", "a100"]


def test_sequence_parallel_json(capsys):
    ring = run_json(capsys, *SP_ARGS, "--sp", "4")
    assert ring["sp"] == 4 and ring["attention"] == "ring" and len(ring["peak_memory_bytes"]) == 4
    layer = ring["sp_layer"]
    assert layer["steps"] == 3 and layer["step_bytes"] == 2 * 8192 * 2048 * 2
    assert ring["sp_comm_ms"] == pytest.approx([6 * 3 * layer["steps"] * layer["step_ms"]] * 4)  # 6 layers, F + 2F
    assert ring["sp_exposed_ms"] == [0.0] * 4
    scores = ring["score_bytes"]  # rsa keeps s columns of each row, ring's block has s/N
    assert scores["rsa"]["kept"] == 4 * scores["ring"]["transient"] and scores["rsa"]["transient"] == 0
    rsa = run_json(capsys, *SP_ARGS, "--sp", "4", "--attention", "rsa")
    assert rsa["attention"] == "rsa" and rsa["sp_exposed_ms"] == rsa["sp_comm_ms"]
    assert rsa["makespan"] > ring["makespan"] and max(rsa["peak_memory_bytes"]) > 10 * max(ring["peak_memory_bytes"])
    plain = run_json(capsys, *SP_ARGS, "--attention", "rsa")  # one rank keeping its scores
    assert max(ring["peak_memory_bytes"]) < max(plain["peak_memory_bytes"]) / 4
    fused = run_json(capsys, *SP_ARGS)  # one rank, fused attention: no scores, but every token
    assert "sp" not in fused and max(ring["peak_memory_bytes"]) < max(fused["peak_memory_bytes"]) < max(plain["peak_memory_bytes"])
    one = run_json(capsys, *SP_ARGS, "--sp", "1")
    assert (one["makespan"], one["peak_memory_bytes"]) == (fused["makespan"], fused["peak_memory_bytes"])


def test_sequence_parallel_table(capsys):
    assert main(["simulate", *SP_ARGS, "--sp", "4"]) == 0
    out = capsys.readouterr().out
    assert "sp=4, ring attention: per layer and microbatch 3 forward steps of 64 MiB (K and V)" in out
    assert "rsa keeps 20 GiB; ring keeps 0.5 MiB (log-sum-exp) and computes in one 5 GiB block" in out


@pytest.mark.parametrize("args,message", [
    (["--sp", "4"], "--sp sets the sequence parallelism that --model derives costs for"),
    (["--attention", "rsa"], "--attention sets the sequence-parallel attention that --model derives costs for"),
    (["--model", "gpt-1.3b", "--seq", "1000", "--sp", "3"], "--seq 1000 does not split into 2 x --sp 3"),
    (["--model", "gpt-1.3b", "--sp", "0"], "--sp must be a whole number >= 1, got 0"),
    (["--model", "gpt-1.3b", "--sp", "2", "--attention", "flash"], "unknown attention 'flash'; choose one of ring, rsa"),
])
def test_sequence_parallel_bad_input_one_clear_line(capsys, args, message):
    assert main(["simulate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_both_bubble_rates_named(capsys):
    out = run_json(capsys, "--compare", "zb-v,zb-h2", "--pp", "4", "--microbatches", "8")["compare"]
    zbv, h2 = out
    assert zbv["bubble_rate"] == 0 and zbv["step_bubble_rate"] == pytest.approx(1.5 / 25.5)  # idle ends of the step
    assert [r["step_bubble_rate"] for r in zbv["ranks"]] == pytest.approx([1.5 / 25.5] * 4)
    assert h2["bubble_rate"] == 0 and h2["step_bubble_rate"] == pytest.approx(3 / 27)
    assert main(["simulate", "--compare", "zb-v,zb-h2", "--pp", "4", "--microbatches", "8"]) == 0
    assert "span bubble  step bubble" in capsys.readouterr().out


def test_compare_writes_a_trace_and_a_csv_per_schedule_and_one_plot(capsys, tmp_path):
    from pipeloom.schedule import build, to_torch_csv

    out = [str(tmp_path / name) for name in ("t.json", "s.csv", "c.png")]
    assert main(["simulate", "--compare", "1f1b,zb-h1", "--pp", "4", "--microbatches", "8", "--trace", out[0],
                 "--torch-csv", out[1], "--plot", out[2]]) == 0
    for name in ("1f1b", "zb-h1"):
        assert json.loads((tmp_path / f"t-{name}.json").read_text())["otherData"]["family"] == name
        assert (tmp_path / f"s-{name}.csv").read_text() == to_torch_csv(build(name, 4, 8))
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    files = ["s-1f1b.csv", "s-zb-h1.csv", "t-1f1b.json", "t-zb-h1.json", "c.png"]
    assert capsys.readouterr().err.splitlines() == [f"wrote {tmp_path / f}" for f in files]


def simulate_cli(*args: str, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeloom", "simulate", *args], capture_output=True, text=True,
                          timeout=120, **popen)


# (arguments, with {tmp} a fresh directory holding a file named "file"; exit code; the error's words, or
# None for a run that succeeds; the files under {tmp} it writes)
MISTAKES = {
    "missing output dir is created": (["--plot", "{tmp}/new/dir/p.png"], 0, None, ["new/dir/p.png"]),
    "parent is a file": (["--trace", "{tmp}/file/t.json"], 2, "--trace {tmp}/file/t.json: {tmp}/file is a file", []),
    "output is a directory": (["--torch-csv", "{tmp}"], 2, "--torch-csv {tmp}: is a directory", []),
    "bad plot suffix": (["--plot", "{tmp}/p.pdf"], 2, "--plot {tmp}/p.pdf: the file name must end in .png or .svg", []),
    "seq without model": (["--seq", "4096"], 2, "--seq sets the sequence length that --model derives costs for", []),
    "microbatch size without model": (["--microbatch-size", "2"], 2, "--microbatch-size sets the sequences", []),
    "hardware without model": (["--hardware", "h100"], 2, "--hardware sets the cost preset that --model", []),
    "unknown schedule": (["--schedule", "nope"], 2, "unknown schedule 'nope'; valid schedules: gpipe", []),
    "pp 0": (["--pp", "0"], 2, "--pp must be a whole number >= 1, got 0", []),
    "pp not a number": (["--pp", "four"], 2, "argument --pp: invalid int value: 'four'", []),
    "microbatches negative": (["--microbatches", "-3"], 2, "--microbatches must be a whole number >= 1, got -3", []),
    "cost unknown": (["--costs", "f=1,x=2"], 2, "bad cost 'x=2'", []),
    "cost not a number": (["--costs", "f=fast"], 2, "'fast' is not a number", []),
    "cost negative": (["--costs", "b=-1"], 2, "costs must be finite numbers >= 0", []),
    "cost nan": (["--costs", "w=nan"], 2, "costs must be finite numbers >= 0", []),
    "cost overflows": (["--costs", "f=1e308"], 2, "the makespan overflows to inf", []),
    "compare unknown name": (["--compare", "1f1b,nope"], 2, "unknown schedule 'nope'", []),
    "compare no name": (["--compare", ","], 2, "--compare ',': give at least one name", []),
    "compare a name twice": (["--compare", "1f1b,1f1b"], 2, "1f1b is named twice", []),
    "compare writes files": (
        ["--compare", "1f1b,zb-v", "--plot", "{tmp}/c.svg", "--trace", "{tmp}/t/t.json", "--torch-csv", "{tmp}/s.csv"],
        0, None, ["s-1f1b.csv", "s-zb-v.csv", "t/t-1f1b.json", "t/t-zb-v.json", "c.svg"],
    ),
    "memory limit negative": (["--memory-limit", "-1"], 2, "--memory-limit -1: must be a positive number of M_B", []),
    "memory limit nan": (["--memory-limit", "nan"], 2, "--memory-limit nan: must be a positive number", []),
    "memory limit not a number": (["--memory-limit", "lots"], 2, "argument --memory-limit: invalid float", []),
    "chunks wrong": (["--schedule", "1f1b", "--chunks", "3"], 2, "1f1b uses chunks=1 stages per rank", []),
    "chunks fit none compared": (["--compare", "1f1b,zb-v", "--chunks", "3"], 2, "--chunks 3 fits none", []),
    "chunks zero": (["--schedule", "interleaved-1f1b", "--chunks", "0"], 2, "--chunks must be a whole number >= 1", []),
    "steps without 2bw": (["--schedule-steps", "2"], 2, "--schedule-steps sets how many steps a family without a flush "
                          "builds per call (2bw); 1f1b builds one step", []),
    "vocab-parallel junk": (["--vocab-parallel", "vocab-9"], 2, "unknown vocab_parallel mode 'vocab-9'", []),
    "vocab-parallel empty": (["--vocab-parallel", ""], 2, "--vocab-parallel '': give at least one name", []),
    "vocab modes with trace": (["--vocab-parallel", "none,redis", "--trace", "{tmp}/t.json"], 2,
                               "--trace takes one --vocab-parallel value", []),
    "vocab passes in torch csv": (["--vocab-parallel", "vocab-1", "--torch-csv", "{tmp}/v.csv"], 2,
                                  "has no place in torch's compute-only CSV", []),
    "model junk": (["--model", "gpt-9"], 2, "unknown --model 'gpt-9'; presets:", []),
    "hardware junk": (["--model", "4b", "--hardware", "tpu"], 2, "unknown device 'tpu'; presets:", []),
    "device junk": (["--model", "4b", "--device", "tpu"], 2, "argument --device: invalid choice: 'tpu'", []),
    "seq zero": (["--model", "4b", "--seq", "0"], 2, "--seq must be a whole number >= 1, got 0", []),
    "sp not dividing seq": (["--model", "gpt-1.3b", "--seq", "1000", "--sp", "3"], 2, "--seq 1000 does not split", []),
    "more stages than layers": (["--model", "4b", "--pp", "64"], 2, "4b has 32 layers, too few for the 64 stages", []),
    "chunks the family does not take": (["--model", "tiny", "--pp", "3", "--chunks", "3"], 2,
                                        "1f1b uses chunks=1 stages per rank; got chunks=3", []),
    "unknown flag": (["--bogus", "1"], 2, "pipeloom simulate: error: unrecognized arguments: --bogus 1 "
                                          "(see pipeloom simulate --help)", []),
}


@pytest.mark.parametrize("args,code,message,files", MISTAKES.values(), ids=MISTAKES.keys())
def test_every_mistake_stops_in_one_line(tmp_path, args, code, message, files):
    (tmp_path / "file").write_text("a file")
    proc = simulate_cli("--pp", "2", "--microbatches", "2", *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and p.name != "file")
    if message is None:
        assert proc.stderr.splitlines() == [f"wrote {tmp_path / f}" for f in files]
        assert written == sorted(files)
    else:
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("pipeloom simulate: error: "), proc.stderr
        assert message.replace("{tmp}", str(tmp_path)) in lines[0]
        assert written == []  # no probe or half-written file left behind


def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "pipeloom", "simulate", "--pp", "512", "--microbatches", "1",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # as `| head -1` does, with 100 kB still to come
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""


def test_train_without_torch_names_the_extra():
    code = "import sys; sys.modules['torch'] = None; from pipeloom.cli import main; sys.exit(main(['train']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "pip install 'pipeloom[torch]'" in done.stderr


def test_zb_auto_searches_under_the_given_costs(capsys):
    """zb-auto takes the --costs (build hands them on) and, under the zero-bubble paper's 6.2B
    costs at 2p microbatches of memory, finds a far smaller bubble than ZB-H2."""
    costs = "f=29.718,b=29.444,w=19.927,comm=0.527"
    auto = run_json(capsys, "--schedule", "zb-auto", "--pp", "8", "--microbatches", "24", "--costs", costs,
                    "--memory-limit", "16")
    h2 = run_json(capsys, "--schedule", "zb-h2", "--pp", "8", "--microbatches", "24", "--costs", costs)
    assert auto["bubble_rate"] < 0.01 < h2["bubble_rate"]
    assert main(["simulate", "--compare", "1f1b,zb-auto", "--pp", "4", "--microbatches", "8", "--costs", costs]) == 0
    assert "zb-auto" in capsys.readouterr().out
