"""The runtime against the one-process GPT: loss and every gradient, for every synchronous family."""

import os
import time

import pytest

torch = pytest.importorskip("torch")

from parity import (  # noqa: E402
    SYNCHRONOUS, autocast_reference, check, make_batch, max_rel_error, parity_worker, reference, stall_until,
    step_failure,
)
from pipeloom.runtime.local import spawn  # noqa: E402


def _cases(families, pp, dp, microbatches, **options):
    return [(name, dict(schedule=name, pp=pp, microbatches=microbatches, dp=dp, **options)) for name in families]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp,dp,tied", [(2, 1, False), (2, 1, True)])
def test_every_family_matches_one_process(pp, dp, tied):
    check(spawn(pp * dp, parity_worker, _cases(SYNCHRONOUS, pp, dp, 4), {"tie_embeddings": tied}, dp * 8, 16,
                timeout=240))


@pytest.mark.timeout(300)
def test_four_ranks_and_data_parallel():
    fit = [name for name in SYNCHRONOUS if name != "dualpipev"]  # dualpipev needs m >= 2p
    check(spawn(4, parity_worker, _cases(fit, 4, 1, 4), {"n_layer": 8}, 8, 16, timeout=240))
    check(spawn(4, parity_worker, _cases(["1f1b", "zb-v", "interleaved-1f1b"], 2, 2, 4), {"tie_embeddings": True},
                16, 16, timeout=240))


def _dualpipev_timeline(pipe):
    """The measured step's action names per rank, and the kinds of its transfers' producers."""
    from pipeloom.runtime.timeline import gather_timeline, measured_costs
    from pipeloom.sim.trace import transfers_of

    events = gather_timeline(pipe)
    costs = measured_costs(events, pipe.schedule)
    transfers = transfers_of(pipe.schedule, events, lambda producer: costs.comm[producer.stage])
    return [[str(e.action) for e in evs] for evs in events], sorted({t.producer.action.kind for t in transfers})


@pytest.mark.timeout(120)
def test_dualpipev_matches_one_process_and_records_its_pairs():
    """p = 2 with m = 6 (m = 4 runs with every family above), p = 3 with m = 6 and tied embeddings;
    the measured timeline holds each overlapped pair as one action, and its sends come from the halves."""
    from pipeloom.schedule import build

    results = spawn(2, parity_worker, _cases(["dualpipev"], 2, 1, 6), {}, 12, 16, None, _dualpipev_timeline,
                    timeout=90)
    check(results)
    names, producers = results[0]["dualpipev"][2]
    assert names == [[str(a) for a in actions] for actions in build("dualpipev", 2, 6).ranks]
    assert any("OVERLAP_F_B" in name for name in names[0]) and producers == ["B", "BW", "F"]
    check(spawn(3, parity_worker, _cases(["dualpipev"], 3, 1, 6), {"n_layer": 6, "tie_embeddings": True}, 6, 16,
                timeout=90))


@pytest.mark.timeout(120)
def test_recompute_matches():
    check(spawn(2, parity_worker, _cases(["1f1b", "zb-h1", "zb-v"], 2, 1, 4, recompute=True), {}, 8, 16, timeout=90))


def _dropout_worker(rank, families):
    """With dropout: a pp 1 pipeline, recomputing or not, against the model run a microbatch at a time
    from the same generator state (relative errors of loss and gradients), and the generator's next draw."""
    import pipeloom
    from pipeloom.nn import GPTConfig

    config = GPTConfig.preset("tiny", dropout=0.3)
    tokens, targets = make_batch(config, batch=4, seq=16)
    torch.manual_seed(0)
    model = config.build()
    torch.manual_seed(1)
    ref_loss = 0.0
    for i in range(4):
        loss = model(tokens[i:i + 1], targets[i:i + 1]) / 4
        loss.backward()
        ref_loss += loss.item()
    ref_grads, out = {n: p.grad for n, p in model.named_parameters()}, {"reference": (0.0, 0.0, torch.rand(1).item())}
    for family in families:
        for recompute in (False, True):
            torch.manual_seed(0)
            pipe = pipeloom.Pipeline(config.build(), family, pp=1, microbatches=4, recompute=recompute)
            torch.manual_seed(1)
            loss = pipe.step(tokens, targets)
            out[f"{family}, recompute {recompute}"] = (abs(loss - ref_loss) / ref_loss,
                                                       max_rel_error(pipe.gather_grads(), ref_grads),
                                                       torch.rand(1).item())
    return out


@pytest.mark.timeout(120)
def test_recompute_draws_the_same_dropout_masks():
    """The backward's forward runs again with the generators as F had them, then hands them back as
    they were: the same masks as the model's own run, and the same next draw."""
    (result,) = spawn(1, _dropout_worker, ["1f1b", "zb-h1"], timeout=90)
    check([{case: errors[:2] for case, errors in result.items()}])
    assert len({after for *_, after in result.values()}) == 1, result


def _training_worker(rank, name, pp, dp, steps):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", tie_embeddings=True)
    tokens, targets = make_batch(config, batch=8, seq=16)
    torch.manual_seed(0)
    ref = GPT(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(steps):
        loss = ref(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule=name, pp=pp, microbatches=4, dp=dp)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(tokens, targets))
        pipe.optimizer_step(opt, max_norm=0.5)
    return ref_losses, losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,pp,dp", [("zb-h1", 2, 1), ("zb-v", 2, 2)])
def test_training_steps_with_adamw_match(name, pp, dp):
    for ref_losses, losses in spawn(pp * dp, _training_worker, name, pp, dp, 5, timeout=240):
        assert ref_losses[-1] < ref_losses[0]  # it trains
        assert losses == pytest.approx(ref_losses, rel=1e-4)


def _two_bw_worker(rank, pp, dp, calls, steps, tied, vocab=None, options=None):
    """PipeDream-2BW against its definition on one process: W(1) = W(0) and
    W(t+1) = W(t) - update(grad f(W(t-1))), over several calls of several steps (with
    ``vocab``, the vocabulary shards too; ``options``: the pipeline's other options). SGD with
    momentum: AdamW would magnify the float noise of gradients that are zero in exact
    arithmetic (the key bias) into differences of a whole learning rate."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", tie_embeddings=tied, **({"vocab_size": 203} if vocab else {}))
    total, m = calls * steps, 4
    batches = [make_batch(config, batch=dp * m * 2, seq=16, seed=10 + t) for t in range(total)]
    torch.manual_seed(0)
    ref = GPT(config)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    ref_losses, pending = [], None
    for tokens, targets in batches:
        loss = ref(tokens, targets)
        loss.backward()
        ref_losses.append(loss.item())
        grads = {p: p.grad for p in ref.parameters()}
        ref.zero_grad(set_to_none=True)
        if pending:  # W(t+1) = W(t) - update(g(t-1))
            for p, g in pending.items():
                p.grad = g
            ref_opt.step()
            ref.zero_grad(set_to_none=True)
        pending = grads
    for p, g in pending.items():  # the pipeline applies the last step's gradient too
        p.grad = g
    ref_opt.step()

    torch.manual_seed(0)
    model = GPT(config)
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    pipe = pipeloom.Pipeline(model, schedule="2bw", pp=pp, microbatches=m, dp=dp, steps=steps, vocab_parallel=vocab,
                             **(options or {}))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for c in range(calls):
        group = batches[c * steps:(c + 1) * steps]
        losses += pipe.run_steps(torch.cat([b[0] for b in group]), torch.cat([b[1] for b in group]), opt)
    weights = pipe.gather_weights()  # the newest: every stage's and the vocabulary shards, whole
    expected = dict(ref.named_parameters())
    assert set(weights) == set(expected)
    error = max(((weights[n] - expected[n]).norm() / expected[n].norm()).item() for n in expected)
    return ref_losses, losses, error, moved


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp,dp,tied,vocab,options", [
    (2, 1, True, None, None), (2, 2, False, None, None), (4, 1, True, None, None), (2, 1, False, "vocab-1", None),
    (2, 1, True, "vocab-2", None), (2, 1, True, None, {"recompute": "cheap"}), (2, 1, False, None, {"recompute": True}),
    (2, 1, True, None, {"offload": "full"}), (2, 1, False, "vocab-2", {"offload": "selective", "offload_ratio": 0.5})],
    ids=["pp2-tied", "dp2", "pp4-tied", "vocab-1", "vocab-2-tied", "cheap", "full-recompute", "offload",
         "vocab-2-selective-offload"])
def test_two_bw_gives_its_delayed_update(pp, dp, tied, vocab, options):
    """Each backward sees its forward's weight version, the norms cheap recomputation rebuilds too,
    and activations offloaded to the host come back for it."""
    for ref_losses, losses, error, moved in spawn(pp * dp, _two_bw_worker, pp, dp, 2, 3, tied, vocab, options,
                                                  timeout=240):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert moved > 1e-2  # the updates changed the weights
        assert error < 1e-5


def _bad_input_worker(rank, cases):
    """Each case's error message (None where none came), by case, on one pair of ranks."""
    import pipeloom
    from pipeloom.errors import PipeloomError
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny", n_layer=3)
    make = {
        "world": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=3, microbatches=4),
        "layers": lambda: pipeloom.Pipeline(GPT(config), "zb-v", pp=2, microbatches=4),
        "microbatches": lambda: pipeloom.Pipeline(GPT(config), "interleaved-1f1b", pp=2, microbatches=9),
        "batch": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4).step(*make_batch(config, 6, 8)),
        "device": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, device="cuda"),
        "no device": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, device="tpu"),
        "schedule": lambda: pipeloom.Pipeline(GPT(config), 42, pp=2, microbatches=4),
        "autocast": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, autocast="bf16"),
        "timeout": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, timeout=0),
        "loss": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, loss_fn="ce"),
        "kfac alone": lambda: pipeloom.Pipeline(GPT(config), "1f1b", pp=2, microbatches=4, kfac={"every": 2}),
    }
    found = {}
    for case in cases:
        try:
            make[case]()
        except PipeloomError as err:
            found[case] = str(err)
        else:
            found[case] = None
    return found


BAD_INPUT = {
    "world": "world size 2 does not match dp=1 x pp=3 x sp=1 = 3",
    "layers": "3 layers cannot fill 4 stages",
    "microbatches": "microbatches=9 does not divide",
    "batch": "a batch of 6 sequences does not divide into dp=1 x microbatches=4",
    "device": "device cuda with the gloo backend, which sends cpu tensors only",
    "no device": "device='tpu' is no device: give e.g. 'cpu', 'cuda' or 'cuda:0'",
    "schedule": "schedule=42: give a family name (e.g. '1f1b') or a pipeloom.schedule.Schedule",
    "autocast": "autocast='bf16': give a torch dtype such as torch.bfloat16, or None",
    "timeout": "timeout=0: give the seconds a wait for a peer may take, a number > 0",
    "loss": "loss_fn='ce': give a function of (logits, targets)",
    "kfac alone": "kfac={'every': 2}: K-FAC's options go with optimizer='kfac'",
}


@pytest.fixture(scope="module")
def bad_input_errors():
    """Every case of :data:`BAD_INPUT` tried on one pair of ranks (one start-up for them all)."""
    return spawn(2, _bad_input_worker, list(BAD_INPUT), timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_stops_before_work(bad_input_errors, case):
    for errors in bad_input_errors:
        assert errors[case] is not None and BAD_INPUT[case] in errors[case], errors[case]


def _cuda_machine_worker(rank):
    """On a machine whose torch sees a GPU, a gloo pipeline still runs on the CPU."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=2)
    return str(pipe.device), pipe.step(*make_batch(config, 4, 8))


@pytest.mark.timeout(120)
def test_the_device_follows_the_backend_where_a_gpu_is_visible():
    (device, loss), (device1, loss1) = spawn(2, _cuda_machine_worker, timeout=90)
    assert device == device1 == "cpu" and loss == loss1 > 0


def _timeline_worker(rank, path):
    import json
    import warnings
    import weakref

    import pipeloom
    from pipeloom.errors import PipeloomError
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime.timeline import gather_timeline, measured_costs, write_trace
    from pipeloom.sim import simulate

    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="zb-h1", pp=2, microbatches=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a B that deferred no weight gradient warns
        pipe.step(*make_batch(config, 8, 16))
    events = gather_timeline(pipe)
    write_trace(pipe, path)
    costs = measured_costs(events, pipe.schedule)
    predicted = simulate(pipe.schedule, costs)
    doc = json.loads(open(path).read()) if rank == 0 else None
    channel = weakref.ref(pipe.channel)
    pipe.close()  # the run is over: what it held of torch.distributed is freed now, not at exit
    try:
        pipe.step(*make_batch(config, 8, 16))
    except PipeloomError as err:
        closed = str(err)
    return [[str(e.action) for e in evs] for evs in events], costs, predicted.makespan, doc, channel() is None, closed


@pytest.mark.timeout(120)
def test_measured_timeline_trace_and_costs(tmp_path):
    path = str(tmp_path / "measured.json")
    (names, costs, makespan, doc, freed, closed), (names1, *_, freed1, _) = spawn(2, _timeline_worker, path,
                                                                                 timeout=90)
    assert freed and freed1 and closed.startswith("the pipeline is closed")
    from pipeloom.schedule import build

    schedule = build("zb-h1", 2, 4)
    assert names == names1 == [[str(a) for a in actions] for actions in schedule.ranks]
    assert all(t > 0 for t in costs.f + costs.b + costs.w) and makespan > 0
    compute = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert sorted(e["name"] for e in compute) == sorted(str(a) for actions in schedule.ranks for a in actions)
    assert doc["otherData"]["source"] == "measured"
    assert any(e["ph"] == "s" for e in doc["traceEvents"])  # flow arrows for the transfers


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_torchrun_example_runs(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(root / "examples" / "pipeline.py"), "--steps", "3", "--trace", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]  # the workers' own lines come before torchrun's report
    assert "step   2  loss" in proc.stdout
    assert (tmp_path / "t.json").stat().st_size > 0


def _dead_peer_worker(rank, done):
    from pathlib import Path

    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    pipe = pipeloom.Pipeline(GPT(config), schedule="1f1b", pp=2, microbatches=4, timeout=3)
    if rank == 1:
        stall_until(done)  # stalls: never sends its gradients
        return None
    try:
        return step_failure(pipe, config)
    finally:
        Path(done).touch()


@pytest.mark.timeout(120)
def test_stalled_peer_is_named_within_the_timeout(tmp_path):
    (message, waited), _ = spawn(2, _dead_peer_worker, str(tmp_path / "rank 0 stopped"), timeout=60)
    assert "rank 0: action 0B0 waited for the gradient of stage 1 microbatch 0 from rank 1" in message
    assert waited < 3 + 5


def _autocast_worker(rank):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = autocast_reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule="zb-v", pp=2, microbatches=4, autocast=torch.bfloat16)
    loss = pipe.step(tokens, targets)
    grads = pipe.gather_grads()
    fp32 = reference(config, tokens, targets)[0]
    return loss, ref_loss, fp32, max_rel_error(grads, ref_grads)


@pytest.mark.timeout(120)
def test_bf16_autocast_tracks_the_one_process_autocast_model():
    for loss, ref_loss, fp32_loss, grad_err in spawn(2, _autocast_worker, timeout=90):
        assert loss != fp32_loss  # bf16 really ran
        assert loss == pytest.approx(ref_loss, rel=2e-2)
        assert grad_err < 5e-2


@pytest.mark.parametrize("device,backend,gpus,local_ranks,message", [
    ("cpu", "nccl", 1, 1, "device cpu with the nccl backend, which sends cuda tensors only"),
    ("cuda", "nccl", 0, 1, "device cuda: torch sees no CUDA device on this machine"),
    (None, "nccl", 1, 2, "device cuda: 2 ranks on this machine but 1 GPU visible; NCCL needs one GPU per rank"),
    ("cuda:1", "nccl", 1, 1, "2 ranks on this machine but 1 GPU visible"),
])
def test_a_device_the_backend_cannot_serve_is_refused(monkeypatch, device, backend, gpus, local_ranks, message):
    from pipeloom.errors import PipeloomError
    from pipeloom.runtime.device import pipeline_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(PipeloomError, match=message):
        pipeline_device(device, backend)
    assert str(pipeline_device(None, "gloo")) == "cpu"


def _exits_at_once(rank, dies):
    if rank == dies:
        os._exit(3)  # as a worker killed by a signal, or one whose start-up failed, goes
    time.sleep(0.2)
    return rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dies", [0, 1])
def test_a_worker_that_dies_is_named_at_once_not_after_the_timeout(dies):
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"worker {dies} exited with code 3 before it returned"):
        spawn(2, _exits_at_once, dies, timeout=50)
    assert time.monotonic() - began < 20


def test_a_send_is_let_go_once_a_message_from_its_peer_proves_it_received():
    """On gloo a send never reports complete before it is waited for: the channel lets it go once a
    message arrives that its peer sent after the action consuming it (their positions in the lowered
    lists: :func:`~pipeloom.schedule.lower.proofs`), which 1F1B's first stage gets with each gradient."""
    from types import SimpleNamespace

    from pipeloom.runtime.p2p import Channel
    from pipeloom.schedule import build, lower
    from pipeloom.schedule.ir import Action
    from pipeloom.schedule.lower import RECV_B, SEND_F, proofs

    class Work:
        def __init__(self):
            self.waited = False

        def is_completed(self):
            return False  # gloo's, until waited for

        def wait(self, timeout=None):
            self.waited = True
            return True

    schedule = lower(build("1f1b", 2, 4))
    consumers, producers = proofs(schedule, 0)
    # rank 1, the last stage, runs F(1, 0), B(1, 0) and sends its gradient, then F(1, 1)...: that
    # gradient proves microbatch 0's activations received, not microbatch 1's
    sends = [Action(SEND_F, 0, i) for i in range(4)]
    assert all(consumers[send][0] == 1 for send in sends)
    channel = Channel.__new__(Channel)
    channel.pending, channel.posted, channel.timeout, channel.watched = [], {}, 60.0, False
    channel.rank, channel.groups, channel.proofs = 0, {(1, 0): None}, (consumers, producers)
    channel.heartbeat = SimpleNamespace(now=None, waiting=lambda *a: None, why_ended=lambda state: None)
    works = [Work() for _ in sends]
    for send, work in zip(sends[:2], works):  # rank 0's warm-up: F0, F1 sent
        channel.send_work(work, torch.zeros(1), None, consumers[send])
    gradient = Action(RECV_B, 0, 0)
    channel.posted[gradient] = (torch.zeros(1), 1, Work(), "the gradient")
    channel.recv(gradient, None)  # sent by rank 1 after its F(1, 0) (position before its SEND_B(1, 0))
    assert [w.waited for w in works[:2]] == [True, False]
    assert [e[0] for e in channel.pending] == [works[1]]
    channel.proofs = None  # a list not lowered as is (K-FAC's): only flush lets go
    channel.send_work(works[2], torch.zeros(1), None)
    channel.flush()
    assert channel.pending == [] and works[2].waited


def test_a_send_is_let_go_once_it_reports_complete_not_at_the_end_of_the_step():
    """The channel holds each sent tensor while its send is in flight: the oldest sends that report
    complete (NCCL's, once their kernel ran) are waited for and dropped as the next one is posted;
    one still in flight, and every one after it, stays until flush."""
    from types import SimpleNamespace

    from pipeloom.runtime.p2p import Channel

    class Send:
        def __init__(self, done):
            self.done, self.waited = done, False

        def is_completed(self):
            return self.done

        def wait(self, timeout=None):
            self.waited = True
            return True

    channel = Channel.__new__(Channel)
    channel.pending, channel.timeout, channel.watched = [], 60.0, False
    channel.heartbeat = SimpleNamespace(now=None, waiting=lambda *a: None, why_ended=lambda state: None)
    sends = [Send(True), Send(True), Send(False), Send(True)]
    for send in sends:
        channel.send_work(send, torch.zeros(1), None)
    assert [entry[0] for entry in channel.pending] == sends[2:]  # the first two let go, in order
    assert [send.waited for send in sends] == [True, True, False, False]
    sends[2].done = True
    channel.send_work(Send(False), torch.zeros(1), None)
    assert len(channel.pending) == 1 and all(send.waited for send in sends)
    channel.flush()
    assert channel.pending == []
