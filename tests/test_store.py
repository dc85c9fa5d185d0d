"""RunStore: round trips against plain Python reference models, the schema-version rules, error messages, and the
crash/concurrency guarantees checked with real processes (two spawned writers; a writer killed with SIGKILL).

The tests that take the ``store`` fixture run once per backend (``store_location`` in conftest.py: an SQLite file
and a fresh PostgreSQL database); the file, schema and crash rules are SQLite's (PostgreSQL's: test_store_pg.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import pickle
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _postgres import raw

from lowprec.runs import _store
from lowprec.runs._store import MIGRATIONS, RunStore, StoreCorrupt, StoreError


@pytest.fixture
def store(store_location: str):
    with RunStore(store_location) as s:
        yield s


def _new(store: RunStore, name: str = "r", **kw) -> str:
    return store.create_run(name=name, config={"lr": 0.1, "seed": 1}, manifest={"metrics": {"loss": "min"}}, **kw)


# -- round trips (oracle: the values and dicts the test itself wrote) ---------------------------------------------

def test_create_get_list_round_trip(store: RunStore) -> None:
    a = store.create_run(name="a", config={"x": [1, 2.5, "s", None, True]}, manifest={"m": {"n": 1}}, group="g1")
    time.sleep(0.01)
    b = _new(store, "b", group="g2")
    rec = store.get_run(a)
    assert (rec.run_id, rec.name, rec.group, rec.status, rec.error) == (a, "a", "g1", "running", None)
    assert rec.config == {"x": [1, 2.5, "s", None, True]} and rec.manifest == {"m": {"n": 1}}
    assert rec.finished_at is None and abs(rec.created_at - time.time()) < 60
    assert (rec.hostname, rec.pid) == (store._hostname, os.getpid())
    assert len(a) == 12 and int(a, 16) >= 0
    assert [r.run_id for r in store.list_runs()] == [b, a]  # newest first
    assert [r.run_id for r in store.list_runs(group="g1")] == [a]
    store.finish_run(b, status="completed")
    assert [r.run_id for r in store.list_runs(status="completed")] == [b]
    assert [r.run_id for r in store.list_runs(status="running")] == [a]
    store.finish_run(a, status="failed", error="loss is NaN at step 7")
    rec = store.get_run(a)
    assert (rec.status, rec.error) == ("failed", "loss is NaN at step 7") and rec.finished_at >= rec.created_at


def test_scalars_match_reference_model(store: RunStore) -> None:
    """Random logs (with replacements, NaN and inf) against a dict reference; INSERT OR REPLACE keeps the last."""
    rid = _new(store)
    rng = random.Random(0)
    ref: dict[str, dict[int, float]] = {}
    for _ in range(300):
        step = rng.randrange(50)
        values = {k: rng.choice([rng.uniform(-1e6, 1e6), math.nan, math.inf, -math.inf, 0.1])
                  for k in rng.sample(["train/loss", "train/lr", "eval/loss", "eval/accuracy"], 2)}
        if rng.random() < 0.5:
            store.log_scalars(rid, step, values)
        else:
            store.log_rows(rid, ((step, k, v) for k, v in values.items()))
        for k, v in values.items():
            ref.setdefault(k, {})[step] = v
    got = store.scalars(rid)
    assert sorted(got) == sorted(ref)
    for k, (steps, values) in got.items():
        assert steps.dtype == np.int64 and values.dtype == np.float64
        want_steps = sorted(ref[k])
        assert steps.tolist() == want_steps
        np.testing.assert_array_equal(values, np.array([ref[k][s] for s in want_steps]))  # NaN == NaN here


def test_scalars_accept_numpy_and_torch_numbers(store: RunStore) -> None:
    import torch

    rid = _new(store)
    store.log_scalars(rid, np.int64(3), {"a": np.float32(0.5), "b": torch.tensor(2.0), "c": 7})
    assert {k: (s.tolist(), v.tolist()) for k, (s, v) in store.scalars(rid).items()} == {
        "a": ([3], [0.5]), "b": ([3], [2.0]), "c": ([3], [7.0])}


def test_events_round_trip_and_filter(store: RunStore) -> None:
    rid = _new(store)
    store.add_event(rid, step=5, kind="nonfinite", payload={"tensor": "fc1.weight.grad", "count": 3})
    store.add_event(rid, step=2, kind="lr_drop", payload={"lr": 0.01})
    store.add_event(rid, step=5, kind="nonfinite", payload={"tensor": "fc2.weight.grad", "count": 1})
    assert store.events(rid) == [
        {"step": 2, "kind": "lr_drop", "payload": {"lr": 0.01}},
        {"step": 5, "kind": "nonfinite", "payload": {"tensor": "fc1.weight.grad", "count": 3}},
        {"step": 5, "kind": "nonfinite", "payload": {"tensor": "fc2.weight.grad", "count": 1}},
    ]
    assert [e["step"] for e in store.events(rid, kind="lr_drop")] == [2]
    assert store.events(rid, kind="other") == []


def test_reopen_run_truncates_after_from_step(store: RunStore) -> None:
    rid = _new(store)
    other = _new(store, "other")
    for s in range(1, 11):
        store.log_scalars(rid, s, {"train/loss": 1.0 / s})
        store.log_scalars(other, s, {"train/loss": 2.0})
        store.add_event(rid, step=s, kind="tick", payload={})
    store.finish_run(rid, status="failed", error="preempted")
    store.reopen_run(rid, from_step=6)
    rec = store.get_run(rid)
    assert (rec.status, rec.error, rec.finished_at) == ("running", None, None)
    assert store.scalars(rid)["train/loss"][0].tolist() == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in store.events(rid)] == [1, 2, 3, 4, 5, 6]
    assert len(store.scalars(other)["train/loss"][0]) == 10  # another run is untouched


def test_run_id_prefixes(store: RunStore) -> None:
    a = _new(store, "first", run_id="abcdef000001")
    b = _new(store, "second", run_id="abcdef100002")
    assert store.get_run("abcdef000001").run_id == a
    assert store.get_run("ABCDEF100002").run_id == b  # case-insensitive
    assert store.get_run("abcdef0").run_id == a
    assert store.get_run(" abcdef1 ").run_id == b
    with pytest.raises(StoreError, match=r"'abcd' is ambiguous: it matches 2 runs: abcdef100002 \(second\), "
                                         r"abcdef000001 \(first\); give more characters"):
        store.get_run("abcd")
    with pytest.raises(StoreError, match=r"no run with id '1234' in \S+; recent runs: abcdef100002 \(second\), "
                                         r"abcdef000001 \(first\)$"):
        store.get_run("1234")
    with pytest.raises(StoreError, match="too short: give at least 4"):
        store.get_run("abc")
    with pytest.raises(StoreError, match="already exists"):
        _new(store, run_id=a)
    with pytest.raises(ValueError, match="run_id must be 12 lowercase hex"):
        _new(store, run_id="xyz")


def test_unknown_run_in_writes_and_empty_store(store: RunStore) -> None:
    with pytest.raises(StoreError, match="no run with id 'feedfeedfeed'.*has no runs yet"):
        store.log_scalars("feedfeedfeed", 1, {"a": 1.0})
    with pytest.raises(StoreError, match="no run with id"):
        store.add_event("feedfeedfeed", step=1, kind="k", payload={})
    with pytest.raises(StoreError, match="no run with id"):
        store.finish_run("feedfeedfeed", status="completed")


def test_argument_validation_names_the_field(store: RunStore) -> None:
    rid = _new(store)
    cases = [
        (lambda: store.log_scalars(rid, -1, {"a": 1.0}), "step of scalar 'a' must be an integer >= 0, got -1"),
        (lambda: store.log_scalars(rid, 1.5, {"a": 1.0}), "must be an integer >= 0, got 1.5"),
        (lambda: store.log_scalars(rid, 1, {"a": "x"}), "scalar 'a' at step 1 must be a real number, got 'x'"),
        (lambda: store.log_scalars(rid, 1, {"": 1.0}), "scalar key must be a non-empty string"),
        (lambda: store.finish_run(rid, status="done"), "status must be one of completed, diverged, failed, got 'done'"),
        (lambda: store.list_runs(status="ok"), "status must be one of running, completed, diverged, failed"),
        (lambda: store.create_run(name="", config={}, manifest={}), "name must be a non-empty string"),
        (lambda: store.create_run(name="n", config={"f": object()}, manifest={}), "config must be JSON-serial"),
        (lambda: store.create_run(name="n", config=[], manifest={}), "config must be a dict, got list"),
        (lambda: store.add_event(rid, step=1, kind="k", payload={1j: 2}), "payload must be JSON-serial"),
        (lambda: store.reopen_run(rid, from_step=True), "from_step must be an integer >= 0, got True"),
        (lambda: RunStore(store.path, synchronous="off"), "synchronous must be 'full' or 'normal'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call()
    assert store.scalars(rid) == {}  # nothing half-written by the rejected calls


def test_baselines(store: RunStore) -> None:
    with pytest.raises(StoreError, match="no baseline named 'x'.*no baselines are saved there yet"):
        store.get_baseline("x")
    store.save_baseline("mlp/bf16", {"envelope": [1.0, 2.0], "seeds": [0, 1, 2]})
    store.save_baseline("cnn/fp32", {"v": 1})
    assert store.list_baselines() == ["cnn/fp32", "mlp/bf16"]
    assert store.get_baseline("mlp/bf16") == {"envelope": [1.0, 2.0], "seeds": [0, 1, 2]}
    with pytest.raises(StoreError, match="baseline 'cnn/fp32' already exists.*overwrite=True"):
        store.save_baseline("cnn/fp32", {"v": 2})
    assert store.get_baseline("cnn/fp32") == {"v": 1}
    store.save_baseline("cnn/fp32", {"v": 2}, overwrite=True)
    assert store.get_baseline("cnn/fp32") == {"v": 2}
    with pytest.raises(StoreError, match="no baseline named 'nope'.*known baselines: cnn/fp32, mlp/bf16"):
        store.get_baseline("nope")


def test_pickle_reopens_same_file_and_threads_share_a_store(store: RunStore) -> None:
    rid = _new(store)
    with pickle.loads(pickle.dumps(store)) as copy:
        assert copy.location == store.location and copy.get_run(rid).run_id == rid

    def log(key: str) -> None:
        for s in range(200):
            store.log_scalars(rid, s, {key: float(s)})

    threads = [threading.Thread(target=log, args=(k,)) for k in ("t0", "t1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: len(v[0]) for k, v in store.scalars(rid).items()} == {"t0": 200, "t1": 200}


def test_closed_store_raises(tmp_path: Path) -> None:
    s = RunStore(tmp_path / "runs.db")
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreError, match="is closed"):
        s.list_runs()


# -- file, schema and version rules (oracle: SQLite read directly) ----------------------------------------------

def test_default_path_creates_parent_and_uses_wal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with RunStore() as s:
        _new(s)
    db = tmp_path / "lowprec-runs" / "runs.db"
    assert db.is_file()
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == len(MIGRATIONS) == 3
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"runs", "scalars", "events", "baselines", "schema_version", "run_heads"} <= tables
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


def test_migrations_apply_in_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runs.db"
    with RunStore(path) as s:
        rid = _new(s)
        s.log_scalars(rid, 1, {"a": 1.5})
    v2 = ("CREATE TABLE tags (run_id TEXT NOT NULL, tag TEXT NOT NULL)",
          "INSERT INTO tags SELECT run_id, 'migrated' FROM runs")
    monkeypatch.setattr(_store, "MIGRATIONS", [*MIGRATIONS, v2])
    for _ in range(2):  # the second open must not apply version 2 again
        with RunStore(path) as s:
            assert s.scalars(rid)["a"][1].tolist() == [1.5]
    con = sqlite3.connect(path)
    try:
        assert [r[0] for r in con.execute("SELECT version FROM schema_version ORDER BY version")] == [1, 2, 3, 4]
        assert con.execute("SELECT run_id, tag FROM tags").fetchall() == [(rid, "migrated")]
    finally:
        con.close()


def test_failed_migration_is_rolled_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).close()
    monkeypatch.setattr(_store, "MIGRATIONS", [*MIGRATIONS, ("CREATE TABLE t2 (x)", "SELECT * FROM no_such_table")])
    with pytest.raises(StoreError, match="no such table"):
        RunStore(path)
    con = sqlite3.connect(path)
    try:
        assert con.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == len(MIGRATIONS)
        assert con.execute("SELECT name FROM sqlite_master WHERE name = 't2'").fetchone() is None
    finally:
        con.close()


def test_newer_schema_version_asks_to_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).close()
    con = sqlite3.connect(path)
    with con:
        con.execute("INSERT INTO schema_version VALUES (?, 0)", (len(MIGRATIONS) + 1,))
    con.close()
    with pytest.raises(StoreError, match=r"written by a newer lowprec \(schema version 4; this lowprec reads up to "
                                         r"version 3\); upgrade lowprec"):
        RunStore(path)


def test_garbage_file_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(random.Random(0).randbytes(8192))
    with pytest.raises(StoreError, match=r"runs.db is not a lowprec run store \(file is not a database\); "
                                         r"move it away or pass --store"):
        RunStore(path)
    assert path.read_bytes() == random.Random(0).randbytes(8192)  # left untouched


def test_corrupt_store_pages_are_reported(tmp_path: Path) -> None:
    """A real store whose pages after the 100-byte header are overwritten: SQLite reports it malformed."""
    path = tmp_path / "runs.db"
    with RunStore(path) as s:
        s.log_rows(_new(s), [(i, "k", 1.0) for i in range(2000)])
    data = path.read_bytes()
    path.write_bytes(data[:100] + random.Random(1).randbytes(len(data) - 100))
    with pytest.raises(StoreError, match="is not a lowprec run store .*malformed"):
        RunStore(path)


def test_other_sqlite_database_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    con = sqlite3.connect(path)
    with con:
        con.execute("CREATE TABLE users (id INTEGER)")
    con.close()
    with pytest.raises(StoreError, match="is not a lowprec run store .*SQLite database with other tables"):
        RunStore(path)


def test_unwritable_paths(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"cannot write the run store at .*: it is a directory; pass --store PATH"):
        RunStore(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # a path below a regular file cannot be created, even by root
    with pytest.raises(StoreError, match=r"cannot write the run store at .*file/sub/runs.db: cannot create .*"
                                         r"; pass --store PATH or fix permissions"):
        RunStore(blocker / "sub" / "runs.db")


def test_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        try:
            (ro / "probe").touch()
        except PermissionError:
            pass
        else:
            pytest.skip("running as root: chmod does not block writes (test_unwritable_paths covers this user)")
        with pytest.raises(StoreError, match=r"cannot write the run store at .*ro/runs.db: .*pass --store PATH"):
            RunStore(ro / "runs.db")
    finally:
        ro.chmod(0o755)


# -- the dead-process rule (oracle: processes whose fate the test controls) -------------------------------------

def _set_owner(store: RunStore, rid: str, **cols: object) -> None:
    """Edit a run's owner columns as another process would have written them (checksum kept valid)."""
    with raw(store) as con:
        for col, val in cols.items():
            con.execute(f"UPDATE runs SET {col} = ? WHERE run_id = ?", (val, rid))
        row = con.execute(f"SELECT {RunStore._COLUMNS} FROM runs WHERE run_id = ?", (rid,)).fetchone()
        con.execute("UPDATE runs SET checksum = ? WHERE run_id = ?", (_store.run_checksum(row), rid))


def test_dead_zombie_reused_and_remote_processes(store: RunStore) -> None:
    rid = _new(store)
    assert store.get_run(rid).status == "running"  # this very process
    child = subprocess.Popen([sys.executable, "-c", ""])
    try:
        for _ in range(500):  # wait until it has exited but is not reaped: a zombie
            stat = _store._proc_stat(child.pid)
            if stat is None or stat[0] == "Z":
                break
            time.sleep(0.01)
        _set_owner(store, rid, pid=child.pid, pid_start=None)
        rec = store.get_run(rid)
        assert (rec.status, rec.error) == ("failed", f"process {child.pid} ended without finishing the run")
    finally:
        child.wait()
    assert store.get_run(rid).status == "failed"  # reaped: no such process
    assert [r.run_id for r in store.list_runs(status="failed")] == [rid]
    _set_owner(store, rid, hostname="another-host")  # cannot be checked from here: stored status stands
    assert store.get_run(rid).status == "running"
    _set_owner(store, rid, hostname=store._hostname, pid=os.getpid(), pid_start="1")
    if _store._proc_stat(os.getpid()) is not None:  # Linux: a live pid with another start time was reused
        assert store.get_run(rid).status == "failed"


# Child processes import only the store: ``import lowprec.runs`` does not import torch (the store needs the
# standard library and numpy), so each child starts in about 0.4 s.
_STANDALONE = f"""
import sys
sys.path.insert(0, {str(Path(_store.__file__).parents[2])!r})
from lowprec.runs import RunStore
"""

_KILLED_WRITER = _STANDALONE + """
store = RunStore(sys.argv[1])
rid = store.create_run(name="doomed", config={}, manifest={})
step = 0
while True:
    step += 1
    store.log_scalars(rid, step, {"train/loss": 1.0 / step})
    store.log_rows(rid, [(step, f"bulk/{i}", float(i)) for i in range(300)])
    if step == 20:
        print(rid, flush=True)
"""


def test_sigkill_mid_run_leaves_a_readable_store(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        rid = proc.stdout.readline().strip()
        time.sleep(0.3)  # let it commit more, then kill it wherever it is (likely inside a transaction)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert len(rid) == 12, "the writer did not start"
    with RunStore(path) as s:
        rec = s.get_run(rid)
        assert (rec.status, rec.error) == ("failed", f"process {proc.pid} ended without finishing the run")
        sc = s.scalars(rid)
        last = int(sc["train/loss"][0][-1])
        assert last >= 20 and sc["train/loss"][0].tolist() == list(range(1, last + 1))  # nothing committed lost
        bulk_steps = {k: v[0].tolist() for k, v in sc.items() if k.startswith("bulk/")}
        assert len(bulk_steps) == 300
        assert len({tuple(v) for v in bulk_steps.values()}) == 1  # each batch is all there or not at all
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        con.close()


# -- two processes writing at once (oracle: every value is a known function of who wrote it) ---------------------

N_RUNS, N_STEPS, KEYS = 2, 600, ("train/loss", "train/lr", "train/grad_norm")


def _value(worker: int, run: int, step: int, key: int) -> float:
    return worker * 1e6 + run * 1e4 + step + key / 8  # the same formula is in _CONCURRENT_WRITER


_CONCURRENT_WRITER = _STANDALONE + """
with RunStore(PATH) as s:
    BARRIER.wait(timeout=60)  # both processes start logging together
    for run in range(N_RUNS):
        rid = s.create_run(name=f"w{WORKER} r{run}", config={"worker": WORKER}, manifest={})
        if run == 0:  # both first runs exist before either writes: the writes overlap however the OS schedules
            BARRIER.wait(timeout=60)
        for step in range(1, N_STEPS + 1):
            s.log_scalars(rid, step, {k: WORKER * 1e6 + run * 1e4 + step + i / 8 for i, k in enumerate(KEYS)})
        s.log_rows(rid, [(step, "bulk", float(step)) for step in range(1, N_STEPS + 1)])
        s.add_event(rid, step=N_STEPS, kind="done", payload={"worker": WORKER})
        s.finish_run(rid, status="completed")
        QUEUE.put((WORKER, run, rid))
"""


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).close()  # created once; the workers race on everything else
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=exec, args=(_CONCURRENT_WRITER, {
        "PATH": str(path), "WORKER": w, "BARRIER": barrier, "QUEUE": queue, "N_RUNS": N_RUNS, "N_STEPS": N_STEPS,
        "KEYS": KEYS})) for w in range(2)]
    for p in procs:
        p.start()
    ids = [queue.get(timeout=120) for _ in range(2 * N_RUNS)]
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    queue.close()
    queue.join_thread()
    with RunStore(path) as s:
        runs = s.list_runs(status="completed")
        assert len(runs) == 2 * N_RUNS
        spans = [(min(r.created_at for r in runs if r.config["worker"] == w),
                  max(r.finished_at for r in runs if r.config["worker"] == w)) for w in range(2)]
        assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], "the writers did not overlap in time"
        for worker, run, rid in ids:
            sc = s.scalars(rid)
            assert sorted(sc) == sorted([*KEYS, "bulk"])
            for i, k in enumerate(KEYS):
                steps, values = sc[k]
                assert steps.tolist() == list(range(1, N_STEPS + 1))
                assert values.tolist() == [_value(worker, run, st, i) for st in range(1, N_STEPS + 1)]
            assert s.events(rid) == [{"step": N_STEPS, "kind": "done", "payload": {"worker": worker}}]


# -- planted run ids (oracle: ids the test itself wrote into the file, with valid checksums) ------------------------

def _plant(path: Path, run_id: str, name: str = "planted") -> None:
    """A runs row with ``run_id`` as an attacker editing the file would add it: checksum and head made valid, so
    only the id check can refuse it."""
    con = sqlite3.connect(path)
    with con:
        row = (run_id, name, None, "completed", 1.0, 2.0, "{}", "{}", None, "h", 1, None)
        con.execute(f"INSERT INTO runs ({RunStore._COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        if any(c[1] == "checksum" for c in con.execute("PRAGMA table_info(runs)")):  # (a store before it: no)
            con.execute("UPDATE runs SET checksum = ? WHERE run_id = ?", (_store.run_checksum(row), run_id))
            con.execute("INSERT INTO run_heads VALUES (?, 'x', 0, 0)", (run_id,))
    con.close()


@pytest.mark.parametrize("planted", ["../..", "/abs/path", "abcdef12345/", "abcdef12345g"])
def test_planted_run_ids_are_refused_naming_the_row(tmp_path: Path, planted: str) -> None:
    path = tmp_path / "runs.db"
    with RunStore(path) as s:
        good = _new(s)
    _plant(path, planted)
    with RunStore(path) as s:
        where = rf"invalid id {planted!r} \(row 2, name 'planted'\)".replace(".", r"\.")
        for read in (lambda: s.get_run(planted), lambda: s.scalars(planted), lambda: s.events(planted),
                     lambda: s.list_runs(), lambda: s.list_runs(verify=False)):
            with pytest.raises(StoreCorrupt, match=where + ": a run id is 12 lowercase hex characters"):
                read()
        assert s.verify_run(planted).state == "corrupt"
        for write in (lambda: s.reopen_run(planted, from_step=0), lambda: s.finish_run(planted, status="failed")):
            with pytest.raises(StoreCorrupt, match=where):
                write()
        with pytest.raises(ValueError, match="run_id must be 12 lowercase hex"):
            s.log_scalars(planted, 1, {"a": 1.0})
        assert s.get_run(good).run_id == good  # the valid run is still readable by id
        report = s.check()
        assert not report.ok and any(f"invalid run id {planted!r} (row 2)" in p for r in report.runs
                                     for p in r.problems)


# -- read-only media (oracle: a real read-only bind mount; root ignores chmod) ---------------------------------------

@contextlib.contextmanager
def _read_only_view(src: Path, dst: Path):
    """``dst``: a read-only bind mount of the folder ``src`` (skips where mounting is not permitted)."""
    dst.mkdir()
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(dst)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here ({r.stderr.strip() or r.returncode}); needs root "
                    "with CAP_SYS_ADMIN")
    try:
        yield dst
    finally:
        gc.collect()  # close any connection left to a dying object before unmounting
        if subprocess.run(["umount", str(dst)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(dst)], capture_output=True)


def test_a_store_on_read_only_media_is_read_and_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lowprec.cli import main

    src = tmp_path / "src"
    with RunStore(src / "runs.db") as s:
        rid = _new(s, "ro")
        s.log_rows(rid, [(i, "train/loss", 1.0 / i) for i in range(1, 6)])
        s.finish_run(rid, status="completed")
    assert not (src / "runs.db-wal").exists()  # closed cleanly: no -wal, no -shm (immutable=1 is exact)
    with _read_only_view(src, tmp_path / "ro") as ro, RunStore(ro / "runs.db", create=False) as s:
        assert s.read_only and "not writable" in s.read_only
        assert [r.run_id for r in s.list_runs()] == [rid] and s.get_run(rid).status == "completed"
        assert s.scalars(rid)["train/loss"][0].tolist() == [1, 2, 3, 4, 5] and s.check().ok
        with pytest.raises(StoreError, match=r"was opened read-only \(.*not writable\): it cannot record anything"):
            s.log_scalars(rid, 6, {"train/loss": 0.1})
        assert main(["runs", "list", "--store", str(ro / "runs.db")]) == 0
        assert f"{rid}  completed" in capsys.readouterr().out
        assert main(["store", "check", "--store", str(ro / "runs.db")]) == 0
        assert "clean: 1 runs" in capsys.readouterr().out


def test_read_only_media_with_a_pending_log_and_an_old_schema(tmp_path: Path) -> None:
    """A copy taken while a writer was active (its -wal and -shm next to it) reads every commit (mode=ro, not
    immutable); an old schema-1 store on read-only media is read as it is (nothing can be migrated there)."""
    src = tmp_path / "src"
    with RunStore(src / "runs.db") as s:
        rid = _new(s)
    con = sqlite3.connect(src / "runs.db", isolation_level=None)
    con.execute("PRAGMA wal_autocheckpoint = 0")
    try:
        with RunStore(src / "runs.db") as writer:
            writer.log_scalars(rid, 1, {"train/loss": 0.5})  # committed to the log only (no checkpoint)
            with _read_only_view(src, tmp_path / "ro") as ro, RunStore(ro / "runs.db") as s:
                assert s.read_only and s.scalars(rid)["train/loss"][1].tolist() == [0.5]
    finally:
        con.close()
    old = tmp_path / "old"
    old.mkdir()
    con = sqlite3.connect(old / "runs.db")
    with con:
        con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at REAL NOT NULL)")
        for statement in _store._V1:
            con.execute(statement)
        con.execute("INSERT INTO schema_version VALUES (1, 0)")
        con.execute("INSERT INTO runs VALUES ('0123456789ab', 'old', NULL, 'completed', 1, 2, '{}', '{}', NULL, "
                    "'h', 1, NULL)")
        con.execute("INSERT INTO scalars VALUES ('0123456789ab', 1, 'train/loss', 0.25)")
        con.execute("INSERT INTO baselines VALUES ('b', '{\"v\": 1}', 1, 1)")
    con.close()
    with _read_only_view(old, tmp_path / "ro-old") as ro, RunStore(ro / "runs.db") as s:
        assert s._schema == 1 and [r.name for r in s.list_runs()] == ["old"]
        assert s.scalars("0123456789ab")["train/loss"][1].tolist() == [0.25] and s.get_baseline("b") == {"v": 1}
        report = s.check()
        assert report.ok and [r.state for r in report.runs] == ["unverified"]
    with RunStore(old / "runs.db") as s:  # writable again: migrated on open
        assert s._schema == len(MIGRATIONS)


# -- a mistyped --store (oracle: the file system: nothing is created) ------------------------------------------------

def test_reading_commands_refuse_a_missing_store_writers_create_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from lowprec.cli import main

    missing = tmp_path / "typo" / "runs.db"
    for args in (["runs", "list"], ["runs", "show", "abcd1234"], ["runs", "export", "abcd1234"],
                 ["stats", "abcd1234"], ["compare", "--baseline", "ref", "g"],
                 ["report", "--baseline", "ref", "g", "--out", str(tmp_path / "r.html")], ["baselines", "list"],
                 ["baselines", "export", "ref", str(tmp_path / "b.json")], ["store", "check"]):
        assert main([*args, "--store", str(missing)]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(f"lowprec: error: no run store at {missing} (the file does not exist): check --store"), \
            (args, err)
        assert not missing.parent.exists(), args
    with RunStore(missing) as s:  # the library's default, and the writing commands', is to create it
        assert s.list_runs() == []


# -- a full disk (oracle: a real 4 MiB tmpfs filled up) --------------------------------------------------------------

@contextlib.contextmanager
def _small_disk(where: Path, size: str = "4M"):
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}); needs root with "
                    "CAP_SYS_ADMIN")
    try:
        yield where
    finally:
        gc.collect()
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill the file system of ``disk`` up to ``leave`` bytes free."""
    st = os.statvfs(disk)
    filler = disk / "filler"
    filler.write_bytes(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
    return filler


def test_a_full_disk_keeps_the_failure_reason(tmp_path: Path) -> None:
    """When the disk is full, finish_run's error says so and still names the run's own failure reason."""
    with _small_disk(tmp_path / "disk") as disk, RunStore(disk / "runs.db") as s:
        rid = _new(s)
        _fill(disk, 0)
        with pytest.raises(StoreError, match=r"cannot write the run store at .*: the disk is full "):
            for step in range(1, 100_000):
                s.log_rows(rid, [(step, f"k{i}", float(i)) for i in range(50)])
        with pytest.raises(StoreError, match=r"the disk is full .*; the run's failed status with its reason could "
                                             r"not be recorded: RuntimeError: CUDA out of memory"):
            for _ in range(100):  # a few commits may still fit in pages SQLite has already allocated
                s.finish_run(rid, status="failed", error="RuntimeError: CUDA out of memory")
                s.reopen_run(rid, from_step=0)


def test_lowprec_run_on_a_full_disk_names_both_errors_and_the_run_reads_failed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('model = "mlp-digits"\nsteps = 100000\neval_interval = 100000\nthreads = 1\n'
                   "[checkpoint]\ninterval = 100000\n")
    with _small_disk(tmp_path / "disk") as disk:
        filler = _fill(disk, 600_000)
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                               os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, "-m", "lowprec.cli", "run", str(cfg), "--store", str(disk / "runs.db"),
                            "--quiet"], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 2 and "lowprec: error: cannot write the run store" in r.stderr, r.stderr
        assert "the disk is full (database or disk is full)" in r.stderr, r.stderr
        filler.unlink()
        with RunStore(disk / "runs.db") as s:
            (rec,) = s.list_runs()
            assert s.verify_run(rec.run_id).state == "ok"  # what did get committed is intact
        assert rec.status == "failed", rec
        if "could not be recorded" in r.stderr:  # the failed status did not fit: the message names both errors
            assert "failed status with its reason could not be recorded: StoreError: cannot write" in r.stderr
            assert rec.error == f"process {rec.pid} ended without finishing the run"  # the dead-process rule
        else:  # it fitted in the log's last pages: the reason is stored
            assert rec.error is not None and "the disk is full" in rec.error, rec


# -- deleting runs and baselines; status "diverged" and its migration (oracle: store check and the rows written) ----

def test_delete_run_removes_its_rows_and_leaves_the_store_clean(store: RunStore) -> None:
    keep, gone = _new(store, "keep"), _new(store, "gone")
    for rid in (keep, gone):
        store.log_rows(rid, [(i, "train/loss", 1.0 / (i + 1)) for i in range(10)])
        store.add_event(rid, step=3, kind="note", payload={"x": 1})
    assert store.delete_run(gone[:6]) == (gone, 10, 1)
    assert [r.run_id for r in store.list_runs()] == [keep]
    with pytest.raises(StoreError, match="no run with id"):
        store.get_run(gone)
    with raw(store) as con:
        for table in ("runs", "scalars", "events", "run_heads"):
            assert con.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id = ?", (gone,)).fetchone()[0] == 0
    report = store.check()
    assert report.ok and [r.state for r in report.runs] == ["ok"], report.lines()
    assert store.scalars(keep)["train/loss"][1].size == 10 and len(store.events(keep)) == 1
    with pytest.raises(StoreError, match="no run with id"):
        store.delete_run(gone)


def test_delete_baseline(store: RunStore) -> None:
    store.save_baseline("a", {"v": 1})
    store.save_baseline("b", {"v": 2})
    store.delete_baseline("a")
    assert store.list_baselines() == ["b"] and store.check().ok
    with pytest.raises(StoreError, match=r"no baseline named 'a' in .*; known baselines: b"):
        store.delete_baseline("a")


def test_diverged_status_is_stored_listed_and_checked(store: RunStore) -> None:
    done, bad = _new(store, "done"), _new(store, "bad")
    store.finish_run(done, status="completed")
    store.finish_run(bad, status="diverged")
    assert store.get_run(bad).status == "diverged" and store.get_run(bad).finished_at is not None
    assert [r.run_id for r in store.list_runs(status="diverged")] == [bad]
    assert [r.run_id for r in store.list_runs(status="completed")] == [done]
    assert _store.FINAL_STATUSES == ("completed", "diverged", "failed")
    assert store.check().ok


def _v2_store(path: Path) -> list[str]:
    """A schema-2 store written as lowprec wrote it then: two sealed runs with rows, one unsealed (pre-checksum)."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("CREATE TABLE schema_version (version INTEGER NOT NULL, applied_at REAL NOT NULL)")
    for v, migration in enumerate(MIGRATIONS[:2]):
        for statement in migration:
            con.execute(statement)
        con.execute("INSERT INTO schema_version VALUES (?, 0)", (v + 1,))
    ids = ["0123456789ab", "0123456789ac", "0123456789ad"]
    for i, rid in enumerate(ids):
        row = (rid, f"r{i}", "g", "completed", 5.0, 6.0, json.dumps({"seed": i}), "{}", None, "h", 1, None)
        sealed = i < 2
        con.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*row, _store.run_checksum(row) if sealed else None))
        for step in range(3):
            value = float(step + i)
            con.execute("INSERT INTO scalars VALUES (?, ?, 'train/loss', ?, ?)",
                        (rid, step, value, _store.scalar_checksum(rid, step, "train/loss", value) if sealed else None))
        con.execute("INSERT INTO events (run_id, step, kind, payload, created_at) VALUES (?, 1, 'k', '{}', 7.0)",
                    (rid,))
        eid = con.execute("SELECT MAX(event_id) FROM events").fetchone()[0]
        if sealed:
            con.execute("UPDATE events SET checksum = ? WHERE event_id = ?",
                        (_store.event_checksum(eid, rid, 1, "k", "{}", 7.0), eid))
            con.execute("INSERT INTO run_heads VALUES (?, 'a', 3, 1)", (rid,))
    con.close()
    return ids


def test_a_schema_2_store_migrates_keeping_every_row_and_checksum(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    ids = _v2_store(path)
    with RunStore(path) as s:
        assert s._schema == len(MIGRATIONS) == 3
        # created in the same instant: the order of insertion (rowid) is kept
        assert [r.run_id for r in s.list_runs()] == ids[::-1]
        for i, rid in enumerate(ids):
            assert s.scalars(rid)["train/loss"][1].tolist() == [i, i + 1, i + 2]
            assert [e["kind"] for e in s.events(rid)] == ["k"]
        report = s.check()
        assert report.ok and [r.state for r in report.runs] == ["ok", "ok", "unverified"], report.lines()
        s.finish_run(ids[0], status="diverged")  # the new constraint admits it
        assert s.get_run(ids[0]).status == "diverged"
        s.delete_run(ids[1])  # the foreign keys still cascade to (and name) the rebuilt table
        assert s.check().ok
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA foreign_keys = ON")
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
        assert con.execute("SELECT COUNT(*) FROM scalars").fetchone()[0] == 6
        sql = con.execute("SELECT sql FROM sqlite_master WHERE name = 'scalars'").fetchone()[0]
        assert "REFERENCES runs (run_id)" in sql or "REFERENCES \"runs\"" in sql
        assert {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")} >= {
            "runs_by_created", "runs_by_group"}
        with pytest.raises(sqlite3.IntegrityError):
            con.execute("UPDATE runs SET status = 'bogus'")
    finally:
        con.close()
