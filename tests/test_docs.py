"""Every Python snippet of the README and docs/ runs: a plain one as a script, one that
initialises torch.distributed under ``torchrun --nproc-per-node 2`` (gloo, on this CPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPETS = [(page, n, code) for page in PAGES
            for n, code in enumerate(re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.S | re.M))]


def test_the_docs_have_snippets():
    assert len(SNIPPETS) >= 6


@pytest.mark.parametrize("page,n,code", SNIPPETS, ids=[f"{p.relative_to(ROOT)}#{n}" for p, n, _ in SNIPPETS])
@pytest.mark.timeout(150)
def test_snippet_runs(tmp_path, page, n, code):
    if "init_process_group" in code:
        pytest.importorskip("torch")
    script = tmp_path / "snippet.py"
    script.write_text(code)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
              if "init_process_group" in code else [sys.executable])
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([*launch, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert done.returncode == 0, f"{page.relative_to(ROOT)}, snippet {n}:\n{done.stderr[-3000:]}"


def _shown(page: Path):
    """The console examples of ``page`` whose output is fixed by pipeloom alone (simulate, plan):
    (command, its shown output lines)."""
    for block in re.findall(r"^```\n(\$ pipeloom (?:simulate|plan) .*?)^```$", page.read_text(), re.S | re.M):
        lines = block.replace("\\\n", "").splitlines()
        yield lines[0][2:], [line for line in lines[1:] if line.strip()]


SHOWN = [(page, command, output) for page in PAGES for command, output in _shown(page)]


@pytest.mark.parametrize("page,command,output", SHOWN, ids=[f"{p.relative_to(ROOT)}: {c[:60]}" for p, c, _ in SHOWN])
@pytest.mark.timeout(300)
def test_shown_output_is_what_the_command_prints(tmp_path, page, command, output):
    """Each line shown ("..." skips some) is a line the command prints, in that order."""
    import shlex

    command, _, grep = command.partition(" | grep ")
    done = subprocess.run([sys.executable, "-m", "pipeloom", *shlex.split(command)[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line.rstrip() for line in (done.stdout + done.stderr).splitlines() if grep in line]
    at = 0
    for line in output:
        if line.strip() == "...":
            continue
        assert line.rstrip() in printed[at:], f"{page.relative_to(ROOT)}: {command}\nshown:   {line}\nprinted:\n" + \
            "\n".join(printed)
        at = printed.index(line.rstrip(), at) + 1
