"""A plan as a run spec, and as the ``torchrun ... pipeloom train ...`` line that runs it, and back."""

from __future__ import annotations

import shlex

from ..presets import SIZES
from ..spec import RunSpec
from .space import SETTINGS, Candidate, PlanRequest, hooked

#: The candidate's fields, each a run spec's field of the same name (printed in this order): its
#: layout, then the techniques' axes.
FIELDS = ("schedule", "pp", "dp", "sp", "chunks", "microbatches", "microbatch_size", *SETTINGS)


def run_spec(request: PlanRequest, c: Candidate, steps: int | None = None) -> RunSpec:
    """The run spec of ``c`` on the request's cluster: the run ``pipeloom train`` makes of the plan's
    command, with the costs the planner priced it with (the cluster's links for its layout, the
    profile if any); ``steps`` steps a call for a family without a flush (None: the family's)."""
    model, cluster = request.model, request.cluster
    preset = SIZES.get(model.name)
    link = cluster.device_for(c.pp, c.dp, c.sp).link_bandwidth
    derived = {name: value for t in hooked("plan_fields") for name, value in t.plan_fields(request, c).items()}
    return RunSpec(
        model=model.name, vocab=None if preset is not None and preset.vocab == model.vocab else model.vocab,
        seq=request.seq, **{name: getattr(c, name) for name in FIELDS}, **derived,
        schedule_steps=steps, device=cluster.runtime_device,
        hardware=cluster.device.name, link_bandwidth=None if link == cluster.device.link_bandwidth else link / 1e9,
        profile=request.profile.source if request.profile is not None else None, options=c.options)


def command(request: PlanRequest, c: Candidate) -> str:
    """The exact command line: torchrun with one process per GPU over the cluster's nodes, then
    ``pipeloom train`` with every setting of ``c``'s run spec (the data is the user's: add ``--data``)."""
    cluster = request.cluster
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    launch = ["torchrun", "--nnodes", str(cluster.nodes), "--nproc-per-node", str(per_node)]
    if cluster.nodes > 1:
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500"]
    spec = run_spec(request, c)
    train = ["-m", "pipeloom", "train", "--model", spec.model, "--seq", str(spec.seq)]
    for name in FIELDS:  # every layout setting, defaults too: the line says the whole layout
        train += ["--" + name.replace("_", "-"), str(getattr(spec, name))]
    shown = {"--" + name.replace("_", "-") for name in ("model", "seq", *FIELDS)}
    flags = spec.flags()
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag not in shown:
            train += [flag, value]
    return " ".join(launch + [shlex.quote(word) for word in train])


def candidate_of(spec: RunSpec) -> Candidate:
    """The candidate a run spec (a parsed ``pipeloom train`` command line) runs."""
    return Candidate(**{name: getattr(spec, name) for name in FIELDS if name != "chunks"}, chunks=spec.family_chunks,
                     options=spec.options)
