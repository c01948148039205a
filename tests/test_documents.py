"""Datasets of documents as training data: JSON lines, Parquet, ``datasets`` directories; each
document's tokens then the end-of-text token, cached; their refusals in one line."""

import json
import sys

import numpy as np
import pytest

from pipeloom import data as data_module
from pipeloom.data import BYTE_EOS, EOS_NAMES, end_of_text, load_data
from pipeloom.documents import Documents
from pipeloom.errors import PipeloomError

DOCS = ["héllo pipeline\n", "", "second document", None, "the third, with a\n\nblank line"]
TEXTS = [d for d in DOCS if d]  # the null and the empty one are left out


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELOOM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_jsonl(path, docs, field="text"):
    lines = [json.dumps({"id": i, field: d}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines[:2] + [""] + lines[2:]) + "\n")  # a blank line is skipped
    return path


def write_parquet(path, docs, field="text"):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=2)
    return path


def write_saved(path, docs, field="text", splits=("train",)):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"id": list(range(len(docs))), field: docs})
    if splits is None:
        dataset.save_to_disk(str(path))
    else:
        datasets.DatasetDict({s: dataset for s in splits}).save_to_disk(str(path))
    return path


def write_directory(path, docs, field="text"):
    path.mkdir()
    write_jsonl(path / "a.jsonl", docs[:2], field)
    write_parquet(path / "b.parquet", docs[2:], field)
    return path


FORMATS = {
    "jsonl": lambda d, docs, field="text": write_jsonl(d / "c.jsonl", docs, field),
    "json": lambda d, docs, field="text": write_jsonl(d / "c.json", docs, field),
    "parquet": lambda d, docs, field="text": write_parquet(d / "c.parquet", docs, field),
    "dataset": lambda d, docs, field="text": write_saved(d / "saved", docs, field, splits=None),
    "datasetdict": lambda d, docs, field="text": write_saved(d / "saved", docs, field, splits=("test", "train")),
    "directory": lambda d, docs, field="text": write_directory(d / "docs", docs, field),
}


def joined(encoded, eos):
    """Each document's ids, then ``eos``: the expected stream, built without pipeloom."""
    return [i for ids in encoded for i in [*ids, eos]]


@pytest.mark.parametrize("kind", FORMATS)
def test_every_format_gives_its_documents_as_bytes_each_ended_by_nul(tmp_path, kind):
    data = load_data(FORMATS[kind](tmp_path, DOCS))
    assert data.tokens.tolist() == joined([list(t.encode()) for t in TEXTS], 0)
    assert data.vocab_size == 256 and data.eos == BYTE_EOS == 0 and data.tokenizer == "bytes"
    assert "field 'text'" in data.source and f"({len(data)} tokens)" in data.source


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_text_field_names_the_documents_field(tmp_path, kind):
    data = load_data(FORMATS[kind](tmp_path, DOCS, field="body"), text_field="body")
    assert data.tokens.tobytes() == b"".join(t.encode() + b"\0" for t in TEXTS)


@pytest.mark.parametrize("kind,where", [("jsonl", "c.jsonl, line 1"), ("parquet", "c.parquet"),
                                        ("dataset", "saved"), ("datasetdict", "saved")])
def test_a_missing_field_is_named_with_the_fields_there_are(tmp_path, kind, where):
    path = FORMATS[kind](tmp_path, DOCS, field="content")
    with pytest.raises(PipeloomError) as err:
        load_data(path)
    assert str(err.value) == (f"--data {tmp_path / where}: no field 'text'; its fields: id, content; "
                              "choose the text with --text-field")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset"])
def test_a_field_that_is_not_text_is_refused(tmp_path, kind):
    with pytest.raises(PipeloomError, match="field 'id' holds int(64)?, not text; choose a text field with --text-field"):
        load_data(FORMATS[kind](tmp_path, DOCS), text_field="id")


def test_bad_json_lines_name_their_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(PipeloomError, match=r"a.jsonl, line 2: not JSON \(.*\); JSON lines hold one object per line"):
        load_data(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text('["text"]\n')
    with pytest.raises(PipeloomError, match="b.jsonl, line 1: a JSON list, not an object"):
        load_data(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(PipeloomError, match=r"c.jsonl \(documents, field 'text'\): no text to train on"):
        load_data(tmp_path / "c.jsonl")


def test_a_datasetdict_without_a_train_split_names_its_splits(tmp_path):
    path = write_saved(tmp_path / "saved", DOCS, splits=("test", "validation"))
    with pytest.raises(PipeloomError, match=r"saved holds the splits test, validation and no train split; "
                                            r"give one split's directory, e.g. --data .*saved/test"):
        load_data(path)
    assert load_data(path / "validation").tokens.tobytes() == b"".join(t.encode() + b"\0" for t in TEXTS)


@pytest.mark.parametrize("module,kind,package", [("pyarrow.parquet", "parquet", "pyarrow"),
                                                 ("datasets", "dataset", "datasets")])
def test_a_missing_package_names_its_pip_install(tmp_path, monkeypatch, module, kind, package):
    path = FORMATS[kind](tmp_path, DOCS)
    monkeypatch.setitem(sys.modules, module, None)  # import fails as when it is not installed
    with pytest.raises(PipeloomError, match=rf"needs the {package} package: pip install 'pipeloom\[data\]' "
                                            rf"\(or pip install {package}\)$"):
        load_data(path)


def test_text_field_and_token_dtype_need_the_right_data(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    with pytest.raises(PipeloomError, match="--text-field body: --data .*a.txt is not a dataset of documents"):
        load_data(tmp_path / "a.txt", text_field="body")
    with pytest.raises(PipeloomError, match="is a dataset of documents, not a token file; drop --token-dtype"):
        load_data(write_jsonl(tmp_path / "c.jsonl", DOCS), token_dtype="uint16")


def test_a_trained_bpe_reserves_the_end_of_text_token(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    docs = [f"def stage_{i}(microbatch):\n    return microbatch * {i}\n" for i in range(60)]
    data = load_data(write_jsonl(tmp_path / "c.jsonl", docs), tokenizer="bpe", vocab_size=300)
    model = tokenizers.Tokenizer.from_file(data.tokenizer)
    eos = model.token_to_id("<|endoftext|>")
    assert eos is not None and data.eos == eos and 256 < data.vocab_size <= 300
    assert data.tokens.tolist() == joined([model.encode(d).ids for d in docs], eos)
    assert len(data) < sum(map(len, docs)) / 2  # merges learned from the documents
    assert model.decode(data.tokens.tolist()) == "".join(docs)  # the end-of-text token decodes to nothing


def _tokenizer(tmp_path, specials, post=None):
    """A small BPE ``tokenizer.json`` made by the tokenizers package, with ``specials`` and a post-processor
    template (``post``, e.g. "<s> $A") when given."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    model = tokenizers.Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(TEXTS * 5, trainers.BpeTrainer(
        vocab_size=290, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if post:
        model.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[(s, model.token_to_id(s)) for s in specials if s in post])
    (tmp_path / "model").mkdir()
    model.save(str(tmp_path / "model" / "tokenizer.json"))
    return model, tmp_path / "model" / "tokenizer.json"


@pytest.mark.parametrize("specials,config,post,eos_name", [
    (["<unk>", "<|endoftext|>"], None, None, "<|endoftext|>"),
    (["<s>", "</s>"], None, "<s> $A", "</s>"),  # each document begins with the tokenizer's own <s>
    (["<s>", "</s>"], None, "<s> $A </s>", "</s>"),  # ends with </s> already: not doubled
    (["<|endoftext|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}, None, "<|im_end|>"),
    (["<|endoftext|>", "<|eot|>"], {"eos_token": {"content": "<|eot|>", "special": True}}, None, "<|eot|>"),
])
def test_a_given_tokenizer_ends_documents_with_its_eos(tmp_path, specials, config, post, eos_name):
    model, path = _tokenizer(tmp_path, specials, post)
    if config:
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    eos = model.token_to_id(eos_name)
    assert end_of_text(path) == eos
    data = load_data(write_jsonl(tmp_path / "c.jsonl", DOCS), tokenizer=str(path))
    expected = [model.encode(t).ids for t in TEXTS]
    if post and post.endswith(eos_name):
        assert all(ids[-1] == eos for ids in expected)
        expected = [ids[:-1] for ids in expected]
    assert data.tokens.tolist() == joined(expected, eos) and data.eos == eos
    assert data.vocab_size == model.get_vocab_size()


def test_a_tokenizer_without_an_eos_is_refused(tmp_path):
    _, path = _tokenizer(tmp_path, ["<pad>"])
    with pytest.raises(PipeloomError, match="has no end-of-text token to end each document with: no eos_token in a "
                                            f"tokenizer_config.json beside it, and none of {', '.join(EOS_NAMES)}"):
        load_data(write_jsonl(tmp_path / "c.jsonl", DOCS), tokenizer=str(path))
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    with pytest.raises(PipeloomError, match="the eos_token '<eos>' of .*tokenizer_config.json is not in its vocabulary"):
        end_of_text(path)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_the_stream_is_cached_until_a_file_changes(tmp_path, monkeypatch, tokenizer):
    if tokenizer == "bpe":
        pytest.importorskip("tokenizers")
    path = write_jsonl(tmp_path / "c.jsonl", DOCS)
    first = load_data(path, tokenizer=tokenizer, vocab_size=300)
    reads = []
    read = Documents.batches
    monkeypatch.setattr(Documents, "batches", lambda self: reads.append(self.path) or read(self))
    again = load_data(path, tokenizer=tokenizer, vocab_size=300)
    assert reads == [] and np.array_equal(again.tokens, first.tokens) and again.tokenizer == first.tokenizer
    write_jsonl(path, DOCS + ["one more"])
    changed = load_data(path, tokenizer=tokenizer, vocab_size=300)
    assert reads and len(changed) > len(first)
    other_field = write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    load_data(other_field, text_field="body", tokenizer=tokenizer, vocab_size=300)
    assert reads[-1] == other_field


def test_progress_shows_on_stderr_only_when_asked(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(data_module, "LARGE", 0)  # as if the corpus were large
    load_data(write_jsonl(tmp_path / "a.jsonl", DOCS))
    assert capsys.readouterr().err == ""
    load_data(write_jsonl(tmp_path / "b.jsonl", DOCS), progress=True)
    captured = capsys.readouterr()
    assert "tokenizing" in captured.err and "b.jsonl" in captured.err and captured.out == ""


def test_training_on_json_lines_end_to_end(tmp_path):
    pytest.importorskip("torch")
    from launching import train_forked

    docs = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(100)]
    write_jsonl(tmp_path / "corpus.jsonl", docs)
    done = train_forked("--data", "corpus.jsonl", "--steps", "3", "--seq", "32", "--metrics", "m.jsonl",
                        cwd=tmp_path, env={"PIPELOOM_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    assert "data: corpus.jsonl (documents, field 'text'), bytes" in done.stderr
    refused = train_forked("--data", "corpus.jsonl", "--text-field", "body", "--steps", "3", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "corpus.jsonl, line 1: no field 'body'; its fields: id, text" in refused.stderr


def test_a_missing_package_stops_the_command_before_launch(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from launching import train_forked

    write_parquet(tmp_path / "corpus.parquet", DOCS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    done = train_forked("--data", "corpus.parquet", "--steps", "3", cwd=tmp_path,
                        env={"PIPELOOM_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "corpus.parquet is Parquet, which needs the pyarrow package: pip install 'pipeloom[data]'" in done.stderr
