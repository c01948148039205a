"""The flags of a run, one definition for every command that takes them, and the run spec they make.

``simulate`` and ``train`` take every flag here with the same meaning and
default (``--model`` aside: simulate without one times ``--costs``): the run's
own, then each technique's (:mod:`pipeloom.techniques`). :func:`spec_of` reads
them once into a :class:`~pipeloom.spec.RunSpec`; the argparse namespace goes
no further than the command that parsed it.
"""

from __future__ import annotations

from dataclasses import fields

from ..spec import DEVICES, PRECISIONS, RunSpec
from ..techniques import flags as technique_flags


def add_run_flags(p, *, model_default: str | None, lists: bool = False) -> None:
    """Add the run's flags to parser ``p``. ``model_default``: the model without ``--model`` or
    ``--init-from`` (None: no model, costs given); ``lists``: the compared technique flags read comma lists
    (``simulate``). Each flag's default is :class:`~pipeloom.spec.RunSpec`'s (argparse's None: not given)."""
    from ..presets import SIZES
    from ..schedule import FAMILIES
    from ..sim.specs import DEVICES as HARDWARE

    g = p.add_argument_group("the run: model, layout, schedule, where it runs (the same in simulate and train)")
    g.add_argument("--model", metavar="PRESET",
                   help=f"model preset: {', '.join(SIZES)}"
                        + (f" (default {model_default}, unless --init-from)" if model_default else
                           " (default: none; the costs come from --costs)"))
    g.add_argument("--init-from", metavar="DIR",
                   help="instead of --model: a Hugging Face Llama or GPT-2 directory (config.json, model.safetensors "
                        "or its shards' index, tokenizer.json if any); its config gives the model, its weights the "
                        "start")
    p.set_defaults(model_default=model_default)
    g.add_argument("--vocab", type=int, metavar="V",
                   help="the model's vocabulary (default: the preset's; train grows it to the data's if that is larger)")
    g.add_argument("--seq", type=int, help="tokens per sequence (default: a --profile's, else 128)")
    g.add_argument("--schedule", metavar="NAME",
                   help=f"one of: {', '.join(FAMILIES)} (default 1f1b); or torch:CLASS, torch:FILE.csv: the order of "
                        "a torch.distributed.pipelining schedule")
    g.add_argument("--pp", type=int, help="pipeline ranks (default 2)")
    g.add_argument("--dp", type=int, help="data-parallel replicas (default 1; under torchrun: world size / (pp x sp))")
    g.add_argument("--chunks", type=int, help="stages per rank (interleaved-1f1b: >= 2, default 2; V schedules: 2)")
    g.add_argument("--microbatches", type=int, help="microbatches per step and replica (default 4)")
    g.add_argument("--microbatch-size", type=int, help="sequences per microbatch (default 8)")
    g.add_argument("--memory-limit", type=float, metavar="X",
                   help="activation memory limit per rank in units of a full stage's M_B (zb-auto searches under it; "
                        "other schedules are checked against it)")
    g.add_argument("--device", choices=DEVICES,
                   help="where the run executes: cpu (gloo) or cuda (NCCL); default cpu")
    g.add_argument("--precision", choices=PRECISIONS, help="bf16 autocast (default on cuda) or fp32 (default on cpu)")
    g.add_argument("--hardware", metavar="PRESET",
                   help=f"the cost preset of the formulas: {', '.join(HARDWARE)} (default: cpu on --device cpu, h100 "
                        "on cuda; a profile's device with --profile)")
    g.add_argument("--link-bandwidth", type=float, metavar="GB/s",
                   help="the stage-to-stage and sequence-parallel links' bandwidth in the costs (default: the "
                        "--hardware preset's; pipeloom plan sets its cluster's)")
    g.add_argument("--profile", metavar="FILE.json",
                   help="take the layers' and ends' times, activation bytes and the stage-to-stage transfer from this "
                        "profile (pipeloom profile) instead of the formulas; --seq defaults to the profile's")
    g = p.add_argument_group("techniques (each from pipeloom.techniques; plug-ins add theirs here)")
    for flag in technique_flags():
        flag.add(g, lists=lists)


def spec_of(args, **changes) -> RunSpec:
    """The run spec the parsed flags give (``changes`` applied first, e.g. one ``vocab_parallel``
    of a comma list), checked. A ``--profile`` gives ``--seq`` and ``--hardware`` their defaults."""
    values = {name: getattr(args, name) for name in _CORE}
    options = []
    for flag in technique_flags():
        value = getattr(args, flag.name)
        if flag.name in _FIELDS:
            values[flag.name] = value
        elif value is not None:
            options.append((flag.name, value))
    values.update(changes)
    if values["model"] is None and values["init_from"] is None:
        values["model"] = args.model_default
    modelled = values["model"] is not None or values["init_from"] is not None
    if values["profile"] is not None and modelled and None in (values["seq"], values["hardware"]):
        from ..sim.profile import load_profile

        profile = load_profile(values["profile"])
        if values["seq"] is None:
            values["seq"] = profile.seq
        if values["hardware"] is None:
            values["hardware"] = "h100" if profile.machine["device"] == "cuda" else "cpu"
    given = {k: v for k, v in values.items() if v is not None or k in _NULLABLE}
    return RunSpec(**given, options=tuple(options)).check()


#: The spec's fields; the core flags set those that no technique's flag does (``costs`` is simulate's own).
_FIELDS = {f.name for f in fields(RunSpec)}
_CORE = ("model", "init_from", "vocab", "seq", "schedule", "pp", "dp", "chunks", "microbatches", "microbatch_size",
         "memory_limit", "device", "precision", "hardware", "link_bandwidth", "profile")
#: Fields whose None is a value of its own (no model: costs given, or the model of --init-from).
_NULLABLE = ("model",)
