"""``pipeloom generate``'s flags; the command itself is :mod:`pipeloom.generate`."""

from __future__ import annotations

from ..errors import PipeloomError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="sample text from a model pipeloom train trained (a checkpoint, --save's weights, --save-hf's "
             "directory)",
        description="Load a trained model on one process and continue a prompt with sampled tokens.",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a checkpoint (a step_* directory), or a --checkpoint-dir: its latest checkpoint")
    source.add_argument("--weights", metavar="FILE.safetensors", help="the weights pipeloom train --save wrote")
    source.add_argument("--hf", metavar="DIR",
                        help="a Hugging Face Llama or GPT-2 directory (config.json, model.safetensors, "
                             "tokenizer.json): pipeloom train --save-hf's, or a downloaded one")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to sample, printed as they are drawn (default 200); beyond the model's "
                        "context each is drawn from the last context-length tokens")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits; 0 takes the most likely token (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, metavar="K",
                   help="sample among the K most likely tokens (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--tokenizer", metavar="FILE.json",
                   help="a tokenizers tokenizer.json to encode with (default: the run's; needed for a run on a token file)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run the model (default cpu)")
    p.add_argument("--json", action="store_true", help="print the prompt, the sampled token ids and the text as JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeloomError("pipeloom generate needs PyTorch, which is not installed: "
                            "pip install 'pipeloom[torch]' (or pip install torch)") from None
    from ..generate import run

    return run(args)
