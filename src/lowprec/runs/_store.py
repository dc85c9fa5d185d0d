"""The run store: every run's config, manifest, per-step scalars, events and the named baselines, in one SQLite file.

Why SQLite in WAL mode.  A training run appends a few scalars per step while a second process (another run, or
``lowprec runs list``) reads or writes the same file.  In write-ahead-log mode a commit appends the changed pages
to ``runs.db-wal`` and only then marks them committed, so readers never block the writer, the writer never blocks
readers, and a process killed in the middle of a transaction leaves an uncommitted tail that the next opener
discards: a crashed or killed process loses at most the transaction in flight, never one that was committed, and
never corrupts the file.  The default ``synchronous="normal"`` fsyncs the log only at checkpoints (SQLite's
recommended WAL setting): a power loss or OS crash may roll back the last few commits but still cannot corrupt the
file.  ``synchronous="full"`` fsyncs every commit so committed rows also survive a power loss, at about 1-5 ms per
commit (one commit per training step) instead of ~0.1 ms.

Two writers.  SQLite admits one writer at a time.  Every write here is one short ``BEGIN IMMEDIATE ... COMMIT``
(the write lock is taken up front, so two writers never deadlock upgrading read locks); a writer that finds the
lock taken waits ``busy_timeout`` and then retries with back-off until a deadline.  Two processes logging
thousands of scalars at once therefore interleave their transactions and lose nothing.

Schema versions.  ``schema_version`` holds one row per applied migration; ``MIGRATIONS[i]`` takes the schema from
version ``i`` to ``i + 1`` and runs inside the same transaction as the row that records it, so a migration is
applied completely or not at all.  A file written by a newer lowprec (a version above ``len(MIGRATIONS)``) is
refused with a message to upgrade, never silently misread.

Dead processes.  Each run records the hostname, pid and (on Linux) the process start time of the process that
writes it.  A run still marked ``running`` whose process, on this same host, no longer exists (or is a zombie, or
is a different process that reused the pid) is *shown* as failed ("process <pid> ended without finishing the run");
the stored row is left as it is, so a reader never needs write access.  Runs from another host cannot be checked
and keep their stored status.

NaN.  SQLite has no NaN (it stores a NaN REAL as NULL); the scalars table stores NULL for NaN and reads it back as
NaN, so a diverged run keeps its NaN losses.  Infinities are stored as they are.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import re
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

__all__ = ["DEFAULT_PATH", "MIGRATIONS", "RunRecord", "RunStore", "StoreError"]

T = TypeVar("T")

DEFAULT_PATH = Path("lowprec-runs") / "runs.db"
STATUSES = ("running", "completed", "failed")
FINAL_STATUSES = ("completed", "failed")
MIN_PREFIX = 4
BUSY_TIMEOUT_MS = 5_000  # one wait inside SQLite for the write lock ...
WRITE_DEADLINE_S = 120.0  # ... retried with back-off until this deadline
_RUN_ID = re.compile(r"[0-9a-f]{12}")

# MIGRATIONS[i] takes the schema from version i to version i + 1 (a tuple of statements, run in one transaction).
_V1 = (
    """CREATE TABLE runs (
        run_id      TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        grp         TEXT,
        status      TEXT NOT NULL CHECK (status IN ('running', 'completed', 'failed')),
        created_at  REAL NOT NULL,
        finished_at REAL,
        config      TEXT NOT NULL,  -- JSON
        manifest    TEXT NOT NULL,  -- JSON
        error       TEXT,
        hostname    TEXT NOT NULL,  -- host, pid and pid start time of the writing process (dead-process rule)
        pid         INTEGER NOT NULL,
        pid_start   TEXT
    )""",
    "CREATE INDEX runs_by_created ON runs (created_at)",
    "CREATE INDEX runs_by_group ON runs (grp)",
    """CREATE TABLE scalars (
        run_id TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
        step   INTEGER NOT NULL,
        key    TEXT NOT NULL,
        value  REAL,  -- NULL stores NaN (SQLite has no NaN)
        PRIMARY KEY (run_id, key, step)
    ) WITHOUT ROWID""",
    """CREATE TABLE events (
        event_id   INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id     TEXT NOT NULL REFERENCES runs (run_id) ON DELETE CASCADE,
        step       INTEGER NOT NULL,
        kind       TEXT NOT NULL,
        payload    TEXT NOT NULL,  -- JSON
        created_at REAL NOT NULL
    )""",
    "CREATE INDEX events_by_run ON events (run_id, step)",
    """CREATE TABLE baselines (
        name       TEXT PRIMARY KEY,
        payload    TEXT NOT NULL,  -- JSON
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    )""",
)
MIGRATIONS: list[tuple[str, ...]] = [_V1]


class StoreError(ValueError):
    """The run store cannot do what was asked: unreadable/corrupt file, unwritable path, unknown run id, ..."""


@dataclass(frozen=True)
class RunRecord:
    """One run as stored (``status``/``error`` already reflect the dead-process rule)."""

    run_id: str  # 12 hex chars; any unique prefix of >= 4 chars selects it
    name: str  # human label
    group: str | None  # selects a group of runs, e.g. a baseline's name
    status: str  # "running" | "completed" | "failed"
    created_at: float  # unix time
    finished_at: float | None
    config: dict  # the full resolved run config
    manifest: dict  # versions, hardware, hashes, seed, metric directions, ...
    error: str | None  # why it failed
    hostname: str | None = None  # host of the process that last wrote the run
    pid: int | None = None  # pid of that process


def _cannot_write(path: Path, why: str) -> str:
    return f"cannot write the run store at {path}: {why}; pass --store PATH or fix permissions"


def _not_a_store(path: Path, why: str) -> str:
    return f"{path} is not a lowprec run store ({why}); move it away or pass --store"


def _is_busy(e: sqlite3.Error) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a Linux process, or None where /proc cannot tell."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name (field 2) may hold spaces and parentheses
    return (fields[0], fields[19]) if len(fields) > 19 else None


def _process_alive(pid: int, start: str | None) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    stat = _proc_stat(pid)
    if stat is not None:
        state, started = stat
        if state in ("Z", "X"):  # killed but not yet reaped by its parent
            return False
        if start is not None and started != start:  # the pid was reused by another process
            return False
    return True


def _dumps(field: str, obj: Any) -> str:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{field} must be a dict, got {type(obj).__name__}")
    try:
        return json.dumps(obj, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} must be JSON-serialisable (dict, list, str, int, float, bool, None): {e}") from e


def _check_text(field: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")


def _check_step(field: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{field} must be an integer >= 0, got {step!r}")
    return int(step)


def _scalar_row(step: Any, key: Any, value: Any) -> tuple[int, str, float | None]:
    _check_text("scalar key", key)
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"scalar {key!r} at step {step} must be a real number, got {value!r}") from e
    return _check_step(f"step of scalar {key!r}", step), key, (None if math.isnan(v) else v)


class RunStore:
    """Runs, their per-step scalars and events, and named baselines, in one SQLite file (see the module docstring).

    Write methods (``log_scalars``, ``log_rows``, ``add_event``) take the full run id; the others also accept a
    unique prefix of at least 4 characters.  Safe to share between threads; after ``fork`` the child opens its
    own connection.  Use as a context manager or call ``close()``.
    """

    def __init__(self, path: str | os.PathLike[str] = DEFAULT_PATH, *,
                 synchronous: Literal["full", "normal"] = "normal") -> None:
        if synchronous not in ("full", "normal"):
            raise ValueError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.synchronous = synchronous
        self._lock = threading.RLock()
        self._hostname = socket.gethostname()
        self._abandoned: list[sqlite3.Connection] = []  # connections inherited across fork: never touched again
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._closed = False
        self._conn = self._open()

    # -- connection, errors, transactions ------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        path = self.path
        if path.is_dir():
            raise StoreError(_cannot_write(path, "it is a directory"))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(_cannot_write(path, f"cannot create {path.parent}: {e.strerror or e}")) from e
        try:
            conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as e:
            raise self._translate(e) from e
        try:
            self._configure(conn)
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        def pragmas(c: sqlite3.Connection) -> str:
            c.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            c.execute(f"PRAGMA synchronous = {self.synchronous.upper()}")
            c.execute("PRAGMA foreign_keys = ON")
            return str(mode)

        mode = self._retry(conn, pragmas, transaction=False)
        if mode.lower() != "wal":
            raise StoreError(_cannot_write(self.path, f"SQLite refused WAL journal mode (got {mode!r}); "
                                                      "network file systems cannot hold a run store"))

    def _migrate(self, conn: sqlite3.Connection) -> None:
        latest = len(MIGRATIONS)

        def version(c: sqlite3.Connection) -> int:
            tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "schema_version" not in tables:
                if tables - {"sqlite_sequence"}:
                    raise StoreError(_not_a_store(self.path, "it is an SQLite database with other tables"))
                return 0
            v = c.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
            if v is not None and v > latest:
                raise StoreError(f"the run store at {self.path} was written by a newer lowprec (schema version {v}; "
                                 f"this lowprec reads up to version {latest}); upgrade lowprec "
                                 "(pip install -U lowprec) to read it")
            return int(v or 0)

        if self._retry(conn, version, transaction=False) == latest:
            return

        def migrate(c: sqlite3.Connection) -> None:
            current = version(c)  # again, under the write lock: another process may have migrated meanwhile
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_at REAL NOT NULL)")
            for v in range(current, latest):
                for statement in MIGRATIONS[v]:
                    c.execute(statement)
                c.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (v + 1, time.time()))

        self._retry(conn, migrate, transaction=True)

    def _translate(self, e: sqlite3.Error) -> StoreError:
        msg = str(e)
        low = msg.lower()
        if _is_busy(e):
            return StoreError(f"the run store at {self.path} stayed locked by another process for more than "
                              f"{WRITE_DEADLINE_S:.0f} s ({msg})")
        if "not a database" in low or "malformed" in low or "file is encrypted" in low:
            return StoreError(_not_a_store(self.path, msg))
        if "unable to open" in low or "readonly" in low or "read-only" in low or "disk i/o" in low:
            return StoreError(_cannot_write(self.path, msg))
        return StoreError(f"run store at {self.path}: {msg}")

    def _retry(self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], *, transaction: bool) -> T:
        """Run ``fn`` (inside ``BEGIN IMMEDIATE ... COMMIT`` when ``transaction``), retrying while the db is busy."""
        deadline = time.monotonic() + WRITE_DEADLINE_S
        delay = 0.002
        while True:
            try:
                if not transaction:
                    return fn(conn)
                conn.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(conn)
                    conn.execute("COMMIT")
                    return result
                except BaseException:
                    if conn.in_transaction:
                        try:
                            conn.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
                    raise
            except sqlite3.Error as e:
                if isinstance(e, sqlite3.OperationalError) and _is_busy(e) and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(2 * delay, 0.1)
                    continue
                raise self._translate(e) from e

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError(f"the run store at {self.path} is closed")
        if self._pid != os.getpid():  # forked: an SQLite connection must not cross fork, open our own
            if self._conn is not None:
                self._abandoned.append(self._conn)
            self._conn = None
            self._pid = os.getpid()
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            return self._retry(self._connection(), fn, transaction=True)

    def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        with self._lock:
            return self._retry(self._connection(), fn, transaction=False)

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise StoreError."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
            self._closed = True

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (e.g. to a spawned process) as "open the same file"
        return (_reopen, (str(self.path), self.synchronous))

    def __repr__(self) -> str:
        return f"RunStore({str(self.path)!r})"

    # -- runs ----------------------------------------------------------------------------------------------------

    def _owner(self) -> tuple[str, int, str | None]:
        pid = os.getpid()
        stat = _proc_stat(pid)
        return self._hostname, pid, (stat[1] if stat else None)

    def create_run(self, *, name: str, config: dict, manifest: dict, group: str | None = None,
                   run_id: str | None = None) -> str:
        """Record a new run with status "running"; returns its id (12 hex chars, random unless given)."""
        _check_text("name", name)
        _check_text("group", group, optional=True)
        if run_id is not None and (not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id)):
            raise ValueError(f"run_id must be 12 lowercase hex characters, got {run_id!r}")
        config_json, manifest_json = _dumps("config", config), _dumps("manifest", manifest)
        host, pid, pid_start = self._owner()

        def insert(c: sqlite3.Connection) -> str:
            for _ in range(100):
                rid = run_id or uuid.uuid4().hex[:12]
                if c.execute("SELECT 1 FROM runs WHERE run_id = ?", (rid,)).fetchone() is None:
                    c.execute("INSERT INTO runs (run_id, name, grp, status, created_at, config, manifest, hostname, "
                              "pid, pid_start) VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?)",
                              (rid, name, group, time.time(), config_json, manifest_json, host, pid, pid_start))
                    return rid
                if run_id is not None:
                    raise StoreError(f"run id {run_id!r} already exists in {self.path}; pass another run_id")
            raise StoreError(f"could not draw an unused run id in {self.path}")  # pragma: no cover

        return self._write(insert)

    def _unknown_run(self, c: sqlite3.Connection, ident: str) -> StoreError:
        recent = c.execute("SELECT run_id, name FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 5").fetchall()
        hint = ("; recent runs: " + ", ".join(f"{r} ({n})" for r, n in recent)) if recent else "; it has no runs yet"
        return StoreError(f"no run with id {ident!r} in {self.path}{hint}")

    def _resolve(self, c: sqlite3.Connection, ident: str) -> str:
        if not isinstance(ident, str):
            raise ValueError(f"run id must be a string, got {ident!r}")
        p = ident.strip().lower()
        if len(p) < MIN_PREFIX:
            raise StoreError(f"run id prefix {ident!r} is too short: give at least {MIN_PREFIX} of its 12 characters")
        rows = c.execute("SELECT run_id, name FROM runs WHERE run_id >= ? AND run_id < ? "
                         "ORDER BY created_at DESC, rowid DESC",
                         (p, p + "~")).fetchall()  # '~' sorts after every hex digit: a prefix range scan
        if any(r == p for r, _ in rows):
            return p
        if not rows:
            raise self._unknown_run(c, ident)
        if len(rows) > 1:
            shown = ", ".join(f"{r} ({n})" for r, n in rows[:10]) + (" ..." if len(rows) > 10 else "")
            raise StoreError(f"run id prefix {ident!r} is ambiguous: it matches {len(rows)} runs: {shown}; "
                             "give more characters")
        return str(rows[0][0])

    def _record(self, row: tuple[Any, ...]) -> RunRecord:
        run_id, name, grp, status, created, finished, config, manifest, error, host, pid, pid_start = row
        if status == "running" and host == self._hostname and not _process_alive(pid, pid_start):
            status, error = "failed", f"process {pid} ended without finishing the run"
        return RunRecord(run_id=run_id, name=name, group=grp, status=status, created_at=created,
                         finished_at=finished, config=json.loads(config), manifest=json.loads(manifest), error=error,
                         hostname=host, pid=pid)

    _COLUMNS = ("run_id, name, grp, status, created_at, finished_at, config, manifest, error, hostname, pid, "
                "pid_start")

    def get_run(self, run_id_or_prefix: str) -> RunRecord:
        """The run with this id or unique id prefix (>= 4 chars); StoreError naming candidates otherwise."""

        def get(c: sqlite3.Connection) -> RunRecord:
            rid = self._resolve(c, run_id_or_prefix)
            return self._record(c.execute(f"SELECT {self._COLUMNS} FROM runs WHERE run_id = ?", (rid,)).fetchone())

        return self._read(get)

    def list_runs(self, *, group: str | None = None, status: str | None = None) -> list[RunRecord]:
        """Runs, newest first, optionally only one group and/or one (shown) status."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        sql, args = f"SELECT {self._COLUMNS} FROM runs", tuple[str, ...]()
        if group is not None:
            sql, args = sql + " WHERE grp = ?", (group,)
        rows = self._read(lambda c: c.execute(sql + " ORDER BY created_at DESC, rowid DESC", args).fetchall())
        records = [self._record(r) for r in rows]
        return [r for r in records if status is None or r.status == status]

    def finish_run(self, run_id: str, *, status: str, error: str | None = None) -> None:
        """Mark the run "completed" or "failed" (with ``error`` saying why) and stamp ``finished_at``."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"status must be one of {', '.join(FINAL_STATUSES)}, got {status!r}")
        if error is not None and not isinstance(error, str):
            raise ValueError(f"error must be a string or None, got {error!r}")

        def finish(c: sqlite3.Connection) -> None:
            rid = self._resolve(c, run_id)
            c.execute("UPDATE runs SET status = ?, finished_at = ?, error = ? WHERE run_id = ?",
                      (status, time.time(), error, rid))

        self._write(finish)

    def reopen_run(self, run_id: str, *, from_step: int) -> None:
        """Resume: status back to "running" owned by this process; scalars and events after ``from_step`` deleted."""
        from_step = _check_step("from_step", from_step)
        host, pid, pid_start = self._owner()

        def reopen(c: sqlite3.Connection) -> None:
            rid = self._resolve(c, run_id)
            c.execute("UPDATE runs SET status = 'running', finished_at = NULL, error = NULL, hostname = ?, pid = ?, "
                      "pid_start = ? WHERE run_id = ?", (host, pid, pid_start, rid))
            c.execute("DELETE FROM scalars WHERE run_id = ? AND step > ?", (rid, from_step))
            c.execute("DELETE FROM events WHERE run_id = ? AND step > ?", (rid, from_step))

        self._write(reopen)

    # -- scalars and events --------------------------------------------------------------------------------------

    def log_scalars(self, run_id: str, step: int, values: Mapping[str, float]) -> None:
        """Store ``values`` (key -> number) at ``step`` in one transaction; a repeated (key, step) replaces."""
        if not isinstance(values, Mapping):
            raise ValueError(f"values must be a mapping of key -> number, got {type(values).__name__}")
        self.log_rows(run_id, [(step, k, v) for k, v in values.items()])

    def log_rows(self, run_id: str, rows: Iterable[tuple[int, str, float]]) -> None:
        """Store many (step, key, value) rows in one transaction (INSERT OR REPLACE)."""
        batch = [(run_id, *_scalar_row(*row)) for row in rows]
        if not batch:
            return

        def insert(c: sqlite3.Connection) -> None:
            try:
                c.executemany("INSERT OR REPLACE INTO scalars (run_id, step, key, value) VALUES (?, ?, ?, ?)", batch)
            except sqlite3.IntegrityError as e:
                raise self._unknown_run(c, run_id) from e

        self._write(insert)

    def add_event(self, run_id: str, *, step: int, kind: str, payload: dict) -> None:
        """Record an event (e.g. ``kind="nonfinite"``) at ``step`` with a JSON-able payload."""
        step = _check_step("step", step)
        _check_text("kind", kind)
        payload_json = _dumps("payload", payload)

        def insert(c: sqlite3.Connection) -> None:
            try:
                c.execute("INSERT INTO events (run_id, step, kind, payload, created_at) VALUES (?, ?, ?, ?, ?)",
                          (run_id, step, kind, payload_json, time.time()))
            except sqlite3.IntegrityError as e:
                raise self._unknown_run(c, run_id) from e

        self._write(insert)

    def scalars(self, run_id: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """key -> (steps int64, values float64), steps ascending; NaN where NaN was logged."""

        def fetch(c: sqlite3.Connection) -> list[tuple[str, int, float | None]]:
            rid = self._resolve(c, run_id)
            return c.execute("SELECT key, step, value FROM scalars WHERE run_id = ? ORDER BY key, step",
                             (rid,)).fetchall()

        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, group in itertools.groupby(self._read(fetch), key=lambda r: r[0]):
            rows = list(group)
            out[key] = (np.array([r[1] for r in rows], dtype=np.int64),
                        np.array([r[2] for r in rows], dtype=np.float64))  # None (stored NaN) -> nan
        return out

    def events(self, run_id: str, kind: str | None = None) -> list[dict]:
        """Events in step order: ``{"step": int, "kind": str, "payload": dict}``, optionally of one kind only."""

        def fetch(c: sqlite3.Connection) -> list[tuple[int, str, str]]:
            rid = self._resolve(c, run_id)
            args: tuple[str, ...] = (rid,)
            sql = "SELECT step, kind, payload FROM events WHERE run_id = ?"
            if kind is not None:
                sql, args = sql + " AND kind = ?", (rid, kind)
            return c.execute(sql + " ORDER BY step, event_id", args).fetchall()

        return [{"step": s, "kind": k, "payload": json.loads(p)} for s, k, p in self._read(fetch)]

    # -- baselines -----------------------------------------------------------------------------------------------

    def save_baseline(self, name: str, payload: dict, *, overwrite: bool = False) -> None:
        """Store a baseline's JSON-able dict under ``name``; StoreError if it exists and not ``overwrite``."""
        _check_text("baseline name", name)
        payload_json = _dumps("baseline payload", payload)

        def save(c: sqlite3.Connection) -> None:
            now = time.time()
            if c.execute("SELECT 1 FROM baselines WHERE name = ?", (name,)).fetchone() is None:
                c.execute("INSERT INTO baselines (name, payload, created_at, updated_at) VALUES (?, ?, ?, ?)",
                          (name, payload_json, now, now))
            elif overwrite:
                c.execute("UPDATE baselines SET payload = ?, updated_at = ? WHERE name = ?", (payload_json, now, name))
            else:
                raise StoreError(f"baseline {name!r} already exists in {self.path}; pass overwrite=True "
                                 "(--overwrite) to replace it, or choose another name")

        self._write(save)

    def get_baseline(self, name: str) -> dict:
        """The baseline dict stored under ``name``; StoreError naming the known baselines when missing."""

        def get(c: sqlite3.Connection) -> dict:
            row = c.execute("SELECT payload FROM baselines WHERE name = ?", (name,)).fetchone()
            if row is None:
                known = [r[0] for r in c.execute("SELECT name FROM baselines ORDER BY name")]
                hint = f"known baselines: {', '.join(known)}" if known else "no baselines are saved there yet"
                raise StoreError(f"no baseline named {name!r} in {self.path}; {hint}")
            return dict(json.loads(row[0]))

        return self._read(get)

    def list_baselines(self) -> list[str]:
        """Names of the stored baselines, sorted."""
        return self._read(lambda c: [r[0] for r in c.execute("SELECT name FROM baselines ORDER BY name")])


def _reopen(path: str, synchronous: Literal["full", "normal"]) -> RunStore:
    return RunStore(path, synchronous=synchronous)
