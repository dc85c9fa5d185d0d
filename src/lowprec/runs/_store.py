"""The run store: every run's config, manifest, per-step scalars, events and the named baselines, in one SQLite file
(or one PostgreSQL database, for a store every node and CI machine writes: see "PostgreSQL" below).

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
NaN, so a diverged run keeps its NaN losses.  Infinities are stored as they are.  SQLite stores -0.0 as 0 (an
integral REAL is kept as an integer), so it reads back as 0.0.

Checksums (schema version 2).  SQLite's own ``PRAGMA integrity_check`` verifies the b-tree *structure*, not the
*values*: a byte overwritten inside a stored float leaves a well-formed file that reads back a different number.
So every row the judge reads carries a 64-bit BLAKE2b checksum of its content, computed in Python when it is
written, in the same transaction: ``scalars`` (run id, step, key, value bits), ``events`` (event id, run id, step,
kind, payload, time), ``runs`` (every column: name, group, status, times, config, manifest, error, owner) and
``baselines`` (name, payload).  Per-row checksums keep a per-step ``log_scalars`` cheap (one hash per value, no
read-modify-write of a digest); a replaced row carries its own new checksum, and truncation on resume needs no
re-hashing.  What per-row checksums cannot see, a row that disappears, a per-run count in ``run_heads`` covers:
``n_scalars`` / ``n_events`` are updated by every write in its transaction and compared with the rows found.
Reads verify by default (``get_run``, ``list_runs``, ``scalars``, ``events``, ``get_baseline``: pass
``verify=False`` to skip), so the judge, the report, baselines and exports never see a changed value: they get
``StoreCorrupt`` naming the run and what differs.  ``check()`` (``lowprec store check``) runs
``PRAGMA integrity_check`` and ``foreign_key_check`` and verifies every run and baseline.  The checksums detect
accidental damage (bad sectors, a torn copy, an editor) with a miss rate of 2**-64 per damaged row; they are not a
signature: someone who edits the file on purpose can recompute them.

Runs written before version 2 have no checksums ("unverified", never an error).  A run is *sealed* (checksummed)
when it has a ``run_heads`` row; its ``runs`` row then has a checksum too, and every scalar and event row must.
The first write to an unsealed run after the migration (a resume, a new event) seals it first: checksums of its
rows as they are then, in the same transaction; ``seal()`` (``lowprec store check --seal``) does so for every
unsealed run and baseline.  Sealing trusts what is stored at that moment: check an old store before sealing it.

Fencing.  A run has one writer group at a time.  ``create_run`` and ``reopen_run`` give the run a new *attempt* id
(in ``run_heads``) and remember it in this ``RunStore`` object as its claim; every later write for that run from
this object (``log_scalars``, ``log_rows``, ``add_event``, ``finish_run``, ``reopen_run``) checks, in its own
transaction, that the stored attempt is still its claim, and raises ``RunTakenOver`` otherwise.  So when a run is
resumed while a stale process still trains it (torchrun killed but its workers alive, a second ``--resume``), the
stale writer fails at its next write instead of mixing its steps into the new attempt or flipping the run to
"completed".  Writes from an object that never claimed the run (other ranks' ``rank_failure`` events, the
launcher marking the run failed) always go through; a non-owner's ``finish_run`` also revokes the current attempt,
so a writer group that outlives its launcher cannot complete a run the launcher declared failed.

PostgreSQL.  ``RunStore("postgresql://USER@HOST:PORT/DATABASE")`` (or ``postgres://``) keeps the same tables,
migration versions, checksums (a run copied between the backends verifies identically), fencing, counts and
errors in a database on a server (``_store_pg``: its types, its row locks for concurrent writers, its
durability); every path is an SQLite file.  This module holds every rule of the store; ``_store_sqlite`` and
``_store_pg`` only connect, migrate, run transactions and translate errors (``_store_base``).  What an SQLite store
keeps next to its file (checkpoints, launch configs), a PostgreSQL store keeps in ``files_dir``.  ``dump_run`` and
``load_run`` move a run between stores exactly (``lowprec store copy``, ``_store_copy``).

Opening.  ``RunStore(path, create=False)`` refuses a missing file (reading commands: a mistyped ``--store`` must
not silently create an empty store).  A store whose file or folder is not writable (read-only media, another
user's archive) is opened read-only (``mode=ro``; ``immutable=1`` when no ``-shm`` can be created and no
write-ahead log is pending) and every write raises ``StoreError``; an older schema is then read as it is, without
migrating (its runs are unverified).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import numbers
import os
import re
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from .._errors import UsageError
from .._types import FINAL_STATUSES as FINAL_STATUSES  # re-exported: callers name them from the store
from .._types import STATUSES as STATUSES
from .._types import FinalStatus, RunStatus
from . import _store_pg
from ._store_base import BUSY_TIMEOUT_MS as BUSY_TIMEOUT_MS
from ._store_base import WRITE_DEADLINE_S as WRITE_DEADLINE_S
from ._store_base import Backend, Conn, NoSuchRun, corrupt_hint
from ._store_base import RunTakenOver as RunTakenOver
from ._store_base import StoreCorrupt as StoreCorrupt
from ._store_base import StoreError as StoreError
from ._store_sqlite import _V1 as _V1  # the SQLite schema's statements (tests build old stores from them)
from ._store_sqlite import _V2 as _V2
from ._store_sqlite import _V3 as _V3
from ._store_sqlite import MIGRATIONS as MIGRATIONS
from ._store_sqlite import SQLiteBackend

__all__ = ["DEFAULT_PATH", "MIGRATIONS", "BaselineCheck", "RunCheck", "RunDump", "RunRecord", "RunStore",
           "RunTakenOver", "StoreCheck", "StoreCorrupt", "StoreError"]

T = TypeVar("T")

DEFAULT_PATH = Path("lowprec-runs") / "runs.db"
MIN_PREFIX = 4
FILES_ENV = "LOWPREC_FILES_DIR"
"""Where a PostgreSQL store's files (checkpoints, launch configs) go, when ``files_dir`` is not given."""
_RUN_ID = re.compile(r"[0-9a-f]{12}")
DURABLE_EVENTS = ("spike", "rollback", "skip", "rerun", "sdc")
"""Event kinds that ``reopen_run`` keeps past its step: the reliability ledger (``lowprec.reliability``) records
what happened on a timeline that a rollback or resume abandons (a spike, the rollback, the batches to skip, a
rerun's diagnosis, a silent-data-corruption finding); the resumed run reads the skip ledger back to skip the same
batches, and the judge and report show every entry."""
CHECKSUM_VERSION = 2
"""The schema version that added checksums and attempts: runs written before it are "unverified"."""
UNVERIFIED = (f"written before the store had checksums (store schema version {CHECKSUM_VERSION}); "
              "`lowprec store check --seal` records them")


@dataclass(frozen=True)
class RunRecord:
    """One run as stored (``status``/``error`` already reflect the dead-process rule)."""

    run_id: str  # 12 hex chars; any unique prefix of >= 4 chars selects it
    name: str  # human label
    group: str | None  # selects a group of runs, e.g. a baseline's name
    status: RunStatus
    created_at: float  # unix time
    finished_at: float | None
    config: dict  # the full resolved run config
    manifest: dict  # versions, hardware, hashes, seed, metric directions, ...
    error: str | None  # why it failed
    hostname: str | None = None  # host of the process that last wrote the run
    pid: int | None = None  # pid of that process


@dataclass(frozen=True)
class RunDump:
    """One run exactly as stored (``RunStore.dump_run``, ``load_run``): what ``lowprec store copy`` moves."""

    row: tuple[Any, ...]  # the runs row: run id, name, group, status, times, config, manifest, error, owner
    checksum: int  # of ``row`` (the same in every store)
    scalars: tuple[tuple[int, str, float | None], ...]  # (step, key, value; None for NaN), by key then step
    events: tuple[tuple[int, str, str, float], ...]  # (step, kind, payload JSON, created_at), in stored order


@dataclass(frozen=True)
class RunCheck:
    """The verdict of ``RunStore.verify_run`` on one run."""

    run_id: str
    name: str | None
    state: Literal["ok", "unverified", "corrupt"]
    problems: tuple[str, ...] = ()  # what is wrong ("corrupt"), or why it cannot be checked ("unverified")
    rows: int = 0  # scalar and event rows checked

    def line(self) -> str:
        label = f"run {self.run_id}" + (f" ({self.name})" if self.name else "")
        if self.state == "ok":
            return f"{label}: ok ({self.rows} rows verified)"
        if self.state == "unverified":
            return f"{label}: unverified (" + "; ".join(self.problems) + ")"
        return f"{label}: CORRUPT: " + "; ".join(self.problems)


@dataclass(frozen=True)
class BaselineCheck:
    name: str
    state: Literal["ok", "unverified", "corrupt"]
    problem: str | None = None

    def line(self) -> str:
        if self.state == "corrupt":
            return f"baseline {self.name!r}: CORRUPT: {self.problem}"
        return f"baseline {self.name!r}: " + (self.state if self.problem is None else f"{self.state} ({self.problem})")


@dataclass(frozen=True)
class StoreCheck:
    """``RunStore.check()``: the database's structural checks plus every run's and baseline's checksums."""

    path: Path | str  # the store's file, or its URL without the password
    problems: tuple[str, ...]  # store-wide: SQLite's integrity_check and foreign_key_check findings
    runs: tuple[RunCheck, ...] = ()
    baselines: tuple[BaselineCheck, ...] = ()
    backend: str = "SQLite"

    @property
    def ok(self) -> bool:
        """Nothing corrupt (unverified runs written before checksums are not a failure)."""
        return (not self.problems and all(r.state != "corrupt" for r in self.runs)
                and all(b.state != "corrupt" for b in self.baselines))

    def lines(self) -> list[str]:
        out = [f"store {self.path}: " + (f"{self.backend} integrity ok" if not self.problems else
                                         f"{self.backend.upper()} INTEGRITY: " + "; ".join(self.problems))]
        out += [r.line() for r in self.runs]
        out += [b.line() for b in self.baselines]
        n_bad = sum(r.state == "corrupt" for r in self.runs) + sum(b.state == "corrupt" for b in self.baselines)
        n_unv = sum(r.state == "unverified" for r in self.runs) + sum(b.state == "unverified" for b in self.baselines)
        verdict = "clean" if self.ok else "CORRUPT"
        out.append(f"{verdict}: {len(self.runs)} runs, {len(self.baselines)} baselines, {n_bad} corrupt, "
                   f"{n_unv} unverified" + ("" if not self.problems else f", {self.backend} integrity problems"))
        return out


# -- checksums -------------------------------------------------------------------------------------------------------

_Q = struct.Struct("<q")
_D = struct.Struct("<d")
_I = struct.Struct("<I")


def _digest(data: bytes) -> int:
    """64-bit BLAKE2b of ``data`` as a signed integer (what an SQLite INTEGER holds)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _text(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return _I.pack(len(b)) + b


def _fields(*values: Any) -> bytes:
    """An unambiguous encoding: a type tag per value, then a fixed width or a length prefix."""
    out = []
    for v in values:
        if v is None:
            out.append(b"n")
        elif isinstance(v, str):
            out.append(b"s" + _text(v))
        elif isinstance(v, float):
            out.append(b"f" + _D.pack(v if v != 0.0 else 0.0))  # SQLite gives -0.0 back as 0.0
        elif isinstance(v, int):
            out.append(b"i" + _Q.pack(v))
        else:  # pragma: no cover - every caller passes the column types above
            raise TypeError(f"cannot checksum {type(v).__name__}")
    return b"".join(out)


def _real(v: Any) -> float | None:
    return None if v is None else float(v)


_key_bytes = functools.lru_cache(maxsize=1 << 16)(_text)  # a run logs the same few keys at every step


def scalar_checksum(run_id: str, step: int, key: str, value: float | None) -> int:
    """Checksum of one scalars row (``value`` None for a stored NaN)."""
    tail = b"n" if value is None else _D.pack(value if value != 0.0 else 0.0)
    return int.from_bytes(hashlib.blake2b(b"S" + run_id.encode() + _Q.pack(step) + _key_bytes(key) + tail,
                                          digest_size=8).digest(), "little", signed=True)


def event_checksum(event_id: int, run_id: str, step: int, kind: str, payload: str, created_at: float) -> int:
    return _digest(b"E" + _fields(int(event_id), run_id, int(step), kind, payload, float(created_at)))


def run_checksum(row: Sequence[Any]) -> int:
    """Checksum of a runs row given in ``_COLUMNS`` order."""
    rid, name, grp, status, created, finished, config, manifest, error, host, pid, pid_start = row
    return _digest(b"R" + _fields(rid, name, grp, status, _real(created), _real(finished), config, manifest, error,
                                  host, None if pid is None else int(pid), pid_start))


def baseline_checksum(name: str, payload: str) -> int:
    return _digest(b"B" + _fields(name, payload))


# -- helpers ---------------------------------------------------------------------------------------------------------

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
        raise UsageError(f"{field} must be a dict, got {type(obj).__name__}")
    try:
        return json.dumps(obj, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise UsageError(f"{field} must be JSON-serialisable (dict, list, str, int, float, bool, None): {e}") from e


def _check_text(field: str, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{field} must be a non-empty string, got {value!r}")


def _check_step(field: str, step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise UsageError(f"{field} must be an integer >= 0, got {step!r}")
    return int(step)


def _check_run_id(run_id: Any) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"run_id must be 12 lowercase hex characters (a full run id), got {run_id!r}")
    return run_id


def _scalar_row(step: Any, key: Any, value: Any) -> tuple[int, str, float | None]:
    _check_text("scalar key", key)
    try:
        v = float(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise UsageError(f"scalar {key!r} at step {step} must be a real number, got {value!r}") from e
    return _check_step(f"step of scalar {key!r}", step), key, (None if math.isnan(v) else (v if v != 0.0 else 0.0))


def _new_attempt() -> str:
    return uuid.uuid4().hex[:16]


def _loads(what: str, text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError) as e:
        raise StoreCorrupt(f"{what} is not valid JSON ({e})") from None


@dataclass
class _Head:
    """What a read needs to verify one run: whether it is sealed, and its recorded row counts."""

    sealed: bool
    n_scalars: int | None
    n_events: int | None
    problems: list[str] = field(default_factory=list)


def _scalar_problems(run_id: str, rows: Sequence[tuple[str, int, float | None, int | None]],
                     head: _Head) -> list[str]:
    """Rows (key, step, value, checksum) of one run against their checksums and the recorded count."""
    if not head.sealed:
        n = sum(r[3] is not None for r in rows)
        return [f"{n} scalar rows carry checksums but the run's checksum record is missing"] if n else []
    bad: dict[str, list[int]] = {}
    # scalar_checksum, unrolled: the run's prefix and each key's bytes are encoded once (~1.5 us a row)
    prefix, keys = b"S" + run_id.encode(), dict[str, bytes]()
    blake2b, pack_q, pack_d, from_bytes = hashlib.blake2b, _Q.pack, _D.pack, int.from_bytes
    for key, step, value, checksum in rows:
        try:
            kb = keys.get(key)
            if kb is None:
                kb = keys[key] = _key_bytes(key)
            tail = b"n" if value is None else pack_d(value if value != 0.0 else 0.0)
            ok = checksum == from_bytes(blake2b(prefix + pack_q(step) + kb + tail, digest_size=8).digest(),
                                        "little", signed=True)
        except Exception:  # a damaged row may hold values of another type (text for a REAL, ...)
            ok = False
        if not ok:
            bad.setdefault(str(key), []).append(step)
    problems = [f"scalar {key!r}: {len(steps)} value(s) do not match their checksums (step {steps[0]}"
                + (f" and {len(steps) - 1} more)" if len(steps) > 1 else ")") for key, steps in sorted(bad.items())]
    if head.n_scalars is not None and head.n_scalars != len(rows):
        problems.append(f"{head.n_scalars} scalar rows were recorded, {len(rows)} are stored")
    return problems


def _event_problems(run_id: str, rows: Sequence[tuple[int, int, str, str, float, int | None]],
                    head: _Head) -> list[str]:
    """Rows (event_id, step, kind, payload, created_at, checksum) of one run."""
    if not head.sealed:
        n = sum(r[5] is not None for r in rows)
        return [f"{n} event rows carry checksums but the run's checksum record is missing"] if n else []
    problems = []
    for eid, step, kind, payload, created, checksum in rows:
        try:
            ok = checksum == event_checksum(eid, run_id, step, kind, payload, created)
        except Exception:  # values of the wrong type in a damaged row
            ok = False
        if not ok:
            problems.append(f"event {eid} ({kind!r} at step {step}) does not match its checksum")
    if head.n_events is not None and head.n_events != len(rows):
        problems.append(f"{head.n_events} events were recorded, {len(rows)} are stored")
    return problems


class RunStore:
    """Runs, their per-step scalars and events, and named baselines, in one SQLite file or one PostgreSQL database
    (see the module docstring).

    ``location`` is a path (SQLite) or a ``postgresql://`` / ``postgres://`` URL (PostgreSQL, ``_store_pg``).
    Write methods (``log_scalars``, ``log_rows``, ``add_event``) take the full run id; the others also accept a
    unique prefix of at least 4 characters.  Safe to share between threads; after ``fork`` the child opens its
    own connection.  Use as a context manager or call ``close()``.

    ``create=False`` refuses a path with no store, or a database without the store's tables (instead of creating
    an empty store there).  An SQLite store that cannot be written (read-only file, folder or media) is opened
    read-only: ``read_only`` is then the reason, and writes raise ``StoreError``.

    ``files_dir`` is the folder for the files that belong to the store's runs (checkpoints, launch configs): for
    SQLite always the store file's folder; for PostgreSQL ``files_dir``, else ``$LOWPREC_FILES_DIR``, else
    ``./lowprec-runs`` (the folder of the default SQLite store), made absolute when the store is opened.
    """

    def __init__(self, location: str | os.PathLike[str] = DEFAULT_PATH, *,
                 synchronous: Literal["full", "normal"] = "normal", create: bool = True,
                 files_dir: str | os.PathLike[str] | None = None) -> None:
        if synchronous not in ("full", "normal"):
            raise UsageError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        self.synchronous = synchronous
        self.create = create
        text = os.fspath(location)
        self._backend: Backend
        if isinstance(text, str) and _store_pg.is_url(text):
            self.path: Path | None = None
            """The store's file (SQLite); None for PostgreSQL."""
            self.location = text
            """What reopens this store: the file's absolute path, or the URL as given."""
            self.files_dir = Path(os.path.abspath(files_dir or os.environ.get(FILES_ENV) or DEFAULT_PATH.parent))
            self._backend = _store_pg.PostgresBackend(text, synchronous=synchronous, create=create)
        else:
            self.path = Path(os.path.abspath(text))
            self.location = str(self.path)
            self.files_dir = self.path.parent
            self._backend = SQLiteBackend(self.path, synchronous=synchronous, create=create)
        self.where = self._backend.where
        """What messages name: the file, or the URL without its password."""
        self._lock = threading.RLock()
        self._hostname = socket.gethostname()
        self._abandoned: list[Conn] = []  # connections inherited across fork: never touched again
        self._conn: Conn | None = None
        self._pid = os.getpid()
        self._closed = False
        self._claims: dict[str, str] = {}  # run id -> the attempt this object created or reopened it with
        self._conn = self._open()

    @property
    def backend(self) -> str:
        """"SQLite" or "PostgreSQL"."""
        return self._backend.name

    @property
    def read_only(self) -> str | None:
        """None, or why the store was opened read-only."""
        return self._backend.read_only

    @property
    def _schema(self) -> int:
        return self._backend.schema

    # -- connection, errors, transactions ------------------------------------------------------------------------

    def _open(self) -> Conn:
        return self._backend.connect(MIGRATIONS if self.path is not None else _store_pg.MIGRATIONS)

    def _connection(self) -> Conn:
        if self._closed:
            raise StoreError(f"the run store at {self.where} is closed")
        if self._pid != os.getpid():  # forked: a connection must not cross fork, open our own
            if self._conn is not None:
                self._abandoned.append(self._conn)
            self._conn = None
            self._pid = os.getpid()
        if self._conn is not None and not self._backend.usable(self._conn):  # a lost server connection
            self._abandoned.append(self._conn)
            self._conn = None
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _write(self, fn: Callable[[Conn], T]) -> T:
        with self._lock:
            conn = self._connection()
            if self.read_only:
                raise StoreError(f"the run store at {self.where} was opened read-only ({self.read_only}): it "
                                 "cannot record anything; copy it to writable storage or fix permissions")
            return self._backend.transact(conn, fn, transaction=True)

    def _read(self, fn: Callable[[Conn], T]) -> T:
        with self._lock:
            return self._backend.transact(self._connection(), fn, transaction="read")

    def _write_run(self, run_id: str, fn: Callable[[Conn], T]) -> T:
        """``_write`` for rows of one run: a missing run is a StoreError naming the recent runs."""
        try:
            return self._write(fn)
        except NoSuchRun:
            raise self._read(lambda c: self._unknown_run(c, run_id)) from None

    def close(self) -> None:
        """Close the connection (idempotent); later calls raise StoreError."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._backend.close(self._conn)
            self._conn = None
            self._closed = True

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (e.g. to a spawned process) as "open the same store"
        return (_reopen, (self.location, self.synchronous, self.create,
                          None if self.path is not None else str(self.files_dir)))

    def __repr__(self) -> str:
        return f"RunStore({self.where!r})"

    # -- schema-dependent SQL ------------------------------------------------------------------------------------

    @property
    def _checksummed(self) -> bool:
        return self._schema >= CHECKSUM_VERSION

    def _col(self, name: str) -> str:
        """``name`` in a store with checksums, NULL in an older one read as it is (read-only)."""
        return name if self._checksummed else "NULL"

    def _runs_sql(self) -> str:
        cols = ", ".join(f"r.{c}" for c in self._COLUMNS.split(", "))
        if not self._checksummed:
            return f"SELECT {cols}, NULL, 0 FROM runs r"
        return (f"SELECT {cols}, r.checksum, h.run_id IS NOT NULL FROM runs r "
                "LEFT JOIN run_heads h ON h.run_id = r.run_id")

    # -- runs ----------------------------------------------------------------------------------------------------

    _COLUMNS = ("run_id, name, grp, status, created_at, finished_at, config, manifest, error, hostname, pid, "
                "pid_start")

    def _owner(self) -> tuple[str, int, str | None]:
        pid = os.getpid()
        stat = _proc_stat(pid)
        return self._hostname, pid, (stat[1] if stat else None)

    def create_run(self, *, name: str, config: dict, manifest: dict, group: str | None = None,
                   run_id: str | None = None) -> str:
        """Record a new run with status "running"; returns its id (12 hex chars, random unless given).  This
        object claims the run (see Fencing in the module docstring)."""
        _check_text("name", name)
        _check_text("group", group, optional=True)
        if run_id is not None and (not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id)):
            raise UsageError(f"run_id must be 12 lowercase hex characters, got {run_id!r}")
        config_json, manifest_json = _dumps("config", config), _dumps("manifest", manifest)
        host, pid, pid_start = self._owner()
        attempt = _new_attempt()

        def insert(c: Conn) -> str:
            for _ in range(100):
                rid = run_id or uuid.uuid4().hex[:12]
                row = (rid, name, group, "running", time.time(), None, config_json, manifest_json, None, host, pid,
                       pid_start)
                if self._insert_run(c, row, run_checksum(row), attempt):
                    return rid
                if run_id is not None:
                    raise StoreError(f"run id {run_id!r} already exists in {self.where}; pass another run_id")
            raise StoreError(f"could not draw an unused run id in {self.where}")  # pragma: no cover

        with self._lock:
            rid = self._write(insert)
            self._claims[rid] = attempt
        return rid

    def _insert_run(self, c: Conn, row: Sequence[Any], checksum: int, attempt: str, n_scalars: int = 0,
                    n_events: int = 0) -> bool:
        """Insert a runs row (``_COLUMNS`` order) and its head; False, inserting nothing, when the id is taken."""
        if c.execute(f"INSERT INTO runs ({self._COLUMNS}, checksum) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                     "ON CONFLICT DO NOTHING", (*row, checksum)).rowcount != 1:
            return False
        c.execute("INSERT INTO run_heads (run_id, attempt, n_scalars, n_events) VALUES (?, ?, ?, ?)",
                  (row[0], attempt, n_scalars, n_events))
        return True

    def _unknown_run(self, c: Conn, ident: str) -> StoreError:
        recent = c.execute("SELECT run_id, name FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 5").fetchall()
        hint = ("; recent runs: " + ", ".join(f"{r} ({n})" for r, n in recent)) if recent else "; it has no runs yet"
        return StoreError(f"no run with id {ident!r} in {self.where}{hint}")

    def _bad_id(self, c: Conn | None, run_id: Any) -> StoreCorrupt:
        rowid = None
        if c is not None:
            try:
                found = c.execute("SELECT rowid, name FROM runs WHERE run_id = ?", (run_id,)).fetchone()
                rowid = found and f"row {found[0]}, name {found[1]!r}"
            except self._backend.error:
                pass
        where = f" ({rowid})" if rowid else ""
        return StoreCorrupt(f"the run store at {self.where} holds a run with an invalid id {run_id!r}{where}: a run "
                            "id is 12 lowercase hex characters, and lowprec never wrote this one (it would be used as "
                            f"a file name); {corrupt_hint(self.where)}")

    def _resolve(self, c: Conn, ident: str) -> str:
        if not isinstance(ident, str):
            raise UsageError(f"run id must be a string, got {ident!r}")
        p = ident.strip().lower()
        if len(p) < MIN_PREFIX:
            raise StoreError(f"run id prefix {ident!r} is too short: give at least {MIN_PREFIX} of its 12 characters")
        rows = c.execute("SELECT run_id, name FROM runs WHERE run_id >= ? AND run_id < ? "
                         "ORDER BY created_at DESC, rowid DESC",
                         (p, p + "~")).fetchall()  # '~' sorts after every hex digit: a prefix range scan
        if any(r == p for r, _ in rows):
            found = p
        elif not rows:
            raise self._unknown_run(c, ident)
        elif len(rows) > 1:
            shown = ", ".join(f"{r} ({n})" for r, n in rows[:10]) + (" ..." if len(rows) > 10 else "")
            raise StoreError(f"run id prefix {ident!r} is ambiguous: it matches {len(rows)} runs: {shown}; "
                             "give more characters")
        else:
            found = rows[0][0]
        if not isinstance(found, str) or not _RUN_ID.fullmatch(found):
            raise self._bad_id(c, found)
        return found

    def _record(self, row: Sequence[Any], *, verify: bool = True, c: Conn | None = None) -> RunRecord:
        """A RunRecord from a ``_runs_sql`` row (the columns, checksum, has-head); the id is always validated,
        the checksum when ``verify``."""
        (run_id, name, grp, status, created, finished, config, manifest, error, host, pid, pid_start,
         checksum, has_head) = row
        if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
            raise self._bad_id(c, run_id)
        if verify:
            problems = self._record_problems(row)
            if problems:
                raise StoreCorrupt(f"run {run_id} in {self.where}: {'; '.join(problems)}; {corrupt_hint(self.where)}")
        if (status == "running" and host == self._hostname and isinstance(pid, int)
                and not _process_alive(pid, pid_start if isinstance(pid_start, str) else None)):
            status, error = "failed", f"process {pid} ended without finishing the run"
        try:
            return RunRecord(run_id=run_id, name=name, group=grp, status=status, created_at=created,
                             finished_at=finished, config=_loads(f"run {run_id}'s config", config),
                             manifest=_loads(f"run {run_id}'s manifest", manifest), error=error, hostname=host,
                             pid=pid)
        except StoreCorrupt as e:
            raise StoreCorrupt(f"{e} in {self.where}; {corrupt_hint(self.where)}") from None

    @staticmethod
    def _record_problems(row: Sequence[Any]) -> list[str]:
        checksum, has_head = row[12], bool(row[13])
        if checksum is None:
            return ["its record has no checksum but the run has a checksum head (the checksum was lost)"] \
                if has_head else []
        if not has_head:
            return ["its checksum head (row counts and attempt) is missing"]
        try:
            ok = run_checksum(row[:12]) == checksum
        except Exception:  # values of the wrong type in a damaged row
            ok = False
        return [] if ok else ["its record (name, group, status, times, config, manifest, error, owner) does not "
                              "match its checksum"]

    def _head(self, c: Conn, rid: str) -> _Head:
        if not self._checksummed:
            return _Head(sealed=False, n_scalars=None, n_events=None)
        row = c.execute("SELECT r.checksum, h.n_scalars, h.n_events, h.run_id IS NOT NULL FROM runs r "
                        "LEFT JOIN run_heads h ON h.run_id = r.run_id WHERE r.run_id = ?", (rid,)).fetchone()
        if row is None:
            return _Head(sealed=False, n_scalars=None, n_events=None, problems=["the run's record is missing"])
        checksum, n_s, n_e, has_head = row
        if has_head:
            return _Head(sealed=True, n_scalars=n_s, n_events=n_e)
        return _Head(sealed=checksum is not None, n_scalars=None, n_events=None)  # lost head: reported by _record

    def get_run(self, run_id_or_prefix: str, *, verify: bool = True) -> RunRecord:
        """The run with this id or unique id prefix (>= 4 chars); StoreError naming candidates otherwise.  With
        ``verify`` (the default) its record is checked against its checksum (``StoreCorrupt``)."""

        def get(c: Conn) -> RunRecord:
            rid = self._resolve(c, run_id_or_prefix)
            return self._record(c.execute(self._runs_sql() + " WHERE r.run_id = ?", (rid,)).fetchone(),
                                verify=verify, c=c)

        return self._read(get)

    def list_runs(self, *, group: str | None = None, status: RunStatus | None = None,
                  verify: bool = True) -> list[RunRecord]:
        """Runs, newest first, optionally only one group and/or one (shown) status.  Every id is validated; with
        ``verify`` every record is checked against its checksum (``StoreCorrupt`` names the first bad run)."""
        if status is not None and status not in STATUSES:
            raise UsageError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        sql, args = self._runs_sql(), tuple[str, ...]()
        if group is not None:
            sql, args = sql + " WHERE r.grp = ?", (group,)

        def fetch(c: Conn) -> list[RunRecord]:
            rows = c.execute(sql + " ORDER BY r.created_at DESC, r.rowid DESC", args).fetchall()
            return [self._record(r, verify=verify, c=c) for r in rows]

        return [r for r in self._read(fetch) if status is None or r.status == status]

    # -- fencing and sealing (inside a write transaction) --------------------------------------------------------

    def _taken_over(self, rid: str, mine: str, theirs: str | None) -> RunTakenOver:
        return RunTakenOver(f"run {rid} was taken over by another attempt (this writer's attempt {mine}, the store's "
                            f"{theirs}: another process resumed the run or marked it finished); this writer stops")

    def _seal(self, c: Conn, rid: str) -> None:
        """Give an unsealed run (written before checksums) its checksums and head, from its rows as they are."""
        row = c.execute(f"SELECT {self._COLUMNS}, checksum FROM runs WHERE run_id = ?", (rid,)).fetchone()
        if row is None:
            raise self._unknown_run(c, rid)
        if row[12] is not None:
            raise StoreCorrupt(f"run {rid} in {self.where}: its checksum head (row counts and attempt) is missing; "
                               f"{corrupt_hint(self.where)}")
        c.execute("UPDATE runs SET checksum = ? WHERE run_id = ?", (run_checksum(row[:12]), rid))
        todo = c.execute("SELECT step, key, value FROM scalars WHERE run_id = ? AND checksum IS NULL",
                         (rid,)).fetchall()
        c.executemany("UPDATE scalars SET checksum = ? WHERE run_id = ? AND key = ? AND step = ?",
                      [(scalar_checksum(rid, s, k, v), rid, k, s) for s, k, v in todo])
        events = c.execute("SELECT event_id, step, kind, payload, created_at FROM events WHERE run_id = ? "
                           "AND checksum IS NULL", (rid,)).fetchall()
        c.executemany("UPDATE events SET checksum = ? WHERE event_id = ?",
                      [(event_checksum(e, rid, s, k, p, t), e) for e, s, k, p, t in events])
        n_s = c.execute("SELECT COUNT(*) FROM scalars WHERE run_id = ?", (rid,)).fetchone()[0]
        n_e = c.execute("SELECT COUNT(*) FROM events WHERE run_id = ?", (rid,)).fetchone()[0]
        c.execute("INSERT INTO run_heads (run_id, attempt, n_scalars, n_events) VALUES (?, ?, ?, ?)",
                  (rid, _new_attempt(), n_s, n_e))

    def _claimed_head(self, c: Conn, rid: str) -> str:
        """The run's current attempt, after sealing an unsealed run; RunTakenOver when this object claimed the
        run and the claim is no longer current.  Locks the run's head first (PostgreSQL: one writer per run)."""
        self._backend.lock_run(c, rid)
        head = c.execute("SELECT attempt FROM run_heads WHERE run_id = ?", (rid,)).fetchone()
        if head is None:
            self._seal(c, rid)
            head = c.execute("SELECT attempt FROM run_heads WHERE run_id = ?", (rid,)).fetchone()
        mine = self._claims.get(rid)
        if mine is not None and head[0] != mine:
            raise self._taken_over(rid, mine, head[0])
        return str(head[0])

    def _count(self, c: Conn, rid: str, *, scalars: int = 0, events: int = 0) -> None:
        """Add new rows to the run's counts, fenced: one UPDATE that matches only while this object's claim (if
        it has one) is current; sealing an unsealed run on its first write."""
        mine = self._claims.get(rid)
        sql = "UPDATE run_heads SET n_scalars = n_scalars + ?, n_events = n_events + ? WHERE run_id = ?"
        args: tuple[Any, ...] = (scalars, events, rid)
        if mine is not None:
            sql, args = sql + " AND attempt = ?", (*args, mine)
        if c.execute(sql, args).rowcount == 1:
            return
        head = c.execute("SELECT attempt FROM run_heads WHERE run_id = ?", (rid,)).fetchone()
        if head is not None:
            raise self._taken_over(rid, str(mine), head[0])
        self._seal(c, rid)  # counts every row, the ones just written included
        if mine is not None:
            raise self._taken_over(rid, mine, None)

    def _rewrite_run(self, c: Conn, rid: str, **changes: Any) -> None:
        """UPDATE columns of a runs row and its checksum."""
        row = dict(zip(self._COLUMNS.split(", "),
                       c.execute(f"SELECT {self._COLUMNS} FROM runs WHERE run_id = ?", (rid,)).fetchone(),
                       strict=True))
        row.update(changes)
        sets = ", ".join(f"{k} = ?" for k in changes)
        c.execute(f"UPDATE runs SET {sets}, checksum = ? WHERE run_id = ?",
                  (*changes.values(), run_checksum(list(row.values())), rid))

    def finish_run(self, run_id: str, *, status: FinalStatus, error: str | None = None) -> None:
        """Mark the run "completed", "diverged" (it stopped at a non-finite loss or gradient norm) or "failed" (with
        ``error`` saying why) and stamp ``finished_at``.

        From the object that claimed the run: only while its claim is current (``RunTakenOver`` otherwise).  From
        any other object (a launcher, another rank): always, and it revokes the current attempt, so a writer that
        outlived its launcher cannot flip the run afterwards.  When the store cannot be written (a full disk), the
        ``StoreError`` names ``error`` too, so the reason is not lost."""
        if status not in FINAL_STATUSES:
            raise UsageError(f"status must be one of {', '.join(FINAL_STATUSES)}, got {status!r}")
        if error is not None and not isinstance(error, str):
            raise UsageError(f"error must be a string or None, got {error!r}")

        def finish(c: Conn) -> None:
            rid = self._resolve(c, run_id)
            current = self._claimed_head(c, rid)
            attempt = current if rid in self._claims else _new_attempt()
            self._rewrite_run(c, rid, status=status, finished_at=time.time(), error=error)
            c.execute("UPDATE run_heads SET attempt = ? WHERE run_id = ?", (attempt, rid))

        try:
            self._write(finish)
        except StoreError as e:
            if error is None:
                raise
            raise type(e)(f"{e}; the run's {status} status with its reason could not be recorded: {error}") from e

    def reopen_run(self, run_id: str, *, from_step: int) -> None:
        """Resume: status back to "running" owned by this process; scalars and events after ``from_step`` deleted
        (but for the ``DURABLE_EVENTS``, the reliability ledger).
        The run gets a new attempt, claimed by this object: an earlier writer of the run stops at its next write."""
        from_step = _check_step("from_step", from_step)
        host, pid, pid_start = self._owner()
        attempt = _new_attempt()

        def reopen(c: Conn) -> str:
            rid = self._resolve(c, run_id)
            self._claimed_head(c, rid)
            self._rewrite_run(c, rid, status="running", finished_at=None, error=None, hostname=host, pid=pid,
                              pid_start=pid_start)
            n_s = c.execute("DELETE FROM scalars WHERE run_id = ? AND step > ?", (rid, from_step)).rowcount
            marks = ", ".join("?" * len(DURABLE_EVENTS))
            n_e = c.execute(f"DELETE FROM events WHERE run_id = ? AND step > ? AND kind NOT IN ({marks})",
                            (rid, from_step, *DURABLE_EVENTS)).rowcount
            c.execute("UPDATE run_heads SET attempt = ?, n_scalars = n_scalars - ?, n_events = n_events - ? "
                      "WHERE run_id = ?", (attempt, n_s, n_e, rid))
            return rid

        with self._lock:
            rid = self._write(reopen)
            self._claims[rid] = attempt

    def delete_run(self, run_id: str) -> tuple[str, int, int]:
        """Delete a run (id or unique prefix): its record, scalars, events and checksum head, in one transaction;
        returns (run id, scalar rows, events) deleted.  The store stays consistent (``check()`` finds nothing
        missing: the counts that cover lost rows are the run's own and go with it).  Files outside the store (its
        checkpoints, its launch config) are the caller's: ``lowprec runs delete`` removes them.  Whether the run
        is still being written, or a baseline is built from it, is the caller's to check first."""

        def delete(c: Conn) -> tuple[str, int, int]:
            rid = self._resolve(c, run_id)
            return (rid, *self._delete_rows(c, rid))

        with self._lock:
            out = self._write(delete)
            self._claims.pop(out[0], None)
        return out

    def _delete_rows(self, c: Conn, rid: str) -> tuple[int, int]:
        """Delete a run's rows (inside a write transaction); returns (scalar rows, events) deleted."""
        self._backend.lock_run(c, rid)
        n_s = c.execute("DELETE FROM scalars WHERE run_id = ?", (rid,)).rowcount
        n_e = c.execute("DELETE FROM events WHERE run_id = ?", (rid,)).rowcount
        if self._checksummed:
            c.execute("DELETE FROM run_heads WHERE run_id = ?", (rid,))
        c.execute("DELETE FROM runs WHERE run_id = ?", (rid,))
        return n_s, n_e

    # -- scalars and events --------------------------------------------------------------------------------------

    def log_scalars(self, run_id: str, step: int, values: Mapping[str, float]) -> None:
        """Store ``values`` (key -> number) at ``step`` in one transaction; a repeated (key, step) replaces."""
        if not isinstance(values, Mapping):
            raise UsageError(f"values must be a mapping of key -> number, got {type(values).__name__}")
        self.log_rows(run_id, [(step, k, v) for k, v in values.items()])

    def log_rows(self, run_id: str, rows: Iterable[tuple[int, str, float]]) -> None:
        """Store many (step, key, value) rows in one transaction; a repeated (key, step) replaces (the last one of
        a batch wins).  Each row carries its checksum; the run's row count and the fencing check are one UPDATE."""
        _check_run_id(run_id)
        batch = []
        for row in rows:
            step, key, value = _scalar_row(*row)
            batch.append((run_id, step, key, value, scalar_checksum(run_id, step, key, value)))
        if not batch:
            return

        def insert(c: Conn) -> None:
            self._backend.lock_run(c, run_id)
            new = c.executemany("INSERT INTO scalars (run_id, step, key, value, checksum) VALUES (?, ?, ?, ?, ?) "
                                "ON CONFLICT DO NOTHING", batch).rowcount
            if new < len(batch):  # some (key, step) existed: replace them, in order
                c.executemany("UPDATE scalars SET value = ?, checksum = ? WHERE run_id = ? AND key = ? AND step = ?",
                              [(v, h, r, k, s) for r, s, k, v, h in batch])
            self._count(c, run_id, scalars=new)

        self._write_run(run_id, insert)

    def add_event(self, run_id: str, *, step: int, kind: str, payload: dict) -> None:
        """Record an event (e.g. ``kind="nonfinite"``) at ``step`` with a JSON-able payload."""
        _check_run_id(run_id)
        step = _check_step("step", step)
        _check_text("kind", kind)
        payload_json = _dumps("payload", payload)

        def insert(c: Conn) -> None:
            self._backend.lock_run(c, run_id)
            self._insert_event(c, run_id, step, kind, payload_json, time.time())
            self._count(c, run_id, events=1)

        self._write_run(run_id, insert)

    @staticmethod
    def _insert_event(c: Conn, rid: str, step: int, kind: str, payload: str, created_at: float) -> None:
        eid = c.execute("INSERT INTO events (run_id, step, kind, payload, created_at) VALUES (?, ?, ?, ?, ?) "
                        "RETURNING event_id", (rid, step, kind, payload, created_at)).fetchall()[0][0]
        c.execute("UPDATE events SET checksum = ? WHERE event_id = ?",
                  (event_checksum(eid, rid, step, kind, payload, created_at), eid))

    def _fetch_scalars(self, c: Conn, rid: str) -> list[tuple[str, int, float | None, int | None]]:
        return c.execute(f"SELECT key, step, value, {self._col('checksum')} FROM scalars WHERE run_id = ? "
                         "ORDER BY key, step", (rid,)).fetchall()

    def _fetch_events(self, c: Conn, rid: str) -> list[tuple[int, int, str, str, float, int | None]]:
        return c.execute(f"SELECT event_id, step, kind, payload, created_at, {self._col('checksum')} FROM events "
                         "WHERE run_id = ? ORDER BY step, event_id", (rid,)).fetchall()

    def _refuse(self, rid: str, problems: list[str]) -> None:
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise StoreCorrupt(f"run {rid} in {self.where} does not match its checksums: {shown}; "
                               f"{corrupt_hint(self.where)}")

    def scalars(self, run_id: str, *, verify: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """key -> (steps int64, values float64), steps ascending; NaN where NaN was logged.  With ``verify`` (the
        default) every row is checked against its checksum and the run's row count (``StoreCorrupt``)."""

        def fetch(c: Conn) -> tuple[str, list[Any], _Head | None]:
            rid = self._resolve(c, run_id)
            return rid, self._fetch_scalars(c, rid), (self._head(c, rid) if verify else None)

        rid, rows, head = self._read(fetch)
        if head is not None:
            self._refuse(rid, head.problems + _scalar_problems(rid, rows, head))
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, group in itertools.groupby(rows, key=lambda r: r[0]):
            items = list(group)
            out[key] = (np.array([r[1] for r in items], dtype=np.int64),
                        np.array([r[2] for r in items], dtype=np.float64))  # None (stored NaN) -> nan
        return out

    def events(self, run_id: str, kind: str | None = None, *, verify: bool = True) -> list[dict]:
        """Events in step order: ``{"step": int, "kind": str, "payload": dict}``, optionally of one kind only.
        With ``verify`` (the default) every event of the run is checked against its checksum and the count."""

        def fetch(c: Conn) -> tuple[str, list[Any], _Head | None]:
            rid = self._resolve(c, run_id)
            return rid, self._fetch_events(c, rid), (self._head(c, rid) if verify else None)

        rid, rows, head = self._read(fetch)
        if head is not None:
            self._refuse(rid, head.problems + _event_problems(rid, rows, head))
        return [{"step": s, "kind": k, "payload": _loads(f"run {rid}'s event {e} payload", p)}
                for e, s, k, p, _, _ in rows if kind is None or k == kind]

    def verify_run(self, run_id: str) -> RunCheck:
        """Check one run (its record, every scalar and event row, the row counts) against its checksums; never
        raises for what it finds (an unknown id still raises StoreError)."""

        try:
            rid, row, head, scalars, events = self._read(lambda c: self._fetch_run(c, run_id))
        except StoreCorrupt as e:
            return RunCheck(run_id=str(run_id), name=None, state="corrupt", problems=(str(e),))
        return self._judge_run(rid, row, head, scalars, events)

    def _fetch_run(self, c: Conn, run_id: str) -> tuple[str, Any, _Head, list[Any], list[Any]]:
        """Everything stored of one run, in one read: id, ``_runs_sql`` row, head, scalar rows, event rows."""
        rid = self._resolve(c, run_id)
        row = c.execute(self._runs_sql() + " WHERE r.run_id = ?", (rid,)).fetchone()
        return rid, row, self._head(c, rid), self._fetch_scalars(c, rid), self._fetch_events(c, rid)

    # -- copying runs between stores (``lowprec store copy``) ----------------------------------------------------

    def dump_run(self, run_id: str) -> RunDump:
        """Everything stored of one run (id or unique prefix), verified against its checksums (``StoreCorrupt``);
        a run written before the store had checksums is refused (seal it first: it could not be verified)."""
        rid, row, head, scalars, events = self._read(lambda c: self._fetch_run(c, run_id))
        verdict = self._judge_run(rid, row, head, scalars, events)
        if verdict.state == "corrupt":
            self._refuse(rid, list(verdict.problems))
        if verdict.state == "unverified":
            raise StoreError(f"run {rid} in {self.where} is {UNVERIFIED}: it cannot be verified, so it is not "
                             f"copied; `lowprec store check --seal --store {self.where}` seals it first")
        return RunDump(row=tuple(row[:12]), checksum=int(row[12]), scalars=tuple((s, k, v) for k, s, v, _ in scalars),
                       events=tuple((s, k, p, t) for _, s, k, p, t, _ in events))

    def load_run(self, dump: RunDump, *, replace: bool = False) -> None:
        """Store ``dump`` (from ``dump_run`` of any store) as it is, in one transaction: the same record and
        checksum, scalars and events (events get this store's ids, and checksums over them).  StoreError when the
        run id exists, unless ``replace`` (the stored run is deleted first, in the same transaction)."""
        rid = _check_run_id(dump.row[0])
        if run_checksum(dump.row) != dump.checksum:
            raise StoreCorrupt(f"run {rid}: its record does not match its checksum; not stored in {self.where}")
        scalars = [(rid, s, k, v, scalar_checksum(rid, s, k, v)) for s, k, v in dump.scalars]

        def load(c: Conn) -> None:
            if c.execute("SELECT 1 FROM runs WHERE run_id = ?", (rid,)).fetchone() is not None:
                if not replace:
                    raise StoreError(f"run {rid} already exists in {self.where}; pass --overwrite to replace it "
                                     "(or --skip-existing)")
                self._delete_rows(c, rid)
            if not self._insert_run(c, dump.row, dump.checksum, _new_attempt(), len(scalars), len(dump.events)):
                raise StoreError(f"run {rid} was created in {self.where} meanwhile; copy it again")  # pragma: no cover
            c.executemany("INSERT INTO scalars (run_id, step, key, value, checksum) VALUES (?, ?, ?, ?, ?)", scalars)
            for step, kind, payload, created in dump.events:
                self._insert_event(c, rid, step, kind, payload, created)

        with self._lock:
            self._write(load)
            self._claims.pop(rid, None)

    def _judge_run(self, rid: str, row: Sequence[Any], head: _Head, scalars: list[Any],
                   events: list[Any]) -> RunCheck:
        problems = self._record_problems(row) + head.problems
        problems += _scalar_problems(rid, scalars, head) + _event_problems(rid, events, head)
        for what, text in (("config", row[6]), ("manifest", row[7])):
            try:
                json.loads(text)
            except (TypeError, ValueError) as e:
                problems.append(f"its {what} is not valid JSON ({e})")
        n = len(scalars) + len(events)
        if problems:
            return RunCheck(run_id=rid, name=row[1], state="corrupt", problems=tuple(problems), rows=n)
        if not head.sealed:
            return RunCheck(run_id=rid, name=row[1], state="unverified", problems=(UNVERIFIED,), rows=n)
        return RunCheck(run_id=rid, name=row[1], state="ok", rows=n)

    # -- the whole store -----------------------------------------------------------------------------------------

    def check(self) -> StoreCheck:
        """``PRAGMA integrity_check`` and ``foreign_key_check``, then ``verify_run`` of every run and the checksum
        of every baseline.  What is found is reported, never raised (see ``StoreCheck.ok``)."""
        problems: list[str] = []

        try:
            problems.extend(self._read(self._backend.structure_problems))
        except StoreError as e:
            problems.append(str(e))
        runs: list[RunCheck] = []
        try:
            ids = self._read(lambda c: [(r[0], r[1]) for r in
                                        c.execute("SELECT run_id, rowid FROM runs ORDER BY created_at, rowid")])
        except StoreError as e:
            return StoreCheck(path=self.path or self.where, problems=(*problems, str(e)), backend=self.backend)
        for rid, rowid in ids:
            if not isinstance(rid, str) or not _RUN_ID.fullmatch(rid):
                runs.append(RunCheck(run_id=repr(rid), name=None, state="corrupt",
                                     problems=(f"invalid run id {rid!r} (row {rowid})",)))
                continue
            try:
                runs.append(self.verify_run(rid))
            except Exception as e:  # a damaged file can break any read: report it, never crash the check
                runs.append(RunCheck(run_id=rid, name=None, state="corrupt", problems=(f"{type(e).__name__}: {e}",)))
        return StoreCheck(path=self.path or self.where, problems=tuple(problems), runs=tuple(runs),
                          baselines=tuple(self._check_baselines()), backend=self.backend)

    def _check_baselines(self) -> list[BaselineCheck]:
        try:
            rows = self._read(lambda c: c.execute(f"SELECT name, payload, {self._col('checksum')} FROM baselines "
                                                  "ORDER BY name").fetchall())
        except StoreError as e:
            return [BaselineCheck(name="*", state="corrupt", problem=str(e))]
        out = []
        for name, payload, checksum in rows:
            problem = self._baseline_problem(name, payload, checksum)
            state: Literal["ok", "unverified", "corrupt"] = (
                "corrupt" if problem else "unverified" if checksum is None else "ok")
            out.append(BaselineCheck(name=str(name), state=state, problem=problem or (
                UNVERIFIED if checksum is None else None)))
        return out

    @staticmethod
    def _baseline_problem(name: Any, payload: Any, checksum: int | None) -> str | None:
        if checksum is not None:
            try:
                if baseline_checksum(name, payload) != checksum:
                    return "its payload does not match its checksum"
            except Exception:
                return "its row holds values of the wrong type"
        try:
            json.loads(payload)
        except (TypeError, ValueError) as e:
            return f"its payload is not valid JSON ({e})"
        return None

    def seal(self) -> tuple[int, int]:
        """Record checksums for every run and baseline written before the store had them (trusting what is stored
        now: check first); returns (runs sealed, baselines sealed)."""
        ids = self._read(lambda c: [r[0] for r in c.execute(
            "SELECT r.run_id FROM runs r LEFT JOIN run_heads h ON h.run_id = r.run_id "
            "WHERE h.run_id IS NULL AND r.checksum IS NULL")])
        for rid in ids:
            self._write(functools.partial(self._seal, rid=rid))

        def baselines(c: Conn) -> int:
            rows = c.execute("SELECT name, payload FROM baselines WHERE checksum IS NULL").fetchall()
            c.executemany("UPDATE baselines SET checksum = ? WHERE name = ?",
                          [(baseline_checksum(n, p), n) for n, p in rows])
            return len(rows)

        return len(ids), self._write(baselines)

    # -- baselines -----------------------------------------------------------------------------------------------

    def save_baseline(self, name: str, payload: dict, *, overwrite: bool = False) -> None:
        """Store a baseline's JSON-able dict under ``name``; StoreError if it exists and not ``overwrite``."""
        _check_text("baseline name", name)
        payload_json = _dumps("baseline payload", payload)
        checksum = baseline_checksum(name, payload_json)

        def save(c: Conn) -> None:
            now = time.time()
            if c.execute("INSERT INTO baselines (name, payload, created_at, updated_at, checksum) VALUES "
                         "(?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", (name, payload_json, now, now, checksum)).rowcount:
                return
            if overwrite:
                c.execute("UPDATE baselines SET payload = ?, updated_at = ?, checksum = ? WHERE name = ?",
                          (payload_json, now, checksum, name))
            else:
                raise StoreError(f"baseline {name!r} already exists in {self.where}; pass overwrite=True "
                                 "(--overwrite) to replace it, or choose another name")

        self._write(save)

    def get_baseline(self, name: str, *, verify: bool = True) -> dict:
        """The baseline dict stored under ``name``; StoreError naming the known baselines when missing, and
        ``StoreCorrupt`` when ``verify`` finds that it does not match its checksum."""

        def get(c: Conn) -> tuple[str, int | None]:
            row = c.execute(f"SELECT payload, {self._col('checksum')} FROM baselines WHERE name = ?",
                            (name,)).fetchone()
            if row is None:
                known = [r[0] for r in c.execute("SELECT name FROM baselines ORDER BY name")]
                hint = f"known baselines: {', '.join(known)}" if known else "no baselines are saved there yet"
                raise StoreError(f"no baseline named {name!r} in {self.where}; {hint}")
            return row[0], row[1]

        payload, checksum = self._read(get)
        problem = self._baseline_problem(name, payload, checksum) if verify else None
        if problem:
            raise StoreCorrupt(f"baseline {name!r} in {self.where}: {problem}; {corrupt_hint(self.where)}")
        return dict(_loads(f"baseline {name!r}", payload))

    def delete_baseline(self, name: str) -> None:
        """Delete the baseline ``name`` (its seed runs stay); StoreError naming the known baselines when missing."""

        def delete(c: Conn) -> None:
            if c.execute("DELETE FROM baselines WHERE name = ?", (name,)).rowcount == 0:
                known = [r[0] for r in c.execute("SELECT name FROM baselines ORDER BY name")]
                hint = f"known baselines: {', '.join(known)}" if known else "no baselines are saved there yet"
                raise StoreError(f"no baseline named {name!r} in {self.where}; {hint}")

        self._write(delete)

    def list_baselines(self) -> list[str]:
        """Names of the stored baselines, sorted."""
        return self._read(lambda c: [r[0] for r in c.execute("SELECT name FROM baselines ORDER BY name")])


def _reopen(location: str, synchronous: Literal["full", "normal"], create: bool = True,
            files_dir: str | None = None) -> RunStore:
    return RunStore(location, synchronous=synchronous, create=create, files_dir=files_dir)
