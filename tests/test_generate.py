"""Training's outputs from the outside: validation loss, --save, --tensorboard, and pipeloom generate."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from test_train import TIMEOUT, metrics, train  # noqa: E402

STEPS, EVERY, BATCHES, SEQ = 6, 3, 2, 32


def generate(*args, cwd, check=True, env=None):
    done = subprocess.run([sys.executable, "-m", "pipeloom", "generate", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def validation_loss(model, fraction=0.05):
    """The one-process model's mean loss on the run's validation batches (the built-in corpus,
    its last ``fraction``; batches of 4 x 8 sequences, seed 0)."""
    from pipeloom.data import load_data

    _, val = load_data().split(fraction)
    with torch.no_grad():
        losses = [model(b[:, :-1], b[:, 1:]).item()
                  for b in (torch.from_numpy(val.batch(k, 32, SEQ, 0)) for k in range(BATCHES))]
    return float(np.mean(losses))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT)
def test_validation_save_tensorboard_and_generate(tmp_path):
    from safetensors.torch import load_model

    from pipeloom.nn import GPT, GPTConfig

    board = ["--tensorboard", "tb"] if _has("tensorboard") else []
    done = train("--steps", str(STEPS), "--seq", str(SEQ), "--eval-every", str(EVERY), "--eval-batches", str(BATCHES),
                 "--save", "out/w.safetensors", "--checkpoint-dir", "ck", "--metrics", "m.jsonl", *board, cwd=tmp_path)
    rows = metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert any(line.startswith("step 3/6") and " val " in line for line in done.stderr.splitlines())
    assert "saved the weights of step 6 to out/w.safetensors" in done.stderr
    # the file holds the last weights by their unsplit names: the one-process model gives the pipeline's validation loss
    model = GPT(GPTConfig.preset("tiny", vocab_size=256))
    assert load_model(model, tmp_path / "out" / "w.safetensors") == (set(), [])
    assert validation_loss(model) == pytest.approx(rows[-1]["val_loss"], rel=1e-5)
    if board:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(events.Tags()["scalars"])
        assert [e.step for e in events.Scalars("val_loss")] == [3, 6]
        assert [e.step for e in events.Scalars("loss")] == list(range(1, STEPS + 1))
    # generate: from the checkpoint directory (its latest), and from the weights, the same tokens
    out = json.loads(generate("--checkpoint", "ck", "--prompt", "def main(", "--max-new-tokens", "24", "--json",
                              cwd=tmp_path).stdout)
    assert out["step"] == STEPS and out["source"].endswith("step_0000006") and len(out["tokens"]) == 24
    assert out["prompt_tokens"] == list(b"def main(") and out["text"] == bytes(out["tokens"]).decode(errors="replace")
    text = generate("--weights", "out/w.safetensors", "--prompt", "def main(", "--max-new-tokens", "24",
                    cwd=tmp_path)
    assert text.stdout == "def main(" + out["text"] + "\n" and "24 new tokens" in text.stderr
    # the tokens stream: the first come while the rest are still drawn
    proc = subprocess.Popen([sys.executable, "-m", "pipeloom", "generate", "--weights", "out/w.safetensors",
                             "--prompt", "def main(", "--max-new-tokens", "100000"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = proc.stdout.read(len("def main(") + 8)
        assert first.startswith(b"def main(") and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    # a checkpoint of another vocabulary, and none at all: one line each
    shutil.copytree(tmp_path / "ck" / "step_0000006", tmp_path / "other")
    meta = json.loads((tmp_path / "other" / "pipeloom.json").read_text())
    (tmp_path / "other" / "pipeloom.json").write_text(json.dumps({**meta, "vocab_size": 300}))
    for where, message in (("other", "--checkpoint other: wte.weight is [256, 32] there but [300, 32] in this model"),
                           ("nowhere", "--checkpoint nowhere: no such directory")):
        bad = generate("--checkpoint", where, "--prompt", "x", cwd=tmp_path, check=False)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and message in bad.stderr, bad.stderr


@pytest.mark.timeout(60)
def test_tensorboard_missing_is_one_line(tmp_path):
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "tensorboard.py").write_text("raise ImportError('not installed (a test hides it)')\n")
    path = os.pathsep.join([str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = train("--tensorboard", "tb", cwd=tmp_path, launcher=True, check=False, env={"PYTHONPATH": path})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard" in done.stderr
    assert not (tmp_path / "tb").exists()


def _has(package):
    import importlib.util

    return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", ""], "--checkpoint is empty: give the path of what it names"),
    (["--weights", "w.safetensors", "--tokenizer", ""], "--tokenizer is empty"),
    (["--hf", "hf", "--temperature", "inf"], "--temperature inf: use 0 (the most likely token) or a finite number"),
    (["--hf", "hf", "--temperature", "nan"], "--temperature nan: use 0"),
    (["--hf", "hf", "--top-k", "0"], "--top-k must be at least 1, got 0"),
])
def test_generate_mistakes_are_one_line(args, message):
    from pipeloom.cli import _parser
    from pipeloom.errors import PipeloomError
    from pipeloom.generate import check

    with pytest.raises(PipeloomError, match=re.escape(message)):
        check(_parser().parse_args(["generate", "--prompt", "def", *args]))
