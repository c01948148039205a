"""One run spec, one builder: ``simulate`` and ``train --dry-run`` describe the run the workers make."""

import json
import re
import subprocess
import sys

import pytest

from pipeloom.builder import build_run, costs_of
from pipeloom.cli import _parser, main
from pipeloom.cli.flags import spec_of
from pipeloom.errors import PipeloomError
from pipeloom.spec import RunSpec

from launching import train_forked

#: Runs that combine the techniques, GPT and Llama presets, pp 1 to 8.
RUNS = {
    "gpt pp1 gpipe offload full": "--model gpt-125m --pp 1 --schedule gpipe --microbatches 8 --offload full",
    "gpt pp2 1f1b selective cheap": "--model gpt-125m --pp 2 --offload selective --offload-ratio 0.5 "
                                    "--recompute cheap",
    "gpt pp4 vocab-1 full recompute": "--model gpt-125m --pp 4 --microbatches 8 --vocab-parallel vocab-1 "
                                      "--recompute full --offload full",
    "gpt pp4 zb-auto": "--model gpt-125m --pp 4 --schedule zb-auto --microbatches 8 --microbatch-size 2",
    "gpt pp8 interleaved vocab-2 selective": "--model gpt-350m --pp 8 --schedule interleaved-1f1b --microbatches 16 "
                                             "--vocab-parallel vocab-2 --offload selective --offload-ratio 0.25",
    "gpt pp2 kfac": "--model gpt-125m --pp 2 --optimizer kfac --seq 64",
    "llama pp2 kfac every 2": "--model llama-tiny --pp 2 --optimizer kfac --kfac-every 2 --seq 64",
    "llama pp4 v-half offload cheap": "--model llama-1b --pp 4 --schedule v-half --microbatches 8 --seq 256 "
                                      "--offload full --recompute cheap",
    "llama pp8 2bw vocab-2": "--model llama-8b --pp 8 --schedule 2bw --microbatches 8 --seq 512 --vocab-parallel vocab-2",
}


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags", RUNS.values(), ids=RUNS.keys())
def test_dry_run_and_simulate_describe_the_same_run(capsys, flags):
    simulated = _json(capsys, "simulate", *flags.split(), "--json")
    dry = _json(capsys, "train", *flags.split(), "--dry-run", "--json")
    assert dry == simulated  # digest, makespan, memory: every field
    spec = spec_of(_parser().parse_args(["train", *flags.split()]))
    assert simulated["schedule_digest"] == build_run(spec).digest()


@pytest.mark.parametrize("flags", [RUNS["gpt pp2 1f1b selective cheap"], "--model gpt-125m --pp 4 --schedule zb-v"])
def test_dry_run_and_simulate_write_the_same_trace(capsys, tmp_path, flags):
    """``train --dry-run --trace`` writes the simulated step, as ``simulate --trace`` does; its memory
    counters in bytes (a model's costs), the run's peak activation bytes at their top."""
    traces = {}
    for command in ("simulate", "train"):
        path = tmp_path / f"{command}.json"
        report = _json(capsys, command, *flags.split(), "--trace", str(path), "--json",
                       *(["--dry-run"] if command == "train" else []))
        traces[command] = json.loads(path.read_text())
    assert traces["simulate"] == traces["train"]
    counters = [e for e in traces["train"]["traceEvents"] if e["ph"] == "C" and e["name"] == "activation memory"]
    peaks = [max(e["args"]["bytes"] for e in counters if e["pid"] == r) for r in range(report["pp"])]
    assert peaks == pytest.approx(report["peak_activation_bytes"])


@pytest.mark.parametrize("layout,copied", [
    ("--pp 1 --schedule gpipe --microbatches 8 --microbatch-size 2", 0),  # a pair's copies (62 ms) outlast its gap
    ("--pp 4 --schedule 1f1b --microbatches 8 --microbatch-size 2", 1),
])
def test_offload_follows_the_costs_in_every_command(capsys, layout, copied):
    """Full offload copies only the pairs whose copies fit the copy stream (or, paced, delay compute little),
    in simulate and train alike (gpt-1.3b on an h100: train once offloaded all 8 pairs of the
    first layout, which simulate predicted 2 of)."""
    flags = f"--model gpt-1.3b --seq 1024 --offload full --device cuda {layout}".split()
    spec = spec_of(_parser().parse_args(["train", *flags]))
    schedule = build_run(spec)
    assert sum(a.kind == "OFFLOAD" for actions in schedule.ranks for a in actions) == copied
    assert _json(capsys, "train", *flags, "--dry-run", "--json")["schedule_digest"] == schedule.digest()
    assert _json(capsys, "simulate", *flags, "--json")["schedule_digest"] == schedule.digest()


def test_the_digest_follows_the_schedule():
    one = build_run(RunSpec())
    assert one.digest() == build_run(RunSpec()).digest() and len(one.digest()) == 64
    assert build_run(RunSpec(microbatches=8)).digest() != one.digest()
    assert build_run(RunSpec(offload="full")).digest() != one.digest()


def test_the_spec_is_data():
    spec = RunSpec(model="gpt-125m", pp=4, offload="selective", offload_ratio=0.5, hardware="a100")
    assert RunSpec.from_dict(json.loads(spec.to_json())) == spec
    assert hash(spec) == hash(RunSpec.from_dict(spec.to_dict()))
    again = spec_of(_parser().parse_args(["train", *spec.flags()]))
    assert again == spec  # the flags it renders give it back
    with pytest.raises(PipeloomError, match="unknown field 'pipes'"):
        RunSpec.from_dict({"pipes": 2})


@pytest.mark.parametrize("changes,message", [
    ({"pp": 0}, "--pp must be a whole number >= 1, got 0"),
    ({"offload_ratio": 0.5}, "--offload-ratio 0.5 goes with --offload selective"),
    ({"kfac_every": 2}, "--kfac-every 2 goes with --optimizer kfac"),
    ({"model": "gpt-9"}, "unknown --model 'gpt-9'"),
    ({"hardware": "tpu"}, "unknown device 'tpu'"),
    ({"schedule_steps": 2}, "--schedule-steps sets how many steps"),
    ({"model": None, "seq": 4096}, "--seq sets the sequence length that --model derives costs for"),
])
def test_one_line_for_each_mistake(changes, message):
    with pytest.raises(PipeloomError, match=re.escape(message)):
        RunSpec(**changes).check()


@pytest.mark.parametrize("changes,message", [
    ({"model": "gpt-125m", "seq": 2048}, "--seq 2048 is longer than the 1024 positions"),
    ({"seq": 127}, "--seq 127 does not split into 2 x --sp 1"),
])
def test_what_the_runtime_cannot_run_is_refused_before_launch(changes, message):
    spec = RunSpec(**changes)
    spec.check()  # simulate takes it
    with pytest.raises(PipeloomError, match=re.escape(message)):
        spec.check_runnable()


def test_the_dry_run_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None; from pipeloom.cli import main; "
            "sys.exit(main(['train', '--dry-run', '--json', '--offload', 'full']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schedule_digest"] == build_run(RunSpec(offload="full")).digest()


def test_costs_come_from_the_hardware_preset():
    cpu, a100 = costs_of(RunSpec()), costs_of(RunSpec(hardware="a100"))
    assert costs_of(RunSpec(device="cuda")) == costs_of(RunSpec(hardware="h100"))
    assert sum(a100.f) < sum(cpu.f)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flags", [
    "--seq 64 --offload selective --offload-ratio 0.5 --recompute cheap --vocab-parallel vocab-1",
    "--model llama-tiny --seq 64 --optimizer kfac --kfac-every 2 --vocab-parallel vocab-1 --offload full",
], ids=["gpt offload vocab-1", "llama kfac vocab-1 offload"])
def test_the_workers_run_the_schedule_the_dry_run_shows(capsys, tmp_path, flags):
    """Every rank logs the digest of the schedule it runs (checked equal across ranks): the dry run's."""
    shown = _json(capsys, "train", *flags.split(), "--dry-run", "--json")["schedule_digest"]
    done = train_forked(*flags.split(), "--steps", "2", cwd=tmp_path, timeout=200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"schedule sha256 {shown} (every rank's)" in done.stderr
