"""The planner's peak memory per rank, from a profile of this machine and from the formulas, against what
`pipeloom train` holds.

Each run's `--metrics` carry every pipeline rank's measured peak (`peak_memory_bytes`: the resident
set's high-water mark above the one before the model was built). The workers start with
`MALLOC_MMAP_THRESHOLD_=65536` so that resident memory follows the live tensors; the pages of torch's
code and buffers that any training step touches (the floor) are measured with the `tiny` model and
left out. `bench/plan_memory.py` runs more layouts at a larger size.
"""

import json
import os
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipeloom.cli import _parser
from pipeloom.cli.flags import spec_of
from pipeloom.plan import Cluster, Costing, PlanRequest
from pipeloom.plan.command import candidate_of
from pipeloom.sim.model import get_model
from pipeloom.sim.profile import load_profile

pytestmark = [pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc"),
              pytest.mark.slow]  # a profile and four runs of the real command: a minute

TIMEOUT = 280
SEQ = 64
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
LAYOUTS = (
    "--schedule gpipe --pp 1 --microbatches 3 --microbatch-size 2",  # gradients only from the first backward
    "--schedule zb-h1 --pp 2 --microbatches 4 --microbatch-size 2",  # W's kept inputs and output gradients
    "--schedule 2bw --pp 2 --microbatches 2 --microbatch-size 2",  # weight versions holding the gradients
)


def measured(tmp_path, model: str, flags: str) -> list[int]:
    metrics = tmp_path / "m.jsonl"
    steps = "4" if "2bw" in flags else "2"
    done = subprocess.run([sys.executable, "-m", "pipeloom", "train", "--model", model, "--vocab", "256", "--seq", str(SEQ),
                           *shlex.split(flags), "--steps", steps, "--metrics", str(metrics)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [max(r["peak_memory_bytes"][k] for r in rows) for k in range(len(rows[0]["peak_memory_bytes"]))]


def predicted(profile, flags: str) -> list[float]:
    c = candidate_of(spec_of(_parser().parse_args(["train", "--seq", str(SEQ), *shlex.split(flags)])))
    model = replace(get_model("gpt-125m"), vocab=256)  # train's default data: bytes
    request = PlanRequest(model, SEQ, c.microbatch_size * c.microbatches * c.dp, Cluster.of("cpu", c.pp * c.dp),
                          profile=profile)
    return Costing(request).evaluate(c).peak_memory_bytes


@pytest.mark.timeout(2 * TIMEOUT)
def test_predicted_peak_memory_is_within_ten_percent_of_measured(tmp_path):
    subprocess.run([sys.executable, "-m", "pipeloom", "profile", "--model", "gpt-125m", "--vocab", "256", "--seq",
                    str(SEQ), "--microbatch-sizes", "2", "--device", "cpu", "--out", "p.json"],
                   cwd=tmp_path, env=ENV, check=True, capture_output=True, timeout=TIMEOUT)
    profile = load_profile(tmp_path / "p.json")
    floor = max(measured(tmp_path, "tiny", LAYOUTS[1]))
    assert 0 < floor < 400 * 2**20
    for flags in LAYOUTS:
        got = measured(tmp_path, "gpt-125m", flags)
        for source in (profile, None):  # the profile's costs, and the formulas' (fp32, as the CPU trains)
            want = predicted(source, flags)
            assert len(got) == len(want)
            ratios = [p / (m - floor) for p, m in zip(want, got)]
            assert all(abs(r - 1) <= 0.1 for r in ratios), (flags, source is None, got, want, floor, ratios)
