"""The Llama-family model: its layers against torch's and Hugging Face's definitions, its stages,
safetensors files by Hugging Face's names, the simulator's counts, and the runtime against one process."""

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from parity import SYNCHRONOUS, check, cheap_recompute_run, parity_worker  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import (LLAMA_PRESETS, Linear, Llama, LlamaConfig, Rotary, WeightGradStore,  # noqa: E402
                         defer_weight_grads, preset_config)
from pipeloom.runtime.local import spawn  # noqa: E402
from pipeloom.sim import MODELS, stage_parameters  # noqa: E402
from test_gpt import assert_same_grads, batch, grads, unsplit_step  # noqa: E402


def tiny(seed=0, device=None, **overrides):
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("llama-tiny", **overrides), device=device)


# -- the layers ---------------------------------------------------------------------------------

def test_rms_norm_is_torchs():
    model = tiny()
    norm = model.blocks[0].ln_1
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (32,), norm.weight, 1e-5))
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight)


def _hf_rotary(x, positions, theta):
    """Hugging Face's Llama rotary embedding (rotate_half layout), written out."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


def test_attention_is_sdpa_with_repeated_kv_heads_after_rotary():
    model = tiny()
    attn = model.blocks[1].attn
    x = torch.randn(3, 12, 32)
    b, t, c, heads, kv_heads, d = 3, 12, 32, 4, 2, 8
    q, k, v = F.linear(x, attn.qkv.weight).split([c, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = (y.view(b, t, -1, d).transpose(1, 2) for y in (q, k, v))
    positions = torch.arange(t)
    q, k = _hf_rotary(q, positions, 10000.0), _hf_rotary(k, positions, 10000.0)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = F.linear(y.transpose(1, 2).reshape(b, t, c), attn.proj.weight)
    torch.testing.assert_close(attn(x), want)
    # and plain softmax attention
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(y, scores.softmax(-1) @ v)


def test_rotary_takes_hf_checkpoints_as_meta_rotates_its_own():
    """Meta's reference turns dimension pairs (2i, 2i+1) as complex numbers; Hugging Face's
    conversion permutes q and k rows so that rotate_half pairs (i, i + d/2) give the same
    scores. So pipeloom's rotate_half rotary takes Hugging Face's rows as they are."""
    heads, d, c, t = 2, 8, 16, 7
    wq, wk = torch.randn(heads * d, c), torch.randn(heads * d, c)
    x = torch.randn(t, c)
    positions = torch.arange(3, 3 + t)

    def meta(w):  # llama/model.py: apply_rotary_emb on interleaved pairs
        y = (x @ w.T).view(t, heads, d // 2, 2)
        freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        turn = torch.polar(torch.ones(t, d // 2), positions.float()[:, None] * freqs)
        return torch.view_as_real(torch.view_as_complex(y) * turn[:, None]).flatten(2).transpose(0, 1)

    def hf_permute(w):  # transformers' convert_llama_weights_to_hf.permute
        return w.view(heads, d // 2, 2, c).transpose(1, 2).reshape(heads * d, c)

    rotary = Rotary(d)
    q, k = ((x @ hf_permute(w).T).view(t, heads, d).transpose(0, 1) for w in (wq, wk))
    q, k = rotary(q, k, positions)
    torch.testing.assert_close(q @ k.transpose(-1, -2), meta(wq) @ meta(wk).transpose(-1, -2), rtol=1e-4, atol=1e-4)


def test_rotary_scores_depend_on_relative_positions():
    rotary, q, k = Rotary(16, theta=500000.0), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    a = torch.matmul(*_turned(rotary, q, k, torch.arange(6)))
    b = torch.matmul(*_turned(rotary, q, k, torch.arange(100, 106)))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _turned(rotary, q, k, positions):
    q, k = rotary(q, k, positions)
    return q, k.transpose(-1, -2)


def test_llama3_frequency_scaling_is_metas():
    scaling = (8.0, 1.0, 4.0, 8192)
    got = Rotary(128, 500000.0, scaling).frequencies()

    def apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):  # llama3 reference
        low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
        new = []
        for freq in freqs.tolist():
            wavelen = 2 * math.pi / freq
            if wavelen < high_freq_wavelen:
                new.append(freq)
            elif wavelen > low_freq_wavelen:
                new.append(freq / scale_factor)
            else:
                smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                new.append((1 - smooth) * freq / scale_factor + smooth * freq)
        return torch.tensor(new)

    want = apply_scaling(Rotary(128, 500000.0).frequencies(), *scaling)
    torch.testing.assert_close(got, want)
    assert (got < Rotary(128, 500000.0).frequencies()).any()


def test_swiglu():
    mlp = tiny().blocks[0].mlp
    x = torch.randn(2, 3, 32)
    gate, up = mlp.gate_up.weight.split(96)
    torch.testing.assert_close(mlp(x), F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), mlp.proj.weight))


def _hf_forward(tensors, config, tokens):
    """Hugging Face's LlamaForCausalLM, written out on its own names (eager attention)."""
    c, d = config, config.n_embd // config.n_head

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps))

    b, t = tokens.shape
    x = tensors["model.embed_tokens.weight"][tokens]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    for i in range(c.n_layer):
        p = f"model.layers.{i}."
        h = rms(x, tensors[p + "input_layernorm.weight"])
        q, k, v = (F.linear(h, tensors[p + f"self_attn.{n}_proj.weight"]).view(b, t, -1, d).transpose(1, 2)
                   for n in "qkv")
        q, k = _hf_rotary(q, torch.arange(t), c.rope_theta), _hf_rotary(k, torch.arange(t), c.rope_theta)
        k, v = (y.repeat_interleave(c.n_head // c.n_kv_head, 1) for y in (k, v))
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + F.linear(y, tensors[p + "self_attn.o_proj.weight"])
        h = rms(x, tensors[p + "post_attention_layernorm.weight"])
        gate, up = (F.linear(h, tensors[p + f"mlp.{n}_proj.weight"]) for n in ("gate", "up"))
        x = x + F.linear(F.silu(gate) * up, tensors[p + "mlp.down_proj.weight"])
    head = tensors["model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"]
    return F.linear(rms(x, tensors["model.norm.weight"]), head)


@pytest.mark.parametrize("tied", [False, True])
def test_saved_file_has_hf_names_and_runs_as_hf_llama(tmp_path, tied):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    model = tiny(tie_embeddings=tied)
    with torch.no_grad():  # norms away from one, so that a misplaced weight shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_safetensors(tmp_path / "model.safetensors")
    tensors = load_file(tmp_path / "model.safetensors")
    layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    want = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    want |= {f"model.layers.{i}.{n}.weight" for i in range(4) for n in layer}
    assert set(tensors) == want
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 kv heads of 8
    assert tensors["model.layers.0.mlp.up_proj.weight"].shape == (96, 32)
    tokens, _ = batch(model.config, b=2, t=12)
    torch.testing.assert_close(model(tokens), _hf_forward(tensors, model.config, tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_load_into_a_model_and_into_meta_stages(tmp_path, tied):
    pytest.importorskip("safetensors")
    source = tiny(seed=3, tie_embeddings=tied)
    source.save_safetensors(tmp_path / "m.safetensors")
    tokens, _ = batch(source.config)
    want = source(tokens)
    loaded = tiny(seed=4, tie_embeddings=tied)
    loaded.load_safetensors(tmp_path / "m.safetensors")
    torch.testing.assert_close(loaded(tokens), want)
    # a meta model reads each stage's tensors as it materialises it; a directory of shards works too
    shards = tmp_path / "shards"
    shards.mkdir()
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "m.safetensors")
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, shards / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, shards / "model-00002-of-00002.safetensors")
    meta = tiny(seed=5, device="meta", tie_embeddings=tied)
    meta.load_safetensors(shards)
    stages = meta.build_stages(2, [0, 1])
    x = tokens
    for stage in stages.values():
        x = stage(x)
    torch.testing.assert_close(x, want)


def test_load_refuses_what_does_not_fit(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file

    tiny().save_safetensors(tmp_path / "untied.safetensors")
    tiny(tie_embeddings=True).save_safetensors(tmp_path / "tied.safetensors")
    with pytest.raises(PipeloomError, match=r"no tensor lm_head.weight \(a checkpoint with tied embeddings: use "
                                            r"tie_embeddings=True\)"):
        tiny().load_safetensors(tmp_path / "tied.safetensors")
    tiny(tie_embeddings=True).load_safetensors(tmp_path / "untied.safetensors")  # its lm_head ignored
    with pytest.raises(PipeloomError, match=r"holds model.layers.2.*no place for \(nor \d+ more\)"):
        tiny(n_layer=2).load_safetensors(tmp_path / "untied.safetensors")
    with pytest.raises(PipeloomError, match=r"self_attn.k_proj.weight in .* has shape \[16, 32\]; this model's is "
                                            r"\[32, 32\]"):
        tiny(n_kv_head=4).load_safetensors(tmp_path / "untied.safetensors")
    tensors = load_file(tmp_path / "untied.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "short.safetensors")
    with pytest.raises(PipeloomError, match=r"has no tensor model.norm.weight$"):
        tiny().load_safetensors(tmp_path / "short.safetensors")
    with pytest.raises(PipeloomError, match=r"is not a safetensors file"):
        tiny().load_safetensors(tmp_path / "none.safetensors")
    with pytest.raises(PipeloomError, match=r"on the meta device"):
        tiny(device="meta").save_safetensors(tmp_path / "x.safetensors")


# -- the model as the runtime uses it ---------------------------------------------------------------

def test_every_linear_layer_is_pipeloom_linear_and_defers_its_weight_grad():
    model = tiny()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, Linear) for m in linears) and len(linears) == 4 * 4 + 1
    assert not any(m.bias is not None for m in linears)
    tokens, targets = batch(model.config)
    _, want = unsplit_step(model, tokens, targets)
    model.zero_grad()
    store = WeightGradStore()
    with defer_weight_grads(store):
        model(tokens, targets).backward()
    assert len(store.work) == len(linears) and model.blocks[0].mlp.gate_up.weight.grad is None
    store.run()
    assert_same_grads(grads(model.named_parameters()), want)


@pytest.mark.parametrize("tied", [False, True])
def test_meta_stages_are_the_materialised_models(tied):
    full = tiny(tie_embeddings=tied)
    want = dict(full.named_parameters())
    for k in range(3):
        (stage,) = tiny(device="meta", tie_embeddings=tied).build_stages(3, [k]).values()
        for local, p in stage.named_parameters():
            assert torch.equal(p, want[stage.param_names[local]]), local
    for name, p in full.named_parameters():
        if ".ln_" in name or name.startswith("ln_f"):
            assert (p == 1).all(), name


def test_vocab_parallel_stages_leave_out_the_embedding_and_head():
    model = tiny()
    tokens, _ = batch(model.config)
    stages = model.split(2, vocab_parallel=True)
    names = {n for stage in stages for n, _ in stage.named_parameters()}
    assert "wte.weight" not in names and "lm_head.weight" not in names
    x = F.embedding(tokens, model.wte.weight)
    for stage in stages:
        x = stage(x)
    torch.testing.assert_close(F.linear(x, model.lm_head.weight), model(tokens))


@pytest.mark.parametrize("name", list(LLAMA_PRESETS))
def test_presets_match_the_simulators_parameter_count(name):
    config = LlamaConfig.preset(name)
    with torch.device("meta"):
        model = Llama(config)
    spec = MODELS[name]
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.mlp_width, spec.vocab, spec.tied_embeddings) == (
        config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.ffn_hidden, config.vocab_size,
        config.tie_embeddings)
    assert sum(p.numel() for p in model.parameters()) == spec.parameters(config.block_size)


def test_simulated_flops_are_the_layers_products():
    """The simulator's F, B and W of a layer against the matrix products torch counts in one
    (GQA's narrower k/v, SwiGLU's three matrices; attention's 4bs²h and 8bs²h on top)."""
    from torch.utils.flop_counter import FlopCounterMode

    from pipeloom.sim import layer_flops

    b, s = 2, 64
    config = LlamaConfig.preset("llama-tiny", n_kv_head=1, ffn_hidden=80)
    block = Llama(config).blocks[0]
    x = torch.randn(b, s, 32, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        y = block(x)
    with FlopCounterMode(display=False) as backward:
        y.sum().backward()
    f, bwd, w = layer_flops(dataclasses.replace(MODELS["llama-tiny"], kv_heads=1, ffn_hidden=80), s, b)
    attention = 4 * b * s * s * 32
    assert forward.get_total_flops() == f - attention == 2 * b * s * (2 * 32 * 32 + 2 * 32 * 8 + 3 * 32 * 80)
    assert backward.get_total_flops() == bwd - 2 * attention + w


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("vocab_parallel", [None, "vocab-1"])
def test_stage_sizes_are_the_simulators(tied, vocab_parallel):
    model = tiny(tie_embeddings=tied)
    counts = [sum(p.numel() for p in s.parameters()) for s in model.split(3, vocab_parallel=bool(vocab_parallel))]
    spec = dataclasses.replace(MODELS["llama-tiny"], tied_embeddings=tied)
    assert counts == stage_parameters(spec, 3, 256, vocab_parallel=vocab_parallel)


def test_presets_and_bad_configs():
    assert preset_config("llama-8b") == LlamaConfig.preset("llama-8b")
    assert LlamaConfig.preset("llama-1b").rope_theta == 500000.0 and LlamaConfig.preset("llama-tiny").rope_theta == 1e4
    assert LlamaConfig(n_layer=2, n_embd=4096, n_head=32, vocab_size=8, block_size=8).ffn_hidden == 11008  # Llama 2 7B
    with pytest.raises(PipeloomError, match=r"unknown Llama preset 'tiny' \(tiny is a gpt preset\); presets: llama-ti"):
        LlamaConfig.preset("tiny")
    with pytest.raises(PipeloomError, match=r"n_kv_head 3 does not divide n_head 4"):
        LlamaConfig.preset("llama-tiny", n_kv_head=3)
    with pytest.raises(PipeloomError, match=r"head size .* = 3 must be even"):
        LlamaConfig.preset("llama-tiny", n_embd=12)
    with pytest.raises(PipeloomError, match=r"257 tokens exceeds block_size 256"):
        tiny().split(2)[0](torch.zeros(1, 257, dtype=torch.long))


# -- the runtime against one process ------------------------------------------------------------------

def _cases(families, pp, microbatches, **options):
    return [(name, dict(schedule=name, pp=pp, microbatches=microbatches, **options)) for name in families]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_schedules_match_one_process(tied):
    cases = _cases(SYNCHRONOUS if not tied else ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v"], 2, 4)
    if not tied:
        cases += [(("1f1b", "cheap"), dict(schedule="1f1b", pp=2, microbatches=4, recompute="cheap")),
                  (("zb-h1", "full"), dict(schedule="zb-h1", pp=2, microbatches=4, recompute=True)),
                  (("zb-v", "offload"), dict(schedule="zb-v", pp=2, microbatches=4, offload="full"))]
    check(spawn(2, parity_worker, cases, {"tie_embeddings": tied}, 8, 16, "meta", None, "llama-tiny", timeout=240))


@pytest.mark.timeout(300)
def test_vocabulary_parallel_matches_one_process():
    """Vocabulary 203: shards of uneven real rows, with padding."""
    untied = [((family, algorithm), dict(schedule=family, pp=2, microbatches=4, vocab_parallel=algorithm))
              for family, algorithm in (("1f1b", "vocab-1"), ("zb-v", "vocab-2"))]
    check(spawn(2, parity_worker, untied, {"vocab_size": 203}, 8, 16, "meta", None, "llama-tiny", timeout=240))
    tied = [(("1f1b", "vocab-2"), dict(schedule="1f1b", pp=2, microbatches=4, vocab_parallel="vocab-2"))]
    check(spawn(2, parity_worker, tied, {"vocab_size": 203, "tie_embeddings": True}, 8, 16, None, None, "llama-tiny",
                timeout=240))


@pytest.mark.timeout(300)
def test_ring_attention_turns_by_global_positions():
    """Each of 2 sequence-parallel ranks holds an early and a late quarter of every sequence:
    the rotary positions must be the tokens' global ones for the gradients to match."""
    cases = [((family, attention), dict(schedule=family, pp=1, microbatches=2, sp=2, attention=attention))
             for family, attention in (("1f1b", "ring"), ("1f1b", "rsa"))]
    check(spawn(2, parity_worker, cases, {}, 4, 32, None, None, "llama-tiny", timeout=240))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipeloom_train_trains_llama_tiny(tmp_path):
    import json

    from launching import train_forked

    done = train_forked("--model", "llama-tiny", "--steps", "30", "--schedule", "zb-h1", "--metrics", "m.jsonl",
                        cwd=tmp_path, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "llama-tiny (66k parameters, vocabulary 256), zb-h1, pp=2" in done.stderr
    losses = [json.loads(line)["loss"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0


def test_cheap_recompute_rebuilds_the_norms_and_silu_and_keeps_no_unturned_queries():
    """The RMSNorms' and SiLU's outputs rebuilt in the backward: the same gradients, bit for bit,
    and exactly those outputs fewer bytes kept; v is kept on its own, not as a view of the q/k/v
    projection's output (which would keep the queries and keys from before their rotation)."""
    from pipeloom.nn.llama import LlamaBlock

    torch.manual_seed(0)
    block = LlamaBlock(LlamaConfig(n_layer=1, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=160, vocab_size=16,
                                   block_size=32))
    x = torch.randn(2, 32, 64)

    (kept, plain), (kept_cheap, rebuilt) = cheap_recompute_run(block, x)
    assert all(torch.equal(a, b) for a, b in zip(plain, rebuilt))
    assert kept - kept_cheap == 4 * 2 * 32 * (64 + 64 + 160)  # ln_1, ln_2 and SiLU outputs, fp32
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.untyped_storage().nbytes()) or t,
                                                  lambda t: t):
        block(x)
    assert 4 * 2 * 32 * (64 + 2 * 32) not in sizes  # no view of the q/k/v output is kept


def test_simulate_plans_llama_and_profile_checks_its_sizes(capsys):
    import json

    from pipeloom.cli import main

    assert main(["simulate", "--model", "llama-8b", "--pp", "4", "--microbatches", "8", "--seq", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] > 0
    assert main(["profile", "--model", "llama-tiny", "--heads", "3"]) == 2  # before measuring anything
    assert capsys.readouterr().err == ("pipeloom profile: error: model 'llama-tiny heads=3': hidden 32 is not "
                                       "divisible by heads 3\n")
