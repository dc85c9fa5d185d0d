"""The PostgreSQL run store against a real server (``postgres_server`` in conftest.py; CI starts one and sets
LOWPREC_REQUIRE_POSTGRES=1), and ``lowprec store copy`` between the backends.

Oracles: the SQLite store (the same schema read back through ``PRAGMA table_info``; the same rows, checksums and
dumps of a run copied either way), the server's own catalog and rows read with psycopg directly, the values each
writer process itself logged (4 real processes at once), and the stored rows after a takeover.  The behaviours
shared with SQLite (round trips, fencing, baselines, the dead-process rule) run on both backends in
test_store.py and test_store_fencing.py.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
import time
from pathlib import Path

import pytest
from _postgres import raw

from lowprec._errors import UsageError
from lowprec.cli import main
from lowprec.runs import _store, _store_pg
from lowprec.runs._store import RunStore, RunTakenOver, StoreCorrupt, StoreError

# Child processes import only the store (no torch: ``lowprec.runs`` does not import it), as in test_store.py.
_STANDALONE = f"""
import sys
sys.path.insert(0, {str(Path(_store.__file__).parents[2])!r})
from lowprec.runs import RunStore
"""


def _new(store: RunStore, name: str = "r", **kw) -> str:
    return store.create_run(name=name, config={"lr": 0.1}, manifest={"metrics": {"loss": "min"}}, **kw)


# -- schema and opening rules -----------------------------------------------------------------------------------

def test_the_schema_is_sqlites_in_postgresql_types(postgres_url: str, tmp_path: Path) -> None:
    """Oracle: the SQLite store's tables and columns (PRAGMA table_info) and its schema_version rows."""
    assert len(_store_pg.MIGRATIONS) == len(_store.MIGRATIONS)
    with RunStore(postgres_url) as pg, RunStore(tmp_path / "runs.db") as lite:
        with raw(pg) as c:
            pg_cols = {(t, col) for t, col in c.execute(
                "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = "
                "current_schema()").fetchall()}
            versions = [r[0] for r in c.execute("SELECT version FROM schema_version ORDER BY version").fetchall()]
            types = dict(c.execute("SELECT column_name, data_type FROM information_schema.columns "
                                   "WHERE table_name = 'scalars'").fetchall())
        with raw(lite) as c:
            tables = [r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT "
                                              "LIKE 'sqlite_%'")]
            lite_cols = {(t, r[1]) for t in tables for r in c.execute(f"PRAGMA table_info({t})")}
            lite_versions = [r[0] for r in c.execute("SELECT version FROM schema_version ORDER BY version")]
    assert pg_cols - {("runs", "rowid")} == lite_cols  # rowid: SQLite's implicit column, explicit here
    assert versions == lite_versions == [1, 2, 3]
    assert types == {"run_id": "text", "step": "bigint", "key": "text", "value": "double precision",
                     "checksum": "bigint"}


def test_opening_rules(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(StoreError, match="no run store at .*the database holds no lowprec tables"):
        RunStore(postgres_url, create=False)
    with RunStore(postgres_url) as s, raw(s) as c:  # now a store; then a newer lowprec's version
        c.execute("INSERT INTO schema_version VALUES (4, 0)")
    with pytest.raises(StoreError, match="written by a newer lowprec .*version 4.*pip install -U lowprec"):
        RunStore(postgres_url)
    with _plain(postgres_url) as c:
        c.execute("DROP TABLE schema_version, run_heads, scalars, events, baselines, runs")
        c.execute("CREATE TABLE other (x int)")
    with pytest.raises(StoreError, match=r"is not a lowprec run store \(it is a PostgreSQL database \(schema public\) "
                                         "with other tables"):
        RunStore(postgres_url)
    secret = "postgresql://me:s3cret@/nodb?host=/nonexistent-socket-dir"
    with pytest.raises(StoreError, match="cannot connect to the run store at postgresql://me:\\*\\*\\*@/nodb") as e:
        RunStore(secret)
    assert "s3cret" not in str(e.value)
    monkeypatch.setitem(sys.modules, "psycopg", None)  # the driver is not installed
    with pytest.raises(UsageError, match=r"pip install 'lowprec\[postgresql\]'"):
        RunStore(postgres_url)


def _plain(url: str):
    import psycopg

    return psycopg.connect(url, autocommit=True)


def test_processes_migrating_a_fresh_database_at_once_migrate_it_once(postgres_url: str) -> None:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=exec, args=(_STANDALONE + "BARRIER.wait()\nRunStore(URL).close()\n",
                                            {"URL": postgres_url, "BARRIER": barrier})) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0] * 3
    with RunStore(postgres_url) as s, raw(s) as c:
        assert [r[0] for r in c.execute("SELECT version FROM schema_version ORDER BY version").fetchall()] == [1, 2, 3]


# -- values, damage (oracle: the rows read with psycopg directly) ----------------------------------------------

def test_nan_inf_and_negative_zero_and_exact_floats(postgres_url: str) -> None:
    values = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0": -0.0, "third": 1 / 3, "tiny": 5e-324}
    with RunStore(postgres_url) as s:
        rid = _new(s)
        s.log_scalars(rid, 1, values)
        got = {k: v[1][0] for k, v in s.scalars(rid).items()}
        with raw(s) as c:
            stored = dict(c.execute("SELECT key, value FROM scalars WHERE run_id = ?", (rid,)).fetchall())
    assert math.isnan(got.pop("nan")) and stored.pop("nan") is None  # NaN is stored as NULL, as in SQLite
    assert got == stored == {k: v for k, v in values.items() if k != "nan"}
    assert math.copysign(1.0, got["-0"]) == 1.0  # -0.0 is stored as 0.0, as in SQLite


def test_damage_is_detected_and_refused(postgres_url: str) -> None:
    with RunStore(postgres_url) as s:
        rid, other = _new(s, "a"), _new(s, "b")
        for r in (rid, other):
            s.log_rows(r, [(i, "train/loss", 1.0 / (i + 1)) for i in range(50)])
            s.add_event(r, step=3, kind="note", payload={"x": 1})
        s.save_baseline("base", {"run_ids": [rid]})
        assert s.check().ok
        with raw(s) as c:
            c.execute("UPDATE scalars SET value = 0.5 WHERE run_id = ? AND step = 7", (rid,))
            c.execute("DELETE FROM events WHERE run_id = ?", (other,))
            c.execute("UPDATE baselines SET payload = '{\"run_ids\": []}'")
        with pytest.raises(StoreCorrupt, match=rf"run {rid} .*scalar 'train/loss': 1 value.*\(step 7\)"):
            s.scalars(rid)
        with pytest.raises(StoreCorrupt, match="1 events were recorded, 0 are stored"):
            s.events(other)
        with pytest.raises(StoreCorrupt, match="baseline 'base'.*does not match its checksum"):
            s.get_baseline("base")
        report = s.check()
        assert not report.ok and [r.state for r in report.runs] == ["corrupt", "corrupt"]
        assert report.lines()[0].endswith("PostgreSQL integrity ok")


# -- concurrent writers (oracle: what each process logged) ------------------------------------------------------

N_WRITERS, N_STEPS = 4, 300
_WRITER = _STANDALONE + """
s = RunStore(URL)
BARRIER.wait()
for step in range(1, N_STEPS + 1):
    s.log_scalars(SHARED, step, {f"w{WORKER}/loss": WORKER + step / 1000, f"w{WORKER}/lr": step * 1e-3})
    s.log_scalars(OWN, step, {"loss": WORKER + step / 1000})
    if step % 10 == 0:
        s.add_event(SHARED, step=step, kind="tick", payload={"worker": WORKER})
s.finish_run(OWN, status="completed")
s.close()
"""


def test_four_processes_writing_the_same_and_their_own_runs_lose_nothing(postgres_url: str) -> None:
    with RunStore(postgres_url) as s:
        shared = _new(s, "shared")
        own = [_new(s, f"own{w}") for w in range(N_WRITERS)]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_WRITERS)
    procs = [ctx.Process(target=exec, args=(_WRITER, {
        "URL": postgres_url, "WORKER": w, "BARRIER": barrier, "N_STEPS": N_STEPS, "SHARED": shared, "OWN": own[w]}))
        for w in range(N_WRITERS)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0] * N_WRITERS, f"{time.perf_counter() - t0:.1f} s"
    steps = list(range(1, N_STEPS + 1))
    with RunStore(postgres_url) as s:
        sc = s.scalars(shared)
        assert sorted(sc) == sorted(f"w{w}/{k}" for w in range(N_WRITERS) for k in ("loss", "lr"))
        for w in range(N_WRITERS):
            assert sc[f"w{w}/loss"][0].tolist() == steps
            assert sc[f"w{w}/loss"][1].tolist() == [w + st / 1000 for st in steps]
            assert s.scalars(own[w])["loss"][1].tolist() == [w + st / 1000 for st in steps]
            assert s.get_run(own[w]).status == "completed"
        ticks = s.events(shared, "tick")
        assert sorted((e["step"], e["payload"]["worker"]) for e in ticks) == sorted(
            (st, w) for st in steps if st % 10 == 0 for w in range(N_WRITERS))
        report = s.check()
        assert report.ok and {r.rows for r in report.runs} == {N_STEPS, 2 * N_WRITERS * N_STEPS + len(ticks)}


_STALE = _WRITER.split("BARRIER.wait()")[0] + """
QUEUE.put(WORKER)
step = 0
try:
    while True:
        step += 1
        s.log_scalars(RUN, step, {f"w{WORKER}": float(step)})
        if step == 30:
            QUEUE.put(WORKER)
except Exception as e:
    QUEUE.put((type(e).__name__, str(e)))
"""


def test_a_resume_fences_writer_processes_on_other_connections(postgres_url: str) -> None:
    """Four processes write one run (one writer group); a resume from this process takes it over: each of them
    stops at its next write with RunTakenOver, and nothing any of them wrote after the resumed step stays."""
    with RunStore(postgres_url) as s:
        rid = _new(s)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with RunStore(postgres_url) as owner:  # the writers share the run's attempt, as ranks of one run do
        owner.reopen_run(rid, from_step=0)
        attempt = owner._claims[rid]
    code = _STALE.replace("s = RunStore(URL)", "s = RunStore(URL)\ns._claims[RUN] = ATTEMPT")
    procs = [ctx.Process(target=exec, args=(code, {"URL": postgres_url, "WORKER": w, "N_STEPS": 0, "RUN": rid,
                                                   "QUEUE": queue, "ATTEMPT": attempt})) for w in range(4)]
    for p in procs:
        p.start()
    for _ in range(8):  # started, then 30 steps each
        queue.get(timeout=120)
    with RunStore(postgres_url) as resumer:
        resumer.reopen_run(rid, from_step=10)
        stops = [queue.get(timeout=60) for _ in range(4)]
        for p in procs:
            p.join(timeout=60)
        assert all(name == "RunTakenOver" and f"run {rid} was taken over" in msg for name, msg in stops), stops
        sc = resumer.scalars(rid)
        assert {k: v[0].tolist() for k, v in sc.items()} == {f"w{w}": list(range(1, 11)) for w in range(4)}
        assert resumer.verify_run(rid).state == "ok"
    with RunStore(postgres_url) as late:  # the old attempt, on a connection opened after the takeover
        late._claims[rid] = attempt
        with pytest.raises(RunTakenOver):
            late.log_scalars(rid, 99, {"late": 1.0})


def test_a_lost_connection_fails_the_write_in_flight_and_the_next_one_reconnects(postgres_url: str) -> None:
    """Oracle: the server ends the store's session (pg_terminate_backend, as a server restart or a network cut
    would); the stored rows afterwards."""
    with RunStore(postgres_url) as s:
        rid = _new(s)
        s.log_scalars(rid, 1, {"a": 1.0})
        with _plain(postgres_url) as c:
            c.execute("SELECT pg_terminate_backend(%s)", (s._conn.raw.info.backend_pid,))
        with pytest.raises(StoreError, match="lost the connection to the run store at .*the next call connects"):
            s.log_scalars(rid, 2, {"a": 2.0})
        s.log_scalars(rid, 3, {"a": 3.0})
        assert s.scalars(rid)["a"][0].tolist() == [1, 3] and s.verify_run(rid).state == "ok"
        with pytest.raises(StoreError, match="cannot hold a NUL character"):
            s.log_scalars(rid, 4, {"a\x00b": 1.0})


# -- lowprec store copy (oracle: the source's dump, rows and checksums) -----------------------------------------

def _fill(s: RunStore) -> list[str]:
    a, b = _new(s, "a", group="g"), _new(s, "b")
    s.log_rows(a, [(i, k, v) for i in range(40) for k, v in (("train/loss", 1 / (i + 1)), ("nan", math.nan))])
    s.add_event(a, step=2, kind="nonfinite", payload={"where": "loss"})
    s.add_event(a, step=5, kind="spike", payload={"z": 7.5})
    s.finish_run(a, status="completed")
    s.log_scalars(b, 0, {"train/loss": 2.0})
    s.finish_run(b, status="failed", error="boom")
    s.save_baseline("ref", {"run_ids": [a], "v": 1})
    return [a, b]


def _checksums(store: RunStore, rid: str) -> list[tuple]:
    """The run's record checksum, then (key, step, checksum) of each scalar row, as stored."""
    with raw(store) as c:
        return [tuple(r) for r in c.execute("SELECT checksum FROM runs WHERE run_id = ?", (rid,)).fetchall()
                + c.execute("SELECT key, step, checksum FROM scalars WHERE run_id = ? ORDER BY key, step",
                            (rid,)).fetchall()]


def test_copy_sqlite_to_postgresql_and_back_is_exact(postgres_url: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lite, back = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    with RunStore(lite) as s:
        ids = _fill(s)
    assert main(["store", "copy", lite, postgres_url]) == 0
    assert main(["store", "copy", postgres_url, back]) == 0
    out = capsys.readouterr().out
    assert "copied 2 runs (83 rows) and 1 baselines" in out, out
    with RunStore(lite) as a, RunStore(postgres_url) as p, RunStore(back) as b:
        for rid in ids:
            assert a.dump_run(rid) == p.dump_run(rid) == b.dump_run(rid)
            assert a.get_run(rid) == p.get_run(rid) == b.get_run(rid)
            assert a.events(rid) == p.events(rid) == b.events(rid)
            assert _checksums(a, rid) == _checksums(p, rid) == _checksums(b, rid)  # the same checksums everywhere
        assert a.get_baseline("ref") == p.get_baseline("ref") == b.get_baseline("ref")
        assert p.check().ok and b.check().ok
        assert [r.run_id for r in p.list_runs()] == [r.run_id for r in a.list_runs()]


def test_copy_refuses_overwriting_and_damaged_runs(postgres_url: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lite = str(tmp_path / "a.db")
    with RunStore(lite) as s:
        a, b = _fill(s)
    assert main(["store", "copy", lite, postgres_url, "--run", a[:6], "--quiet"]) == 0
    capsys.readouterr()
    assert main(["store", "copy", lite, postgres_url]) == 2  # a is there already: nothing copied
    err = capsys.readouterr().err
    assert f"already holds {a}; nothing was copied: pass --overwrite" in err, err
    with RunStore(postgres_url) as p:
        assert [r.run_id for r in p.list_runs()] == [a] and p.list_baselines() == []
    assert main(["store", "copy", lite, postgres_url, "--skip-existing"]) == 0
    assert "1 already there, left as they were" in capsys.readouterr().out
    with raw(RunStore(lite)) as c:
        c.execute("UPDATE scalars SET value = 3.0 WHERE run_id = ? AND step = 1 AND key = 'train/loss'", (a,))
    assert main(["store", "copy", lite, postgres_url, "--run", a, "--overwrite"]) == 2
    assert f"run {a} in {lite} does not match its checksums" in capsys.readouterr().err
    with RunStore(postgres_url) as p:
        assert p.scalars(a)["train/loss"][1][1] == 0.5  # the copy already there is untouched
    assert main(["store", "copy", lite, lite]) == 2
    assert main(["store", "copy", str(tmp_path / "missing.db"), postgres_url]) == 2


# -- a whole run on PostgreSQL (oracle: runs list and the judge reading it back) --------------------------------

def test_lowprec_run_baseline_list_and_compare_on_postgresql(postgres_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOWPREC_FILES_DIR", str(tmp_path / "files"))
    (tmp_path / "c.toml").write_text(f'model = "mlp-digits"\nsteps = 4\nthreads = 1\nstore = "{postgres_url}"\n'
                                     "[schedule]\nwarmup_steps = 2\n[checkpoint]\ninterval = 2\n")
    (tmp_path / "flat.toml").write_text("min_loss_drop = 0\nmin_judged_steps = 1\n")
    assert main(["baseline", "c.toml", "--name", "ref", "--seeds", "2", "--criteria", "flat.toml", "--quiet"]) == 0
    assert main(["run", "c.toml", "--seeds", "5", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["runs", "list", "--store", postgres_url]) == 0
    listing = capsys.readouterr().out
    assert listing.count("completed") == 3, listing
    with RunStore(postgres_url) as s:
        (cand,) = [r for r in s.list_runs() if r.manifest["seed"] == 5]
        assert s.check().ok and s.scalars(cand.run_id)["train/loss"][0].tolist() == [1, 2, 3, 4]
        assert (tmp_path / "files" / "checkpoints" / cand.run_id).is_dir()  # files: $LOWPREC_FILES_DIR
        assert not (tmp_path / "lowprec-runs").exists()
    rc = main(["compare", "--baseline", "ref", cand.run_id, "--store", postgres_url])
    out = capsys.readouterr().out  # 4 steps decide nothing: the verdict is not the point, the judge reading it is
    assert rc in (0, 1, 3) and "1 candidate run(s) against baseline 'ref'" in out, out
    assert "all 1 run(s) completed 4 steps" in out and "the reference trained" in out, out
    with RunStore(postgres_url) as s:  # as if it had crashed: a resume finds its checkpoints in the files folder
        s.finish_run(cand.run_id, status="failed", error="crashed")
    assert main(["run", "--resume", cand.run_id, "--store", postgres_url, "--quiet"]) == 0
    with RunStore(postgres_url) as s:
        assert s.get_run(cand.run_id).status == "completed" and s.verify_run(cand.run_id).state == "ok"
        assert [e["kind"] for e in s.events(cand.run_id)].count("resumed") == 1, s.events(cand.run_id)
