"""Torch modules (layer 4): the GPT and Llama models, their pipeline stages, a user's own
stages (:class:`Stages`), and the Linear layer whose weight gradient a runtime can defer
(the B/W split), also for plain ``nn.Linear`` layers (:func:`deferrable`)."""

from .decoder import Decoder, DecoderStage
from .gpt import PRESETS, GPT, GPTConfig, GPTStage
from .hf import from_hf
from .linear import Linear, WeightGradStore, defer_weight_grads, deferrable, plain_linears
from .llama import PRESETS as LLAMA_PRESETS
from .llama import Llama, LlamaConfig, Rotary
from .models import preset_config
from .ring_attention import (SP_ATTENTION_KINDS, SequenceLayout, ring_attention, rsa_attention, sequence_layout,
                             sequence_parallel_attention)
from .stages import Stage, Stages
from .vocab import (VOCAB_ALGORITHMS, LMHeadState, VocabParallelEmbedding, VocabParallelLMHead, VocabShard,
                    vocab_shard)

__all__ = ["PRESETS", "GPT", "GPTConfig", "GPTStage", "LLAMA_PRESETS", "Llama", "LlamaConfig", "Rotary", "Decoder",
           "DecoderStage", "from_hf", "preset_config", "Linear", "WeightGradStore", "defer_weight_grads",
           "deferrable", "plain_linears", "Stage", "Stages",
           "VOCAB_ALGORITHMS", "LMHeadState", "VocabParallelEmbedding", "VocabParallelLMHead", "VocabShard",
           "vocab_shard", "SP_ATTENTION_KINDS", "SequenceLayout", "ring_attention", "rsa_attention",
           "sequence_layout", "sequence_parallel_attention"]
