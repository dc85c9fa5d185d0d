"""Tests for the zoo task ``hf-causal-lm`` (transformers causal-LM families built from a config, on the Python docs).

Oracles: ``ln(vocab)`` for the loss of a freshly initialised model (near-uniform predictions); an independent
cross-entropy of the logits with the targets shifted by hand (the model's own label shift); the same computation
run twice (bitwise, ``torch.equal``) and in a second interpreter with another hash seed (the BPE merges); the
UTF-8 text itself (byte tokens, BPE round trip); the run store of a real ``run_config`` run; and the definition
of each error message (which option, which value, the fix).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lowprec import UsageError
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import run_config
from lowprec.runs._store import RunStore
from lowprec.runs.zoo import get_task, hash_arrays, names
from lowprec.runs.zoo._hf import FAMILIES, INSTALL, MOE, bpe_tokenizer, split_text, token_ids

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = {"hidden": 32, "layers": 1, "heads": 4, "context": 16}  # fast options for tests that need no default size


@pytest.fixture(scope="module")
def fresh_process() -> dict[str, Any]:
    """Facts from one fresh interpreter (one torch import for two tests; another hash seed than this one):
    which of transformers/tokenizers ``import lowprec.runs`` loads, then the sha256 of a BPE trained there."""
    code = ("import hashlib, json, sys, lowprec, lowprec.runs, lowprec.runs.zoo\n"
            "loaded = [m for m in ('transformers', 'tokenizers') if m in sys.modules]\n"
            "from lowprec.runs.zoo._hf import bpe_tokenizer\n"
            "sha = hashlib.sha256(bpe_tokenizer(512).to_str().encode()).hexdigest()\n"
            "print(json.dumps({'imported_by_lowprec_runs': loaded, 'bpe_sha256': sha}))")
    env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONHASHSEED="12345", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _task(seed: int = 0, **kw: object):
    return get_task("hf-causal-lm", seed=seed, batch_size=kw.pop("batch_size", 4), **{**TINY, **kw})  # type: ignore


def test_registered_as_a_builtin_task() -> None:
    assert "hf-causal-lm" in names()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_builds_trains_a_step_and_starts_near_ln_vocab(family: str) -> None:
    # Oracle: ln(256) = 5.545 for near-uniform initial predictions (init std 0.02); one AdamW step stays finite.
    t = _task(family=family)
    assert t.info["family"] == family and t.info["vocab"] == 256 and t.info["params"] > 0
    assert t.info["transformers"] and t.info["options"]["family"] == family
    if family in MOE:
        assert t.model.config.output_router_logits is False and "router_aux_loss" in t.info
    if family != "gpt2":  # grouped-query attention: default kv_heads = heads // 2
        assert t.model.config.num_key_value_heads == 2
    batch = t.train_batch(0)
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].shape == (4, 16)
    assert torch.equal(batch["input_ids"], batch["labels"])
    opt = torch.optim.AdamW(t.model.parameters(), lr=1e-3)
    loss = t.loss_fn(t.model(**batch), batch)
    assert loss.dim() == 0 and abs(loss.item() - math.log(256)) < 0.15, loss.item()
    loss.backward()
    opt.step()
    assert math.isfinite(t.loss_fn(t.model(**t.train_batch(1)), None).item())


def test_model_loss_is_next_token_cross_entropy_over_the_window() -> None:
    # Oracle: cross-entropy of logits[:, :-1] against input_ids[:, 1:] computed here (labels = input_ids, and
    # transformers shifts them internally: context tokens give context - 1 predictions).
    t = _task()
    batch = t.train_batch(3)
    out = t.model(**batch)
    want = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), batch["input_ids"][:, 1:].reshape(-1))
    assert torch.allclose(out.loss, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_same_seed_same_params_and_batches_other_seed_differs(family: str) -> None:
    torch.manual_seed(1)  # the caller's global state must not matter ...
    a = _task(7, family=family)
    state = torch.get_rng_state()
    b = _task(7, family=family)
    assert torch.equal(state, torch.get_rng_state())  # ... and building leaves it untouched
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    assert all(torch.equal(a.train_batch(s)["input_ids"], b.train_batch(s)["input_ids"]) for s in (0, 5))
    c = _task(8, family=family)
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters(), strict=True))
    assert not torch.equal(a.train_batch(0)["input_ids"], c.train_batch(0)["input_ids"])


def test_train_batch_is_a_pure_function_of_seed_and_step() -> None:
    fresh = _task(5)
    expected = [fresh.train_batch(s) for s in range(12)]
    other = _task(5)
    for s in [11, 3, 0, 7, 3, 11, 0]:
        got = other.train_batch(s)
        assert torch.equal(got["input_ids"], expected[s]["input_ids"]), s
        assert torch.equal(got["labels"], expected[s]["labels"]), s


def test_byte_tokens_are_the_utf8_text_and_data_hash_is_of_the_token_ids() -> None:
    # Oracle: the UTF-8 bytes of the split text; the split is at a character boundary near 90 %.
    train_text, val_text = split_text()
    train, val, vocab = token_ids("bytes", 256)
    assert vocab == 256 and bytes(train.to(torch.uint8).tolist()) == train_text.encode()
    assert bytes(val.to(torch.uint8).tolist()) == val_text.encode()
    assert abs(len(train) / (len(train) + len(val)) - 0.9) < 1e-4
    a, b = _task(0), _task(99)
    assert a.data_hash == b.data_hash == hash_arrays(train, val)
    assert "Python" in a.data_source and "UTF-8 bytes" in a.data_source


def test_eval_metrics_keys_values_and_seed_independence() -> None:
    a, b = _task(0), _task(3)
    m = a.evaluate(a.model)
    assert set(m) == set(a.metrics) == {"loss", "perplexity"} and set(a.metrics.values()) == {"min"}
    assert abs(m["loss"] - math.log(256)) < 0.15 and math.isclose(m["perplexity"], math.exp(m["loss"]))
    assert a.model.training  # evaluate restored training mode
    assert b.evaluate(a.model) == m  # the held-out windows do not depend on the seed
    # every validation token after the first is predicted once, up to the last partial window
    _, val, _ = token_ids("bytes", 256)
    assert a.info["val_windows"] == (len(val) - 1) // 15


def test_bpe_tokenizer_is_deterministic_and_trained_on_the_training_text(fresh_process: dict[str, Any]) -> None:
    import tokenizers

    first = bpe_tokenizer.__wrapped__(512).to_str()  # two trainings in this process ...
    assert bpe_tokenizer.__wrapped__(512).to_str() == first
    assert fresh_process["bpe_sha256"] == hashlib.sha256(first.encode()).hexdigest()  # ... and in another one
    t = _task(tokenizer="bpe", vocab_size=512)
    train, val, vocab = token_ids("bpe", 512)
    assert vocab == 512 == t.info["vocab"] and int(train.max()) < 512 and int(val.max()) < 512
    assert bpe_tokenizer(512).decode(val.tolist()) == split_text()[1]  # byte-level: lossless round trip
    assert f"tokenizers {tokenizers.__version__}" in t.data_source
    assert t.data_hash != _task().data_hash
    assert t.model.get_input_embeddings().weight.shape[0] == 512
    assert abs(t.evaluate(t.model)["loss"] - math.log(512)) < 0.15


def test_missing_transformers_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(UsageError, match=r"hf-causal-lm needs transformers: pip install 'lowprec\[transformers\]'"):
        _task()
    assert INSTALL == "hf-causal-lm needs transformers: pip install 'lowprec[transformers]'"


def test_importing_lowprec_runs_does_not_import_transformers(fresh_process: dict[str, Any]) -> None:
    assert fresh_process["imported_by_lowprec_runs"] == []


def test_a_short_run_through_the_runner_records_the_loss(tmp_path: Path) -> None:
    cfg = RunConfig(model="hf-causal-lm", model_options={"family": "llama", "hidden": 32, "context": 32},
                    batch_size=8, steps=20, eval_interval=10, store=str(tmp_path / "runs.db"))
    with RunStore(cfg.store) as store:
        (rid,) = run_config(cfg, store=store, progress=False)
        rec = store.get_run(rid)
        steps, loss = store.scalars(rid)["train/loss"]
        eval_steps, _ = store.scalars(rid)["eval/perplexity"]
    assert rec.status == "completed"
    assert steps.tolist() == list(range(1, 21)) and all(math.isfinite(v) for v in loss)
    assert loss[-1] < loss[0]  # AdamW at the task's lr learns the byte frequencies within 20 steps
    assert eval_steps.tolist() == [10, 20]
    task = get_task("hf-causal-lm", seed=rec.manifest["seed"], family="llama", hidden=32, context=32)
    assert rec.manifest["data_hash"] == task.data_hash and rec.manifest["metrics"] == task.metrics


@pytest.mark.parametrize(("options", "needle"), [
    ({"family": "bert"}, r"option family must be one of \['llama', 'qwen2', 'qwen3', 'mistral', 'gpt2', 'mixtral', "
                         r"'qwen2_moe', 'qwen3_moe'\]; got 'bert'"),
    ({"hidden": 30, "heads": 4}, r"option hidden \(30\) must be a multiple of heads \(4\): set hidden = 32 or "
                                 r"heads = 3"),
    ({"heads": 4, "kv_heads": 3}, r"option kv_heads \(3\) must divide heads \(4\)"),
    ({"family": "gpt2", "kv_heads": 2}, r"option kv_heads: family 'gpt2' has no grouped-query attention"),
    ({"experts": 8}, r"option experts applies to the mixture-of-experts families only"),
    ({"family": "mixtral", "experts": 2, "top_k": 3}, r"option top_k \(3\) must be at most experts \(2\)"),
    ({"vocab_size": 1000}, r"option vocab_size applies to tokenizer = 'bpe' only"),
    ({"tokenizer": "wordpiece"}, r"option tokenizer must be one of \['bytes', 'bpe'\]"),
    ({"hidden": 24, "heads": 8}, r"rotary positions, which need an even head width"),
    ({"hidden_size": 64}, r"task 'hf-causal-lm' has no option 'hidden_size'; its options are: family, hidden"),
])
def test_invalid_options_name_the_option_and_the_fix(options: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        get_task("hf-causal-lm", seed=0, **options)


def test_the_documented_config_builds() -> None:
    # Oracle: RunConfig.from_toml (the parser `lowprec run` uses) and the task itself accept docs/runs.md's example.
    import re

    text = (SRC.parent / "docs" / "runs.md").read_text()
    section = text.split("### `hf-causal-lm`", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```text\n# run config \(TOML\)\n(.*?)```", section, flags=re.S)
    cfg = RunConfig.from_toml(block, where="docs/runs.md")
    assert cfg.model == "hf-causal-lm" and cfg.model_options["family"] == "mixtral"
    t = get_task(cfg.model, seed=0, batch_size=2, **cfg.model_options)
    assert t.info["family"] == "mixtral" and t.model.config.num_local_experts == 4
