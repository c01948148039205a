"""The vocabulary-parallel embedding and LM head, against torch's own functions on the unsplit tensors."""

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parity import Products  # noqa: E402
from pipeloom.nn import vocab as vocab_module  # noqa: E402
from pipeloom.errors import PipeloomError  # noqa: E402
from pipeloom.nn import (VOCAB_ALGORITHMS, VocabParallelEmbedding, VocabParallelLMHead,  # noqa: E402
                         vocab_shard)
from pipeloom.runtime.local import spawn  # noqa: E402

HIDDEN, TOKENS = 6, 10
#: (loss, gradient) tolerances by the layer's dtype: bf16 against torch on the same bf16 logits
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.bfloat16: (1e-3, 2e-2)}


def close(name, got, want, tol=1e-5):
    """Relative error below ``tol`` (measured against at least 0.01: V = 1 has a zero loss and gradients)."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, want {list(want.shape)}"
    if not want.numel():
        return
    error = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-2)
    assert error < tol, f"{name}: relative error {error:.2e}"


def data(vocab, seed):
    """An unsplit weight, hidden states, tokens, targets and a hidden-to-hidden matrix, in float64."""
    g = torch.Generator().manual_seed(1000 * vocab + seed)
    weight = torch.randn(vocab, HIDDEN, generator=g, dtype=torch.float64)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    tokens = torch.randint(vocab, (TOKENS,), generator=g)
    targets = torch.randint(vocab, (TOKENS,), generator=g)
    mix = torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN ** 0.5
    return weight, x, tokens, targets, mix


def shard_grad(name, layer, want_full, tol=1e-5):
    """``layer.weight.grad`` is the shard's rows of ``want_full``, and zero on padding rows."""
    shard, grad = layer.shard, layer.weight.grad
    assert grad.dtype == layer.weight.dtype, f"{name}: gradient in {grad.dtype}"
    close(name, grad[: shard.real_rows], want_full[shard.start:shard.end], tol)
    assert not grad[shard.real_rows:].any(), f"{name}: padding rows have a gradient"


def distributed():
    return dist.is_available() and dist.is_initialized()


def gather(tensor):
    """Every rank's ``tensor``, stacked [ranks, ...]."""
    if not distributed():
        return tensor[None]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)


def all_reduce(tensor):
    """``tensor`` summed over the ranks, in place."""
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def run_passes(head, states, dst):
    """The passes after S, in the order ``head.passes`` gives, interleaving microbatches like a
    schedule, with the collectives a runtime runs between them: C gathers every rank's row
    statistics (vocab-2: and its parts of ∇X) and naive sums its exponentials in a second round;
    R sums the parts of ∇X into rank ``dst`` (every rank with None). Each microbatch's ∇X, None
    on ranks R leaves without."""
    grads = {}

    def c(state):
        parts = gather(head.grad_input_parts(state)) if head.algorithm == "vocab-2" else None
        stats = gather(head.row_stats(state))
        head.combine(state, stats)
        if head.algorithm == "naive":
            head.combine_sums(state, all_reduce(head.row_sums(state)))
        if parts is not None:
            grads[id(state)] = head.grad_input_from(state, stats, parts)

    def r(state):
        grad = state.grad_input_partial
        if dst is None:
            all_reduce(grad)
        elif distributed():
            dist.reduce(grad, dst)
        here = dst is None or dst == (dist.get_rank() if distributed() else 0)
        grads[id(state)] = grad.to(state.input_dtype).reshape(state.input_shape) if here else None

    steps = {"C": c, "T": head.t_pass, "R": r}
    for name in head.passes[1:]:
        for state in (states if name == "C" else reversed(states)):
            steps[name](state)
    return [grads[id(state)] for state in states]


def check_head(algorithm, vocab, rank, world, smoothing, ignore_index, microbatches, dtype=torch.float32):
    """Loss, ∇X and ∇W of the pass API with a layer and inputs in ``dtype`` against F.cross_entropy
    (in fp64, or for bf16 on the same bf16 logits upcast); then the forward-only loss."""
    weight, x, _, targets, _ = data(vocab, 1)
    if ignore_index is not None:
        targets[::3] = ignore_index
    kwargs = {} if ignore_index is None else {"ignore_index": ignore_index}
    low = dtype == torch.bfloat16
    weight, x = (weight.bfloat16(), x.bfloat16()) if low else (weight, x)
    ref_w, ref_x = weight.clone().requires_grad_(), x.clone().requires_grad_()
    count = (targets != kwargs.get("ignore_index", -100)).sum()
    logits = (ref_x @ ref_w.T).float() if low else ref_x @ ref_w.T
    want = F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction="sum", **kwargs) / count
    want.backward()

    name = f"{algorithm} {dtype} V={vocab} eps={smoothing} ignore={ignore_index} mb={microbatches}"
    loss_tol, grad_tol = TOLERANCES[dtype]
    head = VocabParallelLMHead(vocab, HIDDEN, algorithm=algorithm, label_smoothing=smoothing, **kwargs).to(dtype)
    head.load_full(weight)
    x = x.to(dtype)
    if microbatches == 1:  # one [batch, time, hidden] microbatch
        xs, ts = [x.view(2, TOKENS // 2, HIDDEN)], [targets.view(2, TOKENS // 2)]
    else:
        xs, ts = x.chunk(microbatches), targets.chunk(microbatches)
    denominator = None if microbatches == 1 else count
    states = [head.s_pass(xm, tm, denominator) for xm, tm in zip(xs, ts)]
    assert all(state.probs.dtype == dtype for state in states), f"{name}: the kept buffer is not in {dtype}"
    dst = None if microbatches == 1 else world - 1
    grads = run_passes(head, states, dst)
    assert {state.loss.dtype for state in states} == {torch.promote_types(dtype, torch.float32)}, f"{name}: loss"
    close(f"{name}: loss", sum(state.loss for state in states), want, loss_tol)
    shard_grad(f"{name}: grad W", head, ref_w.grad, grad_tol)
    if dst is None or dst == rank or algorithm == "vocab-2":
        grad_x = torch.cat([grad.reshape(-1, HIDDEN) for grad in grads])
        assert grad_x.dtype == dtype, f"{name}: grad x in {grad_x.dtype}"
        close(f"{name}: grad x", grad_x, ref_x.grad, grad_tol)

    before = head.weight.grad.clone()
    with torch.no_grad():
        evaluated = head(x.requires_grad_(), targets)
    assert evaluated.grad_fn is None and not evaluated.requires_grad, f"{name}: evaluating built a graph"
    assert torch.equal(head.weight.grad, before), f"{name}: evaluating touched the gradients"
    close(f"{name}: evaluated loss", evaluated, want, loss_tol)


def tied_reference(vocab, smoothing):
    """The unsplit tied model: embed, tanh(e @ mix), then the head with the same weight, by torch autograd."""
    weight, _, tokens, targets, mix = data(vocab, 2)
    weight.requires_grad_()
    mix.requires_grad_()
    hidden = torch.tanh(F.embedding(tokens, weight) @ mix)
    loss = F.cross_entropy(hidden @ weight.T, targets, label_smoothing=smoothing)
    loss.backward()
    return weight, mix, tokens, targets, loss


def check_tied(algorithm, vocab, rank, world):
    """Tied weights, first through the passes as a pipeline places them, then through the head's
    ``forward``; the embedding's sum over ranks and its gradient's broadcast as a runtime does them."""
    smoothing = 0.1
    weight, mix, tokens, targets, want = tied_reference(vocab, smoothing)
    name = f"tied {algorithm} V={vocab}"

    embedding = VocabParallelEmbedding(vocab, HIDDEN)
    embedding.load_full(weight.detach().float())
    head = VocabParallelLMHead(vocab, HIDDEN, algorithm=algorithm, label_smoothing=smoothing, weight=embedding.weight)
    assert head.weight is embedding.weight
    my_mix = mix.detach().float().requires_grad_()
    partial = embedding.partial(tokens)
    full = all_reduce(partial.detach().clone())
    close(f"{name}: summed embedding", full, F.embedding(tokens, weight.detach()))
    hidden = torch.tanh(full.requires_grad_() @ my_mix)
    last = world - 1
    state = head.s_pass(hidden.detach(), targets)
    (grad_x,) = run_passes(head, [state], last)
    close(f"{name}: loss", state.loss, want)
    if rank == last:
        hidden.backward(grad_x)
        close(f"{name}: grad mix", my_mix.grad, mix.grad)
    grad = full.grad if rank == last else torch.empty_like(full)
    if distributed():
        dist.broadcast(grad, last)
    torch.autograd.backward(partial, grad)
    shard_grad(f"{name}: grad W (passes)", embedding, weight.grad)

    embedding.weight.grad = None
    my_mix.grad = None
    partial = embedding.partial(tokens)
    full = all_reduce(partial.detach().clone()).requires_grad_()
    loss = head(torch.tanh(full @ my_mix), targets)
    (0.5 * loss).backward()  # an incoming gradient other than 1
    torch.autograd.backward(partial, full.grad)  # every rank has the same loss, so the same gradient
    close(f"{name}: forward loss", loss, want)
    close(f"{name}: forward grad mix", my_mix.grad, 0.5 * mix.grad)
    shard_grad(f"{name}: forward grad W", embedding, 0.5 * weight.grad)


def worker(rank, world, vocab_sizes):
    """Every check for every algorithm on ``world`` ranks; returns how many ran."""
    torch.manual_seed(rank)  # the layers' own initial weights differ by rank: load_full must replace them
    checks = 0
    for vocab in vocab_sizes:
        for algorithm in VOCAB_ALGORITHMS:
            for dtype in (torch.float32, torch.bfloat16):
                check_head(algorithm, vocab, rank, world, 0.0, None, microbatches=1, dtype=dtype)
                check_head(algorithm, vocab, rank, world, 0.1, -1, microbatches=2, dtype=dtype)
            check_head(algorithm, vocab, rank, world, 0.1, -1, microbatches=2, dtype=torch.float64)
            check_tied(algorithm, vocab, rank, world)
            checks += 6
    return checks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, vocab_sizes", [(2, [7]), (3, [10]), (4, [37, 5])])
def test_layers_match_torch_on_ranks(world, vocab_sizes):
    # V=37 on 4 ranks pads 3 rows; V=10 on 3 pads 2; V=5 on 4 leaves rank 3 with padding alone
    assert spawn(world, worker, world, vocab_sizes, timeout=50, group_timeout=30) == [18 * len(vocab_sizes)] * world


def test_layers_match_torch_without_distributed():
    assert worker(0, 1, [7, 1]) == 36


@pytest.mark.parametrize("algorithm", VOCAB_ALGORITHMS)
def test_autocast_runs_the_products_in_bf16_and_the_statistics_in_fp32(algorithm):
    weight, x, _, targets, _ = data(37, 3)
    weight, x = weight.float(), x.float()
    targets[::4] = -100
    ref_w, ref_x = weight.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ref_x @ ref_w.T
    want = F.cross_entropy(logits.float(), targets, label_smoothing=0.1)
    want.backward()

    head = VocabParallelLMHead(37, HIDDEN, algorithm=algorithm, label_smoothing=0.1)
    head.load_full(weight)
    x.requires_grad_()
    with Products() as products:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = head(x, targets)
        loss.backward()  # T, outside autocast as usual: in S's dtype all the same
    # x·Wᵀ and vocab-2's softmax·W in S (C with vocab-2), ∇Zᵀ·x and (naive, vocab-1) ∇Z·W in T
    assert products.dtypes == [(torch.bfloat16, torch.bfloat16)] * 3, products.dtypes
    assert (loss.dtype, x.grad.dtype, head.weight.grad.dtype) == (torch.float32,) * 3
    close("loss", loss, want, 1e-3)
    close("grad x", x.grad, ref_x.grad, 2e-2)
    close("grad W", head.weight.grad, ref_w.grad, 2e-2)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = head.s_pass(x, targets)
    assert state.probs.dtype == torch.bfloat16 and head.row_stats(state).dtype == torch.float32


def test_row_chunks_change_nothing(monkeypatch):
    """Buffers worked through a few rows at a time, as large ones are, give the same results."""
    monkeypatch.setattr(vocab_module, "_CHUNK_BYTES", (80, 80))  # V = 7: two rows a chunk, the last one short
    for algorithm in VOCAB_ALGORITHMS:
        for dtype in (torch.float32, torch.bfloat16):
            check_head(algorithm, 7, 0, 1, 0.0, None, microbatches=1, dtype=dtype)
            check_head(algorithm, 7, 0, 1, 0.1, -1, microbatches=2, dtype=dtype)


def test_vocab_shard_splits_padded_rows():
    shards = [vocab_shard(37, 4, i) for i in range(4)]
    assert [(s.start, s.end) for s in shards] == [(0, 10), (10, 20), (20, 30), (30, 37)]
    assert {(s.rows, s.padded_size, s.vocab_size, s.parts) for s in shards} == {(10, 40, 37, 4)}
    assert [(s.start, s.end, s.real_rows) for s in (vocab_shard(5, 4, i) for i in range(4))] == \
        [(0, 2, 2), (2, 4, 2), (4, 5, 1), (5, 5, 0)]
    assert (vocab_shard(10, 1, 0).start, vocab_shard(10, 1, 0).end, vocab_shard(10, 1, 0).rows) == (0, 10, 10)


@pytest.mark.parametrize("args, match", [((10, 0, 0), "parts"), ((10, 2, 2), r"index .*\[0, 2\)"),
                                         ((10, 2, -1), "index"), ((0, 1, 0), "vocab_size"),
                                         ((10, 2.0, 0), "parts")])
def test_vocab_shard_rejects_bad_arguments(args, match):
    with pytest.raises(PipeloomError, match=match):
        vocab_shard(*args)


def test_lm_head_rejects_bad_arguments():
    with pytest.raises(PipeloomError, match=r"'vocab-3'.*naive, vocab-1, vocab-2"):
        VocabParallelLMHead(10, 4, algorithm="vocab-3")
    with pytest.raises(PipeloomError, match="label_smoothing"):
        VocabParallelLMHead(10, 4, label_smoothing=1.5)
    with pytest.raises(PipeloomError, match=r"shape \[10, 4\]"):
        VocabParallelLMHead(10, 4, weight=torch.nn.Parameter(torch.zeros(9, 4)))
    head = VocabParallelLMHead(10, 4)
    with pytest.raises(PipeloomError, match="targets must have shape"):
        head.s_pass(torch.zeros(3, 4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(PipeloomError, match=r"x must have shape \[\.\.\., 4\]"):
        head.s_pass(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(PipeloomError, match="before t_pass"):
        head.t_pass(head.s_pass(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)))
    with pytest.raises(PipeloomError, match=r"shape \[10, 4\]"):
        VocabParallelEmbedding(10, 4).load_full(torch.zeros(11, 4))


def test_passes_follow_the_algorithm():
    assert [VocabParallelLMHead(10, 4, algorithm=a).passes for a in VOCAB_ALGORITHMS] == \
        [("S", "C", "T", "R"), ("S", "C", "T", "R"), ("S", "C", "T")]
