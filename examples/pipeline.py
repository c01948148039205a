"""Train the tiny GPT through a pipeline: torchrun --nproc-per-node 2 examples/pipeline.py

Every rank builds the same model (same seed) and passes the same batch;
pipeloom keeps each rank's own stages and runs the schedule's actions.
"""

import argparse

import torch
import torch.distributed as dist

import pipeloom
from pipeloom.nn import GPT, GPTConfig
from pipeloom.runtime.timeline import write_trace

parser = argparse.ArgumentParser()
parser.add_argument("--schedule", default="zb-v")
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--trace", help="write the last step's measured timeline as a Chrome trace")
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # the stages follow: LOCAL_RANK's GPU, or the CPU
torch.manual_seed(0)
config = GPTConfig.preset("tiny")
pipe = pipeloom.Pipeline(GPT(config), schedule=args.schedule, pp=dist.get_world_size(), microbatches=args.microbatches)
optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)

data = torch.randint(0, config.vocab_size, (64, 33), generator=torch.Generator().manual_seed(1))
for step in range(args.steps):
    batch = data[(step * 8) % 64:][:8]
    loss = pipe.step(batch[:, :-1], batch[:, 1:])
    pipe.optimizer_step(optimizer, max_norm=1.0)
    if dist.get_rank() == 0:
        print(f"step {step:3d}  loss {loss:.4f}", flush=True)
if args.trace:
    write_trace(pipe, args.trace)
dist.barrier()
dist.destroy_process_group()
