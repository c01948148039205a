"""Every Python snippet of the README and docs/ runs: a plain one as a script, one that
initialises torch.distributed as under ``torchrun --nproc-per-node 2`` (gloo, on this CPU; its
ranks forked as :func:`launching.script_forked` does: the subject is the snippet, not torchrun)."""

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
    script = tmp_path / "snippet.py"
    script.write_text(code)
    if "init_process_group" in code:
        pytest.importorskip("torch")
        from launching import script_forked

        done = script_forked(script, 2, cwd=tmp_path, timeout=120)
    else:
        path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    assert done.returncode == 0, f"{page.relative_to(ROOT)}, snippet {n}:\n{done.stderr[-3000:]}"


def _blocks(page: Path):
    """The console examples of ``page``: each a list of (command, its shown output lines, the
    environment variables set before it, ``NAME=value pipeloom ...``), run in turn."""
    for block in re.findall(r"^```\n(\$ (?:\w+=\S+ )*pipeloom .*?)^```$", page.read_text(), re.S | re.M):
        runs = []
        for line in block.replace("\\\n", "").splitlines():
            if line.startswith("$ "):
                env = dict(re.findall(r"(\w+)=(\S+) ", line[2:line.index("pipeloom")]))
                runs.append((line[line.index("pipeloom"):], [], env))
            elif line.strip():
                runs[-1][1].append(line.rstrip())
        yield runs


def _slow(runs) -> bool:
    """Whether a block runs a worker (a training run, sampling or a profile: a minute or so each) or
    a K-FAC plan search (each layout simulated over its refresh cycle: seconds a layout)."""
    return any(re.match(r"pipeloom (generate|profile)|pipeloom train(?!.*--dry-run)|pipeloom plan .*--optimizer (kfac|any)",
                        command) for command, *_ in runs)


def _timed(command: str) -> bool:
    """Whether every number the command prints is a measured time (compared as ``#``)."""
    return "--report" in command or command.startswith("pipeloom profile")


def _same(line: str, command: str) -> str:
    """``line`` without what changes from run to run: throughput and time left of a training run's
    progress, and every number of a timed command."""
    if _timed(command):
        return " ".join(re.sub(r"\d[\d,.]*", "#", line).split())
    return re.sub(r"[\d,]+ tok/s +\d+s left", "tok/s left", line)


BLOCKS = [pytest.param(page, runs, id=f"{page.relative_to(ROOT)}: {runs[0][0][:60]}",
                       marks=[pytest.mark.slow] if _slow(runs) else [])
          for page in PAGES for runs in _blocks(page)]


@pytest.mark.parametrize("page,runs", BLOCKS)
@pytest.mark.timeout(600)
def test_shown_output_is_what_the_command_prints(tmp_path, page, runs):
    """Each line shown ("..." skips some) is a line the command prints, in that order; the commands of
    one example run in turn in one directory (``generate`` reads what ``train`` saved)."""
    import shlex

    for command, output, env in runs:
        command, _, grep = command.partition(" | grep ")
        done = subprocess.run([sys.executable, "-m", "pipeloom", *shlex.split(command)[1:]], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=540,
                              env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stdout[-2000:]
        printed = [_same(line.rstrip(), command) for line in done.stdout.splitlines() if grep in line]
        at = 0
        for line in output:
            if line.strip() == "...":
                continue
            assert _same(line, command) in printed[at:], \
                f"{page.relative_to(ROOT)}: {command}\nshown:   {line}\nprinted:\n" + "\n".join(printed)
            at = printed.index(_same(line, command), at) + 1


def _page():
    """bench/page.py, which rebuilds docs/benchmarks.md's tables from bench/results/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_page", ROOT / "bench" / "page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_tables_are_their_json():
    page = _page()
    text = page.PAGE.read_text()
    _, changed = page.rebuilt(text)
    assert not changed, f"docs/benchmarks.md: run python bench/page.py (stale: {changed})"
    assert sorted(m["name"] for m in page.BLOCK.finditer(text)) == sorted(page.TABLES)


def test_a_changed_result_makes_its_table_stale(tmp_path):
    import json

    page = _page()
    doc = json.loads((page.RESULTS / "vs_torch_pipelining.json").read_text())
    doc["schedules"]["1f1b"]["ratio"] = 0.5
    (tmp_path / "vs_torch_pipelining.json").write_text(json.dumps(doc))
    text = "<!-- results: vs_torch_pipelining -->\n" + page.rendered("vs_torch_pipelining") + "<!-- /results -->\n"
    new, changed = page.rebuilt(text, tmp_path)
    assert changed == ["vs_torch_pipelining"] and "| 0.500 |" in new and "| 0.500 |" not in text
    assert "Not measured yet: `python bench/compile.py --device cuda`" in page.rendered("compile_cuda", tmp_path)
