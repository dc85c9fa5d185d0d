"""Importing runs from TensorBoard, MLflow, CSV and JSON Lines (lowprec.runs._import) and exporting to MLflow.

Oracles: the same synthetic curves written through each tool's own writer (``SummaryWriter``, ``MlflowClient``,
``csv``) give equal verdict dicts from the judge (the values are float32-representable, so TensorBoard's float32
storage loses nothing and the comparison is exact); a float64 value that float32 cannot hold comes back from
TensorBoard as ``np.float32(value)`` and from MLflow bit for bit; ``hashlib.sha256`` of the file for provenance;
the store's ``list_runs`` for "nothing half-imported".
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lowprec import UsageError, accuracy
from lowprec.cli import main
from lowprec.runs import RunStore
from lowprec.runs._export import export_mlflow
from lowprec.runs._import import import_run, sha256_path

STEPS = 40
EVAL_STEPS = list(range(9, STEPS, 10))  # 9, 19, 29, 39: the last eval at the last step
ARMS = {"ref": (0, 0.0, 0.90), "good": (10, 0.0, 0.90), "bad": (20, 0.6, 0.60)}  # seed base, loss shift, accuracy


def curves(arm: str, k: int) -> dict[str, tuple[list[int], list[float]]]:
    """Seed k of an arm: a decaying loss with seed noise, float32-representable (TensorBoard stores float32)."""
    base, shift, acc = ARMS[arm]
    rng = np.random.default_rng(base + k)
    t = np.arange(STEPS)
    loss = (2.0 * np.exp(-t / 12) + 0.3 + shift + 0.02 * rng.standard_normal(STEPS)).astype(np.float32)
    ev_acc = (acc - 0.3 * np.exp(-np.array(EVAL_STEPS) / 12) + 0.005 * rng.standard_normal(len(EVAL_STEPS)))
    ev_loss = loss[EVAL_STEPS] + np.float32(0.05)
    return {"loss": (t.tolist(), [float(v) for v in loss]),
            "eval/accuracy": (EVAL_STEPS, [float(v) for v in ev_acc.astype(np.float32)]),
            "eval/loss": (EVAL_STEPS, [float(v) for v in ev_loss.astype(np.float32)])}


def write_tb(logdir: Path, c: dict) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(log_dir=str(logdir))
    for tag, (steps, values) in c.items():
        for s, v in zip(steps, values, strict=True):
            w.add_scalar(tag, v, global_step=s, walltime=1.0)
    w.close()
    return logdir


def write_mlflow(uri: Path, c: dict, name: str, status: str = "FINISHED") -> str:
    from lowprec.runs._import import _mlflow_client

    client, _ = _mlflow_client(str(uri))
    from mlflow.entities import Metric

    exp = client.get_experiment_by_name("e")
    exp_id = exp.experiment_id if exp else client.create_experiment("e")
    run = client.create_run(exp_id, run_name=name)
    client.log_batch(run.info.run_id, metrics=[Metric(tag, v, 0, s) for tag, (steps, values) in c.items()
                                               for s, v in zip(steps, values, strict=True)])
    client.set_terminated(run.info.run_id, status=status)
    return str(run.info.run_id)


def write_csv(path: Path, c: dict) -> Path:
    table: dict[int, dict[str, float]] = {}
    for tag, (steps, values) in c.items():
        for s, v in zip(steps, values, strict=True):
            table.setdefault(s, {})[tag] = v
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", *c])
        for s in sorted(table):
            w.writerow([s, *(repr(table[s][k]) if k in table[s] else "" for k in c)])
    return path


def import_arms(tmp: Path, fmt: str) -> RunStore:
    store = RunStore(tmp / f"{fmt}.db")
    for arm in ARMS:
        for k in range(3):
            c, name = curves(arm, k), f"{arm}-{k}"
            if fmt == "tensorboard":
                src, run = write_tb(tmp / "tb" / name, c), None
            elif fmt == "mlflow":
                src, run = tmp / "mlruns", write_mlflow(tmp / "mlruns", c, name)
            else:
                src, run = write_csv(tmp / f"{name}.csv", c), None
            import_run(store, src, fmt=fmt, name=name, group=arm, seed=ARMS[arm][0] + k, run=run,  # type: ignore
                       model="mlp", data_hash="d1", recipe="fp32" if arm == "ref" else "fp8_tensorwise")
    return store


def verdicts(store: RunStore) -> list[dict]:
    baseline = accuracy.baseline_from_runs(store, "ref", ["ref"])
    out = []
    for v in accuracy.judge_groups(baseline, accuracy.select_runs(store, ["good", "bad"])):
        text = json.dumps(v.to_dict(), sort_keys=True)
        for rec in store.list_runs():  # run ids are random: compare by run name
            text = text.replace(rec.run_id, rec.name)
        out.append(json.loads(text))
    return out


def test_three_formats_give_the_same_verdicts(tmp_path: Path) -> None:
    got = {fmt: verdicts(import_arms(tmp_path, fmt)) for fmt in ("tensorboard", "mlflow", "csv")}
    good, bad = got["csv"]
    assert good["outcome"] != "fail", good
    assert bad["outcome"] == "fail", bad
    assert got["tensorboard"] == got["csv"] == got["mlflow"]


def test_mlflow_export_import_round_trip_is_bit_exact(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "a.db")
    rid = store.create_run(name="r", group="g", config={"model": "mlp", "steps": 3},
                           manifest={"seed": 7, "metrics": {"accuracy": "max"}, "data_hash": "d", "recipe_hash": "h"})
    vals = [0.1, 1 / 3, math.nan, math.inf]  # 1/3 is not a float32
    store.log_rows(rid, [(s, "train/loss", v) for s, v in enumerate(vals)] + [(3, "eval/accuracy", 0.123456789)])
    store.finish_run(rid, status="completed")
    mid = export_mlflow(store, rid, tmp_path / "mlruns")
    back = import_run(store, tmp_path / "mlruns", fmt="mlflow", run=mid)
    a, b = store.scalars(rid), store.scalars(back)
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key][0], b[key][0])
        assert [v.hex() for v in a[key][1].tolist()] == [v.hex() for v in b[key][1].tolist()]  # float64, NaN too
    rec = store.get_run(back)
    assert (rec.manifest["seed"], rec.manifest["metrics"], rec.manifest["data_hash"], rec.config["model"],
            rec.config["steps"], rec.name) == (7, {"accuracy": "max"}, "d", "mlp", 3, "r")


def test_tensorboard_keeps_float32(tmp_path: Path) -> None:
    write_tb(tmp_path / "tb", {"train/loss": ([0, 1], [1 / 3, 0.1])})
    with RunStore(tmp_path / "s.db") as store:
        rid = import_run(store, tmp_path / "tb", fmt="tensorboard", seed=0)
        assert store.scalars(rid)["train/loss"][1].tolist() == [float(np.float32(1 / 3)), float(np.float32(0.1))]


def test_jsonl_provenance_and_nonfinite(tmp_path: Path) -> None:
    p = tmp_path / "run.jsonl"
    p.write_text('{"step": 0, "train/loss": 2.5}\n{"step": 1, "train/loss": "nan", "eval/f1": null}\n'
                 '{"step": 2, "train/loss": 1.0, "eval/f1": 0.5, "lr": 0.1}\n')
    with RunStore(tmp_path / "s.db") as store:
        rid = import_run(store, p, fmt="jsonl", seed=3, metrics={"f1": "max"})
        rec = store.get_run(rid)
        sc = store.scalars(rid)
        assert math.isnan(sc["train/loss"][1][1]) and sc["eval/f1"][0].tolist() == [2]  # NaN kept: divergence
        src = rec.manifest["source"]
        assert src["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest() and src["format"] == "jsonl"
        assert src["skipped"] == ["lr"] and rec.config == {"model": "unknown", "steps": 2}
        assert (rec.status, rec.manifest["metrics"], rec.manifest["recipe_hash"]) == ("completed", {"f1": "max"},
                                                                                      "none")


def test_folder_hash_covers_names_and_bytes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x")
    h1 = sha256_path(tmp_path / "d")
    (tmp_path / "d" / "a").rename(tmp_path / "d" / "b")
    assert sha256_path(tmp_path / "d") != h1


BAD_CSV = [
    ("step,acc\n0,1\n", {}, "no 'train/loss' curve: the tags found are ['acc']; name the training loss with --map"),
    ("step,loss\n0,1\n2,1\n1,1\n", {}, "line 4: 'loss' steps out of order: step 1 after step 2"),
    ("step,loss\n0,1\n0,2\n", {}, "line 3: 'loss' logs step 0 twice"),
    ("step,loss\n0,1\n1,abc\n", {}, "line 3: 'loss' value 'abc' is not a number"),
    ("step,loss,eval/f1\n0,1,2\n", {}, "eval/f1 has no direction: pass --metric f1=min or --metric f1=max"),
    ("loss\n1\n", {}, "line 1: a CSV import needs a header row with a 'step' column"),
    ("step,l\n0,1\n", {"mapping": {"x": "train/loss"}}, "--map x=train/loss: no tag or column 'x'"),
]


@pytest.mark.parametrize(("text", "kw", "msg"), BAD_CSV)
def test_bad_csv_is_refused_and_nothing_stored(tmp_path: Path, text: str, kw: dict, msg: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with RunStore(tmp_path / "s.db") as store:
        with pytest.raises(UsageError, match=None) as e:
            import_run(store, p, fmt="csv", seed=0, **kw)
        assert msg in str(e.value) and str(p) in str(e.value), str(e.value)
        assert store.list_runs() == []


def test_other_format_and_missing_seed(tmp_path: Path) -> None:
    p = write_csv(tmp_path / "r.csv", {"loss": ([0], [1.0])})
    tb = write_tb(tmp_path / "tb", {"loss": ([0], [1.0])})
    (event_file,) = tb.glob("events*")
    with RunStore(tmp_path / "s.db") as store:
        with pytest.raises(UsageError, match="holds no TensorBoard event files"):
            import_run(store, tmp_path, fmt="tensorboard", seed=0)
        with pytest.raises(UsageError, match="is it another format"):
            import_run(store, p, fmt="tensorboard", seed=0)
        with pytest.raises(UsageError, match="not a CSV text file"):
            import_run(store, event_file, fmt="csv", seed=0)
        with pytest.raises(UsageError, match="no seed: pass --seed S"):
            import_run(store, p, fmt="csv")
        assert store.list_runs() == []


def test_failure_while_recording_leaves_no_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write_csv(tmp_path / "r.csv", {"loss": ([0, 1], [1.0, 0.5])})
    with RunStore(tmp_path / "s.db") as store:
        def boom(*a: object, **k: object) -> None:
            raise OSError("disk full")

        monkeypatch.setattr(store, "finish_run", boom)
        with pytest.raises(OSError, match="disk full"):
            import_run(store, p, fmt="csv", seed=0)
        assert store.list_runs() == []


def test_mlflow_run_selection_and_failed_status(tmp_path: Path) -> None:
    uri = tmp_path / "mlruns"
    write_mlflow(uri, {"train/loss": ([0], [1.0])}, "a")
    write_mlflow(uri, {"train/loss": ([0], [1.0])}, "b", status="FAILED")
    with RunStore(tmp_path / "s.db") as store:
        with pytest.raises(UsageError, match="2 runs match: .*; pass --run-id"):
            import_run(store, uri, fmt="mlflow", seed=0)
        rec = store.get_run(import_run(store, uri, fmt="mlflow", seed=0, run="b"))
        assert rec.status == "failed" and "FAILED" in (rec.error or "")
        assert rec.manifest["source"]["sha256_of"] == "folder"


def test_cli_import_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write_csv(tmp_path / "r.csv", {"loss": ([0, 1], [1.0, math.nan]), "acc": ([1], [0.5])})
    db = str(tmp_path / "s.db")
    assert main(["runs", "import", str(p), "--format", "csv", "--seed", "1", "--map", "acc=eval/accuracy",
                 "--store", db, "--group", "g"]) == 0
    out = capsys.readouterr().out
    assert "imported run" in out and "train/loss is not finite from step 1" in out
    rid = RunStore(db).list_runs()[0].run_id
    assert main(["runs", "export", rid, "--format", "mlflow", "--out", str(tmp_path / "ml"), "--store", db]) == 0
    assert "wrote MLflow run" in capsys.readouterr().out
    assert main(["runs", "import", str(p), "--format", "csv", "--store", db]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no seed: pass --seed S" in err
    assert main(["runs", "import", str(p), "--format", "csv", "--seed", "1", "--metric", "f1", "--store", db]) == 2
    assert "write --metric NAME=VALUE" in capsys.readouterr().err


def test_tensorboard_import_does_not_import_torch(tmp_path: Path) -> None:
    """Oracle: ``sys.modules`` of a fresh interpreter after ``runs import --format tensorboard``."""
    tb = write_tb(tmp_path / "tb", {"loss": ([0, 1], [1.0, 0.5])})
    code = ("import sys; from lowprec.cli import main; rc = main(['runs', 'import', sys.argv[1], '--format', "
            "'tensorboard', '--seed', '0', '--store', sys.argv[2]]); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tb), str(tmp_path / "s.db")], capture_output=True,
                         text=True, check=True).stdout
    assert out.split()[-2:] == ["0", "False"], out
