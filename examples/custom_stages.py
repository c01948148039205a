"""Train your own stage modules through a pipeline: python examples/custom_stages.py

A small causal language model of torch's own layers (nn.Embedding,
nn.TransformerEncoderLayer under a causal mask, nn.LayerNorm, nn.Linear), cut by
hand into a stage per layer (4 for zb-v: 2 per rank), runs --schedule on 2 local
gloo processes (pipeloom.runtime.local.spawn), or on torchrun's ranks
(torchrun --nproc-per-node 2 examples/custom_stages.py). Every rank describes the
stages on the meta device and materialises only its own; zb-v's W actions compute
the plain nn.Linear layers' weight gradients.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import pipeloom
from pipeloom.runtime.local import spawn
from pipeloom.schedule import build

VOCAB, WIDTH, HEADS, SEQ = 64, 64, 4, 32


class CausalLayer(nn.Module):
    """A decoder-only layer: torch's encoder layer under a causal mask."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


class Embed(nn.Module):
    """Token and learned position embeddings: stage 0 takes token ids [batch, time]."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)

    def forward(self, tokens):
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


def stages(n):
    """``n`` stages of a layer each, described on the meta device: no storage until a rank builds its own."""
    with torch.device("meta"):
        return [nn.Sequential(Embed(), CausalLayer()), *(CausalLayer() for _ in range(n - 2)),
                nn.Sequential(CausalLayer(), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))]


def loss_fn(logits, targets):
    """The last stage's logits [batch, time, vocab] against the next tokens: a microbatch's mean loss."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data(rows, seed):
    """Sequences counting up from a random start by a random stride (mod VOCAB): learnable."""
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(0, VOCAB, (rows, 1), generator=g), torch.randint(1, 4, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1], tokens[:, 1:]


def train(rank, schedule, steps):
    pp, microbatches = dist.get_world_size(), 4
    n = build(schedule, pp, microbatches).stages  # pp stages, or 2 per rank (zb-v, v-*, interleaved, dualpipev)
    torch.manual_seed(0)  # the same description on every rank
    pipe = pipeloom.Pipeline.from_stages(stages(n), loss_fn, schedule, pp=pp, microbatches=microbatches)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(steps):
        loss = pipe.step(*data(16, seed=step))
        pipe.optimizer_step(optimizer, max_norm=1.0)
        if rank == 0:
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    return loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="zb-v")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        train(dist.get_rank(), args.schedule, args.steps)
        dist.destroy_process_group()
    else:
        spawn(2, train, args.schedule, args.steps)
