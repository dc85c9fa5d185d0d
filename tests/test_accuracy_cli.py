"""``lowprec baseline / baselines / compare / report / demo`` end to end on real (short) zoo runs.

Oracles: the exit-status contract (0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 usage error without traceback); the baseline
JSON read back equals the stored one; fp32 candidates with fresh seeds against an fp32 baseline are the null case
(PASS against a baseline whose declared margin its seeds can show: accuracy within 1%; INCONCLUSIVE against the
default criteria, whose 1% final-loss margin 3 + 2 seeds cannot show), and a learning rate cut by 30% is the
known-bad case (FAIL on the curve) -- both measured on this task with margin (the judge's error rates are measured
in benchmarks/judge_accuracy.py and docs/accuracy.md).
"""

from __future__ import annotations

import html.parser
import json
from pathlib import Path

import pytest

from lowprec.accuracy._baseline import Baseline
from lowprec.cli import main
from lowprec.cli._demo import _reusable, demo_config, run_demo
from lowprec.runs._store import RunStore

STEPS = 120


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with an fp32 baseline (3 seeds), fp32 candidates (2 fresh seeds) and lr-cut candidates."""
    d = tmp_path_factory.mktemp("acc")
    (d / "c.toml").write_text(f'model = "mlp-digits"\nsteps = {STEPS}\nthreads = 1\n')
    (d / "lr.toml").write_text(f'model = "mlp-digits"\nsteps = {STEPS}\nthreads = 1\nname = "lr-cut"\n'
                               "[optimizer]\nlr = 0.0021\n")  # the task's default 3e-3, cut by 30%
    store = str(d / "runs.db")
    assert main(["baseline", str(d / "c.toml"), "--name", "ref", "--seeds", "3", "--store", store, "--quiet",
                 "--export", str(d / "ref.json")]) == 0
    (d / "acc.toml").write_text('metrics = ["accuracy"]\n[metric_margins]\naccuracy = 0.01\n')
    assert main(["baseline", str(d / "c.toml"), "--name", "acc", "--seeds", "3", "--store", store, "--quiet",
                 "--criteria", str(d / "acc.toml")]) == 0
    assert main(["run", str(d / "c.toml"), "--seeds", "10", "11", "--store", store, "--quiet"]) == 0
    assert main(["run", str(d / "lr.toml"), "--seeds", "10", "11", "--store", store, "--quiet"]) == 0
    return d


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_baseline_stored_and_exported(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(workdir / "runs.db")
    with RunStore(store) as s:
        stored = Baseline.from_dict(s.get_baseline("ref"))
        assert len(s.list_runs(group="baseline/ref")) == 3
    from_file = Baseline.load_json(workdir / "ref.json")
    assert from_file.to_dict() == stored.to_dict()
    assert stored.seeds == (0, 1, 2) and stored.steps == STEPS and stored.model == "mlp-digits"
    rc, out, _ = _main(capsys, "baselines", "list", "--store", store)
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == ["acc", "ref"]
    rc, _, _ = _main(capsys, "baselines", "import", str(workdir / "ref.json"), "--name", "golden", "--store", store)
    assert rc == 0
    with RunStore(store) as s:
        assert s.get_baseline("golden")["envelope"] == s.get_baseline("ref")["envelope"]


def test_compare_pass_fail_inconclusive_and_exit_codes(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(workdir / "runs.db")
    rc, out, _ = _main(capsys, "compare", "--baseline", "acc", "mlp-digits fp32", "--store", store)
    assert rc == 0 and out.startswith("PASS") and "95% bound), margin" in out, out
    rc, out, _ = _main(capsys, "compare", "--baseline", "ref", "mlp-digits fp32", "--store", store)
    assert rc == 3 and out.startswith("INCONCLUSIVE"), out
    assert "final/loss      INCONCLUSIVE" in out and "seeds" in out.splitlines()[-1], out
    rc, out, _ = _main(capsys, "compare", "--baseline", str(workdir / "ref.json"), "lr-cut", "--store", store)
    assert rc == 1 and out.startswith("FAIL") and "curve           FAIL" in out, out
    rc, out, _ = _main(capsys, "compare", "--baseline", "acc", "mlp-digits fp32", "lr-cut", "--store", store,
                       "--json")
    verdicts = json.loads(out)
    assert rc == 1 and [v["outcome"] for v in verdicts] == ["pass", "fail"]


def test_plan_prints_the_seeds_each_criterion_needs(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(workdir / "runs.db")
    rc, out, _ = _main(capsys, "plan", "--baseline", "acc", "--store", store)
    assert rc == 0 and "final/accuracy" in out and "curve" in out and "seed" in out.splitlines()[-1], out
    rc, out, _ = _main(capsys, "plan", "--baseline", str(workdir / "ref.json"), "--json", "--store", store)
    p = json.loads(out)
    assert rc == 0 and set(p["criteria"]) == {"curve", "final/loss", "final/accuracy"}
    rc, _, err = _main(capsys, "plan", "--baseline", "acc", "--worse-by", "1.0", "--store", store)
    assert rc == 2 and "worse_by_fraction must be" in err


def test_plan_advice_counts_the_criteria_that_decide_a_pass(workdir: Path) -> None:
    """The loss curve under curve_role = "guard" can only FAIL a verdict, so the advice's seed count is the largest
    over the primary criteria (the finals); with curve_role = "primary" the curve counts too.  Oracle: the
    per-criterion entries of the same plan."""
    import dataclasses

    from lowprec.accuracy import load_baseline, plan
    from lowprec.runs import RunStore

    with RunStore(workdir / "runs.db", create=False) as store:
        stored = load_baseline(store, "acc")
    assert stored.criteria.curve_role == "guard"
    # wide final-metric margins (reachable with few seeds) and a tight curve margin: the curve needs the most seeds
    b = dataclasses.replace(stored, criteria=dataclasses.replace(stored.criteria, curve_margin_rel=1e-4,
                                                                 metric_margin_rel=0.5, metric_margins=None,
                                                                 metric_margin_std=0.0))
    p = plan(b)
    finals = [e["candidate_seeds"] for k, e in p["criteria"].items() if k != "curve"]
    curve = p["criteria"]["curve"]
    assert curve["role"] == "guard" and None not in finals
    assert curve["candidate_seeds"] is None or curve["candidate_seeds"] > max(finals)
    assert p["candidate_seeds"] == max(finals)
    primary = dataclasses.replace(b, criteria=dataclasses.replace(b.criteria, curve_role="primary"))
    q = plan(primary)
    every = [e["candidate_seeds"] for e in q["criteria"].values()]
    assert q["candidate_seeds"] == (None if None in every else max(every)) != max(finals)


def test_report_html(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, out = str(workdir / "runs.db"), workdir / "r.html"
    rc, _, _ = _main(capsys, "report", "--baseline", "ref", "mlp-digits fp32", "lr-cut", "--store", store,
                     "--out", str(out))
    assert rc == 0
    text = out.read_text()
    html.parser.HTMLParser().feed(text)
    assert 'class="headline fail"' in text and "lr-cut seed 10" in text and "<svg" in text


@pytest.mark.parametrize(
    "args, needle",
    [
        (["compare", "--baseline", "nope", "lr-cut"], "ref"),  # the message lists the known baselines
        (["compare", "--baseline", "ref", "no-such-group"], "no-such-group"),
        (["compare", "--baseline", "missing.json", "lr-cut"], "does not exist"),
        (["baseline", "c.toml", "--name", "ref", "--seeds", "2"], "--overwrite"),
        (["baseline", "c.toml", "--name", "x", "--seeds", "1"], "--seeds must be >= 2"),
        (["baselines", "import", "c.toml"], "c.toml"),
    ],
)
def test_usage_errors_exit_2(workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                             args: list[str], needle: str) -> None:
    monkeypatch.chdir(workdir)
    rc, _, err = _main(capsys, *args, "--store", str(workdir / "runs.db"))
    assert rc == 2 and err.startswith("lowprec: error:") and needle in err, err


def test_incompatible_baseline_is_a_usage_error(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(workdir / "runs.db")
    (workdir / "s.toml").write_text('model = "synthetic-regression"\nsteps = 20\nname = "other"\n')
    assert main(["run", str(workdir / "s.toml"), "--store", store, "--quiet"]) == 0
    capsys.readouterr()
    rc, _, err = _main(capsys, "compare", "--baseline", "ref", "other", "--store", store)
    assert rc == 2 and "cannot be judged" in err and "model" in err and "data_hash" in err, err
    bad = workdir / "bad.json"
    bad.write_text(json.dumps({**json.loads((workdir / "ref.json").read_text()), "version": 99}))
    rc, _, err = _main(capsys, "compare", "--baseline", str(bad), "lr-cut", "--store", store)
    assert rc == 2 and "version" in err, err


def test_demo_runs_judges_reports_and_reuses_the_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, report = str(tmp_path / "runs.db"), tmp_path / "demo.html"
    run_demo(store_path=store, report_path=str(report), steps=STEPS, progress=False)
    out = capsys.readouterr().out
    assert "building the fp32 baseline" in out
    words = ("PASS", "FAIL", "INCONCLUSIVE")
    for arm in ("bf16-pure", "bf16-sr", "fp8-tensorwise", "mxfp8", "negative control", "one seed"):
        assert any(arm in line and any(w in line for w in words) for line in out.splitlines()), arm
    assert "expected: no recipe FAILs" in out
    assert report.exists() and "fp8-tensorwise" in report.read_text()
    with RunStore(store) as s:
        name = f"demo-fp32-mlp-digits-{STEPS}"
        assert len(s.list_runs()) == 4 + 5 * 3 + 1 and s.list_baselines() == [name]
        # a second demo reuses the baseline built from the same config, and not one from another config
        assert _reusable(s, name, demo_config(store, steps=STEPS)) is not None
        assert _reusable(s, name, demo_config(store, steps=STEPS + 1)) is None


def test_runs_list_show_export(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the store's own values (CSV cells and JSON scalars read back equal the stored floats)."""
    store = str(workdir / "runs.db")
    rc, out, _ = _main(capsys, "runs", "list", "--group", "lr-cut", "--store", store)
    assert rc == 0 and len(out.splitlines()) == 3 and "lr-cut seed 11" in out
    rid = out.splitlines()[1].split()[0]
    rc, out, _ = _main(capsys, "runs", "show", rid[:6], "--store", store)
    assert rc == 0 and f"run {rid}" in out and "sha256" in out and "train/loss" in out
    with RunStore(store) as s:
        steps, loss = s.scalars(rid)["train/loss"]
    rc, _, _ = _main(capsys, "runs", "export", rid, "--format", "csv", "--out", str(workdir / "r.csv"), "--store",
                     store)
    rows = (workdir / "r.csv").read_text().splitlines()
    col = rows[0].split(",").index("train/loss")
    assert rc == 0 and [float(r.split(",")[col]) for r in rows[1:]] == loss.tolist()
    rc, out, _ = _main(capsys, "runs", "export", rid, "--format", "json", "--store", store)
    assert rc == 0 and json.loads(out)["run_id"] == rid
