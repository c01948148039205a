"""``pipeloom train``'s flags; the command itself is :mod:`pipeloom.train`."""

from __future__ import annotations

import argparse

from ..errors import PipeloomError
from .flags import add_run_flags


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a GPT or Llama model through a pipeline (launches its own workers, or runs under torchrun)",
        description="Train a model with pipeline (and data and sequence) parallelism. Outside torchrun it starts "
                    "pp x dp x sp worker processes on this machine; under torchrun each process is one rank. "
                    "--dry-run shows the run's schedule and prediction without starting them.",
    )
    add_run_flags(p, model_default="tiny")
    g = p.add_argument_group("training")
    g.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits for a peer before it checks the peer's heartbeat: it stops, naming "
                        "what it waited for, if the peer died or stalls, and waits on if it is busy (default 60)")
    g.add_argument("--dry-run", action="store_true",
                   help="show what the run will do without starting workers or allocating weights: its schedule, "
                        "predicted step time, peak memory per rank and the schedule's digest (with --plot, drawn; "
                        "with --trace, the simulated step as a Chrome trace)")
    g.add_argument("--json", action="store_true",
                   help="with --dry-run: the same JSON object as pipeloom simulate --json with these flags")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="start the run even when its predicted peak memory (as --dry-run shows it) exceeds the "
                        "memory available: the host's, shared by the ranks on cpu; each GPU's free memory on cuda")
    g = p.add_argument_group("model and optimisation")
    g.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default 3e-3)")
    g.add_argument("--warmup", type=int, help="linear warmup steps, then cosine decay to lr/10 (default steps/10, at most 100)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the matrices (default 0.1)")
    g.add_argument("--clip", type=clip_norm, default=1.0, metavar="NORM",
                   help="clip gradients to this global norm; 0 or none: no clipping (default 1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH",
                   help="a text file, a directory of text files, a token file (*.bin), or a dataset of documents: "
                        "JSON lines (*.jsonl, *.json), Parquet (*.parquet), a datasets save_to_disk directory, or a "
                        "directory of JSON lines and Parquet files (each document ends with the end-of-text token; "
                        "cached); default: the Python standard library's sources, byte-level")
    g.add_argument("--text-field", metavar="NAME",
                   help="the field of --data's documents that holds their text (default: text)")
    g.add_argument("--token-dtype", choices=("uint16", "uint32"), help="read --data as a token file of this type (*.bin: uint16)")
    g.add_argument("--tokenizer", metavar="bytes|bpe|FILE.json",
                   help="tokenize text by bytes (default; with --init-from: its tokenizer.json, if it has one), by a "
                        "byte-level BPE trained on the data (--vocab-size tokens, default 32000; cached), or by a "
                        "saved tokenizers tokenizer.json")
    g.add_argument("--vocab-size", type=int,
                   help="the size of a BPE vocabulary to train, or the vocabulary of a token file (default: its largest id + 1)")
    g.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                   help="hold out the last F of the token stream for validation; training never sees it (default 0.05)")
    g.add_argument("--eval-every", type=int, metavar="N",
                   help="every N steps and at the end: the mean loss on --eval-batches validation batches, forward "
                        "only through the pipeline (metrics: val_loss; default: no validation)")
    g.add_argument("--eval-batches", type=int, default=10, metavar="K",
                   help="validation batches per evaluation, each the size of a step's, the same every time (default 10)")
    g = p.add_argument_group("checkpoints and output")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints (torch.distributed.checkpoint) under DIR")
    g.add_argument("--checkpoint-every", type=int, metavar="N", help="save every N steps (default: at the end only)")
    g.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                   help="resume from CHECKPOINT (a step_* directory), or the latest under --checkpoint-dir; "
                        "pp and dp may differ from the saving run")
    g.add_argument("--save", metavar="FILE.safetensors",
                   help="at the end, write the model's weights by their unsplit names (safetensors; "
                        "pipeloom generate --weights reads them)")
    g.add_argument("--save-hf", metavar="DIR",
                   help="at the end, write a Hugging Face directory of the model (a Llama, or a GPT as GPT-2): "
                        "config.json, "
                        "model.safetensors and the tokenizer's files, which transformers' "
                        "AutoModelForCausalLM.from_pretrained and pipeloom generate --hf read")
    g.add_argument("--metrics", metavar="FILE.jsonl",
                   help="one JSON object per step: step, loss, step_time, tokens_per_s, lr, grad_norm, val_loss")
    g.add_argument("--tensorboard", metavar="DIR",
                   help="write the metrics' scalars (loss, lr, grad_norm, tokens_per_s, val_loss) for TensorBoard "
                        "under DIR (needs the tensorboard package)")
    g.add_argument("--trace", metavar="FILE.json",
                   help="write the last step's measured timeline as a Chrome trace, with each rank's memory allocated "
                        "above the step's start (with --dry-run: the simulated step's)")
    g.add_argument("--plot", metavar="FILE.png|.svg",
                   help="draw the last step's measured timeline with matplotlib, its memory as --trace counts it")
    g.add_argument("--report", action="store_true",
                   help="at the end: measured step time beside the simulator's prediction from the measured costs, and "
                        "the memory the last step held above its start (on a GPU also the run's peak) beside "
                        "simulate's prediction")
    p.set_defaults(run=run)


def clip_norm(text: str) -> float:
    """--clip: a number; none is 0 (no clipping)."""
    if text.strip().lower() == "none":
        return 0.0
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or none") from None


def run(args) -> int:
    from importlib.util import find_spec

    if not args.dry_run and find_spec("torch") is None:  # found, not imported: the checks come first
        raise PipeloomError("pipeloom train needs PyTorch, which is not installed: "
                            "pip install 'pipeloom[torch]' (or pip install torch)")
    from ..train import run

    return run(args)
