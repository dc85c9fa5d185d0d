"""The run store's SQLite backend: one file in WAL mode, its migrations, read-only opening and busy retries.

What the store promises and why (WAL, one writer at a time with ``BEGIN IMMEDIATE``, read-only media) is told in
``_store``'s docstring; this module is the SQLite side of it.
"""

from __future__ import annotations

import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from ._store_base import (
    BUSY_TIMEOUT_MS,
    WRITE_DEADLINE_S,
    NoSuchRun,
    StoreCorrupt,
    StoreError,
    T,
    Transaction,
    apply_migrations,
    back_off,
    cannot_write,
    missing,
    not_a_store,
    schema_version,
)

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
# Version 2: per-row checksums (NULL in rows written before it), and per run the writer's attempt and row counts.
# ADD COLUMN rewrites nothing, so migrating a large store is instant.
_V2 = (
    "ALTER TABLE runs ADD COLUMN checksum INTEGER",
    "ALTER TABLE scalars ADD COLUMN checksum INTEGER",
    "ALTER TABLE events ADD COLUMN checksum INTEGER",
    "ALTER TABLE baselines ADD COLUMN checksum INTEGER",
    """CREATE TABLE run_heads (
        run_id    TEXT PRIMARY KEY REFERENCES runs (run_id) ON DELETE CASCADE,
        attempt   TEXT NOT NULL,     -- the current writer group's claim (fencing)
        n_scalars INTEGER NOT NULL,  -- rows of the run in scalars / events (a lost row is seen)
        n_events  INTEGER NOT NULL
    ) WITHOUT ROWID""",
)
# Version 3: status "diverged" (a run that stopped at a non-finite loss or gradient norm).  SQLite cannot alter a
# CHECK constraint, so the runs table is rebuilt: a new table, every row copied as it is (rowid included, so the
# order of runs created in the same instant stays; the checksums cover the values, which do not change), the old
# table dropped and the new one renamed.  ``_migrate`` turns foreign keys off around the migration transaction
# (SQLite's documented procedure): dropping the old table must not cascade to scalars, events and run_heads, whose
# references then name the new table.
_V3 = (
    """CREATE TABLE runs_v3 (
        run_id      TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        grp         TEXT,
        status      TEXT NOT NULL CHECK (status IN ('running', 'completed', 'diverged', 'failed')),
        created_at  REAL NOT NULL,
        finished_at REAL,
        config      TEXT NOT NULL,  -- JSON
        manifest    TEXT NOT NULL,  -- JSON
        error       TEXT,
        hostname    TEXT NOT NULL,  -- host, pid and pid start time of the writing process (dead-process rule)
        pid         INTEGER NOT NULL,
        pid_start   TEXT,
        checksum    INTEGER
    )""",
    "INSERT INTO runs_v3 (rowid, run_id, name, grp, status, created_at, finished_at, config, manifest, error, "
    "hostname, pid, pid_start, checksum) SELECT rowid, run_id, name, grp, status, created_at, finished_at, config, "
    "manifest, error, hostname, pid, pid_start, checksum FROM runs",
    "DROP TABLE runs",
    "ALTER TABLE runs_v3 RENAME TO runs",
    "CREATE INDEX runs_by_created ON runs (created_at)",
    "CREATE INDEX runs_by_group ON runs (grp)",
)
MIGRATIONS: list[tuple[str, ...]] = [_V1, _V2, _V3]
_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_at REAL NOT NULL)"


def _is_busy(e: sqlite3.Error) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


class SQLiteBackend:
    """One SQLite file (see ``_store_base.Backend``)."""

    name = "SQLite"
    error: type[Exception] = sqlite3.Error

    def __init__(self, path: Path, *, synchronous: Literal["full", "normal"], create: bool) -> None:
        self.path = path
        self.where = str(path)
        self.synchronous = synchronous
        self.create = create
        self.read_only: str | None = None
        self.schema = len(MIGRATIONS)

    def _why_read_only(self) -> str | None:
        """None when the store can be written in WAL mode, else why not (the file, or its folder, is read-only)."""
        path, parent = self.path, self.path.parent
        if not os.access(path, os.W_OK):
            return f"{path} is not writable"
        if os.access(parent, os.W_OK | os.X_OK):
            return None
        wal, shm = Path(f"{path}-wal"), Path(f"{path}-shm")
        if all(p.exists() and os.access(p, os.W_OK) for p in (wal, shm)):
            return None  # WAL files exist and are writable: nothing needs to be created in the folder
        return f"its folder {parent} is not writable"

    def connect(self, migrations: Sequence[tuple[str, ...]]) -> sqlite3.Connection:
        path = self.path
        if path.is_dir():
            raise StoreError(cannot_write(self.where, "it is a directory"))
        if not path.exists():
            if not self.create:
                raise StoreError(missing(self.where))
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(cannot_write(self.where, f"cannot create {path.parent}: {e.strerror or e}")) from e
        else:
            self.read_only = self._why_read_only()
        try:
            conn = self._connect_read_only() if self.read_only else sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as e:
            raise self._translate(e) from e
        try:
            self._configure(conn)
            self._migrate(conn, migrations)
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_read_only(self) -> sqlite3.Connection:
        """``mode=ro``; where no ``-shm`` exists and none can be created (read-only media), ``immutable=1``, which
        is exact only when no write-ahead log is pending (else refused: the log's commits would be ignored)."""
        path = self.path
        uri = "file:" + urllib.parse.quote(str(path))
        shm, wal = Path(f"{path}-shm"), Path(f"{path}-wal")
        immutable = not shm.exists() and not os.access(path.parent, os.W_OK | os.X_OK)
        if immutable and wal.exists() and wal.stat().st_size > 0:
            raise StoreError(f"cannot read the run store at {path}: it is on read-only storage with a pending "
                             f"write-ahead log ({wal.name}) but no {shm.name}; copy the folder to writable storage "
                             "and open the copy")
        uri += "?mode=ro&immutable=1" if immutable else "?mode=ro"
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                               check_same_thread=False)

    def _configure(self, conn: sqlite3.Connection) -> None:
        def pragmas(c: sqlite3.Connection) -> str:
            c.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            c.execute("PRAGMA foreign_keys = ON")
            if self.read_only:
                return "wal"
            mode = c.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            c.execute(f"PRAGMA synchronous = {self.synchronous.upper()}")
            return str(mode)

        mode = self.transact(conn, pragmas, transaction=False)
        if mode.lower() != "wal":
            raise StoreError(cannot_write(self.where, f"SQLite refused WAL journal mode (got {mode!r}); "
                                                      "network file systems cannot hold a run store"))

    def _version(self, c: sqlite3.Connection, latest: int) -> int:
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return schema_version(c, tables - {"sqlite_sequence"}, self.where, latest, kind="an SQLite database")

    def _migrate(self, conn: sqlite3.Connection, migrations: Sequence[tuple[str, ...]]) -> None:
        latest = len(migrations)
        current = self.transact(conn, lambda c: self._version(c, latest), transaction=False)
        if current == latest:
            self.schema = latest
            return
        if self.read_only:  # read an older schema as it is: nothing can be migrated here
            if current == 0:
                raise StoreError(not_a_store(self.where, f"it is empty, and read-only ({self.read_only})"))
            self.schema = current
            return

        def migrate(c: sqlite3.Connection) -> None:
            # the version again, under the write lock: another process may have migrated meanwhile
            apply_migrations(c, self._version(c, latest), migrations, _VERSION_TABLE)

        # off outside the transaction (SQLite ignores the pragma inside one): a migration that rebuilds a table
        # (version 3) must not cascade the old table's DROP to the rows that reference it
        self.transact(conn, lambda c: c.execute("PRAGMA foreign_keys = OFF"), transaction=False)
        try:
            self.transact(conn, migrate, transaction=True)
        finally:
            self.transact(conn, lambda c: c.execute("PRAGMA foreign_keys = ON"), transaction=False)
        self.schema = latest

    def _translate(self, e: sqlite3.Error) -> StoreError:
        msg = str(e)
        low = msg.lower()
        if _is_busy(e):
            return StoreError(f"the run store at {self.where} stayed locked by another process for more than "
                              f"{WRITE_DEADLINE_S:.0f} s ({msg})")
        if isinstance(e, sqlite3.IntegrityError) and "foreign key" in low:
            return NoSuchRun(f"run store at {self.where}: {msg}")
        if ("not a database" in low or "malformed" in low or "file is encrypted" in low
                or "could not decode" in low):
            return StoreCorrupt(not_a_store(self.where, msg))
        if "full" in low:
            return StoreError(cannot_write(self.where, f"the disk is full ({msg})"))
        if self.read_only and ("readonly" in low or "read-only" in low):
            return StoreError(f"the run store at {self.where} is read-only ({self.read_only}): it cannot record "
                              f"anything ({msg}); copy it to writable storage or fix permissions")
        if "unable to open" in low or "readonly" in low or "read-only" in low or "disk i/o" in low:
            return StoreError(cannot_write(self.where, msg))
        return StoreError(f"run store at {self.where}: {msg}")

    def transact(self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], *,
                 transaction: Transaction) -> T:
        """Run ``fn`` (inside ``BEGIN IMMEDIATE ... COMMIT`` when ``transaction``, ``BEGIN DEFERRED ... COMMIT``
        when "read": one consistent snapshot), retrying while the db is busy."""
        deadline = time.monotonic() + WRITE_DEADLINE_S
        delay = 0.002
        while True:
            try:
                if not transaction:
                    return fn(conn)
                conn.execute("BEGIN" if transaction == "read" else "BEGIN IMMEDIATE")
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
                    delay = back_off(delay)
                    continue
                raise self._translate(e) from e
            except UnicodeDecodeError as e:  # SQLite's message quotes a damaged schema's bytes, which Python cannot
                raise StoreCorrupt(not_a_store(self.where, f"malformed database schema ({e})")) from e

    def lock_run(self, c: sqlite3.Connection, run_id: str) -> None:
        """Nothing: ``BEGIN IMMEDIATE`` already holds the one write lock of the file."""

    def structure_problems(self, c: sqlite3.Connection) -> list[str]:
        """``PRAGMA integrity_check`` and ``foreign_key_check`` findings."""
        found = [str(r[0]) for r in c.execute("PRAGMA integrity_check(100)")]
        problems = [] if found == ["ok"] else found
        orphans: dict[str, int] = {}
        for table, *_ in c.execute("PRAGMA foreign_key_check"):
            orphans[table] = orphans.get(table, 0) + 1
        return problems + [f"{n} rows of table {t} belong to no run" for t, n in sorted(orphans.items())]

    def usable(self, conn: sqlite3.Connection) -> bool:
        return True

    def close(self, conn: sqlite3.Connection) -> None:
        conn.close()
