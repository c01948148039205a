"""Hugging Face model directories: a Llama's or a GPT-2's ``config.json`` as pipeloom's model
sizes, its weight files and tokenizer, and the ``config.json`` of a model pipeloom writes.

A directory ``pipeloom train --init-from`` reads holds ``config.json`` (``model_type``
llama or gpt2), the weights as ``model.safetensors`` or as the shards that
``model.safetensors.index.json`` lists, and ``tokenizer.json`` when it has one.
:func:`read_size` gives the :class:`~pipeloom.presets.ModelSize` of its config, or
one line naming what is missing or unsupported; the weights are read by
:meth:`pipeloom.nn.Decoder.load_safetensors`, each tensor when the stage that holds
it is built. :func:`config_json` is the ``config.json`` of a model ``--save-hf``
writes (transformers' ``LlamaForCausalLM`` or ``GPT2LMHeadModel``). Pure Python:
nothing here imports torch."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .errors import PipeloomError
from .presets import ModelSize

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
#: The tokenizer's settings besides tokenizer.json that transformers reads, copied into an exported directory.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")
#: The rotary scalings pipeloom's Llama runs (None: plain rotary positions).
ROPE_TYPES = (None, "default", "llama3")
#: transformers' defaults for the fields a config.json may leave out, by model type.
_DEFAULTS = {"llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                       "rope_theta": 10000.0, "hidden_act": "silu"},
             "gpt2": {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                      "activation_function": "gelu_new"}}
#: The model types pipeloom reads: Llama-family models and GPT-2.
MODEL_TYPES = tuple(_DEFAULTS)


def read_config(directory: str | Path, flag: str = "--init-from") -> dict:
    """The ``config.json`` of the model directory ``directory``, checked to be one pipeloom reads
    (``flag``: how messages name the directory)."""
    path = Path(directory)
    if not path.is_dir():
        raise PipeloomError(f"{flag} {directory}: no such directory (give a Hugging Face model directory "
                            f"holding {CONFIG})")
    file = path / CONFIG
    if not file.is_file():
        raise PipeloomError(f"{flag} {directory}: no {CONFIG} there (a Hugging Face model directory holds "
                            f"{CONFIG} and {WEIGHTS})")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise PipeloomError(f"{flag} {directory}: {CONFIG} is not JSON ({err})") from None
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        raise PipeloomError(f"{flag} {directory}: model_type {kind!r} is not supported; pipeloom reads "
                            "Llama-family models (model_type llama) and GPT-2 (model_type gpt2)")
    return config


def read_size(directory: str | Path, flag: str = "--init-from") -> ModelSize:
    """The sizes of the model in ``directory`` (see :func:`read_config`), read once per version of its config."""
    file = Path(directory) / CONFIG
    stamp = (file.stat().st_mtime_ns, file.stat().st_size) if file.is_file() else None
    return _size(str(directory), flag, stamp)


@lru_cache(maxsize=None)
def _size(directory: str, flag: str, _stamp) -> ModelSize:
    config = read_config(directory, flag)
    kind = config["model_type"]
    return _SIZES[kind]({**_DEFAULTS[kind], **config}, f"{flag} {directory}: {CONFIG}")


def _llama_size(config: dict, where: str) -> ModelSize:
    _whole(config, ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"),
           where)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    _runs(config, where, "Llama", hidden_act="silu", attention_bias=False, mlp_bias=False, head_dim=hidden // heads)
    theta, scaling = _rope(config, where)
    return ModelSize(config["num_hidden_layers"], hidden, heads, config["vocab_size"],
                     tied=bool(config["tie_word_embeddings"]), block_size=config["max_position_embeddings"],
                     family="llama", kv_heads=config.get("num_key_value_heads") or heads,
                     ffn_hidden=config["intermediate_size"], rope_theta=float(theta), rope_scaling=scaling,
                     norm_eps=float(config["rms_norm_eps"]))


def _gpt2_size(config: dict, where: str) -> ModelSize:
    _whole(config, ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"), where)
    if config["activation_function"] == "gelu_pytorch_tanh":  # the same function as gelu_new
        config = {**config, "activation_function": "gelu_new"}
    _runs(config, where, "GPT", activation_function="gelu_new", layer_norm_epsilon=1e-5, n_inner=4 * config["n_embd"],
          scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)
    return ModelSize(config["n_layer"], config["n_embd"], config["n_head"], config["vocab_size"],
                     tied=bool(config["tie_word_embeddings"]), block_size=config["n_positions"])


def _whole(config: dict, keys, where: str) -> None:
    """Refuse a config without every one of ``keys`` a whole number."""
    missing = [k for k in keys if not isinstance(config.get(k), int)]
    if missing:
        raise PipeloomError(f"{where} gives no whole number {missing[0]}" +
                            (f" (nor {', '.join(missing[1:])})" if missing[1:] else ""))


def _runs(config: dict, where: str, model: str, **fits) -> None:
    """Refuse a config whose field is set (not None) to another value than ``fits`` gives."""
    for field, fit in fits.items():
        value = config.get(field)
        if value is not None and value != fit:
            raise PipeloomError(f"{where} has {field} {value!r}, which pipeloom's {model} does not run; it runs "
                                f"{field} {fit!r}")


def _rope(config: dict, where: str) -> tuple[float, tuple | None]:
    """(rotary base, Llama 3.1's scaling as (factor, low, high, original context) or None) of a config:
    transformers 5's ``rope_parameters``, or the older ``rope_theta`` and ``rope_scaling``."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config["rope_theta"])
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in ROPE_TYPES:
        raise PipeloomError(f"{where} has rotary scaling {kind!r}, which pipeloom's Llama does not run; it runs "
                            "plain rotary positions and llama3's scaling")
    if kind != "llama3":
        return theta, None
    try:
        return theta, (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                       int(rope["original_max_position_embeddings"]))
    except KeyError as err:
        raise PipeloomError(f"{where}: its llama3 rotary scaling gives no {err.args[0]}") from None


_SIZES = {"llama": _llama_size, "gpt2": _gpt2_size}


def weight_files(directory: str | Path, flag: str = "--init-from") -> list[Path]:
    """The safetensors files of the model in ``directory``: the shards its index lists, or its one file."""
    path = Path(directory)
    index = path / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, UnicodeDecodeError):
            raise PipeloomError(f"{flag} {directory}: {INDEX} holds no weight_map of tensor names to "
                                "files") from None
        files = [path / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PipeloomError(f"{flag} {directory}: {INDEX} names {absent[0]}, which is not there"
                                + (f" (nor {len(absent) - 1} more)" if len(absent) > 1 else ""))
        return files
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    bins = " (its pytorch_model.bin weights: convert them to safetensors)" if any(path.glob("*.bin")) else ""
    raise PipeloomError(f"{flag} {directory}: no {WEIGHTS} nor {INDEX} there{bins}")


def tokenizer_file(directory: str | Path) -> str | None:
    """The ``tokenizer.json`` of the model in ``directory``, if it has one."""
    file = Path(directory) / TOKENIZER
    return str(file) if file.is_file() else None


def config_json(family: str, config, template: dict | None = None) -> dict:
    """The ``config.json`` of a transformers model with the sizes of ``config``, float32 weights:
    a ``LlamaForCausalLM`` of a :class:`~pipeloom.nn.LlamaConfig` (``family`` "llama"), a
    ``GPT2LMHeadModel`` of a :class:`~pipeloom.nn.GPTConfig` ("gpt"). ``template``, the config
    of the directory the model came from, gives the rest (token ids, ...)."""
    out = {key: value for key, value in (template or {}).items() if key not in ("rope_scaling", "rope_parameters")}
    out.update(_llama_json(config) if family == "llama" else _gpt2_json(config), dtype="float32",
               torch_dtype="float32", tie_word_embeddings=config.tie_embeddings, vocab_size=config.vocab_size)
    return out


def _llama_json(config) -> dict:
    """A Llama's sizes; its rotary settings both as transformers 5 reads them (``rope_parameters``)
    and as earlier versions do."""
    rope = {"rope_type": "default"}
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original}
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=config.n_layer,
                hidden_size=config.n_embd, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
                head_dim=config.n_embd // config.n_head, intermediate_size=config.ffn_hidden,
                max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                rope_parameters={**rope, "rope_theta": config.rope_theta}, hidden_act="silu", attention_bias=False,
                mlp_bias=False, **({"rope_scaling": rope} if config.rope_scaling is not None else {}))


def _gpt2_json(config) -> dict:
    return dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=config.n_layer, n_embd=config.n_embd,
                n_head=config.n_head, n_positions=config.block_size, n_ctx=config.block_size, n_inner=None,
                activation_function="gelu_new", layer_norm_epsilon=1e-5, resid_pdrop=config.dropout,
                embd_pdrop=config.dropout, attn_pdrop=config.dropout, scale_attn_weights=True,
                scale_attn_by_inverse_layer_idx=False)
