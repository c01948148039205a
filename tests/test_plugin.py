"""A technique from outside the package: a new action kind with its own runtime handler."""

import pytest

torch = pytest.importorskip("torch")

from parity import make_batch, max_rel_error, reference  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402


def _noop_schedule():
    """1F1B on 2 ranks, 4 microbatches, with a NOOP(s, i) after every F(s, i)."""
    from dataclasses import replace

    from pipeloom.schedule import F, Action, build

    schedule = build("1f1b", 2, 4)
    ranks = tuple(tuple(b for a in actions for b in ((a, Action("NOOP", a.stage, a.microbatch)) if a.kind == F
                                                      else (a,)))
                  for actions in schedule.ranks)
    return replace(schedule, ranks=ranks)


def _noop_worker(rank):
    import pipeloom
    import pipeloom.runtime.pipeline
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime import handlers

    calls = []

    @handlers.register("NOOP")
    def noop(action, context):
        assert action.stage in context.stages and context.step.slots[action.stage, action.microbatch].output is not None
        calls.append(action.microbatch)

    # TODO(lead): register the kind on the schedule side once pipeloom.schedule.kinds is on main, e.g.
    #   kinds.register(kinds.Kind("NOOP", "no-op", needs=lambda a, deps: (Action(F, a.stage, a.microbatch),)))
    # and drop this stand-in: today's validator knows only the built-in kinds.
    pipeloom.runtime.pipeline.validate = lambda schedule: schedule

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), _noop_schedule())
    loss = pipe.step(tokens, targets)
    forwards = [a.microbatch for a in pipe.schedule.ranks[pipe.pp_rank] if a.kind == "F"]
    return abs(loss - ref_loss) / ref_loss, max_rel_error(pipe.gather_grads(), ref_grads), calls, forwards


@pytest.mark.timeout(120)
def test_a_handler_registered_from_outside_runs_its_kind():
    for loss_err, grad_err, calls, forwards in spawn(2, _noop_worker, timeout=90):
        assert loss_err < 1e-5 and grad_err < 1e-4, (loss_err, grad_err)
        assert calls == forwards == [0, 1, 2, 3]


def test_a_kind_without_a_handler_is_named():
    from pipeloom.errors import PipeloomError
    from pipeloom.runtime.executor import Executor
    from pipeloom.schedule import Action

    with pytest.raises(PipeloomError, match=r"action 0UNKNOWN1: no runtime handler for kind 'UNKNOWN'; "
                                            r"registered kinds: B, BW, .*, F, .*, W, Z \(add one with "):
        Executor(None, [Action("F", 0, 1), Action("UNKNOWN", 0, 1)])
