"""Output paths checked before a run: parents created, bad paths refused in one line, nothing left behind."""

import os

import pytest

from pipeloom.errors import PipeloomError
from pipeloom.paths import prepare_output, prepare_output_dir


def test_missing_parents_are_created_and_no_probe_is_left(tmp_path):
    out = prepare_output("--metrics", str(tmp_path / "a" / "b" / "m.jsonl"))
    assert out == tmp_path / "a" / "b" / "m.jsonl"
    assert (tmp_path / "a" / "b").is_dir() and list((tmp_path / "a" / "b").iterdir()) == []


def test_an_existing_file_keeps_its_contents(tmp_path):
    (tmp_path / "m.jsonl").write_text("old")
    prepare_output("--metrics", str(tmp_path / "m.jsonl"))
    assert (tmp_path / "m.jsonl").read_text() == "old"


@pytest.mark.parametrize("path,why", [
    ("file/x.json", "{tmp}/file is a file, not a directory"),
    ("file/deeper/x.json", "{tmp}/file is a file, not a directory"),
    (".", "is a directory; give a file name"),
])
def test_unwritable_file_paths(tmp_path, path, why):
    (tmp_path / "file").write_text("")
    given = str(tmp_path / path)
    with pytest.raises(PipeloomError) as err:
        prepare_output("--trace", given)
    assert str(err.value) == f"--trace {given}: {why.replace('{tmp}', str(tmp_path))}"


def test_suffixes(tmp_path):
    assert prepare_output("--plot", str(tmp_path / "p.SVG"), (".png", ".svg")).name == "p.SVG"
    with pytest.raises(PipeloomError, match=r"--plot .*p\.pdf: the file name must end in \.png or \.svg, not '\.pdf'"):
        prepare_output("--plot", str(tmp_path / "p.pdf"), (".png", ".svg"))


def test_directories(tmp_path):
    assert prepare_output_dir("--checkpoint-dir", str(tmp_path / "c" / "d")).is_dir()
    assert list((tmp_path / "c" / "d").iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(PipeloomError, match="--checkpoint-dir .*file: is a file, not a directory"):
        prepare_output_dir("--checkpoint-dir", str(tmp_path / "file"))
    with pytest.raises(PipeloomError, match="file is a file, not a directory"):
        prepare_output_dir("--checkpoint-dir", str(tmp_path / "file" / "ckpt"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs POSIX permissions and a non-root user")
def test_no_permission(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(PipeloomError, match="cannot write it: Permission denied"):
            prepare_output("--trace", str(locked / "t.json"))
        with pytest.raises(PipeloomError, match="cannot create directory .*: Permission denied"):
            prepare_output("--trace", str(locked / "sub" / "t.json"))
        with pytest.raises(PipeloomError, match="cannot write in it: Permission denied"):
            prepare_output_dir("--checkpoint-dir", str(locked))
    finally:
        locked.chmod(0o700)
