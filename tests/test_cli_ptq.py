"""``lowprec ptq``: a stored mlp-digits run quantized, judged, recorded and saved; bad input exits 2 before any
model runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowprec import inference as inf
from lowprec.cli import main
from lowprec.runs import RunStore


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("ptq")
    (d / "c.toml").write_text('model = "mlp-digits"\nsteps = 60\nthreads = 1\n')
    store = str(d / "runs.db")
    assert main(["run", str(d / "c.toml"), "--seeds", "0", "--store", store, "--quiet"]) == 0
    with RunStore(store) as s:
        [rec] = s.list_runs()
    return store, rec.run_id


def test_ptq_judges_records_and_saves(trained, tmp_path: Path, capsys) -> None:
    store, rid = trained
    out = tmp_path / "ckpt"
    rc = main(["ptq", "--run", rid, "--scheme", "w8a8-int8", "--store", store, "--bf16", "--bf16-ratio", "50",
               "--out", str(out), "--report", str(tmp_path / "r.html"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    verdict = doc["verdict"]
    assert rc == {"pass": 0, "fail": 1, "inconclusive": 3}[verdict["outcome"]]
    names = {r["name"] for r in verdict["results"]}
    assert names == {"kl_mean", "top1", "ppl_ratio", "bf16_ratio"}
    assert verdict["metrics"]["kl_mean"]["value"] < 0.01 and verdict["n_examples"] > 0
    state, scheme = inf.load_quantized(out)
    assert scheme == inf.get("w8a8-int8") and state
    with RunStore(store) as s:
        [(vrid, v)] = [x for x in inf.load_verdicts(s) if x[0] == doc["run_id"]]
        assert s.get_run(vrid).config["source_run"] == rid
    assert v.to_dict()["outcome"] == verdict["outcome"]
    assert "lowprec inference accuracy report" in (tmp_path / "r.html").read_text()


def test_ptq_gptq_table(trained, tmp_path: Path, capsys) -> None:
    store, rid = trained
    rc = main(["ptq", "--run", rid, "--scheme", "fp8-dynamic", "--algorithm", "gptq", "--store", store,
               "--out", str(tmp_path / "ck")])
    text = capsys.readouterr().out
    assert rc in (0, 1, 3) and "fp8-dynamic (gptq)" in text and "recorded as run" in text
    state, scheme = inf.load_quantized(tmp_path / "ck")  # the GPTQ model's checkpoint
    assert scheme.name == "fp8-dynamic" and state


def test_ptq_smoothquant_folded_checkpoint(trained, tmp_path, capsys) -> None:
    store, rid = trained
    rc = main(["ptq", "--run", rid, "--store", store, "--scheme", "w8a8-int8", "--algorithm", "smoothquant",
               "--option", "alpha=0.6", "--option", "fold=true", "--out", str(tmp_path / "ck")])
    assert rc in (0, 1, 3) and "w8a8-int8 (smoothquant)" in capsys.readouterr().out
    state, scheme = inf.load_quantized(tmp_path / "ck")  # the factors live in the folded LayerNorms
    assert scheme.name == "w8a8-int8" and not any(k.endswith("smooth") for k in state)


@pytest.mark.parametrize("args, match", [
    (["--scheme", "w9a9"], "--scheme must be a preset"),
    (["--scheme", "missing.toml"], "no such file"),
    (["--scheme", "w4a16-int4"], "group_size=128 does not divide in_features=64"),
    (["--scheme", "w8a8-int8", "--batches", "0"], "--batches must be >= 1"),
    (["--scheme", "w8a8-int8", "--criteria", "nope.json"], "cannot read"),
    (["--scheme", "fp8-dynamic", "--algorithm", "awq", "--out", "ck"], "--out: a model quantized with algorithm 'awq'"),
    (["--scheme", "fp8-dynamic", "--algorithm", "smoothquant", "--out", "ck", "--option", "alpha=0.8"],
     "(CLI: --option fold=true)"),
    (["--scheme", "fp8-dynamic", "--algorithm", "smoothquant", "--option", "alpha"],
     "--option 'alpha': expected KEY=VALUE"),
    (["--scheme", "fp8-dynamic", "--algorithm", "smoothquant", "--option", "beta=1"], "unknown option 'beta'"),
    (["--scheme", "mxfp8", "--algorithm", "gptq", "--out", "ck"], "GPTQ's float32 scales cannot be stored"),
])
def test_ptq_bad_input_exits_2(trained, capsys, args, match) -> None:
    store, rid = trained
    with RunStore(store) as s:
        before = len(s.list_runs())
    assert main(["ptq", "--run", rid, "--store", store, *args]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    with RunStore(store) as s:
        assert len(s.list_runs()) == before  # nothing recorded


def test_algorithm_choices_are_the_library_algorithms() -> None:
    """The parser's spelled-out choices (kept torch-free) must name exactly the algorithms quantize_model accepts."""
    from lowprec.cli._ptq import ALGORITHM_CHOICES
    from lowprec.inference._algorithms import WEIGHT_ALGORITHMS
    from lowprec.inference._calibrate import ALGORITHMS

    assert ALGORITHM_CHOICES == (*ALGORITHMS, *WEIGHT_ALGORITHMS)
