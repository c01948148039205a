"""`pipeloom simulate` from the outside: JSON facts, files, and one-line errors."""

import json
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


@pytest.mark.parametrize("args,message", [
    (["--schedule", "nope"], "valid schedules: " + ", ".join(FAMILIES)),
    (["--pp", "0"], "pp=0"),
    (["--schedule", "1f1b", "--chunks", "3"], "1f1b uses chunks=1"),
    (["--costs", "f=1,x=2"], "bad cost 'x=2'"),
    (["--costs", "f=fast"], "'fast' is not a number"),
    (["--schedule", "2bw", "--pp", "4", "--microbatches", "2"], "2bw needs microbatches >= pp"),
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


@pytest.mark.parametrize("args,message", [
    (["--vocab-parallel", "vocab-3"], "unknown vocab_parallel mode 'vocab-3'; modes: none, redis, naive, vocab-1"),
    (["--schedule", "gpipe", "--vocab-parallel", "vocab-1"], "gpipe cannot take vocabulary passes (vocab-1)"),
    (["--vocab", "1000"], "--vocab sets the vocabulary of a --model preset"),
    (["--vocab-parallel", "none,vocab-2", "--compare", "1f1b,zb-h1"], "--compare takes one --vocab-parallel mode"),
])
def test_vocab_parallel_bad_input_one_clear_line(args, message):
    proc = subprocess.run([sys.executable, "-m", "pipeloom", "simulate", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


SP_ARGS = ["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--model", "gpt-1.3b", "--seq", "32768"]


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
    plain = run_json(capsys, *SP_ARGS)
    assert "sp" not in plain and max(ring["peak_memory_bytes"]) < max(plain["peak_memory_bytes"]) / 4
    one = run_json(capsys, *SP_ARGS, "--sp", "1")
    assert (one["makespan"], one["peak_memory_bytes"]) == (plain["makespan"], plain["peak_memory_bytes"])


def test_sequence_parallel_table(capsys):
    assert main(["simulate", *SP_ARGS, "--sp", "4"]) == 0
    out = capsys.readouterr().out
    assert "sp=4, ring attention: per layer and microbatch 3 forward steps of 64 MiB (K and V)" in out
    assert "rsa keeps 20 GiB; ring keeps 0.5 MiB (log-sum-exp) and computes in one 5 GiB block" in out


@pytest.mark.parametrize("args,message", [
    (["--sp", "4"], "--sp needs a --model preset"),
    (["--attention", "rsa"], "--attention needs a --model preset"),
    (["--model", "gpt-1.3b", "--seq", "1000", "--sp", "3"], "sp=3 must divide seq=1000"),
    (["--model", "gpt-1.3b", "--sp", "0"], "sp must be a positive integer, got 0"),
    (["--model", "gpt-1.3b", "--sp", "2", "--attention", "flash"], "unknown attention 'flash'; algorithms: ring, rsa"),
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


def test_a_closed_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "pipeloom", "simulate", "--pp", "512", "--microbatches", "1",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # as `| head -1` does, with 100 kB still to come
    assert proc.wait(timeout=120) == 141
    assert proc.stderr.read() == b""
