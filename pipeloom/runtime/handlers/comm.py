"""Sends and receives between pipeline ranks: the kinds of :mod:`pipeloom.schedule.lower`.

A send takes what its stage handed on from the step's mail and starts sending
it (:meth:`~pipeloom.runtime.p2p.Channel.send`, non-blocking). A receive is
posted where the lowering pass put it (each link's receives in its send
order) and leaves in the mail a wait for its data, which the action that
consumes it calls. Neither is timed: the simulator does not draw them.
"""

from __future__ import annotations

from functools import partial

import torch

from ...schedule.lower import RECV_B, RECV_F, SEND_B, SEND_F, peer
from ..context import ACTIVATION, GRADIENT
from . import register


def _send(action, context) -> None:
    what = ACTIVATION if action.kind == SEND_F else GRADIENT
    tensor = context.step.mail.pop((what, action.stage, action.microbatch))
    context.channel.send(tensor, context.mesh.peers[peer(context.schedule, action)], action,
                         f"the {what} of stage {action.stage} microbatch {action.microbatch}")


def _post(action, context) -> None:
    s, i, step = action.stage, action.microbatch, context.step
    key = (ACTIVATION, s - 1, i) if action.kind == RECV_F else (GRADIENT, s + 1, i)
    # the output of stage s - 1 (RECV_F), or the gradient of stage s's own output (RECV_B)
    shape = context.boundary(s - 1 if action.kind == RECV_F else s, step.tokens[i])
    buffer = torch.empty(shape, dtype=context.dtype, device=context.device)
    context.channel.post(buffer, context.mesh.peers[peer(context.schedule, action)], action,
                         f"the {key[0]} of stage {key[1]} microbatch {i}")
    step.mail[key] = partial(context.channel.recv, action)


for _kind in (SEND_F, SEND_B):
    register(_kind, _send, timed=False)
for _kind in (RECV_F, RECV_B):
    register(_kind, _post, timed=False)
