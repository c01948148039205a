"""Training data: the built-in corpus, text files and directories, token files, batches."""

import re

import numpy as np
import pytest

from pipeloom.data import BYTE_VOCAB, load_data, stdlib_sources
from pipeloom.errors import PipeloomError


def test_default_corpus_is_the_standard_library_as_bytes():
    files = stdlib_sources()
    assert any(f.name == "argparse.py" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    data = load_data()
    assert data.vocab_size == BYTE_VOCAB and data.tokens.dtype == np.uint8
    assert len(data) == sum(f.stat().st_size for f in files) > 1_000_000
    assert b"def " in data.tokens[:100_000].tobytes()


def test_text_file_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("hello pipeline\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("second file")
    (sub / "blob.bin.gz").write_bytes(b"\x1f\x8b\x00\x00binary")  # has a NUL byte: skipped
    (tmp_path / ".hidden").write_text("not me")
    one = load_data(tmp_path / "a.txt")
    assert one.tokens.tobytes() == b"hello pipeline\n" and one.vocab_size == 256
    both = load_data(tmp_path)
    assert both.tokens.tobytes() == b"hello pipeline\nsecond file"
    assert "2 text files" in both.source


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_is_memory_mapped(tmp_path, dtype):
    ids = np.arange(1000, dtype=dtype) * 7 % 70_000 if dtype == "uint32" else np.arange(1000, dtype=dtype) % 500
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    data = load_data(path, dtype)
    assert isinstance(data.tokens, np.memmap)
    assert np.array_equal(data.tokens, ids) and data.vocab_size == int(ids.max()) + 1
    assert load_data(path, dtype, vocab_size=80_000).vocab_size == 80_000
    with pytest.raises(PipeloomError, match=f"--vocab-size 10 is too small .* use at least {int(ids.max()) + 1}"):
        load_data(path, dtype, vocab_size=10)


def test_bin_suffix_reads_uint16_and_other_files_as_text(tmp_path):
    np.array([3, 1, 2], dtype=np.uint16).tofile(tmp_path / "t.bin")
    assert load_data(tmp_path / "t.bin").tokens.tolist() == [3, 1, 2]
    (tmp_path / "t.raw").write_bytes(np.array([3, 1, 2], dtype=np.uint16).tobytes())
    assert load_data(tmp_path / "t.raw", "uint16").tokens.tolist() == [3, 1, 2]


def _missing(d):
    return d / "missing.txt"


def _empty_file(d):
    (d / "empty.txt").write_text("")
    return d / "empty.txt"


def _empty_dir(d):
    (d / "void").mkdir()
    return d / "void"


@pytest.mark.parametrize("make,message", [
    (_missing, "missing.txt: no such file or directory"),
    (_empty_file, "the file is empty"),
    (_empty_dir, "holds no non-empty text file"),
])
def test_missing_or_empty_data_is_a_clear_error(tmp_path, make, message):
    with pytest.raises(PipeloomError, match=message):
        load_data(make(tmp_path))


def test_odd_sized_token_file_is_refused(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(PipeloomError, match="3 bytes is not a whole number of uint16 tokens"):
        load_data(tmp_path / "t.bin")


def test_batches_are_windows_fixed_by_seed_and_step(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(256)) * 4)
    data = load_data(tmp_path / "a.txt")
    batch = data.batch(step=3, size=5, seq=16, seed=1)
    assert batch.shape == (5, 17) and batch.dtype == np.int64
    assert all(((row[1:] - row[:-1]) % 256 == 1).all() for row in batch)  # consecutive bytes
    assert np.array_equal(batch, data.batch(step=3, size=5, seq=16, seed=1))
    assert not np.array_equal(batch, data.batch(step=4, size=5, seq=16, seed=1))
    with pytest.raises(PipeloomError, match="fewer than one sequence of --seq 2000"):
        data.batch(step=0, size=1, seq=2000)


def test_bpe_is_trained_on_the_text_cached_and_decodes_back(tmp_path, monkeypatch):
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.setenv("PIPELOOM_CACHE", str(tmp_path / "cache"))
    text = "def pipeline(stage, microbatch):\n    return stage + microbatch\n" * 50 + "naïve ünïcode ✓\n"
    (tmp_path / "code.py").write_text(text)
    data = load_data(tmp_path / "code.py", vocab_size=300, tokenizer="bpe")
    assert 256 < data.vocab_size <= 300 and "BPE" in data.source
    assert len(data) < len(text.encode()) / 2  # merges learned from the text compress it
    (saved,) = (tmp_path / "cache" / "tokens").glob("*.tokenizer.json")
    assert tokenizers.Tokenizer.from_file(str(saved)).decode(data.tokens.tolist()) == text
    again = load_data(tmp_path / "code.py", vocab_size=300, tokenizer="bpe")  # from the cache
    assert np.array_equal(again.tokens, data.tokens)
    loaded = load_data(tmp_path / "code.py", tokenizer=str(saved))  # a saved tokenizer.json
    assert np.array_equal(loaded.tokens, data.tokens) and loaded.vocab_size == data.vocab_size


def test_bad_tokenizer_choices_are_clear_errors(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    np.array([1, 2], dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(PipeloomError, match="no such file; use bytes, bpe, or the path of a tokenizer.json"):
        load_data(tmp_path / "a.txt", tokenizer="wordpiece")
    with pytest.raises(PipeloomError, match="already tokenized"):
        load_data(tmp_path / "t.bin", tokenizer="bpe")


def test_a_file_that_is_no_tokenizer_is_named_in_one_line(tmp_path, monkeypatch):
    """--tokenizer given a file that tokenizers cannot read: text that is not its JSON, or no text at all."""
    pytest.importorskip("tokenizers")
    from pipeloom.data import read_tokenizer

    monkeypatch.setenv("PIPELOOM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("hello\n" * 20)
    (tmp_path / "config.json").write_text('{"vocab_size": 256}')
    (tmp_path / "w.bin").write_bytes(bytes([0xf8, 0x00, 0xff]) * 10)
    for name, message in (("config.json", "not a tokenizers tokenizer.json ("),
                          ("w.bin", "not a tokenizer.json (not UTF-8 text)")):
        path = tmp_path / name
        with pytest.raises(PipeloomError, match=re.escape(f"--tokenizer {path}: {message}")):
            load_data(tmp_path / "a.txt", tokenizer=str(path))
        with pytest.raises(PipeloomError, match=re.escape(f"--tokenizer {path}: {message}")):
            read_tokenizer(path, "--tokenizer")
