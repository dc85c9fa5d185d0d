"""``hf-causal-lm``: any Hugging Face ``transformers`` causal-LM family, built tiny from a config, on the Python docs.

The task exists so that a recipe can be judged on the layer layouts real models use (RMSNorm, rotary positions,
gated MLPs, grouped-query attention, mixture-of-experts routing) and not only on the zoo's own GPT.  Nothing is
downloaded: the model is ``AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")`` of a config
written here from the options, with freshly initialised (random) weights.

Families (option ``family``) and the config fields the options set:

=============  =====================================================================================
``llama``      ``LlamaConfig``: RMSNorm, rotary, SwiGLU MLP, grouped-query attention (``kv_heads``)
``qwen2``      ``Qwen2Config``: as llama, with biases on q/k/v
``qwen3``      ``Qwen3Config``: as llama, with RMSNorm on q and k
``mistral``    ``MistralConfig``: as llama (sliding window off: the context is shorter than any window)
``gpt2``       ``GPT2Config``: LayerNorm, learned positions, GELU MLP, full multi-head attention only
``mixtral``    ``MixtralConfig``: llama attention, ``experts`` SwiGLU experts, ``top_k`` routed per token
``qwen2_moe``  ``Qwen2MoeConfig``: qwen2 attention, ``experts`` routed experts plus one shared expert
``qwen3_moe``  ``Qwen3MoeConfig``: qwen3 attention, ``experts`` routed experts
=============  =====================================================================================

Sizes: ``hidden`` (model width), ``layers``, ``heads`` (``hidden`` must be a multiple), ``kv_heads`` (key/value
heads for grouped-query attention; default ``heads // 2``, at least 1; must divide ``heads``; gpt2 has none),
``intermediate`` (MLP width, per expert for the MoE families; default ``4 * hidden`` for gpt2's two-matrix GELU
MLP and ``2 * hidden`` for the three-matrix gated MLPs, so both hold about ``8 * hidden**2`` weights a layer),
``experts`` (default 4) and ``top_k`` (default 2) for the MoE families only, ``context`` (tokens per window,
also the config's ``max_position_embeddings``), ``tie_embeddings`` (share the input embedding and the LM head;
default False).  Dropout is 0 everywhere: a training step must be a pure function of the weights and the batch.
The MoE families have ``output_router_logits=False``, so the router's load-balancing auxiliary loss is not
added: the loss is the language-model cross-entropy alone, comparable across families.  A recipe is applied by
``lowprec.nn.convert`` (as for any task): ``nn.Linear``, GPT-2's ``Conv1D`` and the MoE families' experts (fused
3-d parameters in transformers 5) become emulated modules, the routers stay float32, and a ``NAME+attn`` recipe
emulates attention too; the conversion report lists what stayed float32 (docs/transformers.md).

Data: the Python documentation text of ``gpt-bytes`` (``pydoc_data.topics``, about 465 KB of UTF-8; see
``_text``), split at 90 % of its bytes, moved back to a character boundary, into training and validation text
(independent of the seed).  ``tokenizer`` chooses the tokens:

* ``"bytes"`` (default): the UTF-8 bytes themselves, vocabulary 256, nothing added (no special tokens);
* ``"bpe"``: a byte-level BPE with ``vocab_size`` entries (256 byte symbols plus merges, no special tokens),
  trained with the ``tokenizers`` library on the training text only (the validation text never shapes the
  vocabulary).  Training it is deterministic (the same merges in every process, whatever the hash seed: the
  tests check this), takes about a second, and is cached per process; ``data_source`` names the ``tokenizers``
  version, since another version may merge differently, and ``data_hash`` (sha256 of the token ids) tells runs
  on different token streams apart.

Batches are dicts ``{"input_ids": [B, context], "labels": [B, context]}`` (int64), Hugging Face style, with
``labels`` equal to ``input_ids``: the model shifts the labels itself (position ``t`` predicts token ``t + 1``),
so a window of ``context`` tokens trains ``context - 1`` next-token predictions, and its loss is
``model(**batch).loss`` (the Task's default ``model_loss``).  The windows of step ``s`` start at offsets drawn
uniformly from the training tokens by a generator seeded with ``(seed, "hf-causal-lm/train", s)``, so the batch
is a pure function of ``(seed, step)``.  Validation uses the fixed windows starting at ``i * (context - 1)``,
which overlap by one token, so that every validation token after the first is predicted exactly once.

Metrics: ``loss`` (mean next-token cross-entropy in nats over the validation tokens, "min") and ``perplexity``
(its exp, "min").  At initialisation the loss is about ``ln(vocab)`` (5.55 for bytes).  The model is initialised
inside ``seeded(seed)`` (transformers' own ``_init_weights``: normal with std ``initializer_range`` = 0.02 from
torch's global generator), so the same seed gives the same weights bit for bit and the caller's random state is
untouched.

``transformers`` (and ``tokenizers``, which it requires) are the optional extra ``lowprec[transformers]``; they
are imported when the task is built, never when ``lowprec`` or ``lowprec.runs`` is imported.
"""

from __future__ import annotations

import functools
import math
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

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
    hash_arrays,
    make_defaults,
    model_device,
    restoring_mode,
    seeded,
)
from ._text import text_bytes

NAME = "hf-causal-lm"
DENSE = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
"""Dense families (one MLP a layer)."""
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts families (options ``experts`` and ``top_k``)."""
FAMILIES = DENSE + MOE
"""Every value of the option ``family``: each builds from a tiny config and trains on the CPU."""
TOKENIZERS = ("bytes", "bpe")
INSTALL = f"{NAME} needs transformers: pip install 'lowprec[transformers]'"
"""The message of the UsageError raised when ``transformers`` (or ``tokenizers``) cannot be imported."""
_TRAIN_FRACTION = 0.9
_EVAL_CHUNK = 64  # validation windows per forward pass
Batch = dict[str, torch.Tensor]


def _require(module: str) -> Any:
    """``import module`` (``transformers`` or ``tokenizers``), or the UsageError that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"{INSTALL} (importing {module} failed: {e})") from None


# ---------------------------------------------------------------------------------------------- data


def split_text() -> tuple[str, str]:
    """``(train, validation)`` text: the docs' UTF-8 bytes cut at 90 %, moved back to a character boundary."""
    data = text_bytes()
    cut = int(len(data) * _TRAIN_FRACTION)
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not the start of a character
        cut -= 1
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")


@functools.lru_cache(maxsize=4)
def bpe_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` entries trained on the training text only.

    Byte-level pre-tokenisation (GPT-2's regex split, no prefix space), all 256 byte symbols in the initial
    alphabet (so any text encodes, nothing maps to an unknown token), ``min_frequency=2``, no special tokens.
    Deterministic; cached per process (one per ``vocab_size``).
    """
    tokenizers = _require("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([split_text()[0]], trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def token_ids(tokenizer: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(train ids, validation ids, vocabulary size)`` (int64) for ``tokenizer`` ``"bytes"`` or ``"bpe"``;
    cached per process (treat the tensors as read-only)."""
    train, val = split_text()
    if tokenizer == "bytes":
        def enc(s: str) -> torch.Tensor:
            return torch.frombuffer(bytearray(s.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
        return enc(train), enc(val), 256
    tok = bpe_tokenizer(vocab_size)

    def encode(s: str) -> torch.Tensor:
        return torch.tensor(tok.encode(s).ids, dtype=torch.int64)
    return encode(train), encode(val), int(tok.get_vocab_size())


def _train_batches(train: torch.Tensor, *, context: int, batch_size: int, seed: int) -> Callable[[int], Batch]:
    """``step -> {"input_ids", "labels"}``: ``batch_size`` windows of ``context`` training tokens at offsets drawn
    from a generator seeded with ``(seed, step)``; ``labels`` is a copy of ``input_ids`` (the model shifts)."""

    def train_batch(step: int) -> Batch:
        g = torch.Generator().manual_seed(derive_seed(seed, f"{NAME}/train", check_step(step)))
        starts = torch.randint(0, len(train) - context + 1, (batch_size,), generator=g)
        w = train[starts[:, None] + torch.arange(context)]  # [B, context]
        return {"input_ids": w, "labels": w.clone()}

    return train_batch


def _eval_windows(val: torch.Tensor, context: int) -> torch.Tensor:
    """``[W, context]``: the validation windows starting at ``i * (context - 1)`` (one token of overlap)."""
    n = (len(val) - 1) // (context - 1)
    return val[torch.arange(n)[:, None] * (context - 1) + torch.arange(context)]


def _evaluator(windows: torch.Tensor, vocab: int) -> Callable[[torch.nn.Module], dict[str, float]]:
    """Mean next-token loss (nats; float64 sum) over the validation windows, and its exp."""
    count = windows.shape[0] * (windows.shape[1] - 1)

    @restoring_mode
    def evaluate(m: torch.nn.Module) -> dict[str, float]:
        device = model_device(m)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for chunk in windows.to(device).split(_EVAL_CHUNK):
            logits = m(input_ids=chunk).logits[:, :-1].float()  # [w, context-1, vocab]
            total += F.cross_entropy(logits.reshape(-1, vocab), chunk[:, 1:].reshape(-1), reduction="sum").double()
        loss = float(total / count)
        return {"loss": loss, "perplexity": math.exp(loss)}

    return evaluate


# ---------------------------------------------------------------------------------------------- model


def model_config(family: str, *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int | None,
                 intermediate: int, experts: int | None, top_k: int | None, context: int,
                 tie_embeddings: bool) -> Any:
    """The ``transformers`` config of ``family`` for these sizes (checked options; see the module docstring)."""
    transformers = _require("transformers")
    common: dict[str, Any] = {"vocab_size": vocab, "tie_word_embeddings": tie_embeddings, "pad_token_id": None,
                              "bos_token_id": None, "eos_token_id": None}
    kw: dict[str, Any]
    if family == "gpt2":
        kw = {"n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": context, "n_inner": intermediate,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    else:
        kw = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "intermediate_size": intermediate,
              "max_position_embeddings": context, "attention_dropout": 0.0}
    if family in ("mistral", "mixtral"):
        kw["sliding_window"] = None
    if family == "mixtral":
        kw.update(num_local_experts=experts, num_experts_per_tok=top_k, router_jitter_noise=0.0,
                  output_router_logits=False)
    elif family in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=intermediate,
                  decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        if family == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = intermediate
    return transformers.AutoConfig.for_model(family, **common, **kw)


def _check_options(family: Any, hidden: Any, layers: Any, heads: Any, kv_heads: Any, intermediate: Any,
                   experts: Any, top_k: Any, context: Any, tokenizer: Any, vocab_size: Any,
                   tie_embeddings: Any) -> dict[str, Any]:
    """The resolved options (defaults filled in), or a UsageError naming the option, the value and the fix."""
    family = check_choice("family", family, FAMILIES, task=NAME)
    hidden = check_int("hidden", hidden, 8, 4096, task=NAME)
    layers = check_int("layers", layers, 1, 48, task=NAME)
    heads = check_int("heads", heads, 1, 64, task=NAME)
    if hidden % heads:
        fits = [h for h in range(1, min(heads, hidden) + 1) if hidden % h == 0][-1]
        raise UsageError(f"task {NAME!r}: option hidden ({hidden}) must be a multiple of heads ({heads}): set "
                         f"hidden = {heads * max(1, round(hidden / heads))} or heads = {fits}")
    if (hidden // heads) % 2 and family != "gpt2":
        raise UsageError(f"task {NAME!r}: family {family!r} uses rotary positions, which need an even head width; "
                         f"hidden // heads = {hidden // heads}: change hidden or heads")
    if family == "gpt2":
        if kv_heads not in (None, heads):
            raise UsageError(f"task {NAME!r}: option kv_heads: family 'gpt2' has no grouped-query attention (every "
                             f"head has its own keys and values); leave kv_heads out or set it to heads ({heads})")
        kv_heads = None
    else:
        kv_heads = max(1, heads // 2) if kv_heads is None else check_int("kv_heads", kv_heads, 1, heads, task=NAME)
        if heads % kv_heads:
            raise UsageError(f"task {NAME!r}: option kv_heads ({kv_heads}) must divide heads ({heads}): each "
                             "key/value head serves the same number of query heads")
    default_mlp = 4 * hidden if family == "gpt2" else 2 * hidden
    intermediate = default_mlp if intermediate is None else check_int("intermediate", intermediate, 1, 65536,
                                                                      task=NAME)
    if family in MOE:
        experts = 4 if experts is None else check_int("experts", experts, 1, 256, task=NAME)
        top_k = 2 if top_k is None else check_int("top_k", top_k, 1, 256, task=NAME)
        if top_k > experts:
            raise UsageError(f"task {NAME!r}: option top_k ({top_k}) must be at most experts ({experts})")
    else:
        for opt, value in (("experts", experts), ("top_k", top_k)):
            if value is not None:
                raise UsageError(f"task {NAME!r}: option {opt} applies to the mixture-of-experts families only "
                                 f"({', '.join(MOE)}); leave it out for family {family!r}")
    context = check_int("context", context, 2, 8192, task=NAME)
    tokenizer = check_choice("tokenizer", tokenizer, TOKENIZERS, task=NAME)
    if tokenizer == "bpe":
        vocab_size = 1024 if vocab_size is None else check_int("vocab_size", vocab_size, 257, 65536, task=NAME)
    elif vocab_size not in (None, 256):
        raise UsageError(f"task {NAME!r}: option vocab_size applies to tokenizer = 'bpe' only (tokenizer 'bytes' "
                         "has 256 tokens); set tokenizer = 'bpe' or leave vocab_size out")
    else:
        vocab_size = 256
    tie_embeddings = check_choice("tie_embeddings", tie_embeddings, [False, True], task=NAME)
    return {"family": family, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "intermediate": intermediate, "experts": experts, "top_k": top_k, "context": context,
            "tokenizer": tokenizer, "vocab_size": vocab_size, "tie_embeddings": tie_embeddings}


@task
def hf_causal_lm(
    *, seed: int, batch_size: int | None = None, family: str = "llama", hidden: int = 64, layers: int = 2,
    heads: int = 4, kv_heads: int | None = None, intermediate: int | None = None, experts: int | None = None,
    top_k: int | None = None, context: int = 64, tokenizer: str = "bytes", vocab_size: int | None = None,
    tie_embeddings: bool = False,
) -> Task:
    """A tiny ``transformers`` causal LM of ``family`` on the Python docs.  Default: llama, hidden 64, 2 layers,
    4 heads (2 key/value heads), MLP 128, context 64, byte tokens, 32 windows a step, AdamW."""
    opts = _check_options(family, hidden, layers, heads, kv_heads, intermediate, experts, top_k, context, tokenizer,
                          vocab_size, tie_embeddings)
    transformers = _require("transformers")
    bs = check_batch_size(batch_size, 32, task=NAME, most=4096)
    train, val, vocab = token_ids(opts["tokenizer"], opts["vocab_size"])
    ctx = opts["context"]
    if len(val) < 2 * ctx:
        raise UsageError(f"task {NAME!r}: option context ({ctx}) is too long for the {len(val)} validation tokens; "
                         f"use context <= {len(val) // 2}")
    config = model_config(opts["family"], vocab=vocab, hidden=opts["hidden"], layers=opts["layers"],
                          heads=opts["heads"], kv_heads=opts["kv_heads"], intermediate=opts["intermediate"],
                          experts=opts["experts"], top_k=opts["top_k"], context=ctx,
                          tie_embeddings=opts["tie_embeddings"])
    with seeded(seed):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's class name does not tell transformers its loss (a warning)
    model.train()
    windows = _eval_windows(val, ctx)
    if opts["tokenizer"] == "bpe":
        tokens = (f"a byte-level BPE of {vocab} tokens trained on the training text with tokenizers "
                  f"{_require('tokenizers').__version__}")
    else:
        tokens = "UTF-8 bytes (256 tokens)"
    data_source = (
        f"pydoc_data.topics.topics of Python {platform.python_version()} ({platform.python_implementation()}): the "
        f"standard library's help-topic text, values joined in sorted-key order; tokens: {tokens}; "
        f"{len(train)} training tokens (first 90% of the bytes), {len(val)} validation tokens"
    )
    info: dict[str, Any] = {
        "family": opts["family"], "model_class": type(model).__name__, "params": count_params(model),
        "vocab": vocab, "transformers": transformers.__version__, "n_train_tokens": len(train),
        "n_val_tokens": len(val), "val_windows": int(windows.shape[0]), "tokens_per_step": bs * ctx,
        "options": opts,
    }
    if opts["family"] in MOE:
        info["router_aux_loss"] = "off (output_router_logits=False): the loss is the LM cross-entropy only"
    return Task(
        name=NAME,
        model=model,
        train_batch=_train_batches(train, context=ctx, batch_size=bs, seed=seed),
        evaluate=_evaluator(windows, vocab),
        metrics={"loss": "min", "perplexity": "min"},
        data_hash=hash_arrays(train, val),
        data_source=data_source,
        samples_per_step=bs,
        defaults=make_defaults(steps=300, lr=3e-3, optimizer="adamw", eval_interval=100, batch_size=bs, warmup=30),
        info=info,
    )
