"""``pipeloom generate``: sample text from a model ``pipeloom train`` trained, on one process.

The model comes from a checkpoint (``--checkpoint``: a ``step_*`` directory,
or a ``--checkpoint-dir`` whose latest is taken), loaded without a process
group (:func:`pipeloom.runtime.checkpoint.load_weights`), from the weights
``train --save`` wrote (``--weights FILE.safetensors``), or from a Hugging Face
Llama directory (``--hf DIR``: ``train --save-hf``'s, or any, with its
``tokenizer.json``). Either carries the
run's metadata (model preset, vocabulary, context length, tokenizer): a
checkpoint in its ``pipeloom.json`` (and a BPE run's ``tokenizer.json``
beside it), a weights file in its safetensors metadata. The prompt is encoded
with the run's tokenizer (bytes or BPE; ``--tokenizer FILE.json`` for a run
on a token file), and ``--max-new-tokens`` tokens are sampled one at a time,
from the last ``block_size`` tokens, at ``--temperature`` (0: the most likely
token) among the ``--top-k`` most likely, from a generator seeded by ``--seed``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .errors import PipeloomError

#: safetensors metadata keys of a weights file ``pipeloom train --save`` writes.
META_KEY, TOKENIZER_KEY = "pipeloom", "tokenizer.json"


def run(args) -> int:
    """The command: load, encode, sample, print."""
    check(args)
    import torch

    from .data import BYTE_VOCAB, TextCodec

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PipeloomError("--device cuda: no GPU is visible to torch here; use --device cpu")
    model, meta, tokenizer, source = load(args, device)
    codec = TextCodec.by_bpe(tokenizer) if tokenizer else TextCodec.by_bytes()
    prompt = codec.encode(args.prompt)
    vocab = meta["vocab_size"]
    if not prompt:
        raise PipeloomError(f"--prompt {args.prompt!r} encodes to no token; give some text")
    if max(prompt) >= vocab:
        raise PipeloomError(f"--prompt encodes to token {max(prompt)}, outside this model's vocabulary of {vocab}: "
                            f"the tokenizer ({codec.name}) is not the run's")
    decodable = BYTE_VOCAB if codec.name == "bytes" else None  # a bytes run's model may have more tokens
    tokens = sample(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed, decodable)
    if args.json:
        new = list(tokens)
        print(json.dumps({"model": meta["model"], "source": source, "step": meta.get("step"), "prompt": args.prompt,
                          "prompt_tokens": prompt, "tokens": new, "text": codec.decode(new)}))
        return 0
    print(f"pipeloom generate: {meta['model']} from {source} (step {meta.get('step')}), {args.max_new_tokens} new "
          f"tokens at temperature {args.temperature:g}, top-k {args.top_k or 'all'}", file=sys.stderr, flush=True)
    print(args.prompt, end="", flush=True)
    new, shown = [], ""
    for token in tokens:  # each token as it is drawn; a character split over tokens once it is whole
        new.append(token)
        text = codec.decode(new)
        if not text.endswith("\ufffd"):
            print(text[len(shown):], end="", flush=True)
            shown = text
    print(codec.decode(new)[len(shown):])
    return 0


def check(args) -> None:
    """The arguments' mistakes, in one line."""
    if not args.prompt:
        raise PipeloomError("--prompt is empty: give some text to continue")
    for flag, path in (("--checkpoint", args.checkpoint), ("--weights", args.weights), ("--hf", args.hf),
                       ("--tokenizer", args.tokenizer)):
        if path == "":
            raise PipeloomError(f"{flag} is empty: give the path of what it names")
    if args.max_new_tokens < 1:
        raise PipeloomError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):  # nan too
        raise PipeloomError(f"--temperature {args.temperature:g}: use 0 (the most likely token) or a finite number above")
    if args.top_k is not None and args.top_k < 1:
        raise PipeloomError(f"--top-k must be at least 1, got {args.top_k}")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise PipeloomError(f"--tokenizer {args.tokenizer}: no such file (give a tokenizers tokenizer.json)")


def load(args, device):
    """(the model on ``device``, in eval mode, with the trained weights; the run's metadata;
    its BPE tokenizer's JSON, or None for bytes; where they came from)."""
    if args.checkpoint is not None:
        model, meta, tokenizer, source = _from_checkpoint(args.checkpoint, device)
    elif args.hf is not None:
        model, meta, tokenizer, source = _from_hf(args.hf, device)
    else:
        model, meta, tokenizer, source = _from_weights(args.weights, device)
    if args.tokenizer is not None:
        from .data import read_tokenizer

        tokenizer = read_tokenizer(args.tokenizer, "--tokenizer").to_str()
    elif tokenizer is None and meta.get("tokenizer", "bytes") is None:
        raise PipeloomError(f"{source} holds no tokenizer pipeloom knows (a run on a token file's ids, or a Hugging "
                            "Face directory without tokenizer.json): give it with --tokenizer FILE.json")
    model_name = meta.get("model") or (meta.get("spec") or {}).get("init_from")  # an --init-from run: its directory
    return model.eval(), {**meta, "model": model_name}, tokenizer, source


def _model(meta: dict, where: str, device):
    """The run's model on ``device`` (its weights to be loaded): its preset (or its --init-from
    directory's config), vocabulary and context length from ``meta``."""
    from .hf import read_size
    from .nn.models import size_config
    from .presets import SIZES

    name, init_from = meta.get("model"), (meta.get("spec") or {}).get("init_from")
    size = SIZES.get(name) if init_from is None else read_size(init_from, f"{where}: the run's --init-from")
    if size is None or not isinstance(meta.get("vocab_size"), int):
        raise PipeloomError(f"{where}: it holds model {name!r} with vocabulary {meta.get('vocab_size')!r}, which this "
                            f"pipeloom cannot build; presets: {', '.join(SIZES)}")
    positions = {} if size.block_size else {"block_size": meta.get("seq")}
    return size_config(size, vocab_size=meta["vocab_size"], **positions).build(device=device)


def _from_checkpoint(path: str, device):
    from .runtime import checkpoint

    directory = Path(path)
    if not (directory / checkpoint.META).is_file():
        found = checkpoint.latest(directory) if directory.is_dir() else None
        if found is None:
            what = "no such directory" if not directory.exists() else "no complete pipeloom checkpoint there"
            raise PipeloomError(f"--checkpoint {path}: {what} (a step_* directory holding {checkpoint.META}, or "
                                "the --checkpoint-dir of a run)")
        directory = found
    meta = checkpoint.read_meta(directory)
    where = f"--checkpoint {directory}"
    model = _model(meta, where, device)
    checkpoint.load_weights(directory, model, f"with --model {meta.get('model')}, vocabulary {meta.get('vocab_size')}",
                            "--checkpoint")
    tokenizer = None
    if meta.get("tokenizer") == "bpe":
        file = directory / TOKENIZER_KEY
        if not file.is_file():
            raise PipeloomError(f"{where}: the run tokenized by BPE, but its {TOKENIZER_KEY} is missing; give it "
                                "with --tokenizer FILE.json")
        tokenizer = file.read_text()
    return model, meta, tokenizer, str(directory)


def _from_weights(path: str, device):
    try:
        from safetensors import safe_open
    except ImportError:
        raise PipeloomError("--weights needs the safetensors package: pip install safetensors") from None
    file = Path(path)
    if not file.is_file():
        raise PipeloomError(f"--weights {path}: no such file")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            extra = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 -- safetensors' errors on a damaged file
        raise PipeloomError(f"--weights {path}: not a readable safetensors file ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if META_KEY not in extra:
        raise PipeloomError(f"--weights {path}: it holds no pipeloom metadata (pipeloom train --save writes it): "
                            "the model it belongs to is unknown")
    meta = json.loads(extra[META_KEY])
    model = _model(meta, f"--weights {path}", device)
    load_tensors(model, tensors, f"--weights {path}")
    return model, meta, extra.get(TOKENIZER_KEY), str(file)


def _from_hf(path: str, device):
    """A Hugging Face directory (``train --save-hf``'s, or any): the model of its config.json
    with its weights; its tokenizer.json, else (a byte-level pipeloom run) bytes."""
    from . import hf
    from .nn import from_hf

    size = hf.read_size(path, "--hf")
    files = hf.weight_files(path, "--hf")
    model = from_hf(path, device)  # without safetensors: the pip line
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt", device="cpu") as f:
        extra = f.metadata() or {}
    run = json.loads(extra[META_KEY]) if META_KEY in extra else {"tokenizer": None}  # not pipeloom's: no bytes
    meta = {**run, "model": run.get("model") or path, "vocab_size": size.vocab}
    tokenizer = hf.tokenizer_file(path)
    return model, meta, Path(tokenizer).read_text() if tokenizer else None, path


def load_tensors(model, tensors: dict, where: str) -> None:
    """Copy ``tensors`` (unsplit names, a tied weight once) into ``model``'s parameters;
    a missing weight or one of another shape is refused in one line."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            value = tensors.get(name)
            if value is None:
                raise PipeloomError(f"{where}: it holds no weight {name}, which the model has")
            if tuple(value.shape) != tuple(p.shape):
                raise PipeloomError(f"{where}: {name} is {list(value.shape)} there but {list(p.shape)} in the model")
            p.copy_(value)


def sample(model, prompt: list[int], count: int, temperature: float, top_k: int | None, seed: int,
           vocab: int | None = None):
    """``count`` tokens after ``prompt`` from ``model`` (``model(ids)`` gives logits [1, T, V];
    ``model.config.block_size`` the longest context: a longer text is seen through its last
    ``block_size`` tokens), each drawn from the softmax of the last logits over ``temperature``
    among the ``top_k`` largest (temperature 0: the largest), of the first ``vocab`` tokens only
    if given (those the tokenizer can decode); yielded as each is drawn."""
    import torch

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], device=device)
    block = model.config.block_size
    with torch.no_grad():
        for _ in range(count):
            logits = model(ids[:, -block:])[0, -1, :vocab].float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    floor = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < floor, float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
            yield token
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], 1)
