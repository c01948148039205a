"""``pipeloom train`` end to end: self-launched and under torchrun, data, checkpoints, failures."""

import json
import os
import re
import signal
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from launching import train_forked  # noqa: E402

TIMEOUT = 240


def train(*args, cwd, torchrun=None, launcher=False, check=True, env=None):
    """Run ``pipeloom train args``: under ``torchrun --nproc-per-node N`` if given, self-launched
    with ``launcher``, else with its workers forked (:func:`launching.train_forked`)."""
    if torchrun or launcher:
        start = ["-m", "torch.distributed.run", "--nproc-per-node", str(torchrun)] if torchrun else []
        done = subprocess.run([sys.executable, *start, "-m", "pipeloom", "train", *args], cwd=cwd, capture_output=True,
                              text=True, timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    else:
        done = train_forked(*args, cwd=cwd, env=env, timeout=TIMEOUT)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.timeout(TIMEOUT)
def test_default_job_trains_and_writes_metrics(tmp_path):
    """The README's job (its self-launched workers are the subject of the signal, kill and disk tests below)."""
    done = train("--steps", "40", "--metrics", "m.jsonl", cwd=tmp_path)
    rows = metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    for r in rows:
        assert {"step", "loss", "step_time", "tokens_per_s"} <= set(r)
        assert r["step_time"] > 0 and r["tokens_per_s"] > 0
    first, last = rows[0]["loss"], np.mean([r["loss"] for r in rows[-5:]])
    assert first > 5.0 and last < first - 1.0  # bytes start near ln 256 = 5.5
    assert "1f1b, pp=2, dp=1" in done.stderr and "40/40" in done.stderr


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_under_torchrun_with_data_parallelism(tmp_path, ranks):
    """Under torchrun (the default set: its pipeline alone, the slow set: two replicas of it, dp 2)."""
    done = train("--pp", "2", "--steps", "4", "--schedule", "zb-h1", "--metrics", "m.jsonl", "--report",
                 "--trace", "t.json", cwd=tmp_path, torchrun=ranks, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    assert f"zb-h1, pp=2, dp={ranks // 2}" in done.stderr
    assert len(metrics(tmp_path / "m.jsonl")) == 4
    assert "measured step" in done.stdout and "simulated / measured span" in done.stdout and "bubble seen" in done.stdout
    trace = json.loads((tmp_path / "t.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"0F0", "1I3", "1W3"} <= names
    assert_memory_follows_the_actions(trace)
    # what the ranks held at their peak (activations and, from the first backward, gradients) is what
    # simulate predicts of their activations, in fp32 as the CPU runs (gradients: a few %)
    expected = simulate_json("--model", "tiny", "--pp", "2", "--schedule", "zb-h1")
    predicted = expected["peak_activation_bytes"]
    held = [max(e["args"]["bytes"] for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == r) for r in (0, 1)]
    assert held == pytest.approx(predicted, rel=0.15)
    # --report: the peak above the last step's start, transients within actions too (the trace reads
    # levels between actions), beside simulate's peak less what it holds between steps
    measured, simulated = report_memory(done.stdout)
    assert simulated == pytest.approx([p - h for p, h in zip(expected["peak_memory_bytes"], expected["held_memory_bytes"])],
                                      rel=1e-3)
    assert all(m >= 0.98 * h for m, h in zip(measured, held)), (measured, held)
    assert measured == pytest.approx(simulated, rel=0.3)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_the_last_ranks_peak_holds_the_losss_gradients(tmp_path):
    """At a vocabulary where the logits outweigh the layers (4096, hidden 32), the last rank's measured
    peak above a step's start is what simulate predicts with the loss's gradients (m_loss: 8 bytes a
    logit; without them it predicts 0.4x)."""
    # self-launched: its processes start with the allocator setting (a fork of this one keeps this one's)
    done = train("--vocab", "4096", "--steps", "3", "--report", cwd=tmp_path, launcher=True,
                 env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    measured, simulated = report_memory(done.stdout)
    assert measured[-1] == pytest.approx(simulated[-1], rel=0.05)
    assert simulated[-1] > 8 * 8 * 128 * 4096  # the loss's gradients alone (microbatch size 8, seq 128)


#: PeakMemory.restart/stretch on tensors of known size, in a process of its own whose allocator maps each
#: large block on its own (a test worker's heap holds what earlier tests freed)
_STRETCH = """
import torch
from pipeloom.runtime.memory import PeakMemory
peak = PeakMemory(torch.device("cpu"))
big = torch.ones(16 * 2**20)  # 64 MiB, touched
del big
kept = torch.ones(2 * 2**20)  # 8 MiB held across the restart: not the stretch's
peak.restart()
small = torch.ones(4 * 2**20)  # 16 MiB
print(peak.stretch(), peak.bytes())
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_a_stretchs_peak_is_measured_above_its_start_and_the_runs_peak_kept():
    """--report's measure (``PeakMemory.restart``/``stretch``): a stretch counts what it allocates
    above what was held at its start, the run's peak (``bytes``, --metrics') stays that of the whole run."""
    done = subprocess.run([sys.executable, "-c", _STRETCH], capture_output=True, text=True, timeout=50, check=True,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    stretch, run = map(int, done.stdout.split())
    assert 15 * 2**20 < stretch < 24 * 2**20
    assert run >= 64 * 2**20  # the big tensor, before the restart


def report_memory(stdout: str) -> tuple[list[float], list[float]]:
    """--report's measured and simulated bytes per rank above a step's start."""
    line = next(x for x in stdout.splitlines() if "memory per rank above a step's start" in x)
    sizes = [[float(n) * 2 ** (30 if unit == "GiB" else 20) for n, unit in re.findall(r"([0-9.]+) (MiB|GiB)", part)]
             for part in (line.split("measured ")[1].split(" (")[0], line.split("simulated ")[1].split(";")[0])]
    return sizes[0], sizes[1]


def assert_memory_follows_the_actions(trace: dict) -> None:
    """The measured trace's memory counter (resident memory, which follows the live tensors under
    MALLOC_MMAP_THRESHOLD_): 0 at the step's start, then a level at each action's end; on each rank
    every F keeps its activations (the level rises by at least a quarter of the first F's rise), and
    the step ends below its peak (the backwards freed them)."""
    events = trace["traceEvents"]
    for rank in range(trace["otherData"]["pp"]):
        levels = sorted((e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["pid"] == rank)
        actions = sorted((e["ts"] + e["dur"], e["cat"]) for e in events if e["ph"] == "X" and e["pid"] == rank
                         and e["tid"] == 0)
        assert levels[0][1] == 0 and len(levels) == len(actions) + 1
        rises = [after - before for (_, before), (_, after), (_, kind) in zip(levels, levels[1:], actions)
                 if kind == "F"]
        assert rises[0] > 2**20 and min(rises) > rises[0] / 4, (rank, rises)
        assert levels[-1][1] < max(level for _, level in levels) - rises[0] / 2, (rank, levels)


@pytest.mark.timeout(TIMEOUT)
def test_kfac_reports_and_draws_its_last_refresh_cycle(tmp_path):
    """With K-FAC, --report, --trace and --plot take the last whole refresh cycle (a run may end within
    one where it saves no checkpoint), every call of it,
    its actions numbered as the simulated cycle numbers them (the report simulates that cycle from
    the measured costs, the pieces' too)."""
    done = train("--optimizer", "kfac", "--steps", "10", "--kfac-every", "4", "--seq", "32", "--report",
                 "--trace", "t.json", "--plot", "p.png", cwd=tmp_path)  # ends 2 steps into a third cycle
    assert "the timeline of the last K-FAC refresh cycle, 4 steps" in done.stdout
    assert "measured cycle" in done.stdout and "simulated / measured span" in done.stdout
    assert "K-FAC pieces per stage, a unit's (ms): a " in done.stdout
    assert "the last whole K-FAC cycle (steps 5-8)" in done.stderr and (tmp_path / "p.png").stat().st_size > 0
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {f"0KFAC_PRE{t}" for t in range(4)} | {"0F15", "1B15", "0KFAC_A0"} <= names
    # memory through the cycle: a level at each call's start (above the first call's) and after each action
    computed = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 0]
    levels = sorted((e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["pid"] == 0)
    assert len(levels) == len(computed) + 4 and levels[0][1] == 0


@pytest.mark.timeout(TIMEOUT)
def test_text_file_and_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    train("--data", "a.txt", "--steps", "3", "--seq", "32", "--metrics", "m.jsonl", cwd=tmp_path)
    assert len(metrics(tmp_path / "m.jsonl")) == 3
    np.random.default_rng(0).integers(0, 1000, 50_000).astype(np.uint32).tofile(tmp_path / "tokens.bin")
    done = train("--data", "tokens.bin", "--token-dtype", "uint32", "--steps", "3", "--seq", "32",
                 "--metrics", "m.jsonl", cwd=tmp_path)
    rows = metrics(tmp_path / "m.jsonl")
    assert len(rows) == 3 and abs(rows[0]["loss"] - np.log(1000)) < 0.5
    assert "50000 uint32 tokens" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["--data", "nowhere.txt"], "--data nowhere.txt: no such file or directory"),
    (["--data", "empty.txt"], "the file is empty"),
    (["--schedule", "zb-q"], "unknown schedule 'zb-q'"),
    (["--pp", "4", "--schedule", "zb-v"], "--model tiny has 4 layers, too few for the 8 stages of zb-v"),
    (["--pp", "3", "--microbatches", "2", "--schedule", "2bw"], "2bw needs microbatches >= pp"),
    (["--microbatches", "2", "--schedule", "2bw", "--vocab-parallel", "vocab-1"], "use microbatches >= 3 (got 2)"),
    (["--model", "huge"], "unknown --model 'huge'"),
    (["--device", "cuda", "--dp", "64"], "device cuda: "),  # no GPU here, or fewer than 128
    (["--clip", "-1"], "--clip -1: a gradient norm cannot be negative"),
    (["--clip", "nan"], "--clip nan: a gradient norm cannot be negative or nan"),
    (["--clip", "lots"], "argument --clip: 'lots' is not a number or none"),
    (["--pp", "two"], "argument --pp: invalid int value: 'two'"),
    (["--model", "gpt-125m", "--seq", "2048"], "--seq 2048 is longer than the 1024 positions --model gpt-125m learns"),
    (["--warmup", "500", "--steps", "2"], "--warmup 500: use 0 to --steps 2 warm-up steps"),
    (["--warmup", "-1"], "--warmup -1: use 0 to --steps 200"),
    (["--weight-decay", "-0.1"], "--weight-decay must be at least 0"),
    (["--eval-every", "0"], "--eval-every must be at least 1, got 0"),
    (["--eval-every", "5", "--val-fraction", "0"], "--eval-every needs held-out data: give a --val-fraction above 0"),
    (["--val-fraction", "1"], "--val-fraction 1: hold out a share of the data in [0, 1)"),
    (["--data", "a.txt", "--eval-every", "2"], "--val-fraction 0.05 holds out 50 tokens of a.txt, fewer than one"),
    (["--schedule", "2bw", "--steps", "8", "--eval-every", "2"], "use an --eval-every that is a multiple of 4"),
    (["--schedule", "2bw", "--steps", "6"], "2bw runs 4 steps per call without a flush; use a --steps that is a "
     "multiple of 4, or a --schedule-steps that divides 6"),
    (["--save", "w.pt"], "--save w.pt: the file name must end in .safetensors, not '.pt'"),
    (["--resume", "nowhere"], "nowhere is not a complete pipeloom checkpoint"),
    (["--plot", "a.txt/x.png"], "--plot a.txt/x.png: a.txt is a file, not a directory"),
    (["--plot", "out/x.jpg"], "--plot out/x.jpg: the file name must end in .png or .svg"),
    (["--trace", "a.txt/t.json"], "--trace a.txt/t.json: a.txt is a file, not a directory"),
    (["--metrics", "."], "--metrics .: is a directory"),
    (["--checkpoint-dir", "a.txt"], "--checkpoint-dir a.txt: is a file, not a directory"),
    (["--offload", "full", "--offload-ratio", "0.5"], "--offload-ratio 0.5 goes with --offload selective"),
    (["--offload", "selective", "--offload-ratio", "2"], "offload ratio 2.0: must be in (0, 1]"),
    (["--kfac-every", "2"], "--kfac-every 2 goes with --optimizer kfac"),
    (["--kfac-damping", "0.1"], "--kfac-damping 0.1 goes with --optimizer kfac"),
    (["--json"], "--json goes with --dry-run"),
    (["--data", "a.txt", "--token-dtype", "uint32"], "read as uint32 tokens has ids up to 2,019,914,784, a vocabulary"),
    (["--data", "short.txt"], "short.txt has 9 tokens, fewer than one sequence of --seq 128 plus its target"),
    (["--optimizer", "kfac", "--kfac-damping", "0"], "--kfac-damping must be positive"),
    (["--optimizer", "kfac", "--kfac-every", "20", "--steps", "30", "--checkpoint-dir", "ck"],
     "K-FAC's refresh runs over 20 steps and a checkpoint holds whole refreshes; with --checkpoint-dir use a --steps "
     "that is a multiple of 20"),
    (["--optimizer", "kfac", "--kfac-every", "20", "--steps", "10", "--report"],
     "K-FAC's refresh runs over 20 steps and --report measures a whole one; use a --steps of 20 or more"),
])
@pytest.mark.timeout(60)
def test_bad_arguments_stop_before_any_worker_starts(tmp_path, args, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("some text\n" * 100)
    (tmp_path / "short.txt").write_text("some text")
    mark = uuid.uuid4().hex
    done = train(*args, cwd=tmp_path, check=False, env={"PIPELOOM_TEST_MARK": mark})
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.count("error:") == 1, done.stderr
    assert not _workers(mark)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", ["", "two", "0"])
def test_a_thread_count_that_is_not_a_number_is_said_in_one_line(tmp_path, threads):
    done = train("--steps", "1", cwd=tmp_path, check=False, env={"OMP_NUM_THREADS": threads})
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"OMP_NUM_THREADS={threads!r} is not a positive integer" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("error:") == 1, done.stderr


@pytest.mark.timeout(TIMEOUT)
def test_outputs_into_missing_directories_are_created_before_training(tmp_path):
    (tmp_path / "tmp").mkdir()
    done = train("--steps", "2", "--metrics", "a/m.jsonl", "--trace", "b/c/t.json", "--plot", "d/p.png",
                 "--checkpoint-dir", "e/ck", cwd=tmp_path, env={"TMPDIR": str(tmp_path / "tmp")})
    left = [p.name for p in (tmp_path / "tmp").iterdir() if not p.name.startswith("torchinductor_")]  # torch's cache
    assert not left  # the launcher's logs (torchelastic's) are gone
    assert len(metrics(tmp_path / "a" / "m.jsonl")) == 2
    assert (tmp_path / "b" / "c" / "t.json").stat().st_size and (tmp_path / "d" / "p.png").stat().st_size
    assert (tmp_path / "e" / "ck" / "step_0000002" / "pipeloom.json").is_file()
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(TIMEOUT)
def test_offload_trains_as_without_it(tmp_path):
    for offload in (["none"], ["selective", "--offload-ratio", "0.5"]):
        done = train("--steps", "3", "--seq", "64", "--offload", *offload, "--metrics", f"{offload[0]}.jsonl",
                     cwd=tmp_path)
    assert "offload selective 0.5" in done.stderr
    plain, offloaded = (metrics(tmp_path / f"{name}.jsonl") for name in ("none", "selective"))
    assert [r["loss"] for r in offloaded] == pytest.approx([r["loss"] for r in plain], rel=1e-5)


@pytest.mark.timeout(TIMEOUT)
def test_kfac_trains_and_says_its_refresh_interval(tmp_path):
    done = train("--steps", "4", "--seq", "64", "--optimizer", "kfac", "--kfac-every", "2", "--metrics", "m.jsonl",
                 cwd=tmp_path)
    assert "K-FAC refreshed every 2 steps" in done.stderr
    losses = [r["loss"] for r in metrics(tmp_path / "m.jsonl")]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_clip_zero_or_none_turns_clipping_off(tmp_path):
    for value in ("0", "none"):
        train("--steps", "30", "--clip", value, "--metrics", f"{value}.jsonl", cwd=tmp_path)
        rows = metrics(tmp_path / f"{value}.jsonl")
        assert all("grad_norm" not in r for r in rows)  # no norm computed: nothing to clip with
        assert np.mean([r["loss"] for r in rows[-5:]]) < rows[0]["loss"] - 1.0


@pytest.mark.timeout(TIMEOUT)
def test_resume_gives_the_uninterrupted_losses_also_with_another_pp(tmp_path):
    train("--steps", "12", "--checkpoint-dir", "ck", "--checkpoint-every", "6", "--metrics", "full.jsonl",
          cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_0000006", "step_0000012"]
    full = [r["loss"] for r in metrics(tmp_path / "full.jsonl")]
    train("--steps", "12", "--checkpoint-dir", "again", "--resume", "ck/step_0000006", "--metrics", "same.jsonl",
          cwd=tmp_path)
    same = metrics(tmp_path / "same.jsonl")
    assert [r["step"] for r in same] == list(range(7, 13))
    assert [r["loss"] for r in same] == full[6:]  # the same pp: the same arithmetic, bit for bit
    done = train("--steps", "12", "--pp", "4", "--schedule", "zb-h1", "--checkpoint-dir", "ck",
                 "--resume", "--metrics", "pp4.jsonl", cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-2000:]  # the latest is step 12: nothing left to train, said before launch
    assert done.stderr.strip() == ("pipeloom train: nothing to do: ck/step_0000012 holds step 12 and --steps is 12; "
                                   "give --steps above 12 to train on")
    assert not (tmp_path / "pp4.jsonl").exists()
    done = train("--steps", "12", "--pp", "4", "--schedule", "zb-h1", "--checkpoint-dir", "ck4",
                 "--resume", "ck/step_0000006", "--metrics", "pp4.jsonl", cwd=tmp_path)
    other = [r["loss"] for r in metrics(tmp_path / "pp4.jsonl")]
    assert np.allclose(other, full[6:], rtol=1e-4, atol=0)
    assert "resumed from ck/step_0000006 (step 6, saved with pp=2, dp=1)\n" in done.stderr
    # another batch per step: allowed, and said (the steps from here on see other data)
    done = train("--steps", "7", "--microbatches", "8", "--checkpoint-dir", "ck8", "--resume", "ck/step_0000006",
                 cwd=tmp_path)
    assert ("saved with pp=2, dp=1); a step now takes 64 sequences of 128 tokens, the saving run's 32 of 128"
            in done.stderr), done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_kfac_resumes_with_its_factors_and_inverses_also_with_another_pp(tmp_path):
    """A checkpoint between refresh cycles holds K-FAC's factors and inverses in use under the layers'
    unsplit names: the resumed steps precondition as the uninterrupted ones (without them the next
    step would run unpreconditioned and its loss differ)."""
    import torch.distributed.checkpoint as dcp

    flags = ("--optimizer", "kfac", "--kfac-every", "2", "--steps", "8", "--seq", "64")
    train(*flags, "--checkpoint-dir", "ck", "--checkpoint-every", "4", "--metrics", "full.jsonl", cwd=tmp_path)
    full = [r["loss"] for r in metrics(tmp_path / "full.jsonl")]
    keys = dcp.FileSystemReader(str(tmp_path / "ck" / "step_0000004")).read_metadata().state_dict_metadata
    assert any(k.startswith("kfac/") and k.endswith("/inverses/G") for k in keys)
    train(*flags, "--checkpoint-dir", "again", "--resume", "ck/step_0000004", "--metrics", "same.jsonl", cwd=tmp_path)
    assert [r["loss"] for r in metrics(tmp_path / "same.jsonl")] == full[4:]  # bit for bit
    train(*flags, "--pp", "4", "--schedule", "zb-h1", "--checkpoint-dir", "pp4", "--resume", "ck/step_0000004",
          "--metrics", "pp4.jsonl", cwd=tmp_path)
    assert np.allclose([r["loss"] for r in metrics(tmp_path / "pp4.jsonl")], full[4:], rtol=1e-4, atol=0)


@pytest.mark.timeout(TIMEOUT)
def test_resume_of_another_model_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("abc " * 500)
    np.arange(600, dtype=np.uint16).tofile(tmp_path / "t.bin")
    train("--steps", "2", "--seq", "16", "--data", "a.txt", "--checkpoint-dir", "ck", cwd=tmp_path)
    done = train("--steps", "4", "--seq", "16", "--data", "t.bin", "--checkpoint-dir", "ck", "--resume",
                 cwd=tmp_path, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "vocabulary 256; this run has" in done.stderr
    assert "vocabulary 600 (--vocab, else the preset's or its data's)" in done.stderr


@pytest.mark.timeout(TIMEOUT)
def test_non_finite_loss_stops_with_its_step(tmp_path):
    done = train("--steps", "30", "--lr", "1e6", cwd=tmp_path, check=False)
    assert done.returncode == 1
    assert "error: step " in done.stderr and ("the loss is nan" in done.stderr or "norm is nan" in done.stderr
                                                or "loss is inf" in done.stderr)
    assert "Traceback" not in done.stderr


def _workers(mark):
    """pid by RANK of the processes whose environment carries ``mark``."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue
        if env.get("PIPELOOM_TEST_MARK") == mark and "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
@pytest.mark.timeout(TIMEOUT)
def test_a_killed_rank_stops_the_others_naming_what_they_waited_for(tmp_path):
    mark = uuid.uuid4().hex
    timeout = 20
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeloom", "train", "--steps", "100000", "--timeout", str(timeout),
         "--metrics", "m.jsonl"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PIPELOOM_TEST_MARK": mark})
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
                (tmp_path / "m.jsonl").exists() and len((tmp_path / "m.jsonl").read_text().splitlines()) >= 3):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        workers = _workers(mark)
        assert sorted(workers) == [0, 1]
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=timeout + 30)
        assert time.monotonic() - killed < timeout + 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    # rank 0 names what waited for rank 1 (an action's input, the step's loss, a collective of the step's
    # start or end), or the action whose transfer to or from rank 1 it started
    assert re.search(r"rank 0: (action \S+|the [\w ]+) (waited for|sent|posted) .*rank 1",
                     err.split("stopped:")[0]), err[-2000:]
    assert "stopped: rank 1 died of SIGKILL\n" in err and proc.returncode == 128 + signal.SIGKILL


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_two_bw_trains_in_calls_and_resumes_with_its_weight_versions(tmp_path):
    # with vocabulary parallelism: the shards' versions are saved whole, and resume without it
    train("--schedule", "2bw", "--vocab-parallel", "vocab-1", "--steps", "8", "--checkpoint-dir", "ck",
          "--checkpoint-every", "4", "--metrics", "full.jsonl", cwd=tmp_path)
    full = metrics(tmp_path / "full.jsonl")
    assert [r["step"] for r in full] == list(range(1, 9)) and full[-1]["loss"] < full[0]["loss"]
    train("--schedule", "2bw", "--pp", "4", "--steps", "8", "--checkpoint-dir", "again", "--resume",
          "ck/step_0000004", "--metrics", "resumed.jsonl", cwd=tmp_path)
    resumed = [r["loss"] for r in metrics(tmp_path / "resumed.jsonl")]
    assert np.allclose(resumed, [r["loss"] for r in full[4:]], rtol=1e-4, atol=0)
    done = train("--schedule", "2bw", "--steps", "10", cwd=tmp_path, check=False)
    assert done.returncode == 2 and "use a --steps that is a multiple of 4, or a --schedule-steps" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_vocab_parallel_with_a_bpe_vocabulary_resumes_under_other_splits(tmp_path):
    pytest.importorskip("tokenizers")
    (tmp_path / "a.txt").write_text("def stage(x):\n    return pipeline(x) + vocabulary\n" * 400)
    common = ("--data", "a.txt", "--tokenizer", "bpe", "--vocab-size", "320", "--seq", "32", "--steps", "8",
              "--lr", "1e-2")
    env = {"PIPELOOM_CACHE": str(tmp_path / "cache")}
    done = train(*common, "--vocab-parallel", "vocab-2", "--checkpoint-dir", "ck", "--checkpoint-every", "4",
                 "--metrics", "full.jsonl", cwd=tmp_path, env=env)
    assert "BPE" in done.stderr
    full = [r["loss"] for r in metrics(tmp_path / "full.jsonl")]
    assert full[-1] < full[0] - 0.5
    train(*common, "--vocab-parallel", "vocab-1", "--pp", "4", "--resume", "ck/step_0000004",
          "--metrics", "pp4.jsonl", cwd=tmp_path, env=env)
    train(*common, "--resume", "ck/step_0000004", "--metrics", "plain.jsonl", cwd=tmp_path, env=env)
    for name in ("pp4.jsonl", "plain.jsonl"):  # the shards were saved whole, under the unsplit names
        assert np.allclose([r["loss"] for r in metrics(tmp_path / name)], full[4:], rtol=1e-4, atol=0), name


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_sequence_parallel_training_matches_the_plain_run(tmp_path):
    train("--steps", "6", "--seq", "32", "--metrics", "plain.jsonl", cwd=tmp_path)
    done = train("--steps", "6", "--seq", "32", "--sp", "2", "--attention", "rsa", "--metrics", "sp.jsonl",
                 cwd=tmp_path)
    assert "sp=2 (rsa)" in done.stderr
    train("--steps", "6", "--seq", "32", "--sp", "2", "--vocab-parallel", "vocab-2", "--metrics", "vocab.jsonl",
          cwd=tmp_path)
    plain, sp, vocab = ([r["loss"] for r in metrics(tmp_path / name)] for name in ("plain.jsonl", "sp.jsonl",
                                                                                    "vocab.jsonl"))
    assert np.allclose(sp, plain, rtol=1e-4, atol=0) and np.allclose(vocab, plain, rtol=1e-4, atol=0)
    bad = train("--sp", "3", "--seq", "32", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "use a multiple of 6" in bad.stderr


def _start(tmp_path, *args, mark):
    """A long self-launched run; returns (launcher process, its workers by rank) once 3 steps are done."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeloom", "train", "--steps", "100000", "--metrics", "m.jsonl", *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PIPELOOM_TEST_MARK": mark})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
            (tmp_path / "m.jsonl").exists() and len((tmp_path / "m.jsonl").read_text().splitlines()) >= 3):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.2)
    return proc, _workers(mark)


def _gone(mark, within: float) -> bool:
    """Whether every process carrying ``mark`` has exited within ``within`` seconds."""
    deadline = time.monotonic() + within
    while _workers(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not _workers(mark)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
@pytest.mark.parametrize("sig,code", [pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow), (signal.SIGTERM, 143),
                                      pytest.param(signal.SIGHUP, 129, marks=pytest.mark.slow)])
@pytest.mark.timeout(TIMEOUT)
def test_a_signal_stops_every_rank_after_the_same_step(tmp_path, sig, code):
    mark = uuid.uuid4().hex
    proc, workers = _start(tmp_path, "--checkpoint-dir", "ck", mark=mark)
    try:
        assert sorted(workers) == [0, 1]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err and "Exception" not in err, err[-2000:]
    stopped = [line for line in err.splitlines() if "stopped by" in line]
    assert len(stopped) == 1 and f"stopped by {sig.name} after step " in stopped[0], err[-2000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert [r["step"] for r in metrics(tmp_path / "m.jsonl")] == list(range(1, step + 1))  # nothing half-done
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir()) if (tmp_path / "ck").exists() else []
    if sig == signal.SIGTERM:  # as preemptible clusters expect: a checkpoint of the step it stopped at
        assert saved == [f"step_{step:07d}"] and f"--resume ck/step_{step:07d}" in stopped[0]
    else:
        assert saved == [] and "no checkpoint saved under ck yet (SIGTERM saves one" in stopped[0]
    assert _gone(mark, 5)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_workers_of_a_killed_launcher_exit_within_seconds(tmp_path):
    mark = uuid.uuid4().hex
    proc, workers = _start(tmp_path, mark=mark)
    assert sorted(workers) == [0, 1]
    proc.kill()  # as the OOM killer does: no chance to stop the workers
    proc.communicate(timeout=30)
    assert _gone(mark, 15), "the workers outlived their launcher"


INJECT = """
import sys
import pipeloom.train
from pipeloom.cli import main

real = pipeloom.train.Trainer._call

def failing(self, first):
    if self.rank == 1 and first == 2:
        raise RuntimeError("injected fault on purpose")
    return real(self, first)

pipeloom.train.Trainer._call = failing
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.timeout(TIMEOUT)
def test_a_failing_rank_says_why_and_the_others_name_it(tmp_path):
    (tmp_path / "inject.py").write_text(INJECT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "inject.py", "--steps", "10",
         "--timeout", "10"], cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.startswith("pipeloom train: rank")]
    failed = [line for line in lines if "rank 1 failed: RuntimeError: injected fault on purpose" in line]
    assert len(failed) == 1 and "traceback in " in failed[0], done.stderr[-3000:]
    trace = Path(failed[0].split("traceback in ")[1].rstrip(")"))
    assert "injected fault on purpose" in trace.read_text() and "Traceback" in trace.read_text()
    trace.unlink()
    assert any("rank 0 stopped: rank 1 failed first (RuntimeError: injected fault on purpose)" in line
               for line in lines), done.stderr[-3000:]
    assert "[rank0]" not in done.stderr and "[rank1]" not in done.stderr  # no worker's traceback (torchrun has its own)


@pytest.mark.timeout(TIMEOUT)
def test_a_checkpoint_that_does_not_fit_is_refused_in_one_line(tmp_path):
    train("--steps", "2", "--checkpoint-dir", "ck", cwd=tmp_path)
    good = tmp_path / "ck" / "step_0000002"
    files = sorted(good.glob("*.distcp"))

    def damaged(name, damage):
        copy = tmp_path / name
        subprocess.run(["cp", "-r", str(good), str(copy)], check=True)
        damage(copy / files[0].name)
        return name

    def flip(path):
        data = bytearray(path.read_bytes())
        data[::7] = bytes(b ^ 0xFF for b in data[::7])
        path.write_bytes(data)

    cases = [
        (damaged("cut", lambda p: os.truncate(p, 100)), (), "has 100 bytes of the"),
        (damaged("flipped", flip), (), "rank 0 could not load it"),
        (damaged("noindex", lambda p: (p.parent / ".metadata").write_text("junk")), (), "tensor index (.metadata) cannot be read"),
        ("ck/step_0000002", ("--model", "gpt-125m"), "it was saved with --model tiny"),
    ]
    for checkpoint, extra, message in cases:
        done = train("--steps", "4", "--resume", checkpoint, *extra, "--metrics", "m.jsonl", cwd=tmp_path, check=False)
        assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and message in errors[0] and checkpoint in errors[0], done.stderr[-2000:]
        assert not (tmp_path / "m.jsonl").exists() or not (tmp_path / "m.jsonl").read_text()


def test_a_worker_the_launcher_stopped_does_not_set_the_exit_code(capsys):
    """Rank 1 exits with the run's error (1) while rank 0, which said it, is still shutting down: the
    launcher's SIGTERM to rank 0 is not the run's failure. A worker killed from outside still is."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from pipeloom.launch import exit_code

    def failure(rank, code):
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")

    assert exit_code({0: failure(0, -signal.SIGTERM), 1: failure(1, 1)}) == 1
    assert capsys.readouterr().err == ""
    assert exit_code({0: failure(0, 1), 1: failure(1, -signal.SIGKILL)}) == 128 + signal.SIGKILL
    assert "rank 1 died of SIGKILL" in capsys.readouterr().err
    # one worker killed from outside, the other stopped by the launcher: only the killed one, and not 143
    assert exit_code({0: failure(0, -signal.SIGTERM), 1: failure(1, -signal.SIGKILL)}) == 128 + signal.SIGKILL
    assert capsys.readouterr().err.strip() == "pipeloom train: stopped: rank 1 died of SIGKILL"
    assert exit_code({0: failure(0, -signal.SIGTERM), 1: failure(1, -signal.SIGTERM)}) == 128 + signal.SIGTERM


def test_memory_check_names_the_prediction_and_a_run_that_fits():
    """The check adds the simulator's peaks per rank (as --dry-run shows them) and suggests the nearest run under the limit."""
    from pipeloom.errors import PipeloomError
    from pipeloom.spec import RunSpec
    from pipeloom.train.fits import PROCESS_BYTES, check_fits

    check_fits(RunSpec(model="tiny"), 2 * PROCESS_BYTES + 2**25)  # some MiB beside the two processes: fits
    spec = RunSpec(model="gpt-350m", seq=1024, microbatch_size=32).check()
    with pytest.raises(PipeloomError) as err:
        check_fits(spec, 21 * 2**30)
    message = str(err.value)
    assert "--recompute full --microbatch-size 4 would need" in message and "--no-memory-check" in message
    suggested = simulate_json("--model", "gpt-350m", "--seq", "1024", "--microbatch-size", "4", "--recompute", "full")
    assert sum(suggested["peak_memory_bytes"]) + 2 * PROCESS_BYTES <= 21 * 2**30
    bigger = simulate_json("--model", "gpt-350m", "--seq", "1024", "--microbatch-size", "8", "--recompute", "full")
    assert sum(bigger["peak_memory_bytes"]) + 2 * PROCESS_BYTES > 21 * 2**30


@pytest.mark.timeout(60)
def test_a_run_too_big_for_the_machine_stops_before_launch(tmp_path):
    mark = uuid.uuid4().hex
    done = train("--model", "llama-70b", "--seq", "128", cwd=tmp_path, check=False, env={"PIPELOOM_TEST_MARK": mark})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "the run needs about" in done.stderr and "--no-memory-check starts it anyway" in done.stderr
    assert not _workers(mark)


def simulate_json(*args) -> dict:
    done = subprocess.run([sys.executable, "-m", "pipeloom", "simulate", *args, "--json"], capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path):
    """Files capped at 200 KiB (RLIMIT_FSIZE, as a full disk fails a write): one line naming the
    checkpoint, the cause and the space; --resume then finds no complete checkpoint."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, 200 * 1024))

    done = subprocess.run([sys.executable, "-m", "pipeloom", "train", "--steps", "2", "--checkpoint-dir", "ck"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=cap,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower() or line.startswith("[rank")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert re.search(r"error: checkpoint ck/step_0000002: rank \d could not write it \(OSError: \[Errno 27\] File too "
                     r"large\); rank \d's share needs [\d.]+ MiB and the disk has [\d.]+ [MG]iB free; --resume ignores "
                     r"the incomplete step_0000002", errors[0]), errors[0]
    again = train("--steps", "4", "--checkpoint-dir", "ck", "--resume", cwd=tmp_path, check=False)
    assert again.returncode == 2 and "--resume: no complete checkpoint under ck" in again.stderr
