"""A throwaway PostgreSQL server for the PostgreSQL run-store tests (and for ``.ci/run``).

``postgres_url()``: ``$LOWPREC_TEST_POSTGRES`` when set (a server someone else runs), else a server started here
from the PostgreSQL binaries (``pg_ctl`` on PATH or ``/usr/lib/postgresql/*/bin``) in a fresh temporary folder,
listening only on a Unix socket in it (no port to collide with, nothing reachable from outside), trusted local
connections, stopped at exit; else None (the tests skip, or fail under ``LOWPREC_REQUIRE_POSTGRES=1``).  initdb
refuses to run as root, so as root the server runs as the ``postgres`` user that Debian's package creates.

As a script (``python tests/_postgres.py start DIR`` / ``stop DIR``) it starts a server in DIR and prints its URL,
or stops it: ``.ci/run`` starts one for the whole test run that way.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATABASE = "lowprec"


def binaries() -> Path | None:
    """The folder holding initdb and pg_ctl, or None."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    return Path(folders[-1]) if folders else None


def _as_server_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}): {done.stderr.strip()}")


def start(folder: Path) -> str:
    """Start a server with its data and socket in ``folder`` (created; as root, its parents must be open to the
    ``postgres`` user, as ``/tmp`` is); returns the URL of its database ``lowprec``."""
    bin_dir = binaries()
    if bin_dir is None:
        raise RuntimeError("no PostgreSQL binaries found (apt-get install postgresql)")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        folder.chmod(0o755)
    options = f"-c listen_addresses='' -c unix_socket_directories={folder} -c fsync=off -c max_connections=200"
    _run(_as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "lowprec", "--auth=trust", "--no-sync",
                          "-E", "UTF8", "--locale=C"]))
    _run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-o", options,
                          "-w", "start"]))
    _run([str(bin_dir / "createdb"), "-h", str(folder), "-U", "lowprec", DATABASE])
    return f"postgresql://lowprec@/{DATABASE}?host={folder}"


def stop(folder: Path) -> None:
    bin_dir = binaries()
    if bin_dir is not None and (folder / "data" / "postmaster.pid").exists():
        subprocess.run(_as_server_user([str(bin_dir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate",
                                        "stop"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


_started: list[str] = []


def postgres_url() -> str | None:
    """The server the tests use (see the module docstring); started once per process, stopped at exit."""
    if os.environ.get("LOWPREC_TEST_POSTGRES"):
        return os.environ["LOWPREC_TEST_POSTGRES"]
    if not _started and binaries() is not None:
        folder = Path(tempfile.mkdtemp(prefix="lowprec-pg-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        atexit.register(stop, folder)  # runs first: atexit is last-in first-out
        _started.append(start(folder))
    return _started[0] if _started else None


def unavailable() -> str | None:
    """None when the tests can use PostgreSQL, else why not."""
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install 'lowprec[postgresql]')"
    if not os.environ.get("LOWPREC_TEST_POSTGRES") and binaries() is None:
        return "no PostgreSQL server: set LOWPREC_TEST_POSTGRES=postgresql://... or apt-get install postgresql"
    return None


@contextlib.contextmanager
def raw(store: Any) -> Iterator[Any]:
    """A direct connection to a ``RunStore``'s database, bypassing every lowprec rule, committed at exit: tests
    damage or inspect stores through it.  ``execute`` takes ``?`` placeholders for either backend."""
    if store.path is not None:
        con = sqlite3.connect(store.path)
        try:
            with con:
                yield con
        finally:
            con.close()
        return
    import psycopg

    from lowprec.runs._store_pg import Connection

    with psycopg.connect(store.location, autocommit=True) as conn:
        yield Connection(conn)


def fresh_database(url: str) -> str:
    """A new, empty database on the server of ``url`` (each test gets its own store); returns its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    head, sep, query = url.partition("?")
    return head.rsplit("/", 1)[0] + f"/{name}" + sep + query


def drop_database(server: str, url: str) -> None:
    """Drop the database of ``url`` (made by ``fresh_database``), closing what is still connected to it."""
    import psycopg

    name = url.partition("?")[0].rsplit("/", 1)[1]
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


if __name__ == "__main__":
    action, where = sys.argv[1], Path(sys.argv[2])
    if action == "start":
        print(start(where))
    else:
        stop(where)
