"""Heartbeats: a peer that is alive but busy is waited for; one that hangs or stalls is named."""

import contextlib
import io
import os
import re
import signal
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from parity import make_batch, reference, step_failure  # noqa: E402
from pipeloom.runtime import heartbeat  # noqa: E402
from pipeloom.runtime.local import spawn  # noqa: E402

TIMEOUT = 2.0  # the pipelines' timeout in these tests


def _pipeline():
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    return pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=4, timeout=TIMEOUT), config


def _before_call(module, do, call=1):
    """Make ``module``'s ``call``-th forward call (its first by default) call ``do()`` first."""
    forward, calls = module.forward, []

    def patched(x):
        calls.append(None)
        if len(calls) == call:
            do()
        return forward(x)
    module.forward = patched


def _busy_worker(rank):
    pipe, config = _pipeline()
    tokens, targets = make_batch(config, 8, 16)
    if rank == 0:
        _before_call(pipe.stages[0], lambda: time.sleep(2.5 * TIMEOUT))  # action 0F0 takes 5 s
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        loss = pipe.step(tokens, targets)
    return loss, reference(config, tokens, targets)[0], err.getvalue()


@pytest.mark.timeout(60)
def test_a_busy_peer_is_waited_for():
    results = spawn(2, _busy_worker, timeout=50)
    for loss, ref_loss, _ in results:
        assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss), (loss, ref_loss)
    err = results[1][2]  # rank 1 waited for 0F0's output, once a timeout or more
    assert re.fullmatch(r"(pipeloom: rank 1: action 1F0 waited for the activation of stage 0 microbatch 0 from "
                        r"rank 0 for \d+ s; rank 0 is alive and busy running action 0F0 \(for \d+ s\); "
                        r"still waiting\n)+", err), err


def _deadlock_worker(rank):
    import torch.distributed as dist

    side = dist.new_group([0, 1])  # rank 1 never sends on it
    pipe, config = _pipeline()
    if rank == 0:  # action 0F0 waits for a message that never comes
        work = dist.irecv(torch.zeros(1), 1, group=side)
        _before_call(pipe.stages[0], lambda: pipe.channel.wait(work, "a test waited for rank 1", side))
    return step_failure(pipe, config)


@pytest.mark.timeout(60)
def test_a_stalled_peer_is_named_with_what_it_waits_for():
    (message0, waited0), (message1, waited1) = spawn(2, _deadlock_worker, timeout=50)
    assert re.fullmatch(r"rank 0: a test waited for rank 1 for \d+ s; rank 1 is alive but stalled: action 1F0 "
                        r"waited for the activation of stage 0 microbatch 0 from rank 0 for \d+ s", message0), message0
    # both waits time out at about the same moment: rank 1 reads rank 0 still stalled, or just after it gave up
    assert re.fullmatch(r"rank 1: action 1F0 waited for the activation of stage 0 microbatch 0 from rank 0 for \d+ s; "
                        r"rank 0 is alive but (stalled: a test waited for rank 1 for \d+ s"
                        r"|not running a pipeline step \(for \d+ s\))", message1), message1
    assert max(waited0, waited1) < TIMEOUT + heartbeat.SILENT + 2


def _hung_worker(rank):
    import torch.distributed as dist

    from pipeloom.runtime import PeerTimeout

    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())
    pipe, config = _pipeline()
    if rank == 1:  # the whole process stops in action 1F0, its heartbeat too
        _before_call(pipe.stages[1], lambda: os.kill(os.getpid(), signal.SIGSTOP))
    start = time.monotonic()
    try:
        pipe.step(*make_batch(config, 8, 16))
    except (PeerTimeout, RuntimeError) as err:  # rank 1, woken, finds its link to rank 0 closed
        message, waited = str(err), time.monotonic() - start
    else:
        message, waited = "no error", 0.0
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return message, waited


@pytest.mark.timeout(60)
def test_a_hung_peer_is_named():
    (message, waited), _ = spawn(2, _hung_worker, timeout=50)
    assert re.fullmatch(r"rank 0: action 0B0 waited for the gradient of stage 1 microbatch 0 from rank 1 for \d+ s; "
                        r"rank 1 has not been heard from for 3 s: it died or hangs", message), message
    assert waited < TIMEOUT + heartbeat.SILENT + 2


def _closing_worker(rank):
    from pipeloom.runtime import p2p

    pipe, config = _pipeline()
    if rank == 1:  # in action 1F0 the link from rank 0 closes, as it does when rank 0's end dies
        _before_call(pipe.stages[1], lambda: p2p._close(pipe.channel.groups[(0, 1)]))
    else:  # action 0F1 runs after that, and its output is sent on the closed link
        _before_call(pipe.stages[0], lambda: time.sleep(1), call=2)
    return step_failure(pipe, config)


@pytest.mark.timeout(60)
def test_a_transfer_started_on_a_closed_link_names_its_action():
    (message0, _), (message1, _) = spawn(2, _closing_worker, timeout=50)
    assert re.fullmatch(r"rank 0: action 0SEND_F1 sent the activation of stage 0 microbatch 1 to rank 1, "
                        r"and it failed: .+", message0), message0
    assert re.fullmatch(r"rank 1: action 1RECV_F\d posted the receive of the activation of stage 0 microbatch \d "
                        r"from rank 0, and it failed: .+", message1), message1


class _Peers:
    """Fake peers beating into a HashStore: ``beats[rank]`` is what rank writes, None for silence."""

    def __init__(self, beats):
        self.store, self.beats, self.stop = torch.distributed.HashStore(), beats, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        count = 0
        while not self.stop.is_set():
            for rank, beat in self.beats.items():
                if beat is not None or count == 0:
                    self.store.set(heartbeat.PREFIX + str(rank), f"{count} {beat or 'busy 0 - starting'}")
            count += 1
            time.sleep(heartbeat.INTERVAL)


@pytest.mark.parametrize("beats, verdict", [
    ({1: "waiting 4 2 action 1F1 waited for rank 2", 2: "busy 3 - running action 2F0"},
     (False, "rank 2 is alive and busy running action 2F0 (for 3 s)")),
    ({1: "waiting 4 0 action 1F1 waited for rank 0"},
     (True, "rank 1 is alive but stalled: action 1F1 waited for rank 0 for 4 s")),
    ({1: "waiting 4 2 action 1F1 waited for rank 2", 2: None},
     (True, "rank 2 has not been heard from for 0.2 s: it died or hangs")),
    ({1: "waiting 0 0 action 1F1 waited for rank 0"},
     (False, "rank 1 is alive and has just moved on: action 1F1 waited for rank 0 for 0 s")),
    ({1: "idle 9 - outside a pipeline step"},
     (True, "rank 1 is alive but not running a pipeline step (for 9 s)")),
])
def test_diagnosis_follows_what_peers_wait_for(monkeypatch, beats, verdict):
    monkeypatch.setattr(heartbeat, "INTERVAL", 0.05)
    monkeypatch.setattr(heartbeat, "SILENT", 0.2)
    peers = _Peers(beats)
    beat = heartbeat.Heartbeat(peers.store, 0, close=None)
    try:
        time.sleep(0.1)
        assert beat.diagnose([0, 1], patience=1) == verdict
    finally:
        beat.stop()
        peers.stop.set()


def test_stop_waits_for_a_beat_inside_a_slow_store_operation(monkeypatch):
    """A beat thread still inside a store operation when Python finalizes aborts the process
    ("terminate called without an active exception"): stop() returns only once the threads ended."""
    entered = threading.Event()

    class SlowStore:
        def set(self, key, value):
            entered.set()
            time.sleep(2.5 * heartbeat.INTERVAL)  # longer than one beat's interval

    monkeypatch.setattr(heartbeat.dist, "is_initialized", lambda: True)  # beats run while a group exists
    beat = heartbeat.Heartbeat(SlowStore(), 0, lambda group: None)
    assert entered.wait(5)
    beat.stop()
    assert not any(thread.is_alive() for thread in beat.threads)
