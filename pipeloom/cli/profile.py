"""``pipeloom profile``: measure a layer's, the embedding's and the output layer's costs on this machine."""

from __future__ import annotations

import dataclasses
import json
import sys

from ..errors import PipeloomError
from .output import wrote

#: The size flags' names in the models' configs.
CONFIG_NAMES = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size"}


def add_parser(sub) -> None:
    from ..presets import SIZES

    p = sub.add_parser(
        "profile",
        help="measure a layer's, the embedding's and the output layer's costs on this machine",
        description="Time one transformer layer (F, B and W split, and BW), the embedding and the output layer "
                    "with pipeloom's own modules on this machine (a CPU, or one GPU), count the activation bytes "
                    "they keep, time a stage-to-stage transfer, and write a JSON profile that simulate --profile "
                    "uses instead of the formulas.",
    )
    p.add_argument("--model", default="tiny", metavar="PRESET", help=f"model sizes: {', '.join(SIZES)} (default tiny)")
    for flag, what in (("--layers", "layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--vocab", "vocabulary size")):
        p.add_argument(flag, type=int, metavar="N", help=f"override the preset's {what}")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's block size, else 1024)")
    p.add_argument("--microbatch-sizes", default="1,2,4", metavar="B,B,...",
                   help="sequences per microbatch to measure (default 1,2,4); the simulator scales the others by FLOPs")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (default) or cuda (the current GPU)")
    p.add_argument("--precision", choices=("fp32", "bf16"),
                   help="fp32 (default on cpu) or bf16 autocast (default on cuda)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1, as each runtime worker uses)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs of each op; the median is kept (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    p.add_argument("--hardware", metavar="PRESET",
                   help="cost preset to compare the achieved FLOP rate with (default cpu on cpu, h100 on cuda)")
    p.add_argument("--out", metavar="FILE.json", help="write the profile here (for simulate --profile)")
    p.add_argument("--json", action="store_true", help="print the profile's JSON instead of the table")
    p.set_defaults(run=run)


def _progress(text: str) -> None:
    print(f"pipeloom profile: measuring {text}", file=sys.stderr, flush=True)


def run(args) -> int:
    """Check the inputs and --out, measure, write the profile and print it."""
    from ..paths import prepare_output
    from ..presets import SIZES
    from ..sim.specs import MODELS, get_device
    from ..spec import HARDWARE_OF

    if args.model not in SIZES:
        raise PipeloomError(f"--model {args.model!r}: choose one of {', '.join(SIZES)}")
    size = SIZES[args.model]
    overrides = {key: getattr(args, key) for key in ("layers", "hidden", "heads", "vocab")
                 if getattr(args, key) is not None}
    name = args.model + "".join(f" {key}={value}" for key, value in overrides.items())
    dataclasses.replace(MODELS[args.model], name=name, **overrides)  # a bad size stops here, in one line
    seq = args.seq if args.seq is not None else size.block_size or 1024
    batches = _microbatch_sizes(args.microbatch_sizes)
    preset = get_device(args.hardware or HARDWARE_OF[args.device])
    out = prepare_output("--out", args.out, (".json",)) if args.out else None
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeloomError("pipeloom profile needs PyTorch, which is not installed: pip install torch") from None
    from ..nn import preset_config
    from ..runtime.profile import measure
    from ..sim.profile import Profile

    config = preset_config(args.model, block_size=max(seq, size.block_size or 1),
                           **{CONFIG_NAMES[key]: value for key, value in overrides.items()})
    data = measure(config, seq, batches, device=args.device, precision=args.precision, repeats=args.repeats,
                   warmup=args.warmup, threads=args.threads, name=name, progress=_progress)
    profile = Profile.from_dict(data, str(out or ""))
    if out is not None:
        out.write_text(json.dumps(data, indent=2) + "\n")
        wrote(out)
    print(json.dumps(data, indent=2) if args.json else _profile_table(profile, preset))
    return 0


def _microbatch_sizes(text: str) -> list[int]:
    """--microbatch-sizes: positive integers, each once."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise PipeloomError(f"--microbatch-sizes {text!r}: give positive integers, each once, such as 1,2,4")
    return sizes


def _profile_table(profile, preset) -> str:
    """The profile as tables: per microbatch size, the layer's times, FLOP rates and bytes; the ends; the links."""
    from ..sim.formulas import layer_flops

    machine, model, seq = profile.machine, profile.model, profile.seq
    giga = machine["device"] == "cpu"
    unit, scale = ("GFLOP/s", 1e9) if giga else ("TFLOP/s", 1e12)
    rate = preset.peak_flops * preset.efficiency / scale
    lines = [
        f"{model.name}: hidden {model.hidden}, {model.heads} heads, vocab {model.vocab}; seq {seq}; "
        f"{machine['precision']} on {machine['name']}"
        + (f", {machine['threads']} thread{'s' if machine['threads'] != 1 else ''}" if giga else "")
        + f"; median of {profile.repeats}",
        "",
        f"one layer: times (ms), achieved {unit} ({preset.name} preset: {rate:.4g}), activation MiB kept "
        "(no recompute / cheap / B to W)",
        f"{'b':>4} {'F':>9} {'B':>9} {'W':>9} {'BW':>9}   {'F':>7} {'B':>7} {'W':>7}   {'none':>9} {'cheap':>9} "
        f"{'B to W':>9}",
    ]
    mib = 2**20
    for b, x in profile.samples.items():
        flops = layer_flops(model, seq, b)
        rates = [n / (1e-3 * ms) / scale for n, ms in zip(flops, (x.layer_f, x.layer_b, x.layer_w))]
        lines.append(f"{b:>4} {x.layer_f:>9.4g} {x.layer_b:>9.4g} {x.layer_w:>9.4g} {x.layer_bw:>9.4g}   "
                     + " ".join(f"{r:>7.4g}" for r in rates)
                     + f"   {x.layer_m_none / mib:>9.4g} {x.layer_m_cheap / mib:>9.4g} {x.layer_m_w / mib:>9.4g}")
    lines += ["", "embedding and output layer: times (ms), output layer's activation MiB (F to B / B to W)",
              f"{'b':>4} {'emb F':>9} {'emb B':>9} {'head F':>9} {'head B':>9} {'head W':>9}   {'F to B':>9} "
              f"{'B to W':>9}"]
    for b, x in profile.samples.items():
        lines.append(f"{b:>4} {x.embedding_f:>9.4g} {x.embedding_b:>9.4g} {x.head_f:>9.4g} {x.head_b:>9.4g} "
                     f"{x.head_w:>9.4g}   {x.head_m_b / mib:>9.4g} {x.head_m_w / mib:>9.4g}")
    if profile.link_bandwidth is not None:
        link = f"{profile.link_bandwidth / 1e9:.3g} GB/s, latency {profile.link_latency_ms:.3g} ms"
    else:
        link = f"not measured ({profile.link_reason}; simulate uses the device preset's)"
    host = f"{profile.host_bandwidth / 1e9:.3g} GB/s" if profile.host_bandwidth else "not measured (no device copies)"
    lines += ["", f"stage-to-stage transfer: {link}", f"host <-> device copies: {host}",
              f"model state: {profile.bytes_per_param:.4g} bytes per parameter"]
    if profile.optimizer_ns_per_param is not None:
        lines.append(f"optimizer step (clipping, AdamW): {profile.optimizer_ns_per_param:.3g} ns per parameter")
    if profile.kfac is not None:
        lines += ["", *_kfac_table(profile, preset)]
    return "\n".join(lines)


def _kfac_table(profile, preset) -> list[str]:
    """K-FAC's pieces on one layer, measured, beside what the formulas give on ``preset``."""
    from ..sim.formulas import kfac_costs, kfac_unit_weights

    kfac, model, seq = profile.kfac, profile.model, profile.seq
    lines = [f"K-FAC on one layer ({kfac['units']} linear layers): ms measured ({preset.name} preset's formulas)",
             f"{'b':>4} {'curvature A':>21} {'curvature G':>21}"]
    for b in profile.samples:
        formula = kfac_costs(model, seq, b, preset)
        lines.append(f"{b:>4} {kfac['a'][str(b)]:>9.4g} ({formula['kfac_a']:>9.4g}) "
                     f"{kfac['g'][str(b)]:>9.4g} ({formula['kfac_g']:>9.4g})")
    formula = kfac_costs(model, seq, 1, preset)
    lines.append(f"inverses {kfac['inv']:.4g} ({formula['kfac_inv']:.4g}), preconditioning {kfac['pre']:.4g} "
                 f"({formula['kfac_pre']:.4g}), every step")
    if "shares" in kfac:
        sized = kfac_unit_weights(model)
        lines.append("each linear layer's share, measured (by the formulas' sizes):")
        for key in ("a", "g", "inv"):
            units = len(kfac["shares"][key])
            lines.append(f"{key:>4} " + "  ".join(f"{x:6.1%} ({w / units:6.1%})" for x, w in
                                                 zip(kfac["shares"][key], sized[f"kfac_unit_{key}"])))
    return lines
