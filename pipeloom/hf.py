"""Hugging Face model directories: a Llama's ``config.json`` as pipeloom's model sizes, its weight
files and tokenizer, and the ``config.json`` of a model pipeloom writes.

A directory ``pipeloom train --init-from`` reads holds ``config.json`` (``model_type``
llama), the weights as ``model.safetensors`` or as the shards that
``model.safetensors.index.json`` lists, and ``tokenizer.json`` when it has one.
:func:`read_size` gives the :class:`~pipeloom.presets.ModelSize` of its config, or
one line naming what is missing or unsupported; the weights are read by
:meth:`pipeloom.nn.Llama.load_safetensors`, each tensor when the stage that holds
it is built. :func:`config_json` is the ``config.json`` of a model ``--save-hf``
writes (transformers' ``LlamaForCausalLM``). Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .errors import PipeloomError
from .presets import ModelSize

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
#: The tokenizer's settings besides tokenizer.json that transformers reads, copied into an exported directory.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json")
#: The model types pipeloom reads, and the rotary scalings it runs (None: plain rotary positions).
MODEL_TYPES, ROPE_TYPES = ("llama",), (None, "default", "llama3")
#: transformers' defaults for the fields a Llama config.json may leave out.
_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
             "rope_theta": 10000.0, "hidden_act": "silu"}


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
                            f"Llama-family models (model_type {', '.join(MODEL_TYPES)})")
    return config


def read_size(directory: str | Path, flag: str = "--init-from") -> ModelSize:
    """The sizes of the Llama model in ``directory`` (see :func:`read_config`), read once per version of its config."""
    file = Path(directory) / CONFIG
    stamp = (file.stat().st_mtime_ns, file.stat().st_size) if file.is_file() else None
    return _size(str(directory), flag, stamp)


@lru_cache(maxsize=None)
def _size(directory: str, flag: str, _stamp) -> ModelSize:
    config = {**_DEFAULTS, **read_config(directory, flag)}
    where = f"{flag} {directory}: {CONFIG}"
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(config.get(k), int)]
    if missing:
        raise PipeloomError(f"{where} gives no whole number {missing[0]}" +
                            (f" (nor {', '.join(missing[1:])})" if missing[1:] else ""))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    unsupported = {"hidden_act": (config["hidden_act"], "silu"),
                   "attention_bias": (config.get("attention_bias"), False),
                   "mlp_bias": (config.get("mlp_bias"), False),
                   "head_dim": (config.get("head_dim"), hidden // heads)}
    for field, (value, fits) in unsupported.items():
        if value not in (None, fits):
            raise PipeloomError(f"{where} has {field} {value!r}, which pipeloom's Llama does not run; it runs "
                                f"{field} {fits!r}")
    theta, scaling = _rope(config, where)
    return ModelSize(config["num_hidden_layers"], hidden, heads, config["vocab_size"],
                     tied=bool(config["tie_word_embeddings"]), block_size=config["max_position_embeddings"],
                     family="llama", kv_heads=config.get("num_key_value_heads") or heads,
                     ffn_hidden=config["intermediate_size"], rope_theta=float(theta), rope_scaling=scaling,
                     norm_eps=float(config["rms_norm_eps"]))


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


def config_json(config, template: dict | None = None) -> dict:
    """The ``config.json`` of a transformers ``LlamaForCausalLM`` with the sizes of ``config`` (a
    :class:`~pipeloom.nn.LlamaConfig`), float32 weights; ``template``, the config of the directory
    the model came from, gives the rest (token ids, ...). The rotary settings are written both as
    transformers 5 reads them (``rope_parameters``) and as earlier versions do."""
    rope = {"rope_type": "default"}
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original}
    out = {key: value for key, value in (template or {}).items() if key not in ("rope_scaling", "rope_parameters")}
    out.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=config.n_layer,
               hidden_size=config.n_embd, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
               head_dim=config.n_embd // config.n_head, intermediate_size=config.ffn_hidden,
               vocab_size=config.vocab_size, max_position_embeddings=config.block_size,
               rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings, rope_theta=config.rope_theta,
               rope_parameters={**rope, "rope_theta": config.rope_theta}, hidden_act="silu", attention_bias=False,
               mlp_bias=False, dtype="float32", torch_dtype="float32")
    if config.rope_scaling is not None:
        out["rope_scaling"] = rope
    return out
