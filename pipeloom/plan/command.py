"""A plan as the ``torchrun ... pipeloom train ...`` line that runs it, and back."""

from __future__ import annotations

import shlex

from .space import Candidate, PlanRequest

#: ``pipeloom train`` flags that carry a candidate's settings, by field.
FLAGS = {
    "schedule": "--schedule", "pp": "--pp", "dp": "--dp", "sp": "--sp", "chunks": "--chunks",
    "microbatches": "--microbatches", "microbatch_size": "--microbatch-size", "recompute": "--recompute",
    "vocab_parallel": "--vocab-parallel", "offload": "--offload",
}


def command(request: PlanRequest, c: Candidate) -> str:
    """The exact command line: torchrun with one process per GPU over the cluster's nodes, then
    ``pipeloom train`` with the model, sequence length and every setting of ``c`` (the data is the
    user's: add ``--data``)."""
    cluster = request.cluster
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    launch = ["torchrun", "--nnodes", str(cluster.nodes), "--nproc-per-node", str(per_node)]
    if cluster.nodes > 1:
        launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "$MASTER_ADDR:29500"]
    train = ["-m", "pipeloom", "train", "--model", request.model.name, "--seq", str(request.seq)]
    for name, flag in FLAGS.items():
        train += [flag, str(getattr(c, name))]
    if c.offload_ratio is not None:
        train += ["--offload-ratio", str(c.offload_ratio)]
    train += ["--device", "cpu" if cluster.device.name == "cpu" else "cuda"]
    return " ".join(launch + [shlex.quote(word) for word in train])


def candidate_of(args) -> Candidate:
    """The candidate a parsed ``pipeloom train`` command line runs."""
    return Candidate(**{name: getattr(args, name) for name in FLAGS})
