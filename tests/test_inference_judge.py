"""lowprec.inference's accuracy judge: per-token statistics against independent formulas (scipy), the bootstrap's
false-PASS rate at a threshold (a statistical test with its error rate stated), greedy divergence on a model whose
logits are set by hand, logit tolerances, the three-way mode, the run store and the HTML report."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from torch import nn

from lowprec import UsageError
from lowprec import inference as inf
from lowprec.inference._compare import Comparison
from lowprec.runs import RunStore


class Logits(nn.Module):
    """Returns fixed logits for the example indices it is given: ``model(idx) = table[idx]`` ([B, T, V])."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


def _tables(b: int = 6, t: int = 5, v: int = 7, noise: float = 0.3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    cand = ref + noise * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    return ref, cand


# ------------------------------------------------------------------------------------------ per-token statistics
def test_per_token_statistics_match_scipy() -> None:
    ref, cand = _tables()
    targets = torch.randint(0, 7, (6, 5), generator=torch.Generator().manual_seed(1))
    batches = [(torch.arange(0, 3), targets[:3]), (torch.arange(3, 6), targets[3:])]
    comp = inf.compare(Logits(ref), Logits(cand), batches)
    p = scipy.special.softmax(ref.numpy(), axis=-1).reshape(-1, 7)
    q = scipy.special.softmax(cand.numpy(), axis=-1).reshape(-1, 7)
    np.testing.assert_allclose(comp.kl, scipy.special.rel_entr(p, q).sum(-1), rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(comp.kl_reverse, scipy.special.rel_entr(q, p).sum(-1), rtol=1e-10, atol=1e-15)
    np.testing.assert_array_equal(comp.agree, p.argmax(-1) == q.argmax(-1))
    tg = targets.reshape(-1).numpy()
    np.testing.assert_allclose(comp.nll_ref, -np.log(p[np.arange(30), tg]), rtol=1e-12)
    np.testing.assert_allclose(comp.nll_cand, -np.log(q[np.arange(30), tg]), rtol=1e-12)
    assert comp.example.tolist() == [i // 5 for i in range(30)] and comp.batches == 2 and comp.n_examples == 6
    v = inf.judge_comparison(comp, inf.InferenceCriteria(kl_mean=10.0, top1=None, ppl_ratio=None))
    assert v.metrics["kl_mean"]["value"] == pytest.approx(comp.kl.mean(), rel=1e-12)
    assert v.metrics["kl_median"]["value"] == float(np.quantile(comp.kl, 0.5, method="inverted_cdf"))
    ppl = math.exp(comp.nll_cand.mean() - comp.nll_ref.mean())
    assert v.metrics["ppl_ratio"]["value"] == pytest.approx(ppl, rel=1e-12)


class HFStyle(nn.Module):
    """A causal-LM stand-in: ``model(input_ids=..., labels=..., attention_mask=...)`` returns ``.logits``."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"logits": self.table[: input_ids.shape[0], : input_ids.shape[1]]}


def test_hf_labels_are_shifted_and_the_attention_mask_drops_positions() -> None:
    ref, cand = _tables(b=2, t=4, v=5)
    ids = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])
    labels = ids.clone()
    labels[1, 2] = -100
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    comp = inf.compare(HFStyle(ref), HFStyle(cand), [{"input_ids": ids, "labels": labels, "attention_mask": mask}])
    assert comp.n_tokens == 7  # the masked position is gone
    # position t predicts labels[t + 1]; the last position of each row and the -100 label have no target
    assert comp.has_target.tolist() == [True, True, True, False, True, False, True]
    lp = torch.log_softmax(ref, -1)
    assert comp.nll_ref[0] == pytest.approx(float(-lp[0, 0, 2]), rel=1e-12)
    assert comp.nll_ref[4] == pytest.approx(float(-lp[1, 0, 3]), rel=1e-12)
    assert comp.nll_ref[6] == pytest.approx(float(-lp[1, 2, 1]), rel=1e-12)


def test_identical_models_pass_with_zero_divergence() -> None:
    ref, _ = _tables(b=40, t=8)
    batches = [(torch.arange(i, i + 8), torch.zeros(8, 8, dtype=torch.long)) for i in range(0, 40, 8)]
    v = inf.judge_inference(Logits(ref), Logits(ref.clone()), batches, inf.InferenceCriteria(top1=0.9))
    assert v.metrics["kl_mean"]["value"] == 0.0 and v.metrics["top1"]["value"] == 1.0
    assert v.metrics["ppl_ratio"]["value"] == 1.0
    assert v.outcome == "pass", v.format_table()
    # every token agrees, but the bootstrap of a proportion at 1 is degenerate: the bound is Clopper-Pearson's
    # with one token per example (40 examples): 0.05 ** (1/40)
    assert v.metrics["top1"]["lower"] == pytest.approx(0.05 ** (1 / 40), rel=1e-9)
    strict = inf.judge_inference(Logits(ref), Logits(ref.clone()), batches, inf.InferenceCriteria(top1=0.99))
    assert strict.outcome == "inconclusive"  # 40 examples cannot show 99% agreement, even with no miss


def test_a_degraded_candidate_fails_with_evidence() -> None:
    ref, cand = _tables(b=48, t=8, noise=1.5)
    batches = [(torch.arange(i, i + 8), torch.zeros(8, 8, dtype=torch.long)) for i in range(0, 48, 8)]
    v = inf.judge_inference(Logits(ref), Logits(cand), batches, inf.InferenceCriteria())
    assert v.outcome == "fail"
    by = {r.name: r for r in v.results}
    assert by["kl_mean"].outcome == "fail" and by["top1"].outcome == "fail"
    assert by["kl_mean"].values["lower"] > 0.01
    assert "48 examples" in by["kl_mean"].reason
    assert v.exit_code == 1 and "FAIL" in v.format_table()


def test_verdicts_are_reproducible_and_units_change_the_evidence() -> None:
    ref, cand = _tables(b=32, t=16, noise=0.2)
    batches = [(torch.arange(i, i + 8), torch.zeros(8, 16, dtype=torch.long)) for i in range(0, 32, 8)]
    c = inf.InferenceCriteria(kl_mean=0.05, top1=None, ppl_ratio=None)
    a = inf.judge_inference(Logits(ref), Logits(cand), batches, c)
    b = inf.judge_inference(Logits(ref), Logits(cand), batches, c)
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)
    tok = inf.judge_inference(Logits(ref), Logits(cand), batches, inf.InferenceCriteria(
        kl_mean=0.05, top1=None, ppl_ratio=None, unit="token"))
    assert tok.metrics["kl_mean"]["value"] == a.metrics["kl_mean"]["value"]
    assert tok.results[0].values["n"] == 512 and a.results[0].values["n"] == 32


# --------------------------------------------------------------------------------- bootstrap error rate
def _synthetic(rng: np.random.Generator, n_ex: int, t: int, mu: float) -> Comparison:
    """Per-token KL with example-level clustering: exp(N(log mu_e, 0.5)), mu_e = mu * lognormal(0, 0.5) /
    E[...], so the population mean per token is ``mu``."""
    mu_e = mu * rng.lognormal(0, 0.5, n_ex) / math.exp(0.5 ** 2 / 2)
    kl = (mu_e[:, None] * rng.lognormal(0, 0.5, (n_ex, t)) / math.exp(0.5 ** 2 / 2)).reshape(-1)
    n = kl.size
    return Comparison(example=np.repeat(np.arange(n_ex), t), kl=kl, kl_reverse=kl, agree=np.ones(n, bool),
                      has_target=np.zeros(n, bool), nll_ref=np.full(n, np.nan), nll_cand=np.full(n, np.nan),
                      kl_bf16=None, tolerances=(), batches=1)


def test_false_pass_rate_at_the_threshold_is_near_the_stated_level() -> None:
    """A candidate exactly at the threshold (population mean KL = kl_mean) must PASS at most about
    ``1 - confidence`` = 5% of the time.  200 independent samples of 30 examples x 20 tokens: the expected count
    is 10; the test allows 20 (P(Bin(200, 0.05) >= 20) = 0.0016, the false-alarm rate of this test); a bootstrap
    that ignored the clustering (resampling tokens) PASSes far more often, which the second count checks."""
    rng = np.random.default_rng(123)
    c = inf.InferenceCriteria(kl_mean=0.01, top1=None, ppl_ratio=None, bootstrap=400)
    ct = inf.InferenceCriteria(kl_mean=0.01, top1=None, ppl_ratio=None, bootstrap=400, unit="token")
    passes = passes_tokens = 0
    for _ in range(200):
        comp = _synthetic(rng, 30, 20, 0.01)
        passes += inf.judge_comparison(comp, c).outcome == "pass"
        passes_tokens += inf.judge_comparison(comp, ct).outcome == "pass"
    assert passes < 20, passes
    assert passes_tokens > 2 * max(passes, 10), (passes, passes_tokens)


def test_a_clearly_better_candidate_passes_with_enough_examples() -> None:
    """Power: population mean KL at half the threshold, 60 examples: PASS in at least 180 of 200 samples."""
    rng = np.random.default_rng(7)
    c = inf.InferenceCriteria(kl_mean=0.01, top1=None, ppl_ratio=None, bootstrap=400)
    passes = sum(inf.judge_comparison(_synthetic(rng, 60, 20, 0.005), c).outcome == "pass" for _ in range(200))
    assert passes >= 180, passes


def test_inconclusive_says_how_many_examples_would_decide() -> None:
    rng = np.random.default_rng(3)
    comp = _synthetic(rng, 8, 10, 0.008)
    v = inf.judge_comparison(comp, inf.InferenceCriteria(kl_mean=0.01, top1=None, ppl_ratio=None))
    r = v.results[0]
    assert r.outcome == "inconclusive", r.reason
    need = r.values["units_needed"]
    assert need > 8 and f"about {need} examples would decide it" in r.reason
    z = scipy.stats.norm.ppf(0.95) + scipy.stats.norm.ppf(0.8)
    assert need == math.ceil(8 * (z * r.values["se"] / abs(0.01 - r.values["value"])) ** 2)


# --------------------------------------------------------------------------------------- logit tolerances
def test_logit_tolerances_find_the_worst_token() -> None:
    ref, _ = _tables(b=2, t=3, v=6)
    cand = ref.clone()
    cand[1, 2] += 0.1  # every class of one token moved by 0.1
    top = ref[1, 2].topk(2).indices
    comp = inf.compare(Logits(ref), Logits(cand), [(torch.arange(2), torch.zeros(2, 3, dtype=torch.long))],
                       logit_tolerances={2: (1e-5, 0.01), "all": (0.2, 0.0)})
    top2, every = comp.tolerances
    assert top2.violations == 1 and top2.tokens == 6 and every.violations == 0
    expect = max(0.1 / (1e-5 + 0.01 * abs(float(ref[1, 2, j]))) for j in top)
    assert top2.worst_ratio == pytest.approx(expect, rel=1e-6)
    assert top2.worst["example"] == 1 and top2.worst["position"] == 2
    assert every.worst_ratio == pytest.approx(0.5, rel=1e-6)
    v = inf.judge_comparison(comp, inf.InferenceCriteria(kl_mean=None, top1=None, ppl_ratio=None,
                                                         logit_tolerances={2: (1e-5, 0.01), "all": (0.2, 0.0)}))
    assert v.outcome == "fail" and "example 1, position 2" in v.results[0].reason


# ------------------------------------------------------------------------------------------------ three-way
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(32, 128), nn.Linear(128, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _preset(name: str) -> inf.Scheme:
    """A preset without its ``lm_head`` ignore entry (the MLP has no such layer)."""
    return dataclasses.replace(inf.get(name), ignore=())


class Cast(nn.Module):
    """Runs a bfloat16 model on inputs of any float dtype."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(torch.bfloat16))


def _mlp_batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 16, (16,), generator=g)) for _ in range(n)]


def test_three_way_bf16_itself_is_exactly_as_close_as_bf16() -> None:
    model = MLP()
    low = Cast(inf._compare.bf16_copy(model))
    c = inf.InferenceCriteria(kl_mean=None, top1=None, ppl_ratio=None, bf16_ratio=1.0)
    v = inf.judge_inference(model, low, _mlp_batches(), c, bf16=low)
    assert v.metrics["bf16_ratio"] == {"value": 1.0, "lower": 1.0, "upper": 1.0, "se": 0.0}
    assert v.metrics["bf16_overlap"] == 1.0 and v.outcome == "pass"
    assert v.metrics["bf16_kl_mean"]["value"] > 0  # bf16 is not exact


def test_three_way_a_4bit_tensorwise_candidate_is_worse_than_bf16() -> None:
    model = MLP()
    int4 = inf.Scheme(name="int4-tensor", config_groups=(inf.ConfigGroup(
        name="all", targets=("Linear",), weights=inf.TensorScheme(format="int4", granularity="tensor")),))
    q = inf.quantize_model(copy.deepcopy(model), int4)
    c = inf.InferenceCriteria(kl_mean=None, top1=None, ppl_ratio=None, bf16_ratio=1.0)
    v = inf.judge_inference(model, q, _mlp_batches(), c, bf16="auto")
    r = v.results[0]
    assert r.outcome == "fail", r.reason
    assert v.metrics["bf16_ratio"]["lower"] > 10 and v.metrics["bf16_overlap"] < 0.99
    with pytest.raises(UsageError, match="bf16='auto'"):
        inf.judge_inference(model, q, _mlp_batches(), c)


# -------------------------------------------------------------------------------------------------- greedy
class TableLM(nn.Module):
    """Logits depend only on the position: ``model(ids)[0, t] = table[t]`` (``table [L, V]``)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[: ids.shape[1]][None].expand(ids.shape[0], -1, -1)


def test_greedy_divergence_counts_tokens_and_measures_the_gap() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.randn(20, 9, generator=g, dtype=torch.float64)
    prompt = torch.tensor([1, 2, 3])
    ref_tokens = [int(table[2 + i].argmax()) for i in range(8)]  # position len-1 predicts the next token
    cand = table.clone()
    other = (ref_tokens[3] + 1) % 9
    cand[2 + 3, other] = cand[2 + 3, ref_tokens[3]] + 0.5  # step 3: the candidate prefers `other` by 0.5
    [r] = inf.greedy_divergence(TableLM(table), TableLM(cand), [prompt], max_new_tokens=8, gap_tolerance=0.1)
    assert list(r.reference_tokens) == ref_tokens
    assert (r.matched, r.divergence, r.candidate_token, r.tolerated) == (3, 3, other, 0)
    assert r.gap == pytest.approx(0.5, abs=1e-12)
    top2 = table[5].topk(2).values
    assert r.reference_margin == pytest.approx(float(top2[0] - top2[1]))
    [near] = inf.greedy_divergence(TableLM(table), TableLM(cand), [prompt], max_new_tokens=8, gap_tolerance=0.6)
    assert near.full_match and near.matched == 8 and near.tolerated == 1  # inside the tolerance: not a failure


def test_greedy_agreement_criterion() -> None:
    g = torch.Generator().manual_seed(1)
    table = torch.randn(40, 9, generator=g, dtype=torch.float64)
    prompts = [torch.tensor([i]) for i in range(30)]
    ref = TableLM(table)
    batches = [(torch.zeros(1, 40, dtype=torch.long), torch.zeros(1, 40, dtype=torch.long))]
    c = inf.InferenceCriteria(kl_mean=None, top1=None, ppl_ratio=None, greedy_agreement=0.9, max_new_tokens=4)
    v = inf.judge_inference(ref, TableLM(table.clone()), batches, c, prompts=prompts)
    r = v.results[0]
    assert r.outcome == "pass" and r.values["k"] == 30
    assert r.values["lower"] == pytest.approx(0.05 ** (1 / 30))  # Clopper-Pearson with 30 of 30
    assert v.metrics["greedy"]["full_match"] == 30 and len(v.greedy) == 30
    with pytest.raises(UsageError, match="prompts"):
        inf.judge_inference(ref, ref, batches, c)


# ------------------------------------------------------------------------------------------ store and report
def test_record_and_load_verdicts(tmp_path) -> None:
    model = MLP()
    q = inf.quantize_model(copy.deepcopy(model), _preset("w8a8-int8"))
    v = inf.judge_inference(model, q, _mlp_batches(), inf.InferenceCriteria(top1=0.5, bf16_ratio=3.0), bf16="auto",
                            candidate_name="mlp w8a8")
    with RunStore(tmp_path / "runs.db") as store:
        rid = inf.record_verdict(store, v, scheme=_preset("w8a8-int8"), extra={"algorithm": "max"})
        rec = store.get_run(rid)
        assert rec.status == "completed" and rec.group == "inference"
        assert rec.config["scheme_hash"] == _preset("w8a8-int8").hash() and rec.config["algorithm"] == "max"
        scalars = store.scalars(rid)
        assert scalars["inference/kl_mean"][1][0] == v.metrics["kl_mean"]["value"]
        [(rid2, back)] = inf.load_verdicts(store)
        assert rid2 == rid and back.to_dict() == json.loads(json.dumps(v.to_dict()))
        assert store.check().ok


def test_report_shows_every_verdict_escaped(tmp_path) -> None:
    model = MLP()
    verdicts = []
    for preset in ("w8a8-int8", "fp8-dynamic"):
        q = inf.quantize_model(copy.deepcopy(model), _preset(preset))
        verdicts.append(inf.judge_inference(model, q, _mlp_batches(), inf.InferenceCriteria(
            top1=0.5, bf16_ratio=3.0, logit_tolerances={5: (1e-5, 0.05)}), bf16="auto",
            candidate_name=f"<b>{preset}</b>"))
    path = inf.write_inference_report(tmp_path / "r" / "inference.html", verdicts)
    html = path.read_text()
    assert "<b>w8a8-int8</b>" not in html and "&lt;b&gt;w8a8-int8&lt;/b&gt;" in html
    for v in verdicts:
        for r in v.results:
            assert r.name in html
    assert html.count("<svg") == 1 and "bf16 copy of the reference" in html and "Logit tolerances" in html
    words = [v.word for v in verdicts]
    assert all(w in html for w in words)


# ------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs, match", [
    ({"kl_mean": -1.0}, "kl_mean"),
    ({"top1": 1.5}, "top1"),
    ({"ppl_ratio": 0.9}, "ppl_ratio"),
    ({"unit": "batch"}, "unit"),
    ({"confidence": 0.3}, "confidence"),
    ({"logit_tolerances": {0: (1e-5, 0.1)}}, "logit_tolerances"),
    ({"logit_tolerances": {5: (1e-5,)}}, r"logit_tolerances\[5\]"),
    ({"kl_mean": None, "top1": None, "ppl_ratio": None}, "judges nothing"),
    ({"bootstrap": 10}, "bootstrap"),
])
def test_bad_criteria(kwargs, match) -> None:
    with pytest.raises(UsageError, match=match):
        inf.InferenceCriteria(**kwargs)


def test_criteria_round_trip_and_hash() -> None:
    c = inf.InferenceCriteria(logit_tolerances={5: (1e-5, 0.011), "all": (1e-5, 0.05)}, bf16_ratio=1.0)
    back = inf.InferenceCriteria.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and back.hash() == c.hash()
    assert inf.InferenceCriteria(kl_mean=0.02).hash() != c.hash()
    with pytest.raises(UsageError, match="unknown field"):
        inf.InferenceCriteria.from_dict({"kl": 1})


def test_bad_data() -> None:
    model = MLP()
    with pytest.raises(UsageError, match="empty"):
        inf.compare(model, model, [])
    with pytest.raises(UsageError, match="cannot run"):
        inf.compare(model, model, [(torch.randn(4, 31), torch.zeros(4, dtype=torch.long))])
    other = nn.Sequential(nn.Linear(32, 8))
    with pytest.raises(UsageError, match="differ in shape"):
        inf.compare(model, other, _mlp_batches(1))
    with pytest.raises(UsageError, match="ppl_ratio needs targets"):
        inf.judge_inference(model, model, [torch.randn(4, 32)], inf.InferenceCriteria())
    with pytest.raises(UsageError, match="prompts"):
        inf.greedy_divergence(model, model, [torch.randn(3)])


# ------------------------------------------------------------------------------------------ embedding outputs
def test_embedding_outputs_cosine_and_relative_error() -> None:
    ref, cand = _tables(b=12, t=1, v=16, noise=0.2)
    batches = [(torch.arange(i, i + 4), torch.zeros(4, dtype=torch.long)) for i in range(0, 12, 4)]
    comp = inf.compare(Logits(ref[:, 0]), Logits(cand[:, 0]), batches, output="embedding")
    r, c = ref[:, 0].numpy(), cand[:, 0].numpy()
    cos = (r * c).sum(-1) / np.linalg.norm(r, axis=-1) / np.linalg.norm(c, axis=-1)
    np.testing.assert_allclose(comp.cosine, cos, rtol=1e-12)
    v = inf.judge_comparison(comp, inf.InferenceCriteria.for_embeddings(cosine=0.9, rel_error=0.5))
    assert v.metrics["rel_error"]["value"] == pytest.approx(np.linalg.norm(c - r) / np.linalg.norm(r), rel=1e-12)
    assert v.metrics["cosine"]["value"] == pytest.approx(cos.mean(), rel=1e-12)
    assert v.output == "embedding" and {r.name for r in v.results} == {"cosine", "rel_error"}
    same = inf.judge_inference(Logits(ref[:, 0]), Logits(ref[:, 0].clone()), batches,
                               inf.InferenceCriteria.for_embeddings(cosine=0.999), output="embedding")
    assert same.outcome == "pass" and same.metrics["rel_error"]["value"] == 0.0
    with pytest.raises(UsageError, match="for_embeddings"):
        inf.judge_inference(Logits(ref[:, 0]), Logits(cand[:, 0]), batches, inf.InferenceCriteria(),
                            output="embedding")
    with pytest.raises(UsageError, match="output='embedding'"):
        inf.judge_inference(Logits(ref[:, 0]), Logits(cand[:, 0]), batches,
                            inf.InferenceCriteria.for_embeddings())


def test_embedding_three_way_against_bf16() -> None:
    model = MLP()
    q = inf.quantize_model(copy.deepcopy(model), _preset("w8a8-int8"))
    v = inf.judge_inference(model, q, _mlp_batches(), inf.InferenceCriteria.for_embeddings(cosine=0.9,
                            bf16_ratio=100.0), bf16="auto", output="embedding")
    m = v.metrics
    assert m["bf16_rel_error"]["value"] > 0 and m["bf16_ratio"]["value"] == pytest.approx(
        m["rel_error"]["value"] / m["bf16_rel_error"]["value"], rel=1e-12)
    assert v.outcome == "pass"
