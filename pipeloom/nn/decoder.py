"""What every decoder model shares: the stage split, the meta-device build, the layers' skeleton.

A :class:`Decoder` is a token embedding ``wte``, ``n_layer`` pre-norm
:class:`PreNormBlock` layers ``blocks``, a final norm ``ln_f`` and an LM head
``lm_head``; a family (:class:`~pipeloom.nn.GPT`, :class:`~pipeloom.nn.Llama`)
says which norm, attention and MLP its blocks hold, what the first stage
adds to the token embeddings (:meth:`Decoder.add_positions`: GPT's learned
positions; Llama's rotary positions live in its attention) and how each
weight starts. Everything a runtime uses is here, the same for every family:

- :meth:`Decoder.split` cuts the model into :class:`DecoderStage` modules
  that share the model's parameter objects; :meth:`Decoder.build_stages`
  builds only some of them, materialising a model described on the meta
  device stage by stage, each weight drawn from a generator seeded by its
  name (:meth:`Decoder.parameter_value`). Stage-local parameter names *are*
  the unsplit names (blocks keep their global index:
  ``blocks.5.attn.qkv.weight``); ``stage.param_names`` maps each to its
  unsplit name all the same, because of one exception, tied embeddings,
  described on :class:`DecoderStage`.
- The names ``wte``, ``ln_f``, ``lm_head`` and ``config.vocab_size``,
  ``n_embd``, ``tie_embeddings`` are what vocabulary parallelism
  (:mod:`pipeloom.runtime.handlers.vocab`) and checkpoints rely on.
- :class:`SequenceParallel` / :func:`set_sequence_parallel` switch attention
  (and positions) to a rank's share of the sequence.
- :class:`CausalSelfAttention` is both families' attention: a fused q/k/v
  projection, optional grouped-query heads and rotary positions, torch's
  ``scaled_dot_product_attention`` (or ring attention over an SP group).
"""

from __future__ import annotations

import itertools
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PipeloomError
from ..partition import split_layers
from ..presets import SIZES
from .linear import Linear
from .recompute import mark


class DecoderConfig:
    """What the configs of every family share (each is a frozen dataclass with the fields
    ``n_layer``, ``n_embd``, ``n_head``, ``vocab_size``, ``block_size`` and ``tie_embeddings``):
    checks and presets by name."""

    #: the family's presets: name -> field values
    presets: ClassVar[dict[str, dict]]

    def _check_sizes(self, fields) -> None:
        name = type(self).__name__
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipeloomError(f"{name}: {field} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise PipeloomError(f"{name}: n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @classmethod
    def preset(cls, name: str, **overrides):
        """The preset ``name`` (see the family's ``PRESETS``) with ``overrides`` applied."""
        if name not in cls.presets:
            other = f" ({name} is a {SIZES[name].family} preset)" if name in SIZES else ""
            family = cls.__name__.removesuffix("Config")
            raise PipeloomError(f"unknown {family} preset {name!r}{other}; presets: {', '.join(cls.presets)}")
        fields = list(cls.__dataclass_fields__)
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise PipeloomError(f"unknown {cls.__name__} field(s) {', '.join(unknown)}; fields: {', '.join(fields)}")
        return cls(**{**cls.presets[name], **overrides})


@dataclass
class SequenceParallel:
    """How a sequence-parallel rank runs a model's layers: it holds the tokens of
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


def positions_of(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The global positions of the tokens of ``x`` [B, T, ...] in ``module`` (which may run
    sequence-parallel): 0..T-1, or this rank's share of the sequence."""
    sp = module.sequence_parallel
    return sp.positions.to(x.device) if sp else torch.arange(x.shape[1], device=x.device)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection ``qkv`` and an output
    projection ``proj``. ``n_kv_head`` (dividing ``n_head``; default ``n_head``) gives
    grouped-query attention: the keys and values have that many heads, each serving
    ``n_head / n_kv_head`` query heads (query head i uses key/value head i // group, as
    Hugging Face's ``repeat_kv``). ``rotary``, a :class:`~pipeloom.nn.llama.Rotary`, turns the
    queries and keys by the tokens' global positions."""

    #: Set by a sequence-parallel runtime (see :class:`SequenceParallel`): then the
    #: block's tokens are this rank's share and attention runs over the SP group.
    sequence_parallel: SequenceParallel | None = None

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int | None = None, *, bias: bool = True,
                 dropout: float = 0.0, rotary=None):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head or n_head
        self.head_dim, self.dropout, self.rotary = n_embd // n_head, dropout, rotary
        self.qkv = Linear(n_embd, (n_head + 2 * self.n_kv_head) * self.head_dim, bias=bias)
        self.proj = Linear(n_embd, n_embd, bias=bias)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        d, kv = self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = (y.view(b, t, -1, d).transpose(1, 2) for y in self.qkv(x).split([c, kv, kv], dim=2))
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions_of(self, x))
            v = v.contiguous()  # a view of qkv's output would keep the unturned q and k until the backward
        grouped = self.n_kv_head != self.n_head
        if self.sequence_parallel is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                               is_causal=True, enable_gqa=grouped)
        else:
            if grouped:  # ring attention takes as many key/value heads as query heads
                group = self.n_head // self.n_kv_head
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            y = self.sequence_parallel.attend(q, k, v)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class PreNormBlock(nn.Module):
    """One pre-norm transformer layer, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``:
    hidden states in, hidden states out. ``norm`` makes each of the two norms."""

    def __init__(self, norm: Callable[[], nn.Module], attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.ln_1 = norm()
        self.attn = attn
        self.ln_2 = norm()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Under :func:`~pipeloom.nn.recompute.cheap_recompute` the norms' outputs are marked rebuildable."""
        x = x + self.attn(mark(self.ln_1(x), self.ln_1, x))
        return x + self.mlp(mark(self.ln_2(x), self.ln_2, x))


class HFTensor(NamedTuple):
    """A tensor of a Hugging Face checkpoint that is (part of) one of a decoder's weights:
    ``rows`` of the weight, stacked with the weight's other parts by rows; ``transposed``:
    stored as [in, out] (GPT-2's ``Conv1D``), where a linear layer's weight is [out, in]."""

    name: str
    rows: int
    transposed: bool = False


#: The norms whose weights start at one (and biases at zero).
NORMS = (nn.LayerNorm, nn.RMSNorm)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An ``nn.Embedding`` without torch's random init: the decoder's weights are described on the meta
    device and initialised when they get storage (:meth:`Decoder._initialise`), and ``normal_`` on a meta
    tensor imports ``torch._dynamo`` (about 1 s a process)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def set_sequence_parallel(modules, sp: SequenceParallel | None) -> None:
    """Run ``modules`` (a model or its stages) sequence-parallel with ``sp``, or not (None)."""
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, (CausalSelfAttention, Decoder, DecoderStage)):
                sub.sequence_parallel = sp


class Decoder(nn.Module):
    """A decoder-only language model: ``model(tokens)`` gives logits [B, T, V];
    ``model(tokens, targets)`` the mean cross-entropy over all tokens.

    A family subclasses it with :meth:`block` (one layer), :meth:`norm` (the
    final norm), :meth:`inputs` (modules the first stage holds besides the
    token embedding), :meth:`add_positions` and :meth:`hf_names` (its weights
    in Hugging Face's checkpoints, which :meth:`load_safetensors` reads).

    Initialisation is GPT-2's (normal, std 0.02; residual projections, the
    ``proj`` of attention and of the MLP, scaled by ``1/sqrt(2 * n_layer)``;
    zero biases; norms one and zero). Each parameter is drawn from a generator
    of its own, seeded by its name and ``init_seed``, a number drawn from
    torch's default generator at construction: so the same seed gives the
    same weights on every rank, and on any device. ``device`` is where the
    parameters go (default: torch's default device); on ``"meta"`` (or under
    ``torch.device("meta")``) the model is only described, no storage
    allocated, and :meth:`build_stages` materialises the stages a rank runs
    with the weights the whole model would have had. A family may give some
    weights other values (:attr:`sources`: weights read from a Hugging Face checkpoint).
    """

    #: Set by a sequence-parallel runtime (see :class:`SequenceParallel`).
    sequence_parallel: SequenceParallel | None = None

    def __init__(self, config, device: str | torch.device | None = None):
        super().__init__()
        self.config = config
        self.init_seed = int(torch.randint(2**32, (), device="cpu"))
        #: where the weights that do not start random come from: unsplit name -> a function
        #: giving the tensor (on the CPU, any dtype), or with (start, end) only those rows of
        #: it, read when the weight gets storage
        self.sources: dict[str, Callable[..., torch.Tensor]] = {}
        with torch.device("meta"):
            self.wte = embedding(config.vocab_size, config.n_embd)
            inputs = self.inputs(config)
            for name, module in inputs.items():
                setattr(self, name, module)
            self.blocks = nn.ModuleList(self.block(config) for _ in range(config.n_layer))
            self.ln_f = self.norm(config)
            self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        #: the names of :meth:`inputs`' modules
        self.input_names = tuple(inputs)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        device = torch.get_default_device() if device is None else torch.device(device)
        if device.type != "meta":
            self._materialise(self, {name: name for name, _ in self.named_parameters()}, device)

    # -- what a family defines ------------------------------------------------------
    @staticmethod
    def block(config) -> nn.Module:
        """One transformer layer of ``config``."""
        raise NotImplementedError

    @staticmethod
    def norm(config) -> nn.Module:
        """The final norm (the blocks make their own)."""
        raise NotImplementedError

    @staticmethod
    def inputs(config) -> dict[str, nn.Module]:
        """Modules of the first stage besides the token embedding, by attribute name."""
        return {}

    #: Suffixes of tensors a family's Hugging Face checkpoints hold that are not weights (ignored).
    hf_extras: tuple[str, ...] = ()

    def hf_names(self) -> dict[str, list[HFTensor]]:
        """Each unsplit parameter's tensors in the family's Hugging Face checkpoints."""
        raise NotImplementedError

    @staticmethod
    def add_positions(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``x`` [B, T, C] made the first layer's input by ``module`` (the
        model, or its first stage: it holds :meth:`inputs` and ``config``). Here: unchanged,
        once the sequence is checked to fit ``block_size``."""
        sequence_length(module, x)
        return x

    # -- Hugging Face's checkpoints -------------------------------------------------------
    def load_safetensors(self, path: str | Path) -> None:
        """Take the weights of the safetensors file ``path`` (or, in the directory ``path``, of
        the shards its ``model.safetensors.index.json`` lists, else of every ``*.safetensors``
        file) by Hugging Face's names (:meth:`hf_names`). Weights with storage are overwritten
        now; weights on the meta device read theirs when they get storage (:meth:`build_stages`,
        :meth:`parameter_value`), so each rank of a pipeline reads only its own stages' tensors,
        and of a vocabulary shard only its rows. Stops with one line if a tensor is missing, has
        another shape, or has no place in this model. A tied model ignores a file's
        ``lm_head.weight``."""
        from .hf import load

        load(self, Path(path))

    def save_safetensors(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the model's weights to the safetensors file ``path`` by Hugging Face's names
        (:meth:`hf_names`), in ``dtype`` (default: the weights' own)."""
        from .hf import save

        weights = {}
        for name in self.hf_names():
            param = self.get_parameter(name)
            if param.is_meta:
                raise PipeloomError(f"save_safetensors: {name} is on the meta device; build the model on a "
                                    "device (or every stage of it) first")
            weights[name] = param.detach().to("cpu", dtype or param.dtype)
        save(self, weights, path)

    # -- the model --------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = embed(self, tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else self.loss(logits, targets)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``logits`` [B, T, V] against ``targets`` [B, T]
        (the last stage's loss function in a pipeline)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def split(self, n_stages: int, layers_per_stage=None, vocab_parallel: bool = False) -> list[DecoderStage]:
        """Cut the model into ``n_stages`` :class:`DecoderStage` modules of
        consecutive blocks, sharing this model's parameters.

        ``layers_per_stage`` gives each stage's block count (non-negative,
        summing to ``n_layer``; a stage may hold no block). By default the
        split is :func:`pipeloom.partition.split_layers`'s, the simulator's: as
        even as possible, the remainder to the middle stages first, since the
        first and last also hold the embeddings and the head.

        ``vocab_parallel`` leaves the token embedding and the LM head out (a
        vocabulary-parallel runtime computes them on every rank): the first
        stage then takes token embeddings [B, T, C] (and adds the positions),
        and the last returns the final norm's output [B, T, C].
        """
        counts = layer_counts(self.config.n_layer, n_stages, layers_per_stage)
        return list(self.build_stages(len(counts), range(len(counts)), counts, vocab_parallel).values())

    def build_stages(self, n_stages: int, indices, layers_per_stage=None, vocab_parallel: bool = False,
                     device: str | torch.device | None = None) -> dict[int, DecoderStage]:
        """The stages ``indices`` (by index) of the model cut into ``n_stages``
        as :meth:`split` cuts it, on ``device``: what one rank runs.

        They share this model's parameters: those with storage move to
        ``device`` (if given); those on the meta device get storage there
        (default: torch's default device), initialised as the model built
        with the same seed would be, in the stages and in this model alike.
        So each rank of a pipeline can describe the model on the meta device
        and hold only its own stages' weights.
        """
        counts = layer_counts(self.config.n_layer, n_stages, layers_per_stage)
        bounds = list(itertools.accumulate(counts, initial=0))
        stages = {}
        for k in indices:
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < n_stages:
                raise PipeloomError(f"stage index {k!r} is not a stage of {n_stages}: use 0 to {n_stages - 1}")
            stage = DecoderStage(self, k, n_stages, range(bounds[k], bounds[k + 1]), vocab_parallel)
            self._materialise(stage, stage.param_names, device)
            stages[k] = stage if device is None else stage.to(device)
        return stages

    def has_tied_copies(self, n_stages: int, vocab_parallel: bool = False) -> bool:
        """Whether the stages of a cut into ``n_stages`` hold two copies of the tied
        embedding (the first stage's ``wte``, the last's LM head; see :class:`DecoderStage`)."""
        return self.config.tie_embeddings and n_stages > 1 and not vocab_parallel

    def parameter_value(self, name: str, device: str | torch.device | None = None,
                        rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The unsplit parameter ``name`` (such as ``"wte.weight"``) on ``device``: its
        data if it has storage, else a new tensor (default: on torch's default device)
        initialised as the model built with the same seed has it. ``rows`` (start, end):
        only those rows (a vocabulary shard), read alone from a weight's :attr:`sources`."""
        param = self.get_parameter(name)
        start, end = rows or (0, param.shape[0])
        if not param.is_meta:
            value = param.detach() if rows is None else param.detach()[start:end]
            return value if device is None else value.to(device)
        key = self._unsplit_name(param)
        if key in self.sources:
            value = torch.empty((end - start, *param.shape[1:]), dtype=param.dtype, device=device)
            with torch.no_grad():
                value.copy_(self.sources[key](rows))
            return value
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        self._initialise(key, value)
        return value if rows is None else value[start:end]

    def _unsplit_name(self, param: nn.Parameter) -> str:
        """The name under which ``named_parameters`` lists ``param`` (a tied LM head: ``wte.weight``)."""
        return next(name for name, p in self.named_parameters() if p is param)

    @torch.no_grad()
    def _initialise(self, name: str, value: torch.Tensor) -> None:
        """Fill ``value`` as parameter ``name`` starts, drawn from a CPU generator seeded by
        (``init_seed``, name), so that every device and every rank draws the same numbers."""
        owner, _, kind = name.rpartition(".")
        if isinstance(self.get_submodule(owner), NORMS):
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


def sequence_length(module: nn.Module, x: torch.Tensor) -> int:
    """The whole sequence's length (with sequence parallelism, not only this rank's share) of
    the hidden states ``x`` [B, T, C] in ``module``, checked to fit its ``config.block_size``."""
    sp = module.sequence_parallel
    t = sp.seq_len if sp else x.shape[1]
    block_size = module.config.block_size
    if t > block_size:
        raise PipeloomError(f"sequence of {t} tokens exceeds block_size {block_size}; use at most {block_size} tokens")
    return t


def embed(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The first layer's input for ``tokens`` [B, T]: ``module``'s token embedding
    ``wte`` through its family's :meth:`Decoder.add_positions`."""
    if tokens.dim() != 2:
        raise PipeloomError(f"tokens must have shape [batch, time], got {list(tokens.shape)}")
    return module.add_positions(module, module.wte(tokens))


def layer_counts(n_layer: int, n_stages, layers_per_stage) -> tuple[int, ...]:
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


class DecoderStage(nn.Module):
    """Stage ``index`` of ``n_stages``: the blocks ``layers`` (global
    indices) of a :class:`Decoder`, plus the embeddings on the first stage
    (input: tokens [B, T]) and the final norm and LM head on the last
    (output: logits [B, T, V]); other inputs and outputs are hidden states
    [B, T, C]. With ``vocab_parallel`` the token embedding and the LM head
    are left out (see :meth:`Decoder.split`). One tensor in, one out, so ``torch.distributed.pipelining``'s
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

    #: Set by a sequence-parallel runtime (see :class:`SequenceParallel`).
    sequence_parallel: SequenceParallel | None = None

    def __init__(self, model: Decoder, index: int, n_stages: int, layers: range, vocab_parallel: bool = False):
        super().__init__()
        self.index, self.n_stages, self.layers = index, n_stages, layers
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.vocab_parallel, self.config = vocab_parallel, model.config
        self.add_positions = model.add_positions  # the family's (a static method: no reference to the model)
        if self.is_first:
            for name in model.input_names:
                setattr(self, name, getattr(model, name))
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
            x = self.add_positions(self, x) if self.vocab_parallel else embed(self, x)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.ln_f(x) if self.vocab_parallel else self.lm_head(self.ln_f(x))
        return x


def _head_copy(model: Decoder) -> Linear:
    """An LM head whose weight is a new parameter equal to ``model``'s token embedding."""
    head = Linear(model.config.n_embd, model.config.vocab_size, bias=False, device="meta")
    head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return head
