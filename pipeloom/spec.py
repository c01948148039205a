"""The run spec: one typed, frozen description of a run that ``simulate``, ``plan`` and ``train`` share.

A :class:`RunSpec` says everything that fixes a run's schedule, costs and
layout: the model and its sequences, the layout (pp, dp, sp, chunks), the
microbatches, the schedule family, each technique's settings, where the run
executes and where its costs come from. It is built once from the command
line (:mod:`pipeloom.cli.flags`), checked once (:meth:`RunSpec.check`: every
mistake that does not need the data, one line each) and read everywhere
after; it serialises to JSON and renders back as flags (:meth:`RunSpec.flags`).

:func:`pipeloom.builder.build_run` is the one way a run's schedule is made from
it. Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import PipeloomError, one_of, whole

#: Where a run executes (``--device``): the backend follows (gloo on cpu, NCCL on cuda).
DEVICES = ("cpu", "cuda")
#: The cost preset (``--hardware``) a run's costs come from when none is named, by device.
HARDWARE_OF = {"cpu": "cpu", "cuda": "h100"}
#: The precision of a run on each device when none is given: bf16 autocast on a GPU, fp32 on a CPU.
PRECISION_OF = {"cpu": "fp32", "cuda": "bf16"}
PRECISIONS = ("fp32", "bf16")


def device_of(hardware: str) -> str:
    """Where a run priced by the cost preset ``hardware`` trains: ``cpu`` for the cpu preset, else ``cuda``."""
    return "cpu" if hardware == "cpu" else "cuda"


@dataclass(frozen=True)
class RunSpec:
    """One run. ``model`` a preset name, or ``init_from`` a Hugging Face model directory whose
    config gives the model and whose weights it starts from (neither: the costs are ``costs``, per
    full stage, and nothing can train); ``vocab`` the model's vocabulary (None: the preset's); ``seq`` tokens
    per sequence; ``schedule`` a family name (or ``torch:CLASS``); ``pp``, ``dp``, ``sp``,
    ``chunks`` the layout; ``microbatches`` per step and replica of ``microbatch_size``
    sequences; ``schedule_steps`` steps per call of a family without a flush (2bw);
    ``memory_limit`` activations per rank in full stages' M_B (zb-auto searches under it);
    the techniques: ``recompute``, ``vocab_parallel``, ``offload`` (``offload_ratio`` for
    selective), ``attention`` of sequence parallelism, ``optimizer`` ("kfac": PipeFisher,
    ``kfac_every`` its refresh interval, ``kfac_damping``); ``options``, the settings of
    techniques from outside the package, as (name, value) pairs; ``device`` and ``precision``
    where and how it runs, ``compile`` whether each stage's blocks are compiled (torch.compile);
    its costs from ``profile`` (a ``pipeloom profile`` JSON), else the ``hardware`` preset
    (None: the device's, :data:`HARDWARE_OF`), its stage-to-stage and ring links at
    ``link_bandwidth`` GB/s (None: the preset's; the planner sets a cluster's)."""

    model: str | None = "tiny"
    init_from: str | None = None
    vocab: int | None = None
    seq: int = 128
    schedule: str = "1f1b"
    pp: int = 2
    dp: int = 1
    sp: int = 1
    chunks: int | None = None
    microbatches: int = 4
    microbatch_size: int = 8
    schedule_steps: int | None = None
    memory_limit: float | None = None
    recompute: str = "none"
    vocab_parallel: str = "none"
    offload: str = "none"
    offload_ratio: float | None = None
    attention: str | None = None
    optimizer: str = "adamw"
    kfac_every: int | None = None
    kfac_damping: float = 1e-3
    device: str = "cpu"
    precision: str | None = None
    compile: bool = False
    hardware: str | None = None
    link_bandwidth: float | None = None
    profile: str | None = None
    costs: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    # -- derived ---------------------------------------------------------
    @property
    def size(self):
        """The model's :class:`~pipeloom.presets.ModelSize`: the preset's, or the config of the
        ``init_from`` directory (:func:`pipeloom.hf.read_size`); None without a model."""
        if self.init_from is not None:
            from .hf import read_size

            return read_size(self.init_from)
        from .presets import SIZES

        return None if self.model is None else SIZES.get(self.model)

    @property
    def model_flag(self) -> str:
        """The flag that gives the model, as messages name it: ``--model NAME`` or ``--init-from DIR``."""
        return f"--model {self.model}" if self.init_from is None else f"--init-from {self.init_from}"

    @property
    def world(self) -> int:
        """Processes the run needs: dp x pp x sp."""
        return self.dp * self.pp * self.sp

    @property
    def vocab_mode(self) -> str | None:
        """``vocab_parallel`` as the schedule builder takes it (None for "none")."""
        return None if self.vocab_parallel == "none" else self.vocab_parallel

    @property
    def hardware_preset(self) -> str:
        """The cost preset: ``hardware``, else the device's."""
        return self.hardware or HARDWARE_OF[self.device]

    @property
    def training_precision(self) -> str:
        """The precision the run trains in: ``precision``, else the device's (:data:`PRECISION_OF`)."""
        return self.precision or PRECISION_OF[self.device]

    @property
    def costed_precision(self) -> str:
        """The precision the costs price: ``precision``, else that of a run on the cost preset's kind
        of device (the cpu preset's fp32, a GPU preset's bf16: ``--hardware a100`` prices an A100 run)."""
        return self.precision or PRECISION_OF[device_of(self.hardware_preset)]

    @property
    def family_chunks(self) -> int:
        """Stages per rank: ``chunks``, else the family's default."""
        from .schedule import get_family

        return self.chunks or get_family(self.schedule).default_chunks

    def uses(self, technique: str) -> bool:
        """Whether the run uses the registered technique named ``technique``."""
        from .techniques import TECHNIQUES

        return TECHNIQUES[technique].active(self)

    def option(self, name: str):
        """The setting ``name`` of a technique from outside the package (its flag's default if not given)."""
        given = dict(self.options)
        if name in given:
            return given[name]
        from .techniques import flags

        return next(flag.default for flag in flags() if flag.name == name)

    # -- checks ----------------------------------------------------------
    def check(self) -> RunSpec:
        """This spec, if every fact fits every other; else one line naming the bad value and what fits:
        the run's own facts, then each technique's (:meth:`~pipeloom.techniques.Technique.check`)."""
        from .schedule import get_family
        from .techniques import TECHNIQUES, flags

        for name in ("pp", "dp", "sp", "microbatches", "microbatch_size", "seq"):
            whole(name, getattr(self, name))
        for name in ("chunks", "vocab"):
            if getattr(self, name) is not None:
                whole(name, getattr(self, name))
        one_of("device", self.device, DEVICES)
        if self.precision is not None:
            one_of("precision", self.precision, PRECISIONS)
        for flag in flags():
            value = getattr(self, flag.name) if flag.name in _DEFAULTS else self.option(flag.name)
            if flag.choices is not None and value is not None:
                one_of(flag.name, value, flag.choices)
        if self.memory_limit is not None and not 0 < self.memory_limit < math.inf:
            raise PipeloomError(f"--memory-limit {self.memory_limit:g}: must be a positive number of M_B")
        if self.link_bandwidth is not None and not 0 < self.link_bandwidth < math.inf:
            raise PipeloomError(f"--link-bandwidth {self.link_bandwidth:g}: must be a positive number of GB/s")
        family = get_family(self.schedule)
        for technique in TECHNIQUES.values():
            technique.check(self)
        if self.model is not None and self.init_from is not None:
            raise PipeloomError(f"give either --model or --init-from (whose config.json gives the model), not both; "
                                f"got --model {self.model}")
        if self.model is None and self.init_from is None:
            return self._check_costs_only()
        if self.costs:
            raise PipeloomError("give either --costs or --model, not both")
        self._check_model(family)
        if self.hardware is not None:
            from .sim.specs import get_device

            get_device(self.hardware)
        return self

    def _check_costs_only(self) -> RunSpec:
        """Without a model: the flags that need one are refused."""
        for name, what in _MODEL_FACTS.items():
            if getattr(self, name) != _DEFAULTS[name]:
                flag = "--" + name.replace("_", "-")
                raise PipeloomError(f"{flag} sets {what} that --model derives costs for; give --model too")
        return self

    def _check_model(self, family) -> None:
        from .sim.specs import MODELS

        if self.init_from is None and self.model not in MODELS:
            raise PipeloomError(f"unknown --model {self.model!r}; presets: {', '.join(MODELS)}")
        if self.init_from is not None and self.vocab is not None:
            raise PipeloomError(f"--vocab {self.vocab}: the vocabulary of --init-from {self.init_from} is its "
                                "config.json's; leave --vocab out")
        size = self.size
        stages = self.pp * family.checked_chunks(self.chunks)
        if stages > size.layers:
            raise PipeloomError(f"{self.model_flag} has {size.layers} layers, too few for the {stages} stages of "
                                f"{self.schedule} at --pp {self.pp}; use a larger model or a smaller --pp")

    def check_seq_split(self) -> None:
        """Refuse a sequence that does not split into 2 x sp equal chunks (the runtime's layout of it)."""
        if self.seq % (2 * self.sp):
            raise PipeloomError(f"--seq {self.seq} does not split into 2 x --sp {self.sp} equal chunks (each "
                                f"sequence-parallel rank holds an early and a late one); use a multiple of "
                                f"{2 * self.sp}")

    def check_runnable(self) -> RunSpec:
        """:meth:`check`, and what the runtime cannot run yet (``pipeloom train`` refuses it)."""
        self.check()
        if self.size is None:
            raise PipeloomError("pipeloom train needs --model or --init-from")
        self.check_seq_split()  # the runtime splits every sequence in two, sp = 1 too
        if self.init_from is not None:
            from .hf import weight_files

            weight_files(self.init_from)
        block = self.size.block_size
        if block is not None and self.seq > block:
            raise PipeloomError(f"--seq {self.seq} is longer than the {block} positions {self.model_flag} "
                                f"learns; use --seq {block} or less")
        from .techniques import TECHNIQUES

        for technique in TECHNIQUES.values():
            technique.check_runnable(self)
        return self

    # -- serialisation ---------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> RunSpec:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PipeloomError(f"run spec: unknown field {unknown[0]!r}; fields: {', '.join(sorted(known))}")
        if "options" in data:
            data = {**data, "options": tuple(tuple(pair) for pair in data["options"])}
        return cls(**data)

    def flags(self) -> list[str]:
        """The command-line flags that give this spec (those that differ from the defaults)."""
        words = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != _DEFAULTS[f.name] and f.name not in ("costs", "options"):
                words += ["--" + f.name.replace("_", "-")] + ([] if isinstance(value, bool) else [str(value)])
        for name, value in self.options:
            words += ["--" + name.replace("_", "-"), str(value)]
        if self.costs:
            words += ["--costs", self.costs]
        return words

    def replace(self, **changes) -> RunSpec:
        return replace(self, **changes)


_DEFAULTS = {f.name: f.default for f in fields(RunSpec)}
#: The facts that only mean something with a model, and what they set.
_MODEL_FACTS = {"seq": "the sequence length", "microbatch_size": "the sequences per microbatch",
                "hardware": "the cost preset", "link_bandwidth": "the links' bandwidth", "vocab": "the vocabulary",
                "sp": "the sequence parallelism", "attention": "the sequence-parallel attention",
                "recompute": "the recomputation", "profile": "the measured costs"}
