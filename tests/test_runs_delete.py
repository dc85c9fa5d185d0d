"""The way out of duplicate seeds (issue 15, section 3): the error naming the clashing runs, ``--latest``, ``lowprec
runs delete`` and ``lowprec baselines delete``.  Oracles: the run ids this test created (which run is older), the
file system (checkpoint folders, launch configs) and ``store check``."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from lowprec.accuracy._workflow import select_runs
from lowprec.cli import main
from lowprec.runs._checkpoint import checkpoint_dir
from lowprec.runs._store import RunStore

STEPS = 30
GROUP = "mlp-digits fp32"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-seed baseline, and seed 10 run twice (the same command twice) plus seed 11 once in one group."""
    d = tmp_path_factory.mktemp("dup")
    (d / "c.toml").write_text(f'model = "mlp-digits"\nsteps = {STEPS}\nthreads = 1\n'
                              "[checkpoint]\ninterval = 10\n")
    store = str(d / "runs.db")
    assert main(["baseline", str(d / "c.toml"), "--name", "ref", "--seeds", "2", "--store", store, "--quiet"]) == 0
    for seeds in (["10"], ["10", "11"]):
        assert main(["run", str(d / "c.toml"), "--seeds", *seeds, "--store", store, "--quiet"]) == 0
    return d


def _ids(d: Path) -> tuple[str, str, str]:
    """(older seed-10 run, newer seed-10 run, seed-11 run)."""
    with RunStore(d / "runs.db") as s:
        runs = sorted(s.list_runs(group=GROUP), key=lambda r: r.created_at)
    ten = [r.run_id for r in runs if r.manifest["seed"] == 10]
    (eleven,) = [r.run_id for r in runs if r.manifest["seed"] == 11]
    assert len(ten) == 2
    return ten[0], ten[1], eleven


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_duplicate_seeds_error_names_each_run_and_the_fix(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new, _ = _ids(workdir)
    store = str(workdir / "runs.db")
    rc, out, err = _main(capsys, "compare", "--baseline", "ref", GROUP, "--store", store)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"group '{GROUP}' has 2 runs of seed 10: {old} (created 20" in err
    assert f"{new} (created 20" in err and err.count(", completed)") == 2
    assert "lowprec runs delete RUN_ID..." in err and "--latest" in err and "share seed" not in err
    with RunStore(store) as s, pytest.raises(ValueError, match="has 2 runs of seed 10"):
        select_runs(s, [GROUP])


def test_latest_judges_the_newest_completed_run_of_each_seed(workdir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    old, new, eleven = _ids(workdir)
    store = str(workdir / "runs.db")
    for cmd in (["compare", "--json"], ["report", "--out", str(workdir / "r.html")]):
        rc, out, err = _main(capsys, *cmd, "--baseline", "ref", GROUP, "--latest", "--store", store)
        assert rc in (0, 1, 3), err
        assert f"--latest: left out run {old} (created" in err and f"judged from run {new}" in err
    with RunStore(store) as s:
        left: list[str] = []
        assert sorted(r.run_id for r in select_runs(s, [GROUP], latest=True, left_out=left)) == sorted([new, eleven])
        assert len(left) == 1
        # a failed newer run does not replace the completed one
        s.finish_run(new, status="failed", error="test")
        assert sorted(r.run_id for r in select_runs(s, [GROUP], latest=True)) == sorted([old, eleven])
        s._write(lambda c: s._rewrite_run(c, new, status="completed", error=None))  # as it was


def test_baseline_from_runs_latest_names_what_it_left_out(workdir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``baseline --from-runs GROUP --latest`` builds from the newest run of seed 10 and says on stderr which run it
    dropped, as compare does; without --latest the clash is the usage error."""
    old, new, eleven = _ids(workdir)
    store = str(workdir / "runs.db")
    rc, out, err = _main(capsys, "baseline", "--from-runs", GROUP, "--name", "from-dup", "--store", store)
    assert rc == 2 and "has 2 runs of seed 10" in err and "--latest" in err
    rc, out, err = _main(capsys, "baseline", "--from-runs", GROUP, "--name", "from-dup", "--latest", "--store", store)
    assert rc == 0, err
    assert f"--latest: left out run {old} (created" in err and f"judged from run {new}" in err
    assert "2 seeds [10, 11]" in out
    with RunStore(store) as s:
        assert sorted(e["run_id"] for e in s.get_baseline("from-dup")["seeds"]) == sorted([new, eleven])
        s.delete_baseline("from-dup")


def test_runs_delete_asks_refuses_and_deletes(workdir: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    old, new, eleven = _ids(workdir)
    store = str(workdir / "runs.db")
    ckpt = checkpoint_dir(store, old)
    launch = workdir / "launch" / f"{old}.json"
    launch.parent.mkdir(exist_ok=True)
    launch.write_text("{}")
    assert ckpt.is_dir()
    # stdin not a terminal, no --yes: refused, nothing deleted
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, out, err = _main(capsys, "runs", "delete", old[:6], "--store", store)
    assert rc == 2 and "pass --yes" in err and "would delete 1 run(s)" in out and str(ckpt) in out
    with RunStore(store) as s:
        assert s.get_run(old).run_id == old
    # a terminal: asked, answered no
    tty = io.StringIO("n\n")
    tty.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stdin", tty)
    rc, out, _ = _main(capsys, "runs", "delete", old, "--store", store)
    assert rc == 1 and "nothing deleted" in out and ckpt.is_dir()
    # a seed run of a baseline: refused, naming it, unless --force
    with RunStore(store) as s:
        base_run = s.list_runs(group="baseline/ref")[0].run_id
    rc, _, err = _main(capsys, "runs", "delete", base_run, "--yes", "--store", store)
    assert rc == 2 and "seed run of baseline 'ref'" in err and "--force" in err
    # deleted: rows, checkpoint folder, launch config; the store stays clean and the group is judged again
    rc, out, err = _main(capsys, "runs", "delete", old, "--yes", "--store", store)
    assert rc == 0 and f"deleted run {old}" in out, err
    assert not ckpt.exists() and not launch.exists() and checkpoint_dir(store, new).is_dir()
    with RunStore(store) as s:
        assert sorted(r.run_id for r in s.list_runs(group=GROUP)) == sorted([new, eleven])
        check = s.check()
        assert check.ok and all(r.state == "ok" for r in check.runs), check.lines()
    rc, _, err = _main(capsys, "compare", "--baseline", "ref", GROUP, "--store", store)
    assert rc in (0, 1, 3), err


def test_runs_delete_refuses_a_live_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with RunStore(tmp_path / "runs.db") as s:  # created by this (live) process, still running
        rid = s.create_run(name="live", config={}, manifest={})
    rc, _, err = _main(capsys, "runs", "delete", rid, "--yes", "--force", "--store", str(tmp_path / "runs.db"))
    assert rc == 2 and f"run {rid} (live) is running (process" in err and "stop it first" in err
    with RunStore(tmp_path / "runs.db") as s:
        assert s.get_run(rid).status == "running"


def test_baselines_delete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "runs.db")
    with RunStore(store) as s:
        s.save_baseline("b", {"seeds": [{"run_id": "0123456789ab"}]})
    rc, out, _ = _main(capsys, "baselines", "delete", "b", "--store", store)
    assert rc == 0 and "deleted baseline 'b'" in out
    rc, _, err = _main(capsys, "baselines", "delete", "b", "--store", store)
    assert rc == 2 and "no baseline named 'b'" in err
