"""What only a CUDA device can show: the B/W split with autograd's device thread,
a one-rank NCCL pipeline against the one-process model (also compiled, and with
offload's two copy streams, F's and B's copies both), event-timed actions and the
vocabulary head in bf16. Skipped where
torch sees no GPU (CI never has one).
"""

import os
import warnings

import pytest
import torch

from parity import make_batch, max_rel_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def fp32_matmuls():
    """Exact fp32 products (no TF32), so that parity is to float tolerance."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture
def nccl_world_of_one():
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = "0"
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _reference(config, tokens, targets, autocast=None):
    from pipeloom.nn import GPT

    torch.manual_seed(0)
    model = GPT(config).cuda()
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        loss = model(tokens.cuda(), targets.cuda())
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_weight_gradients_wait_for_w_on_cuda(fp32_matmuls):
    """CUDA backwards run on autograd's device thread: the deferral must still catch them."""
    from pipeloom.nn import GPTConfig, WeightGradStore, defer_weight_grads
    from pipeloom.nn.gpt import Block

    config = GPTConfig.preset("tiny")
    torch.manual_seed(0)
    block = Block(config).cuda()
    x = torch.randn(4, 16, config.n_embd, device="cuda", requires_grad=True)
    block(x).square().sum().backward()
    fused = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    x.grad = None

    store = WeightGradStore()
    with defer_weight_grads(store):
        block(x).square().sum().backward()
    linear_weights = [n for n in fused if n.endswith("weight") and fused[n].dim() == 2]
    assert linear_weights and all(dict(block.named_parameters())[n].grad is None for n in linear_weights)
    store.run()
    for n, p in block.named_parameters():
        assert torch.allclose(p.grad, fused[n], rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("family", ["1f1b", "zb-h1", "zb-v", "gpipe"])
def test_pipeline_on_one_gpu_matches_the_model(family, fp32_matmuls, nccl_world_of_one):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = _reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), family, pp=1, microbatches=4)
    assert pipe.device.type == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a B that deferred no weight gradient warns
        loss = pipe.step(tokens, targets)
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
    assert max_rel_error(pipe.gather_grads(), {n: g.cpu() for n, g in ref_grads.items()}) < 1e-4


@pytest.mark.parametrize("policy", [("full", None), ("selective", 0.5)])
def test_offload_on_one_gpu_matches_the_model_step_after_step(policy, fp32_matmuls, nccl_world_of_one):
    """Offloads on one stream, reloads on another: the second step's offloads write into host buffers
    the first step's reloads read, and must wait for them; every step's loss and gradients are the
    model's."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime.timeline import gather_timeline
    from pipeloom.schedule import Costs

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 64)
    ref_loss, ref_grads = _reference(config, tokens, targets)
    torch.manual_seed(0)
    costs = Costs(f=1, b=2, w=1, m_b=1, extra={"offload": 0.3})  # every pair's copies fit its gap
    pipe = pipeloom.Pipeline(GPT(config), "gpipe", pp=1, microbatches=8, offload=policy[0], offload_ratio=policy[1],
                             costs=costs)
    for _ in range(3):
        pipe.zero_grad()
        loss = pipe.step(tokens, targets)
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
        assert max_rel_error(pipe.gather_grads(), {n: g.cpu() for n, g in ref_grads.items()}) < 1e-4
    assert pipe.offload_stats()["offloaded"] > 0
    # the copies are timed on their own streams: an offload from after its F's end to its last copy's
    (events,) = gather_timeline(pipe)
    ends = {(e.action.stage, e.action.microbatch): e.end for e in events if e.action.kind == "F"}
    copies = [e for e in events if e.action.kind in ("OFFLOAD", "RELOAD")]
    assert copies and all(e.end > e.start for e in copies)
    assert all(e.start >= ends[e.action.stage, e.action.microbatch] for e in copies if e.action.kind == "OFFLOAD")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["1f1b", "zb-h1"])
def test_compiled_pipeline_on_one_gpu_matches_the_model(family, fp32_matmuls, nccl_world_of_one):
    """Inductor's CUDA kernels (Triton) in each block, the split kept: a B that deferred nothing warns."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = _reference(config, tokens, targets)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), family, pp=1, microbatches=4, compile=True)
    assert all(block._compiled_call_impl is not None for stage in pipe.stages.values()
               for block in stage.blocks.values())
    for _ in range(2):  # the second step runs the compiled graphs without tracing
        pipe.zero_grad()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "rank 0: B of stage")  # dynamo's own tracing warns too
            loss = pipe.step(tokens, targets)
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
        assert max_rel_error(pipe.gather_grads(), {n: g.cpu() for n, g in ref_grads.items()}) < 1e-4


def test_what_b_keeps_for_w_offloaded_on_one_gpu(fp32_matmuls, nccl_world_of_one):
    """zb-v (two chunks on the one rank) with B's queued tensors copied to host after B and back before
    W (OFFLOAD_W, RELOAD_W) on the copy streams, beside F's copies, with cheap recomputation: every
    step's loss and gradients are the model's."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.schedule import OFFLOAD_W, Costs, Offload, build

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 64)
    ref_loss, ref_grads = _reference(config, tokens, targets)
    schedule = build("zb-v", 1, 4, transforms=[Offload("full")], costs=Costs(m_b=1, m_w=1.5, extra={"offload": 0.1}))
    assert any(a.kind == OFFLOAD_W for actions in schedule.ranks for a in actions)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), schedule, recompute="cheap")
    for _ in range(2):
        pipe.zero_grad()
        loss = pipe.step(tokens, targets)
        assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
        assert max_rel_error(pipe.gather_grads(), {n: g.cpu() for n, g in ref_grads.items()}) < 1e-4
    stats = pipe.offload_stats()
    assert stats["offloaded"] > 0 and stats["host"] == 0


def test_bf16_pipeline_and_event_timeline(nccl_world_of_one):
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig
    from pipeloom.runtime.timeline import gather_timeline

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    ref_loss, ref_grads = _reference(config, tokens, targets, autocast=torch.bfloat16)
    torch.manual_seed(0)
    pipe = pipeloom.Pipeline(GPT(config), "zb-h1", pp=1, microbatches=4, autocast=torch.bfloat16)
    loss = pipe.step(tokens, targets)
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-2
    assert max_rel_error(pipe.gather_grads(), {n: g.cpu() for n, g in ref_grads.items()}) < 5e-2
    (events,) = gather_timeline(pipe)
    kinds = {e.action.kind for e in events}
    assert {"F", "B", "W"} <= kinds
    # event times: every action takes GPU time, and W (a dozen GEMMs) is not a bare launch
    assert all(e.end > e.start for e in events)
    starts = [e.start for e in events]
    assert starts == sorted(starts)


def test_kfac_products_in_tf32_under_bf16(fp32_matmuls, nccl_world_of_one):
    """A bf16 pipeline's K-FAC takes its products in TF32, an fp32 one's in fp32, and torch's setting
    is as it was after each step; the bf16 run's loss is the fp32 run's within bf16's tolerance."""
    import pipeloom
    from pipeloom.nn import GPT, GPTConfig

    config = GPTConfig.preset("tiny")
    tokens, targets = make_batch(config, 8, 16)
    losses = {}
    for autocast in (None, torch.bfloat16):
        torch.manual_seed(0)
        pipe = pipeloom.Pipeline(GPT(config), "1f1b", pp=1, microbatches=4, autocast=autocast, optimizer="kfac",
                                 kfac={"every": 1})
        assert pipe.context.extras["kfac"].kfac.tf32 == (autocast is not None)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for _ in range(3):
            losses.setdefault(autocast, []).append(pipe.step(tokens, targets))
            pipe.optimizer_step(opt)
            assert torch.backends.cuda.matmul.allow_tf32 is False
    assert all(abs(a - b) / abs(a) < 2e-2 for a, b in zip(losses[None], losses[torch.bfloat16]))


@pytest.mark.parametrize("algorithm", ["vocab-1", "vocab-2"])
def test_vocab_head_bf16_matches_torch_cross_entropy(algorithm):
    import torch.nn.functional as F

    from pipeloom.nn import VocabParallelLMHead

    torch.manual_seed(0)
    n, h, v = 512, 256, 4096
    head = VocabParallelLMHead(v, h, algorithm=algorithm).cuda().to(torch.bfloat16)
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, v, (n,), device="cuda")
    loss = head(x, y)
    loss.backward()
    gx, gw = x.grad.clone(), head.weight.grad.clone()

    x.grad = None
    w = head.weight.detach().clone().requires_grad_(True)
    ref = F.cross_entropy((x @ w.T).float(), y, reduction="sum") / n
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-3
    for got, want in ((gx, x.grad), (gw, w.grad)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 2e-2


def test_peak_memory_reports_reserved_beside_allocated():
    """The metrics' ``peak_reserved_bytes``: the allocator's reserved peak, at least the allocated one."""
    from pipeloom.runtime.memory import PeakMemory

    peak = PeakMemory(torch.device("cuda"))
    x = torch.empty(2**26, device="cuda")
    del x
    assert peak.reserved() >= peak.bytes() >= 2**28


def test_a_stretchs_peak_counts_above_its_start_and_keeps_the_runs():
    """--report's measure on a GPU: a stretch's allocator peak above what was allocated at its start;
    the run's peaks (allocated and reserved, --metrics') kept across the restart."""
    from pipeloom.runtime.memory import PeakMemory

    peak = PeakMemory(torch.device("cuda"))
    x = torch.empty(2**26, device="cuda")  # 256 MiB
    del x
    kept = torch.empty(2**24, device="cuda")  # 64 MiB held across the restart
    peak.restart()
    y = torch.empty(2**24, device="cuda")
    assert 2**26 <= peak.stretch() < 2**26 + 2**22
    assert peak.bytes() >= 2**28 and peak.reserved() >= 2**28
    del y, kept
