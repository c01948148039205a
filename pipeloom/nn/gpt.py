"""The GPT reference model and its split into pipeline stages.

:class:`GPT` is a pre-LayerNorm decoder-only transformer (GPT-2 layout):
token and learned position embeddings, ``n_layer`` blocks
(``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``), a final LayerNorm and an
LM head. Every linear layer is a :class:`~pipeloom.nn.linear.Linear`, so a
runtime can defer its weight gradient (the B/W split).

:meth:`GPT.split` cuts it into :class:`GPTStage` modules that share the
model's parameter objects; :meth:`GPT.build_stages` builds only some of them,
materialising a model described on the meta device stage by stage.
Stage-local parameter names *are* the unsplit names (blocks keep their
global index: ``blocks.5.attn.qkv.weight``); ``stage.param_names`` maps each
to its unsplit name all the same, because of one exception, tied
embeddings, described on :class:`GPTStage`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PipeloomError
from ..partition import split_layers
from ..presets import SIZES
from .linear import Linear
from .recompute import mark

#: Config presets by name: every size of :data:`pipeloom.presets.SIZES` (``block_size`` None where
#: the preset sets no context length: give one, as `pipeloom train` does with --seq).
PRESETS: dict[str, dict] = {
    name: dict(n_layer=size.layers, n_embd=size.hidden, n_head=size.heads, vocab_size=size.vocab,
               block_size=size.block_size, tie_embeddings=size.tied)
    for name, size in SIZES.items()
}


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`GPT`. ``bias`` applies to the linear layers and
    LayerNorms (never the LM head); ``tie_embeddings`` makes the LM head
    weight the token embedding weight."""

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False

    def __post_init__(self):
        for field in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipeloomError(f"GPTConfig: {field} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise PipeloomError(f"GPTConfig: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise PipeloomError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """The preset ``name`` (see :data:`PRESETS`) with ``overrides`` applied."""
        if name not in PRESETS:
            raise PipeloomError(f"unknown GPT preset {name!r}; presets: {', '.join(PRESETS)}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise PipeloomError(f"unknown GPTConfig field(s) {', '.join(unknown)}; fields: {', '.join(fields)}")
        return cls(**{**PRESETS[name], **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection."""

    #: Set by a sequence-parallel runtime (see :class:`SequenceParallel`): then the
    #: block's tokens are this rank's share and attention runs over the SP group.
    sequence_parallel: SequenceParallel | None = None

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.qkv = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        if self.sequence_parallel is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            y = self.sequence_parallel.attend(q, k, v)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with a 4x wider hidden layer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.drop(self.proj(mark(self.gelu(h), self.gelu, h)))


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: hidden states in, hidden states out."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under :func:`~pipeloom.nn.recompute.cheap_recompute` the norms' outputs are marked rebuildable."""
        x = x + self.attn(mark(self.ln_1(x), self.ln_1, x))
        return x + self.mlp(mark(self.ln_2(x), self.ln_2, x))


def _embed(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Token plus position embeddings of ``tokens`` [B, T] with ``module``'s wte, wpe and drop."""
    if tokens.dim() != 2:
        raise PipeloomError(f"tokens must have shape [batch, time], got {list(tokens.shape)}")
    return _add_positions(module, module.wte(tokens))


def _add_positions(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Token embeddings ``x`` [B, T, C] plus ``module``'s position embeddings, through its
    dropout: positions 0..T-1, or with sequence parallelism those of this rank's tokens."""
    sp = getattr(module, "sequence_parallel", None)
    t = sp.seq_len if sp else x.shape[1]
    block_size = module.wpe.num_embeddings
    if t > block_size:
        raise PipeloomError(f"sequence of {t} tokens exceeds block_size {block_size}; use at most {block_size} tokens")
    positions = sp.positions.to(x.device) if sp else torch.arange(t, device=x.device)
    return module.drop(x + module.wpe(positions))


@dataclass
class SequenceParallel:
    """How a sequence-parallel rank runs a GPT's layers: it holds the tokens of
    ``layout`` (a :func:`~pipeloom.nn.ring_attention.sequence_layout`), and causal
    attention runs over ``group`` with ``kind`` ("ring" or "rsa")."""

    group: object
    layout: object
    kind: str = "ring"

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def positions(self) -> torch.Tensor:
        return torch.as_tensor(self.layout.positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from .ring_attention import sequence_parallel_attention

        return sequence_parallel_attention(q, k, v, self.group, self.layout, causal=True, kind=self.kind)


def set_sequence_parallel(modules, sp: SequenceParallel | None) -> None:
    """Run ``modules`` (a GPT or its stages) sequence-parallel with ``sp``, or not (None)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, CausalSelfAttention) or hasattr(sub, "wpe"):
                sub.sequence_parallel = sp


class GPT(nn.Module):
    """The reference model: ``model(tokens)`` gives logits [B, T, V];
    ``model(tokens, targets)`` the mean cross-entropy over all tokens.

    Initialisation is GPT-2's (normal, std 0.02; residual projections scaled
    by ``1/sqrt(2 * n_layer)``; zero biases; LayerNorms one and zero). Each
    parameter is drawn from a generator of its own, seeded by its name and
    ``init_seed``, a number drawn from torch's default generator at
    construction: so the same seed gives the same weights on every rank, and
    on any device. ``device`` is where the parameters go (default: torch's
    default device); on ``"meta"`` (or under ``torch.device("meta")``) the
    model is only described, no storage allocated, and :meth:`build_stages`
    materialises the stages a rank runs with the weights the whole model
    would have had.
    """

    def __init__(self, config: GPTConfig, device: str | torch.device | None = None):
        super().__init__()
        self.config = config
        self.init_seed = int(torch.randint(2**32, (), device="cpu"))
        with torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            self._materialise(self, {name: name for name, _ in self.named_parameters()}, device)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = _embed(self, tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else self.loss(logits, targets)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``logits`` [B, T, V] against ``targets`` [B, T]
        (the last stage's loss function in a pipeline)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def split(self, n_stages: int, layers_per_stage=None, vocab_parallel: bool = False) -> list[GPTStage]:
        """Cut the model into ``n_stages`` :class:`GPTStage` modules of
        consecutive blocks, sharing this model's parameters.

        ``layers_per_stage`` gives each stage's block count (non-negative,
        summing to ``n_layer``; a stage may hold no block). By default the
        split is :func:`pipeloom.partition.split_layers`'s, the simulator's: as
        even as possible, the remainder to the middle stages first, since the
        first and last also hold the embeddings and the head.

        ``vocab_parallel`` leaves the token embedding and the LM head out (a
        vocabulary-parallel runtime computes them on every rank): the first
        stage then takes token embeddings [B, T, C] and adds the positions,
        and the last returns the final norm's output [B, T, C].
        """
        counts = _layer_counts(self.config.n_layer, n_stages, layers_per_stage)
        return list(self.build_stages(len(counts), range(len(counts)), counts, vocab_parallel).values())

    def build_stages(self, n_stages: int, indices, layers_per_stage=None, vocab_parallel: bool = False,
                     device: str | torch.device | None = None) -> dict[int, GPTStage]:
        """The stages ``indices`` (by index) of the model cut into ``n_stages``
        as :meth:`split` cuts it, on ``device``: what one rank runs.

        They share this model's parameters: those with storage move to
        ``device`` (if given); those on the meta device get storage there
        (default: torch's default device), initialised as the model built
        with the same seed would be, in the stages and in this model alike.
        So each rank of a pipeline can describe the model on the meta device
        and hold only its own stages' weights.
        """
        counts = _layer_counts(self.config.n_layer, n_stages, layers_per_stage)
        bounds = list(itertools.accumulate(counts, initial=0))
        stages = {}
        for k in indices:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n_stages:
                raise PipeloomError(f"stage index {k!r} is not a stage of {n_stages}: use 0 to {n_stages - 1}")
            stage = GPTStage(self, k, n_stages, range(bounds[k], bounds[k + 1]), vocab_parallel)
            self._materialise(stage, stage.param_names, device)
            stages[k] = stage if device is None else stage.to(device)
        return stages

    def has_tied_copies(self, n_stages: int, vocab_parallel: bool = False) -> bool:
        """Whether the stages of a cut into ``n_stages`` hold two copies of the tied
        embedding (the first stage's ``wte``, the last's LM head; see :class:`GPTStage`)."""
        return self.config.tie_embeddings and n_stages > 1 and not vocab_parallel

    def parameter_value(self, name: str, device: str | torch.device | None = None) -> torch.Tensor:
        """The unsplit parameter ``name`` (such as ``"wte.weight"``) on ``device``: its
        data if it has storage, else a new tensor (default: on torch's default device)
        initialised as the model built with the same seed has it."""
        param = self.get_parameter(name)
        if not param.is_meta:
            return param.detach() if device is None else param.detach().to(device)
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        self._initialise(self._unsplit_name(param), value)
        return value

    def _unsplit_name(self, param: nn.Parameter) -> str:
        """The name under which ``named_parameters`` lists ``param`` (a tied LM head: ``wte.weight``)."""
        return next(name for name, p in self.named_parameters() if p is param)

    @torch.no_grad()
    def _initialise(self, name: str, value: torch.Tensor) -> None:
        """Fill ``value`` as parameter ``name`` starts: drawn from a CPU generator seeded by
        (``init_seed``, name), so that every device and every rank draws the same numbers."""
        owner, _, kind = name.rpartition(".")
        if isinstance(self.get_submodule(owner), nn.LayerNorm):
            value.fill_(1.0 if kind == "weight" else 0.0)
        elif kind == "bias":
            value.zero_()
        else:
            residual = owner.endswith((".attn.proj", ".mlp.proj"))
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode(), self.init_seed))
            if value.device.type == "cpu":
                value.normal_(0.0, std, generator=generator)
            else:
                value.copy_(torch.empty(value.shape, dtype=value.dtype).normal_(0.0, std, generator=generator))

    def _materialise(self, module: nn.Module, names: dict[str, str], device) -> None:
        """Give ``module``'s meta parameters storage on ``device``, initialised by their
        unsplit names (``names``: local name -> unsplit name), in ``module`` and in this
        model alike, so that a tied weight stays tied."""
        new = {id(p): nn.Parameter(self.parameter_value(names[local], device), p.requires_grad)
               for local, p in module.named_parameters() if p.is_meta}
        for sub in itertools.chain(self.modules(), module.modules()):
            for key, p in list(sub._parameters.items()):
                if p is not None and id(p) in new:
                    sub._parameters[key] = new[id(p)]


def _layer_counts(n_layer: int, n_stages, layers_per_stage) -> tuple[int, ...]:
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise PipeloomError(f"n_stages must be a positive integer, got {n_stages!r}")
    if layers_per_stage is None:
        return split_layers(n_layer, n_stages)
    counts = tuple(layers_per_stage)
    if len(counts) != n_stages or any(not isinstance(n, int) or n < 0 for n in counts) or sum(counts) != n_layer:
        raise PipeloomError(
            f"layers_per_stage {list(counts)}: need {n_stages} non-negative integers (one per stage) "
            f"summing to n_layer {n_layer}"
        )
    return counts


class GPTStage(nn.Module):
    """Stage ``index`` of ``n_stages``: the blocks ``layers`` (global
    indices) of a :class:`GPT`, plus the embeddings on the first stage
    (input: tokens [B, T]) and the final norm and LM head on the last
    (output: logits [B, T, V]); other inputs and outputs are hidden states
    [B, T, C]. With ``vocab_parallel`` the token embedding and the LM head
    are left out (see :meth:`GPT.split`). One tensor in, one out, so ``torch.distributed.pipelining``'s
    ``PipelineStage`` can run it too.

    ``param_names`` maps each local parameter name to the unsplit model's
    name, for checkpoints and for comparing gradients. Parameters are the
    unsplit model's own objects, except with ``tie_embeddings`` and more than
    one stage: the last stage's ``lm_head.weight`` is then its own parameter,
    a copy of ``wte.weight`` made at split time, and maps to ``"wte.weight"``.

    ``tied`` (local name -> unsplit name) lists those parameters whose
    gradient is only part of the unsplit one: ``{"wte.weight": "wte.weight"}``
    on the first stage, ``{"lm_head.weight": "wte.weight"}`` on the last,
    empty elsewhere. A runtime sums their gradients over the stages holding
    them, as Megatron's embedding group does, after the step's last backward
    and before the optimizer: ``all_reduce(SUM)`` over a process group of the
    ranks of the first and last stages, or a local sum when one rank holds
    both (V placement). Both copies then hold the unsplit ``wte.weight``
    gradient and stay equal under the same optimizer update.
    """

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range, vocab_parallel: bool = False):
        super().__init__()
        self.index, self.n_stages, self.layers = index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.vocab_parallel = vocab_parallel
        if self.is_first:
            self.wpe, self.drop = model.wpe, model.drop
            if not vocab_parallel:
                self.wte = model.wte
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        separate_head = model.has_tied_copies(n_stages, vocab_parallel)
        if self.is_last:
            self.ln_f = model.ln_f
            if not vocab_parallel:
                self.lm_head = _head_copy(model) if separate_head else model.lm_head
        self.tied: dict[str, str] = {}
        if separate_head and self.is_first:
            self.tied["wte.weight"] = "wte.weight"
        if separate_head and self.is_last:
            self.tied["lm_head.weight"] = "wte.weight"
        self.param_names: dict[str, str] = {name: self.tied.get(name, name) for name, _ in self.named_parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = _add_positions(self, x) if self.vocab_parallel else _embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.ln_f(x) if self.vocab_parallel else self.lm_head(self.ln_f(x))
        return x


def _head_copy(model: GPT) -> Linear:
    """An LM head whose weight is a new parameter equal to ``model``'s token embedding."""
    head = Linear(model.config.n_embd, model.config.vocab_size, bias=False, device="meta")
    head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return head
