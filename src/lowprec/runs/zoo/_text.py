"""``gpt-bytes``: a tiny GPT-style byte-level language model on the Python documentation.

Data: the ``topics`` dict of ``pydoc_data.topics`` (the text behind ``help('keywords')`` etc., about 465 K
characters of English prose and code that ship with every CPython), values joined in sorted-key order and
encoded as UTF-8.  Nothing is downloaded, but the text differs between Python versions, so ``data_source`` names
the version and ``data_hash`` (sha256 of the bytes) tells runs on different texts apart.  The first 90 % of the
bytes are for training, the last 10 % for validation (contiguous, independent of the seed).

Training batches are ``batch_size`` windows of ``context + 1`` bytes starting at offsets drawn uniformly from the
training part by a generator seeded with ``(seed, step)``; inputs are the first ``context`` bytes, targets the
last ``context`` (next-byte prediction).  Validation uses the fixed windows ``[i*context, (i+1)*context + 1)``,
so every validation byte after the first is predicted exactly once.

Model (pre-norm GPT-2 layout): token + learned position embeddings, ``layers`` blocks of
``x + attn(LN(x))`` and ``x + mlp(LN(x))`` with Linear ``qkv`` [d->3d], ``proj`` [d->d], ``fc`` [d->4d],
``out`` [4d->d], a final LayerNorm and a Linear ``lm_head`` [d->256] (untied unless ``tie_head=True``).  Weights
are N(0, 0.02), residual output projections N(0, 0.02/sqrt(2*layers)), biases zero.  Metrics: ``loss`` (mean
next-byte cross-entropy in nats, "min") and ``perplexity`` (exp of that loss, "min").
"""

from __future__ import annotations

import functools
import hashlib
import math
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..._errors import UsageError
from ._declare import task
from ._task import (
    Task,
    check_batch_size,
    check_choice,
    check_int,
    check_step,
    count_params,
    derive_seed,
    make_defaults,
    model_device,
    restoring_mode,
    seeded,
)

VOCAB = 256
_TRAIN_FRACTION = 0.9
_EVAL_CHUNK = 128  # validation windows per forward pass
TrainBatch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@functools.lru_cache(maxsize=1)
def text_bytes() -> bytes:
    """The UTF-8 bytes of ``pydoc_data.topics.topics``, values in sorted-key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions split the standard library's docs into a separate package
        raise UsageError(
            f"task 'gpt-bytes' needs the standard-library module pydoc_data.topics, which this Python "
            f"({platform.python_version()}) lacks ({e}); install your distribution's full Python standard library"
        ) from None
    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B,T,3d]; under tensor parallelism [B,T,3d/TP] (whole heads) and T the whole sequence
        b, t = qkv.shape[:2]
        q, k, v = qkv.view(b, t, 3, -1, x.shape[-1] // self.heads).permute(2, 0, 3, 1, 4)  # 3x[B,H,T,d/H]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B,H,T,d/H]
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """``[B,T]`` int64 bytes -> ``[B,T,256]`` float32 next-byte logits (``T <= context``)."""

    def __init__(self, *, layers: int, d_model: int, heads: int, context: int, tie_head: bool) -> None:
        super().__init__()
        self.context = context
        self.tok_embed = nn.Embedding(VOCAB, d_model)
        self.pos_embed = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
        if tie_head:
            self.lm_head.weight = self.tok_embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = embed(self.tok_embed, self.pos_embed, idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def pipeline_pieces(self) -> list[tuple[str, nn.Module]]:
        """The forward as a chain for pipeline parallelism (``lowprec.distributed.split_stages``): ``embed``,
        ``blocks.0`` .. ``blocks.{L-1}``, ``ln_f``, ``lm_head`` (the model's own modules)."""
        return [("embed", Embed(self.tok_embed, self.pos_embed)),
                *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
                ("ln_f", self.ln_f), ("lm_head", self.lm_head)]


def embed(tok_embed: nn.Embedding, pos_embed: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """``[B,T]`` int64 bytes -> ``[B,T,d]`` token + learned position embeddings (``T <= context``)."""
    t = idx.shape[1]
    if t > pos_embed.num_embeddings:
        raise UsageError(f"sequence length {t} exceeds the model's context {pos_embed.num_embeddings}")
    return tok_embed(idx) + pos_embed.weight[:t]


class Embed(nn.Module):
    """TinyGPT's first step as a module of its own (a pipeline piece), over the model's embedding modules."""

    def __init__(self, tok_embed: nn.Embedding, pos_embed: nn.Embedding) -> None:
        super().__init__()
        self.tok_embed, self.pos_embed = tok_embed, pos_embed

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embed(self.tok_embed, self.pos_embed, idx)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats): logits ``[B,T,256]``, targets ``[B,T]`` int64 -> 0-d tensor."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train_batches(train: torch.Tensor, *, context: int, batch_size: int, seed: int) -> TrainBatch:
    """``step -> (inputs, targets)``: ``batch_size`` random windows of the training bytes, ``[B, context]`` each."""

    def train_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(derive_seed(seed, "gpt-bytes/train", check_step(step)))
        starts = torch.randint(0, len(train) - context, (batch_size,), generator=g)
        w = train[starts[:, None] + torch.arange(context + 1)]  # [B, context+1]
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    return train_batch


def _evaluator(val: torch.Tensor, *, context: int) -> Callable[[nn.Module], dict[str, float]]:
    """Mean next-byte loss (and its exp) over the windows ``[i*context, (i+1)*context + 1)`` of ``val``."""
    n_windows = (len(val) - 1) // context
    windows = val[torch.arange(n_windows)[:, None] * context + torch.arange(context + 1)]  # [W, context+1]

    @restoring_mode
    def evaluate(m: nn.Module) -> dict[str, float]:
        device = model_device(m)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for chunk in windows.to(device).split(_EVAL_CHUNK):
            logits = m(chunk[:, :-1])  # [w, context, 256]
            total += F.cross_entropy(logits.reshape(-1, VOCAB), chunk[:, 1:].reshape(-1), reduction="sum").double()
        loss = float(total / (n_windows * context))
        return {"loss": loss, "perplexity": math.exp(loss)}

    return evaluate


@task
def gpt_bytes(
    *, seed: int, batch_size: int | None = None, layers: int = 2, d_model: int = 64, heads: int = 4,
    context: int = 64, tie_head: bool = False,
) -> Task:
    """Tiny byte-level GPT.  Default: 2 layers, d_model 64, 4 heads, context 64, 32 windows/step, AdamW."""
    name = "gpt-bytes"
    layers = check_int("layers", layers, 1, 48, task=name)
    heads = check_int("heads", heads, 1, 64, task=name)
    d_model = check_int("d_model", d_model, 8, 4096, task=name)
    if d_model % heads:
        raise UsageError(f"task {name!r}: option d_model must be a multiple of heads ({heads}); got {d_model}")
    context = check_int("context", context, 2, 1024, task=name)
    tie_head = check_choice("tie_head", tie_head, [False, True], task=name)
    bs = check_batch_size(batch_size, 32, task=name, most=4096)
    data = text_bytes()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
    split = int(len(tokens) * _TRAIN_FRACTION)
    train, val = tokens[:split], tokens[split:]
    with seeded(seed):
        model = TinyGPT(layers=layers, d_model=d_model, heads=heads, context=context, tie_head=tie_head)
    options = {"layers": layers, "d_model": d_model, "heads": heads, "context": context, "tie_head": tie_head}
    return Task(
        name=name,
        model=model,
        train_batch=_train_batches(train, context=context, batch_size=bs, seed=seed),
        loss_fn=lm_loss,
        evaluate=_evaluator(val, context=context),
        metrics={"loss": "min", "perplexity": "min"},
        data_hash=hashlib.sha256(data).hexdigest(),
        data_source=(
            f"pydoc_data.topics.topics of Python {platform.python_version()} ({platform.python_implementation()}): "
            f"the standard library's help-topic text, values joined in sorted-key order, UTF-8, {len(data)} bytes; "
            f"first {split} bytes train, last {len(val)} bytes validation"
        ),
        samples_per_step=bs,
        defaults=make_defaults(steps=600, lr=3e-3, optimizer="adamw", eval_interval=100, batch_size=bs, warmup=50),
        info={"n_train_bytes": len(train), "n_val_bytes": len(val), "val_windows": (len(val) - 1) // context,
              "tokens_per_step": bs * context, "params": count_params(model), "options": options},
    )
