"""Run export: CSV and JSON parsed back with the standard library's csv/json (strict) and compared with the store;
TensorBoard event files read back with tensorboard's own EventAccumulator (an independent reader of the format)."""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from lowprec.runs import _atomic
from lowprec.runs._export import atomic_write_bytes, atomic_write_text, export_run, export_tensorboard
from lowprec.runs._store import RunStore


@pytest.fixture
def store(tmp_path: Path):
    with RunStore(tmp_path / "runs.db") as s:
        yield s


@pytest.fixture
def run(store: RunStore) -> str:
    """20 training steps, eval every 5 steps, one NaN loss, one +inf grad norm, two events."""
    rid = store.create_run(name="fp8 seed 1", config={"lr": 0.1, "steps": 20}, manifest={"metrics": {"loss": "min"}},
                           group="demo")
    for s in range(1, 21):
        store.log_scalars(rid, s, {"train/loss": 2.0 / s + 1e-9 * s, "train/lr": 0.1,
                                   "train/grad_norm": math.inf if s == 13 else 1.0 / 3.0 * s})
        if s % 5 == 0:
            store.log_scalars(rid, s, {"eval/loss": 1.0 / s, "eval/accuracy": 0.5 + s / 100})
    store.log_scalars(rid, 7, {"train/loss": math.nan})
    store.add_event(rid, step=7, kind="nonfinite", payload={"tensor": "fc1.weight.grad", "value": math.nan})
    store.add_event(rid, step=13, kind="overflow", payload={"amax": math.inf})
    store.finish_run(rid, status="completed")
    return rid


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def test_csv_wide_round_trips_exactly(store: RunStore, run: str, tmp_path: Path) -> None:
    out = export_run(store, run[:6], fmt="csv", out=tmp_path / "sub" / "run.csv")
    assert out == tmp_path / "sub" / "run.csv"
    with out.open(newline="") as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[1:]
    assert header == ["step", "eval/accuracy", "eval/loss", "train/grad_norm", "train/loss", "train/lr"]
    assert [int(r[0]) for r in body] == list(range(1, 21))
    for j, key in enumerate(header[1:], start=1):
        cells = [(int(r[0]), r[j]) for r in body]
        steps = np.array([s for s, c in cells if c != ""])
        values = np.array([float(c) for _, c in cells if c != ""])  # repr -> float is exact for float64
        want_steps, want_values = store.scalars(run)[key]
        assert np.array_equal(steps, want_steps) and _same(values, want_values), key
    assert body[3][header.index("eval/loss")] == ""  # step 4: no eval, empty cell
    assert body[6][header.index("train/loss")] == "nan" and body[12][header.index("train/grad_norm")] == "inf"


def test_json_is_strict_and_complete(store: RunStore, run: str, tmp_path: Path) -> None:
    out = export_run(store, run, fmt="json", out=tmp_path / "run.json")
    assert isinstance(out, Path)

    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON constant {token}")

    doc = json.loads(out.read_text(), parse_constant=reject)
    rec = store.get_run(run)
    for field in ("run_id", "name", "group", "status", "created_at", "finished_at", "config", "manifest", "error"):
        assert doc[field] == getattr(rec, field), field
    assert (doc["format"], doc["format_version"]) == ("lowprec-run", 1)
    sc = store.scalars(run)
    assert sorted(doc["scalars"]) == sorted(sc)
    for key, (steps, values) in sc.items():
        assert doc["scalars"][key]["steps"] == steps.tolist()
        assert _same(np.array([float(v) for v in doc["scalars"][key]["values"]]), values), key
    assert doc["scalars"]["train/loss"]["values"][6] == "nan"
    assert doc["events"] == [
        {"step": 7, "kind": "nonfinite", "payload": {"tensor": "fc1.weight.grad", "value": "nan"}},
        {"step": 13, "kind": "overflow", "payload": {"amax": "inf"}},
    ]


def test_export_to_text_stream(store: RunStore, run: str) -> None:
    buf = io.StringIO()
    assert export_run(store, run, fmt="json", out=buf) is None
    assert json.loads(buf.getvalue())["run_id"] == run
    buf = io.StringIO()
    export_run(store, run, fmt="csv", out=buf)
    assert buf.getvalue().startswith("step,eval/accuracy,")


def test_export_errors(store: RunStore, run: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fmt must be one of csv, json, got 'xml'"):
        export_run(store, run, fmt="xml", out=tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be a file path or a text stream, got int"):
        export_run(store, run, fmt="csv", out=3)  # type: ignore[arg-type]
    target = tmp_path / "keep.csv"
    target.write_text("previous\n")
    with pytest.raises(ValueError, match="no run with id 'ffffff'"):
        export_run(store, "ffffff", fmt="csv", out=target)
    assert target.read_text() == "previous\n"


def test_atomic_write_replaces_or_leaves_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: the directory listing and file bytes before/after; a failing rename must leave the old file."""
    target = tmp_path / "report.html"
    assert atomic_write_text(target, "v1 \u00e9") == target
    assert target.read_bytes() == "v1 \u00e9".encode()
    atomic_write_bytes(target, b"v2")
    assert target.read_bytes() == b"v2"

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_atomic.os, "replace", broken_replace)
    with pytest.raises(ValueError, match="cannot write .*report.html.*No space left on device"):
        atomic_write_bytes(target, b"v3")
    assert target.read_bytes() == b"v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary file left behind
    monkeypatch.undo()
    with pytest.raises(ValueError, match="cannot write"):
        atomic_write_bytes(tmp_path / "report.html" / "x", b"")  # below a regular file


def _accumulate(directory: Path):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():  # third-party import; see the note in _export._summary_writer
        warnings.simplefilter("ignore")
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep everything
    acc.Reload()
    return acc


def test_tensorboard_event_file_read_back(store: RunStore, run: str, tmp_path: Path) -> None:
    event_file = export_tensorboard(store, run, tmp_path / "tb")
    assert event_file.parent == tmp_path / "tb" / run and event_file.name.startswith("events.out.tfevents.")
    acc = _accumulate(event_file.parent)
    sc = store.scalars(run)
    assert sorted(acc.Tags()["scalars"]) == sorted(sc)
    for key, (steps, values) in sc.items():
        events = acc.Scalars(key)
        assert [e.step for e in events] == steps.tolist()
        # the event format stores float32: compare with the stored float64 values rounded to float32
        assert _same(np.array([e.value for e in events], dtype=np.float32), values.astype(np.float32)), key
    assert {"config/text_summary", "manifest/text_summary", "events/text_summary"} <= set(acc.Tags()["tensors"])
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config_text) == store.get_run(run).config


def test_tensorboard_refuses_to_duplicate_then_overwrites(store: RunStore, run: str, tmp_path: Path) -> None:
    first = export_tensorboard(store, run, tmp_path)
    with pytest.raises(ValueError, match="already holds TensorBoard event files .*overwrite=True"):
        export_tensorboard(store, run, tmp_path)
    second = export_tensorboard(store, run, tmp_path, overwrite=True)
    assert list(second.parent.glob("events.out.tfevents.*")) == [second]
    assert first.parent == second.parent
    assert [e.step for e in _accumulate(second.parent).Scalars("eval/loss")] == [5, 10, 15, 20]  # not doubled


def test_tensorboard_missing_says_how_to_install(store: RunStore, run: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # None in sys.modules: import fails
    with pytest.raises(ValueError, match="pip install tensorboard"):
        export_tensorboard(store, run, tmp_path)
    assert not (tmp_path / run).exists()  # nothing written before the check


# -- run ids that would escape the output folder (oracle: the file system around tmp_path) -----------------------

def _plant(path: Path, run_id: str, config: dict) -> None:
    """A run with id ``run_id`` added by editing the SQLite file, checksum and head made valid (as an attacker who
    knows the format would), so that only the id checks stand in the way."""
    import sqlite3

    con = sqlite3.connect(path)
    with con:
        row = (run_id, "planted", None, "failed", 1.0, 2.0, json.dumps(config), json.dumps({"seed": 0}), "x", "h",
               1, None)
        con.execute(f"INSERT INTO runs ({RunStore._COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        if any(c[1] == "checksum" for c in con.execute("PRAGMA table_info(runs)")):  # (a store before it: no)
            from lowprec.runs._store import run_checksum

            con.execute("UPDATE runs SET checksum = ? WHERE run_id = ?", (run_checksum(row), run_id))
            con.execute("INSERT INTO run_heads VALUES (?, 'x', 0, 0)", (run_id,))
    con.close()


def test_run_dir_refuses_ids_that_are_not_run_ids_and_paths_that_escape(tmp_path: Path) -> None:
    from lowprec.runs._export import run_dir

    assert run_dir(tmp_path, "0123456789ab") == tmp_path / "0123456789ab"
    for bad in ("../..", "/abs/path", "..", "0123456789a/", "0123456789AB", ""):
        with pytest.raises(ValueError, match="a run id is 12 lowercase hex characters"):
            run_dir(tmp_path, bad)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "0123456789ab").symlink_to(outside)  # a planted link
    with pytest.raises(ValueError, match="outside"):
        run_dir(tmp_path / "logs", "0123456789ab")


@pytest.mark.parametrize("planted", ["../..", "/abs/path"])
def test_a_planted_run_id_cannot_make_export_or_resume_write_elsewhere(tmp_path: Path, planted: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from lowprec.cli import main

    root = tmp_path / "work"
    root.mkdir()
    path = root / "runs.db"
    RunStore(path).close()
    _plant(path, planted, {"model": "mlp-digits", "steps": 5, "store": str(path)})
    before = sorted(p for p in tmp_path.rglob("*"))
    with RunStore(path) as s:
        with pytest.raises(ValueError, match=f"invalid id {planted!r}"):
            export_tensorboard(s, planted, root / "tb")
    for args in (["runs", "export", planted, "--format", "tensorboard", "--out", str(root / "tb")],
                 ["run", "--resume", planted], ["runs", "show", planted], ["runs", "list"]):
        assert main([*args, "--store", str(path)]) == 2, args
        err = capsys.readouterr().err
        assert f"holds a run with an invalid id {planted!r} (row 1, name 'planted')" in err, (args, err)
    after = sorted(p for p in tmp_path.rglob("*") if not p.name.startswith("runs.db-"))
    assert after == [p for p in before if not p.name.startswith("runs.db-")]  # nothing written anywhere
    assert planted != "/abs/path" or not Path("/abs/path").exists()


def test_cli_tensorboard_export_default_logdir_hint_and_overwrite(store: RunStore, run: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the file system and the printed command.  The default logdir is ``tb``, the run goes in
    ``tb/<run id>/`` once (not ``tb/<id>/<id>/``), the hint's ``--logdir`` is that folder (what TensorBoard takes),
    and a second export is refused naming the CLI's ``--overwrite``, which then replaces the files."""
    from lowprec.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["runs", "export", run[:6], "--format", "tensorboard", "--store", str(store.path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    (event,) = (tmp_path / "tb" / run).glob("events.out.tfevents.*")
    assert not (tmp_path / "tb" / run / run).exists()
    assert f"wrote TensorBoard event file tb/{run}/{event.name}" in out and out.rstrip().endswith(
        "(view: tensorboard --logdir tb)"), out
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "lowprec runs export --overwrite" in err and "overwrite=True in Python" in err, err
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    assert len(list((tmp_path / "tb" / run).glob("events.out.tfevents.*"))) == 1
    assert main(["runs", "export", run, "--out", "x.csv", "--overwrite", "--store", str(store.path)]) == 2
    assert "--overwrite goes with --format tensorboard" in capsys.readouterr().err
    assert main(["runs", "export", run, "--format", "tensorboard", "--out", "logs", "--store",
                 str(store.path)]) == 0
    assert "(view: tensorboard --logdir logs)" in capsys.readouterr().out
    assert len(list((tmp_path / "logs" / run).glob("events.out.tfevents.*"))) == 1
