"""What the run store's two backends share: its errors, the messages that name the fix, and the migration driver.

``RunStore`` (``_store``) holds every rule of the store (validation, checksums, fencing, counts) and talks to one
*backend*: ``_store_sqlite.SQLiteBackend`` (a file) or ``_store_pg.PostgresBackend`` (a server).  A backend opens
a connection, runs a function inside one transaction (retrying what the database asks to retry, translating its
errors into ``StoreError``), takes a run's row lock where the database needs one, and reports structural damage.
Both speak the same SQL to ``RunStore``: ``?`` placeholders, the same tables and columns (``runs.rowid`` orders
runs created in the same instant), ``INSERT ... ON CONFLICT DO NOTHING`` and ``RETURNING``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, TypeVar

from .._errors import UsageError

T = TypeVar("T")

Conn = Any
"""A backend's connection: ``sqlite3.Connection``, or ``_store_pg.Connection`` (the same ``execute`` /
``executemany`` with ``?`` placeholders, returning a cursor with ``fetchone``, ``fetchall``, ``rowcount``)."""
Transaction = bool | Literal["read"]
"""True: a write transaction; "read": one consistent snapshot; False: no transaction."""

BUSY_TIMEOUT_MS = 5_000  # one wait inside the database for a lock ...
WRITE_DEADLINE_S = 120.0  # ... retried with back-off until this deadline


class StoreError(UsageError):
    """The run store cannot do what was asked: unreadable/corrupt file, unwritable path, unknown run id, ..."""


class StoreCorrupt(StoreError):
    """What is stored does not match its checksums (or SQLite finds the file malformed): refused, never misread."""


class RunTakenOver(StoreError):
    """Another attempt now owns the run (it was resumed, or marked finished, elsewhere): this writer must stop."""


class NoSuchRun(StoreError):
    """A row referenced a run that is not stored (a foreign key failed); ``RunStore`` names the known runs."""


class Backend(Protocol):
    name: str  # "SQLite" or "PostgreSQL"
    where: str  # what messages name: the file, or the URL without its password
    read_only: str | None  # None, or why nothing can be written
    schema: int  # the schema version read (below the latest only for a read-only SQLite store)
    error: type[Exception]  # the driver's base error

    def connect(self, migrations: Sequence[tuple[str, ...]]) -> Conn: ...

    def transact(self, conn: Conn, fn: Callable[[Conn], T], *, transaction: Transaction) -> T: ...

    def lock_run(self, c: Conn, run_id: str) -> None: ...

    def structure_problems(self, c: Conn) -> list[str]: ...

    def usable(self, conn: Conn) -> bool: ...

    def close(self, conn: Conn) -> None: ...


def cannot_write(where: str, why: str) -> str:
    return f"cannot write the run store at {where}: {why}; pass --store PATH or fix permissions"


def not_a_store(where: str, why: str) -> str:
    return f"{where} is not a lowprec run store ({why}); move it away or pass --store"


def missing(where: str, why: str = "the file does not exist") -> str:
    return (f"no run store at {where} ({why}): check --store, $LOWPREC_STORE or the config's "
            "`store`; `lowprec run` and `lowprec baseline` create a store, reading commands do not")


def corrupt_hint(where: str) -> str:
    import shlex

    return (f"the store was changed outside lowprec or is damaged; `lowprec store check --store {shlex.quote(where)}` "
            "lists what is wrong")


def schema_version(c: Conn, tables: set[str], where: str, latest: int, *, kind: str) -> int:
    """The store's schema version (0: an empty database) from its ``tables``; StoreError for a database that
    holds other tables (``kind`` names it in the message), or one written by a newer lowprec."""
    if "schema_version" not in tables:
        if tables:
            raise StoreError(not_a_store(where, f"it is {kind} with other tables"))
        return 0
    v = c.execute("SELECT MAX(version) FROM schema_version").fetchone()[0]
    if v is not None and v > latest:
        raise StoreError(f"the run store at {where} was written by a newer lowprec (schema version {v}; "
                         f"this lowprec reads up to version {latest}); upgrade lowprec (pip install -U lowprec) "
                         "to read it")
    return int(v or 0)


def apply_migrations(c: Conn, current: int, migrations: Sequence[tuple[str, ...]], version_table: str) -> None:
    """``migrations[current:]`` in order, each recorded in ``schema_version`` (created by ``version_table``), inside
    the caller's transaction: all of them or none."""
    c.execute(version_table)
    for v in range(current, len(migrations)):
        for statement in migrations[v]:
            c.execute(statement)
        c.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (v + 1, time.time()))


def back_off(delay: float) -> float:
    """Sleep ``delay`` and return the next one (doubling, at most 0.1 s)."""
    time.sleep(delay)
    return min(2 * delay, 0.1)
