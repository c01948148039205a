"""Compiled stages: ``Pipeline(compile=True)`` compiles each stage's blocks with ``torch.compile``.

Regional compilation, as torchtitan does it: each transformer block of
pipeloom's models (a stage's ``blocks``) is compiled on its own, in place
(``nn.Module.compile``: names, parameters and checkpoints stay the same), and
the blocks of one model share one compiled graph; the embeddings, the final
norm, the LM head and the loss stay eager. Your own stages
(``Pipeline.from_stages``) are each compiled whole.

The B/W split holds: in a compiled graph pipeloom's linear layer's backward is
an operator of its own (:mod:`pipeloom.nn.linear`) that queues the
weight-gradient work in the store of B, as the eager layer's does; W runs it.
That work holds the output gradient and the input of each layer past the end
of the compiled backward, so inductor must not write into their buffers:
:data:`OPTIONS` turns its buffer reuse off (the caching allocator still
reuses freed memory). Recomputation composes: full recomputation reruns the
compiled forward; under cheap recomputation the compiled graph chooses what it
recomputes itself (its partitioner rematerialises the norms and activation
functions), while the eager ends still mark theirs. Offload's
``saved_tensors_hooks`` see what each compiled block saves.
"""

from __future__ import annotations

from torch import nn

from ..errors import PipeloomError
from ..nn.stages import Stage
from .parts import Part

#: Inductor's options for a stage's blocks: no buffer of the backward reused or updated in place (the
#: deferred weight-gradient work still reads the output gradients and inputs it was given).
OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}


def regions(stage: nn.Module) -> list[nn.Module]:
    """What is compiled of ``stage``: its blocks (pipeloom's models), or your own stage's module whole."""
    if isinstance(stage, Stage):
        return [stage.module]
    return list(stage.blocks.values())


class CompilePart(Part):
    """Compiled stages in a pipeline: ``compile`` (True or False, default False) compiles each of
    this rank's stages' :func:`regions` with ``torch.compile`` (:data:`OPTIONS`), once every other
    technique has set its stages up. Refused in one line: sequence parallelism (ring attention's
    collectives inside a block), weight versions (each microbatch's stage runs with the weights of
    its step as tensors, a new graph's inputs), and forward hooks on the layers (K-FAC's capture)."""

    keywords = {"compile": False}

    def check(self) -> None:
        if not isinstance(self.given["compile"], bool):
            raise PipeloomError(f"compile={self.given['compile']!r}: give True or False")

    def setup(self, pipe, model) -> None:
        if not self.given["compile"]:
            return
        if pipe.sp > 1:
            raise PipeloomError(f"compile=True with sp={pipe.sp}: ring attention's collectives run inside the blocks; "
                                "use sp=1 or compile=False")
        if pipe.context.versions is not None:
            raise PipeloomError(f"compile=True with {pipe.schedule.family}: its weight versions run each stage on "
                                "a step's weights as tensors; use a synchronous schedule or compile=False")
        modules = [region for stage in pipe.stages.values() for region in regions(stage)]
        hooked = next((name for region in modules for name, m in region.named_modules()
                       if isinstance(m, nn.Linear) and (m._forward_hooks or m._forward_pre_hooks)), None)
        if hooked is not None:
            raise PipeloomError(f"compile=True with forward hooks on linear layer {hooked} (K-FAC's capture): "
                                "use compile=False")
        for region in modules:
            region.compile(options=OPTIONS)
