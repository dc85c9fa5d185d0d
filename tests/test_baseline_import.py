"""Hostile and broken input files: ``lowprec baselines import`` validates every field, and no user-supplied JSON or
TOML file ends in a traceback, however deeply it nests (issue 14, low items).

Oracles: the baseline format's definition (``Baseline.to_dict``; each field's type, range and agreement with the
others as ``build_baseline`` makes them), a golden written by ``Baseline.save_json`` and edited one field at a
time; the CLI contract (exit status 2 and one ``lowprec: error:`` line on stderr naming the file and the field,
nothing stored); nesting depths counted by construction (``MAX_NESTING`` levels accepted, one more refused).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowprec._parse import MAX_NESTING, parse_json, parse_toml
from lowprec.accuracy._baseline import Baseline, RunData, build_baseline
from lowprec.cli import main
from lowprec.runs._config import load
from lowprec.runs._store import RunStore

STEPS = 20
DEEP = "[" * 100_000 + "]" * 100_000


def _run(seed: int) -> RunData:
    """A completed synthetic seed run: a decaying loss with seed-dependent noise, finals at the last step."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, STEPS + 1, dtype=np.int64)
    last = np.array([STEPS], dtype=np.int64)
    return RunData(
        run_id=f"{seed:012x}", name=f"fp32 seed {seed}", group="fp32", status="completed",
        config={"model": "mlp-digits", "steps": STEPS, "seeds": [seed], "recipe": {"name": "fp32"}},
        manifest={"seed": seed, "data_hash": "d" * 64, "metrics": {"loss": "min", "accuracy": "max"}},
        scalars={"train/loss": (t, 2.0 + np.exp(-t / 5.0) + rng.normal(0.0, 0.01, STEPS)),
                 "eval/loss": (last, np.array([2.0 + rng.normal(0.0, 0.01)])),
                 "eval/accuracy": (last, np.array([0.8 + rng.normal(0.0, 0.01)]))},
    )


@pytest.fixture
def golden() -> dict[str, Any]:
    """The JSON form of a 3-seed baseline, as ``lowprec baseline --export`` writes it."""
    return json.loads(build_baseline("ref", [_run(s) for s in range(3)]).to_json())


def _import(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, name: str = "b.json"
            ) -> tuple[int, str]:
    path = tmp_path / name
    path.write_text(text)
    rc = main(["baselines", "import", str(path), "--store", str(tmp_path / "runs.db")])
    return rc, capsys.readouterr().err


def _one_error_line(err: str) -> None:
    assert err.startswith("lowprec: error:") and err.count("\n") == 1 and "Traceback" not in err, err


def test_an_untouched_golden_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     golden: dict[str, Any]) -> None:
    # The control for the refusals below: the same file, not edited, is accepted and stored as it is.
    rc, err = _import(tmp_path, capsys, json.dumps(golden))
    assert rc == 0, err
    with RunStore(tmp_path / "runs.db") as s:
        assert Baseline.from_dict(s.get_baseline("ref")).to_dict() == golden


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("steps", value=-5), r"steps must be an integer >= 1 \(the number of training steps each seed "
                                  r"ran\); got -5"),
        (_set("steps", value=0), "steps must be an integer >= 1"),
        (_set("steps", value="20"), "steps must be an integer; got '20'"),
        (_set("steps", value=20.0), "steps must be an integer; got 20.0"),
        (_set("steps", value=True), "steps must be an integer; got True"),
        (lambda d: d.update(steps=10) or d["config"].update(steps=10),
         r"envelope.rows must end at step 10 \(steps\); the last row is step 20"),
        (_set("name", value=" "), "name must be a non-empty string"),
        (_set("model", value=""), "model must be a non-empty string"),
        (_set("data_hash", value=""), "data_hash must be a non-empty string"),
        (_set("config_digest", value="not-a-digest"), "config_digest must be 16 lowercase hex digits"),
        (_set("metrics", value={}), "metrics must name at least one eval metric"),
        (_set("config", "steps", value=30), "config.steps 30 differs from steps 20"),
        (_set("config", "model", value="cnn-digits"), "config.model 'cnn-digits' differs from model 'mlp-digits'"),
        (_set("criteria", "metrics", value=["bleu"]), r"criteria.metrics \['bleu'\] are not metrics"),
        (_set("seeds", 0, "seed", value=-1), r"seeds\[0\].seed must be an integer in \[0, 2\*\*63\); got -1"),
        (_set("seeds", 1, "run_id", value="000000000000"), r"seeds\[\*\].run_id must be distinct"),
        (_set("seeds", 2, "name", value=""), r"seeds\[2\].name must be a non-empty string"),
        (_set("seeds", 1, "manifest", "seed", value=7), r"seeds\[1\].manifest.seed 7 differs from seeds\[1\].seed 1"),
        (_set("seeds", 0, "final", "loss", value=float("nan")), r"seeds\[0\].final.loss must be a finite number"),
        (_set("seeds", 0, "final", "accuracy", value=float("inf")), r"seeds\[0\].final.accuracy must be a finite"),
        (_set("seeds", 0, "final", "loss", value=None), r"seeds\[0\].final.loss must be a number; got None"),
        (_set("seeds", 1, "final", value={"loss": 2.0}), r"seeds\[1\].final must have one value per metric"),
        (_set("seeds", value=[]), r"seeds must list >= 2 seed runs"),
        (_set("envelope", "rows", 3, value=[4, 2.0, 0.1, 1.9]), r"envelope.rows\[3\] must be \[step, mean, std, "
                                                               r"min, max\], five finite numbers"),
        (_set("envelope", "rows", 5, 1, value=float("inf")), r"envelope.rows\[5\] must be"),
        (_set("envelope", "rows", value=[]), "envelope.rows must be a non-empty list"),
    ],
)
def test_import_refuses_each_bad_field_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 golden: dict[str, Any], edit: Callable[[dict[str, Any]], None],
                                                 message: str) -> None:
    edit(golden)
    rc, err = _import(tmp_path, capsys, json.dumps(golden))  # NaN/inf are written as JSON's NaN/Infinity
    assert rc == 2
    _one_error_line(err)
    assert "b.json: " in err
    assert re.search(message, err), err
    with RunStore(tmp_path / "runs.db") as s:
        assert s.list_baselines() == []


# --------------------------------------------------------------------------------------------------- nesting


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("deep.json", DEEP),
        ("deep-object.json", '{"a": ' * 100_000 + "1" + "}" * 100_000),
        ("deep-inside.json", '{"format": "lowprec-baseline", "config": ' + DEEP + "}"),
    ],
)
def test_deeply_nested_baseline_files_are_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            name: str, text: str) -> None:
    rc, err = _import(tmp_path, capsys, text, name)
    assert rc == 2
    _one_error_line(err)
    assert f"baseline file '{tmp_path / name}' is nested too deeply (more than {MAX_NESTING} levels" in err
    rc = main(["compare", "--baseline", str(tmp_path / name), "g", "--store", str(tmp_path / "runs.db")])
    err = capsys.readouterr().err
    assert rc == 2 and "is nested too deeply" in err
    _one_error_line(err)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("array.toml", 'model = "mlp-digits"\n[model_options]\nx = ' + DEEP + "\n"),
        ("table.toml", 'model = "mlp-digits"\nx = ' + "{a = " * 100_000 + "1" + "}" * 100_000 + "\n"),
        # dotted keys nest tables without brackets: caught after parsing (later code, json.dumps of the config
        # into the store included, recurses on such data)
        ("dotted.toml", 'model = "mlp-digits"\n[model_options]\n' + ".".join(["a"] * 5_000) + " = 1\n"),
        ("header.toml", 'model = "mlp-digits"\n[model_options.' + ".".join(["a"] * 5_000) + "]\nb = 1\n"),
        ("config.json", '{"model": "mlp-digits", "model_options": {"x": ' + DEEP + "}}"),
    ],
)
def test_deeply_nested_run_configs_are_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    rc = main(["run", str(path), "--store", str(tmp_path / "runs.db"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    _one_error_line(err)
    assert f"{path} is nested too deeply (more than {MAX_NESTING} levels" in err


@pytest.mark.parametrize("name", ["criteria.json", "criteria.toml"])
def test_deeply_nested_criteria_files_are_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           name: str) -> None:
    (tmp_path / "c.toml").write_text('model = "mlp-digits"\nsteps = 2\n')
    crit = tmp_path / name
    crit.write_text(DEEP if name.endswith(".json") else "curve_k = " + DEEP + "\n")
    rc = main(["baseline", str(tmp_path / "c.toml"), "--name", "ref", "--criteria", str(crit), "--quiet",
               "--store", str(tmp_path / "runs.db")])
    err = capsys.readouterr().err
    assert rc == 2
    _one_error_line(err)
    assert f"criteria file '{crit}' is nested too deeply" in err


def test_the_nesting_limit_is_exact_and_ignores_brackets_in_strings_and_comments() -> None:
    n = MAX_NESTING
    assert parse_json("[" * n + "]" * n, where="j") is not None  # the document itself is level 1
    with pytest.raises(ValueError, match=f"j is nested too deeply \\(more than {n} levels"):
        parse_json("[" * (n + 1) + "]" * (n + 1), where="j")
    parse_toml("a = " + "[" * (n - 1) + "]" * (n - 1), where="t")  # plus the top-level table: n levels
    with pytest.raises(ValueError, match="t is nested too deeply"):
        parse_toml("a = " + "[" * n + "]" * n, where="t")
    brackets = "[" * (3 * n)
    text = brackets + '\\"' + brackets  # an escaped backslash and an escaped quote inside the JSON string
    assert parse_json(json.dumps({"a": text}), where="j") == {"a": text}
    toml = (f'a = "{brackets}"  # {brackets}\nb = \'{brackets}\'\nc = """\n{brackets}"""\nd = \'\'\'{brackets}\'\'\'\n'
            "[[t]]\ne = [[1], [2]]\n")
    assert parse_toml(toml, where="t")["t"] == [{"e": [[1], [2]]}]
    with pytest.raises(ValueError, match="j: not valid JSON"):
        parse_json("[1,", where="j")


def test_load_reads_json_configs(tmp_path: Path) -> None:
    # Oracle: RunConfig.to_json, the form `lowprec run` hands to its torchrun workers, read back equal.
    from lowprec.runs._config import RunConfig

    cfg = RunConfig(model="mlp-digits", steps=7, seeds=(1, 2))
    (tmp_path / "c.json").write_text(cfg.to_json())
    assert load(tmp_path / "c.json") == cfg
