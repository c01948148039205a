"""Hugging Face checkpoints in and out: tiny random Llamas made and saved by transformers itself,
trained through pipelines with ``--init-from`` against transformers' own loss, written back with
``--save-hf`` and reloaded by transformers; what each rank reads; the one-line refusals."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch.nn.functional as F  # noqa: E402

from launching import train_forked  # noqa: E402
from pipeloom.data import load_data  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.hf import read_size  # noqa: E402
from pipeloom.nn import from_hf  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

TIMEOUT = 120
#: The tiny Llama's sizes: 2 key/value heads of 4 query heads, a vocabulary that splits unevenly over 2 and 4 ranks.
TINY = dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5)
#: Grouped-query attention and Llama 3.1's rotary scaling (its wavelengths straddle the bounds at this size).
GQA_ROPE = dict(num_key_value_heads=2, rope_parameters={
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16})
#: A tiny GPT-2 of the same vocabulary.
GPT2 = dict(vocab_size=301, n_embd=32, n_layer=4, n_head=4, n_positions=64)
SEQ, MICROBATCH, MICROBATCHES = 16, 2, 4


def hf_model(directory: Path, shard: str | None = None, gpt2: bool = False, **overrides) -> Path:
    """A random transformers Llama of :data:`TINY` sizes (or a GPT-2 of :data:`GPT2`) with ``overrides``,
    saved to ``directory`` (in shards of at most ``shard``); its norms away from one, so that a
    misplaced weight shows; with a byte-level BPE tokenizer.json of its vocabulary, trained on :func:`corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train([str(corpus(directory.parent))], trainers.BpeTrainer(
        vocab_size=TINY["vocab_size"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    torch.manual_seed(0)
    if gpt2:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2, **overrides}))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)  # larger than the default: the logits far from uniform
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def first_batch(corpus: Path, tokenizer: Path):
    """The tokens and targets of ``pipeloom train``'s first step on ``corpus`` (by ``tokenizer``, seed 0, dp 1)."""
    train, _ = load_data(corpus, tokenizer=str(tokenizer)).split(0.05)
    batch = torch.from_numpy(train.batch(0, MICROBATCH * MICROBATCHES, SEQ, 0))
    return batch[:, :-1], batch[:, 1:]


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(Path(__file__).read_text() * 2)
    return path


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def run(tmp_path, source, *flags):
    done = train_forked("--init-from", str(source), "--data", str(corpus(tmp_path)), "--seq", str(SEQ),
                        "--microbatch-size", str(MICROBATCH), "--microbatches", str(MICROBATCHES), "--metrics",
                        "m.jsonl", *flags, cwd=tmp_path, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]


CASES = {  # label: (config overrides, max_shard_size, pipeline flags); "gpt2" in the label: a GPT-2
    "pp1": ({}, None, ["--pp", "1"]),
    "pp2": ({}, None, ["--pp", "2"]),
    "pp4": ({}, None, ["--pp", "4", "--schedule", "gpipe"]),
    "pp2-vocab-1": ({}, None, ["--pp", "2", "--vocab-parallel", "vocab-1"]),
    "pp4-vocab-2": ({}, None, ["--pp", "4", "--vocab-parallel", "vocab-2"]),
    "sharded-pp2": ({}, "40KB", ["--pp", "2"]),
    "tied-pp2": ({"tie_word_embeddings": True}, None, ["--pp", "2"]),
    "tied-pp2-vocab-1": ({"tie_word_embeddings": True}, None, ["--pp", "2", "--vocab-parallel", "vocab-1"]),
    "gqa-rope-pp2": (GQA_ROPE, None, ["--pp", "2", "--schedule", "zb-h1"]),
    "gpt2-pp2": ({}, None, ["--pp", "2"]),
    "gpt2-untied-pp4-vocab-2": ({"tie_word_embeddings": False}, "40KB", ["--pp", "4", "--vocab-parallel", "vocab-2"]),
}


#: The cases the default suite runs (one of each model, tying, GQA with rope scaling, shards and each
#: vocabulary split); the others run with the slow set.
QUICK = {"pp2-vocab-1", "tied-pp2", "gqa-rope-pp2", "gpt2-untied-pp4-vocab-2"}


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("case", [case if case in QUICK else pytest.param(case, marks=pytest.mark.slow)
                                  for case in CASES])
def test_init_from_trains_from_transformers_loss_and_saves_what_transformers_reloads(tmp_path, monkeypatch, case):
    monkeypatch.setenv("PIPELOOM_CACHE", str(tmp_path / "cache"))
    overrides, shard, flags = CASES[case]
    source = hf_model(tmp_path / "source", shard, "gpt2" in case, **overrides)
    if shard:
        assert (source / "model.safetensors.index.json").is_file() and len(list(source.glob("*.safetensors"))) > 2
    tokens, targets = first_batch(corpus(tmp_path), source / "tokenizer.json")  # the run's: --init-from's
    want = loss_of(hf_logits(source, tokens), targets)
    rows = run(tmp_path, source, "--steps", "3", "--lr", "1e-2", "--warmup", "0", "--save", "w.safetensors",
               "--save-hf", "out", *flags)
    assert rows[0]["loss"] == pytest.approx(want, rel=2e-6, abs=2e-6)
    assert rows[-1]["loss"] != rows[0]["loss"]  # it trained
    # transformers reloads --save-hf's directory; its logits are those of pipeloom's trained model,
    # read by pipeloom's own names from --save's file
    from safetensors.torch import load_file

    from pipeloom.generate import _from_weights, load_tensors
    from pipeloom.nn.models import size_config

    trained = size_config(read_size(source)).build()
    load_tensors(trained, load_file(tmp_path / "w.safetensors"), "--save")
    with torch.no_grad():
        ours = trained(tokens)
        torch.testing.assert_close(_from_weights(str(tmp_path / "w.safetensors"), "cpu")[0](tokens), ours)
    theirs = hf_logits(tmp_path / "out", tokens)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(theirs, hf_logits(source, tokens), atol=1e-3)  # the trained weights, not the start
    # pipeloom generate reads the directory: greedy tokens as transformers' own
    import contextlib
    import io

    from pipeloom.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", "--hf", str(tmp_path / "out"), "--prompt", "def ", "--temperature", "0",
                     "--max-new-tokens", "6", "--json"]) == 0
    sampled = json.loads(printed.getvalue())
    ids = list(sampled["prompt_tokens"])
    assert ids == transformers.AutoTokenizer.from_pretrained(tmp_path / "out")("def ")["input_ids"]
    for _ in range(6):
        ids.append(int(hf_logits(tmp_path / "out", torch.tensor([ids]))[0, -1].argmax()))
    assert sampled["tokens"] == ids[-6:]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["tie_word_embeddings"] == overrides.get("tie_word_embeddings", "gpt2" in case)
    assert read_size(tmp_path / "out") == read_size(source)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("model", ["tiny", "llama-tiny"])
def test_a_preset_saves_what_transformers_reloads(tmp_path, model):
    """A GPT preset as a GPT-2, a Llama preset as a Llama, trained from scratch."""
    from pipeloom.generate import _from_weights

    done = train_forked("--model", model, "--data", str(corpus(tmp_path)), "--seq", str(SEQ), "--steps", "2",
                        "--save", "w.safetensors", "--save-hf", "out", cwd=tmp_path, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = torch.randint(0, 256, (2, SEQ))
    with torch.no_grad():
        ours = _from_weights(str(tmp_path / "w.safetensors"), "cpu")[0].eval()(tokens)
    torch.testing.assert_close(hf_logits(tmp_path / "out", tokens), ours, rtol=1e-4, atol=1e-5)


def test_the_run_spec_takes_the_directory_as_its_model(tmp_path):
    from pipeloom.builder import Priced
    from pipeloom.cli import _parser
    from pipeloom.cli.flags import spec_of
    from pipeloom.sim.specs import size_spec

    source = hf_model(tmp_path / "m", **GQA_ROPE)
    spec = spec_of(_parser().parse_args(["train", "--init-from", str(source), "--seq", "32"]))
    assert spec.model is None and spec.init_from == str(source) and spec.size == read_size(source)
    assert spec_of(_parser().parse_args(["train", *spec.flags()])) == spec
    assert Priced(spec).model == size_spec(str(source), read_size(source))  # simulate prices the directory's model
    assert Priced(spec).model.kv_heads == 2 and Priced(spec).model.vocab == 301
    with pytest.raises(PipeloomError, match=r"--vocab 512: the vocabulary of --init-from .* is its config.json's"):
        spec_of(_parser().parse_args(["train", "--init-from", str(source), "--vocab", "512"]))


def test_config_sizes_and_the_model_match_transformers(tmp_path):
    source = hf_model(tmp_path / "m", **GQA_ROPE, tie_word_embeddings=True)
    size = read_size(source)
    assert (size.layers, size.hidden, size.heads, size.kv_heads, size.ffn_hidden, size.vocab, size.tied) == \
        (4, 32, 4, 2, 48, 301, True)
    assert size.rope_theta == 500000.0 and size.rope_scaling == (8.0, 1.0, 4.0, 16) and size.norm_eps == 1e-5
    tokens = torch.randint(0, 301, (2, 40))  # past the original context of the scaling
    with torch.no_grad():
        torch.testing.assert_close(from_hf(source)(tokens), hf_logits(source, tokens), rtol=1e-4, atol=1e-5)
    # the older config.json (transformers 4): rope_theta and rope_scaling beside the sizes
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert read_size(tmp_path / "old") == size


def _reads(rank, source, pp):
    """For a pipeline without and with vocabulary parallelism: the bytes of tensors this rank read
    from ``source`` while the pipeline was built, and the bytes of the weights it holds (a
    vocabulary shard's padding rows aside)."""
    import pipeloom
    from pipeloom.nn import hf

    original, out = hf.read, []
    for vocab in (None, "vocab-1"):
        read = []

        def counted(parts, rows=None):
            tensor = original(parts, rows)
            read.append(tensor.numel() * tensor.element_size())
            return tensor

        hf.read = counted
        pipe = pipeloom.Pipeline(from_hf(source, device="meta"), "1f1b", pp=pp, microbatches=pp,
                                 vocab_parallel=vocab)
        padding = {}
        if vocab:
            shard = pipe.vocab.embedding.shard
            padding = {id(p): (shard.rows - shard.real_rows) * p.shape[1] for p in pipe.vocab.parameters()}
        held = {id(p): (p.numel() - padding.get(id(p), 0)) * p.element_size() for p in pipe.parameters()}
        out.append((sum(read), sum(held.values())))
    return out


@pytest.mark.timeout(TIMEOUT)
def test_each_rank_reads_only_its_own_stages(tmp_path):
    source = hf_model(tmp_path / "m", num_hidden_layers=8)
    total = (source / "model.safetensors").stat().st_size
    results = spawn(4, _reads, source, 4, timeout=TIMEOUT)
    for k, vocab in enumerate(("no vocabulary parallelism", "vocab-1")):
        for rank, rank_results in enumerate(results):
            read, held = rank_results[k]
            print(f"{vocab}, rank {rank}: read {read} bytes of a {total}-byte checkpoint; holds {held} bytes")
            assert read == held, (vocab, rank, read, held)  # every byte read is one of its own weights, read once
            assert read < 0.4 * total, (vocab, rank, read, total)  # its layers and its ends or vocabulary shard
        # together the ranks read each tensor of the checkpoint once (the file's header aside)
        assert total - 16_000 < sum(r[k][0] for r in results) <= total


def test_refusals_are_one_line_before_launch(tmp_path, monkeypatch):
    from launching import train_forked

    def refused(*flags):
        done = train_forked(*flags, "--steps", "1", "--seq", "32", cwd=tmp_path, timeout=TIMEOUT)
        assert done.returncode != 0 and done.stdout == "", done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "no such directory" in refused("--init-from", "nowhere")
    (tmp_path / "empty").mkdir()
    assert "no config.json there" in refused("--init-from", "empty")
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    assert "model_type 'mistral' is not supported; pipeloom reads Llama-family models (model_type llama) and " \
           "GPT-2 (model_type gpt2)" in refused("--init-from", "mistral")
    (mistral / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert "config.json gives no whole number n_embd (nor n_head, vocab_size)" in refused("--init-from", "mistral")
    (mistral / "config.json").write_text(json.dumps({**GPT2, "model_type": "gpt2", "activation_function": "relu"}))
    assert "has activation_function 'relu', which pipeloom's GPT does not run; it runs activation_function " \
           "'gelu_new'" in refused("--init-from", "mistral")
    source = hf_model(tmp_path / "m")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))
    assert "rotary scaling 'yarn'" in refused("--init-from", "m")
    (source / "config.json").write_text(json.dumps(config))
    assert "--model or --init-from" in refused("--init-from", "m", "--model", "llama-tiny")
    (source / "model.safetensors").rename(source / "other.safetensors")
    assert "no model.safetensors nor model.safetensors.index.json" in refused("--init-from", "m")
    (source / "other.safetensors").rename(source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert "holds model.layers.3.input_layernorm.weight, which this model (3 layers) has no place for" in \
        refused("--init-from", "m", "--pp", "1")
    (source / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    assert "model.embed_tokens.weight in" in refused("--init-from", "m")  # before the data is tokenized
    hf_model(tmp_path / "small", vocab_size=280)  # its tokenizer.json has 301 tokens
    monkeypatch.setenv("PIPELOOM_CACHE", str(tmp_path / "cache"))
    assert "vocabulary of 301 tokens is larger than the 280 of --init-from small" in \
        refused("--init-from", "small", "--data", str(corpus(tmp_path)))


def test_missing_safetensors_is_the_pip_line(tmp_path, monkeypatch):
    import sys

    from launching import train_forked

    source = hf_model(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    done = train_forked("--init-from", str(source), "--steps", "1", "--seq", "32", cwd=tmp_path, timeout=TIMEOUT)
    assert done.returncode != 0
    assert "--init-from needs the safetensors package, which is not installed: pip install safetensors" in done.stderr


def test_python_api_from_hf_refuses_in_one_line(tmp_path):
    with pytest.raises(PipeloomError, match=r"no config.json there"):
        from_hf(tmp_path)


def test_sampling_for_bytes_draws_only_bytes():
    """A model trained on bytes from a checkpoint of a larger vocabulary: generate draws among the 256 bytes."""
    from types import SimpleNamespace

    from pipeloom.generate import sample

    class PastTheBytes(torch.nn.Module):  # the tokens past the bytes the likeliest by far
        config = SimpleNamespace(block_size=8)

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(300))

        def forward(self, ids):
            return (self.weight + 10 * (torch.arange(300) >= 256)).expand(1, ids.shape[1], 300)

    model = PastTheBytes()
    assert all(t >= 256 for t in sample(model, [1, 2], 5, 0.0, None, 0))
    drawn = list(sample(model, [1, 2], 20, 1.0, None, 0, vocab=256)) + list(sample(model, [1, 2], 5, 0.0, None, 0, 256))
    assert all(t < 256 for t in drawn)
