"""The accuracy workflow's command line as a new user meets it (issue 15, section 5), on real short zoo runs.

Oracles: the run store (what was trained, with which recipe and seeds, and that nothing was trained when a check
must fail first), the file system, the process table of a subprocess (``sys.modules``: no torch for the commands
that only read the store), and real signals sent to a real ``lowprec run``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowprec import recipes
from lowprec.accuracy._baseline import Baseline
from lowprec.cli import main
from lowprec.runs._config import RunConfig
from lowprec.runs._store import RunStore

SRC = Path(__file__).resolve().parents[1] / "src"
STEPS = 6


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse
        rc = int(e.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _git(d: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=d, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A git checkout (one commit) holding a store: baselines 'ref' (--seeds 2: seeds 0, 1) and 'pair' (--seeds 4 7),
    fp32 candidates (seeds 10, 11) and a run with per-layer statistics and a what-if spec (seed 3)."""
    d = tmp_path_factory.mktemp("wf")
    _git(d, "init", "-q")
    (d / "README").write_text("x")
    _git(d, "add", "README")
    _git(d, "commit", "-q", "-m", "init")
    (d / "c.toml").write_text(f'model = "mlp-digits"\nsteps = {STEPS}\nthreads = 1\n[schedule]\nwarmup_steps = 2\n')
    (d / "s.toml").write_text(f'model = "mlp-digits"\nsteps = {STEPS}\nthreads = 1\nname = "stats"\n'
                              '[schedule]\nwarmup_steps = 2\n[stats]\nevery = 2\nwhat_if = {m4 = "mxfp4"}\n')
    # 2-6 steps do not train the model: these plumbing tests declare that a flat, short reference is expected
    (d / "flat.toml").write_text("min_loss_drop = 0\nmin_judged_steps = 1\n")
    store = str(d / "runs.db")
    cwd = os.getcwd()
    os.chdir(d)  # the manifest's git state is that of the working directory
    try:
        for args in (["baseline", "c.toml", "--name", "ref", "--seeds", "2", "--criteria", "flat.toml"],
                     ["baseline", "c.toml", "--name", "pair", "--seeds", "4", "7", "--criteria", "flat.toml"],
                     ["run", "c.toml", "--seeds", "10", "11"],
                     ["run", "s.toml", "--seeds", "3"]):
            assert main([*args, "--store", store, "--quiet"]) == 0, args
    finally:
        os.chdir(cwd)
    yield d


def _runs(store: str | Path) -> list:
    with RunStore(store) as s:
        return s.list_runs()


# -- 8. baseline --seeds: a count or the seeds --------------------------------------------------------------------

def test_baseline_seeds_one_value_is_a_count_two_or_more_are_the_seeds(work: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored baselines' seeds and the seeds of their runs.  Before the change ``--seeds 4 7`` was an
    argparse error (exit 2)."""
    with RunStore(work / "runs.db") as s:
        assert Baseline.from_dict(s.get_baseline("ref")).seeds == (0, 1)
        assert Baseline.from_dict(s.get_baseline("pair")).seeds == (4, 7)
        assert sorted(r.manifest["seed"] for r in s.list_runs(group="baseline/pair")) == [4, 7]
    rc, out, _ = _main(capsys, "baseline", "--help")
    assert rc == 0 and "one value N: N seeds, 0..N-1" in " ".join(out.split()), out
    rc, _, err = _main(capsys, "baseline", str(work / "c.toml"), "--name", "x", "--seeds", "3", "3",
                       "--store", str(work / "runs.db"))
    assert rc == 2 and "seeds must be distinct" in err, err


# -- 1. --recipe FILE ---------------------------------------------------------------------------------------------

def test_run_and_baseline_take_a_recipe_file(work: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored run's recipe equals the recipe written to the file: TOML (``recipes --show``, what
    ``autoprecision --out`` writes), JSON, and a run config with a [recipe] table (``autoprecision
    --config-out``).  Before the change each was 'unknown recipe'."""
    store = str(tmp_path / "runs.db")
    (tmp_path / "r.toml").write_text(recipes.get("mxfp8").to_toml())
    (tmp_path / "r.json").write_text(recipes.get("bf16-sr").to_json())
    cfg_out = RunConfig(model="mlp-digits", recipe=recipes.get("fp8-rowwise")).to_dict()
    from lowprec.recipes._serial import dict_to_toml

    (tmp_path / "run.toml").write_text(dict_to_toml({"model": "mlp-digits", "recipe": cfg_out["recipe"]}))
    for file, name in (("r.toml", "mxfp8"), ("r.json", "bf16-sr"), ("run.toml", "fp8-rowwise")):
        rc, out, err = _main(capsys, "run", str(work / "c.toml"), "--recipe", str(tmp_path / file), "--seeds", "1",
                             "--steps", "2", "--store", store, "--quiet")
        assert rc == 0, err
        (newest, *_) = _runs(store)
        assert RunConfig.from_dict(newest.config).recipe == recipes.get(name), file
    rc, _, err = _main(capsys, "baseline", str(work / "c.toml"), "--name", "mx", "--recipe", str(tmp_path / "r.toml"),
                       "--steps", "2", "--store", store, "--quiet", "--seeds", "2",
                       "--criteria", str(work / "flat.toml"))
    assert rc == 0, err
    with RunStore(store) as s:
        assert all(RunConfig.from_dict(r.config).recipe == recipes.get("mxfp8")
                   for r in s.list_runs(group="baseline/mx"))
    for ref, needle in ((str(tmp_path / "nope.toml"), "no such recipe file"),
                        ("fp99", "neither a recipe name")):
        rc, _, err = _main(capsys, "run", str(work / "c.toml"), "--recipe", ref, "--store", store)
        assert rc == 2 and needle in err, err
    (tmp_path / "bad.toml").write_text('name = "x"\nseed = -1\n')
    rc, _, err = _main(capsys, "run", str(work / "c.toml"), "--recipe", str(tmp_path / "bad.toml"), "--store", store)
    assert rc == 2 and "bad.toml" in err and "Recipe.seed" in err, err


# -- 2. checks before work ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("criteria, needle", [
    ('metrics = ["nope"]\n', "criteria.metrics names ['nope']"),
    ('[metric_margins]\naccurcy = 0.01\n', "criteria.metric_margins names ['accurcy']"),
])
def test_baseline_criteria_naming_an_unknown_metric_fail_before_training(tmp_path: Path, work: Path, criteria: str,
                                                                         needle: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the store (no run was trained) and the message (the field, the task's metrics, the fix).  Before the
    change the metrics case trained both seeds first, and a mistyped metric_margins key was accepted."""
    (tmp_path / "crit.toml").write_text(criteria)
    store = tmp_path / "runs.db"
    rc, _, err = _main(capsys, "baseline", str(work / "c.toml"), "--name", "b", "--criteria",
                       str(tmp_path / "crit.toml"), "--store", str(store), "--quiet")
    assert rc == 2 and needle in err and "['accuracy', 'loss']" in err and "fix the criteria file" in err, err
    assert not store.exists() or _runs(store) == []


def test_autoprecision_infeasible_budget_fails_before_calibrating(tmp_path: Path, work: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: mxfp4's bits per element (4 + 8/32 = 4.25, the cheapest default candidate) and the file system: the
    store is not even created.  Before the change a calibration run was trained first."""
    store = tmp_path / "runs.db"
    rc, _, err = _main(capsys, "autoprecision", str(work / "c.toml"), "--budget-bits", "3", "--store", str(store),
                       "--quiet")
    assert rc == 2 and "budget_bits=3.0 is below the cheapest mix" in err and "at least 4.25" in err, err
    assert not store.exists()
    from lowprec.numerics._autoprecision import check_budget, min_bits_per_element

    assert min_bits_per_element("mxfp4") == 4.25 and min_bits_per_element("nvfp4") == 4.5
    assert min_bits_per_element("bf16") == 16 and min_bits_per_element(None) == 32
    check_budget(4.25, ["mxfp4", "bf16"])  # the bound itself is feasible


def test_stats_what_if_must_name_a_what_if_of_the_run(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the run's [stats] what_if table ({m4 = "mxfp4"}).  Before the change an unknown name printed an empty
    table with exit 0."""
    (rec,) = [r for r in _runs(work / "runs.db") if r.name == "stats seed 3"]
    rc, _, err = _main(capsys, "stats", rec.run_id, "--what-if", "nope", "--store", str(work / "runs.db"))
    assert rc == 2 and "--what-if 'nope'" in err and "m4" in err, err
    rc, out, err = _main(capsys, "stats", rec.run_id, "--what-if", "m4", "-n", "2", "--store", str(work / "runs.db"))
    assert rc == 0 and "under what-if 'm4'" in out and len(out.splitlines()) == 4, (out, err)


def test_run_command_line_steps_are_checked_like_the_config(work: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: MAX_STEPS and the config's warmup_steps (2): --steps 1 would leave the run in warm-up.  Before the
    change both trained (1e15 steps: for ever, hence a subprocess with a timeout)."""
    rc, _, err = _main(capsys, "run", str(work / "c.toml"), "--steps", "1", "--store", str(tmp_path / "runs.db"))
    assert rc == 2 and err.startswith("lowprec: error: command line:") and "warmup_steps = 2 is more than steps = 1" \
        in err, err
    r = subprocess.run([sys.executable, "-m", "lowprec.cli", "run", str(work / "c.toml"), "--steps",
                        "1000000000000000", "--store", str(tmp_path / "runs.db"), "--quiet"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=120)
    assert r.returncode == 2 and "command line: steps must be at most 1_000_000_000" in r.stderr, r.stderr
    assert not (tmp_path / "runs.db").exists() or _runs(tmp_path / "runs.db") == []


# -- 5. runs show / runs list -------------------------------------------------------------------------------------

def test_runs_show_has_config_git_and_summarises_stats(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored record (its config read back from the printed TOML is the stored config; the git commit
    is the fixture checkout's HEAD) and the number of stats keys.  Before the change there was no config or git
    line and every stats key had a line of its own."""
    store = str(work / "runs.db")
    (rec,) = [r for r in _runs(store) if r.name == "stats seed 3"]
    with RunStore(store) as s:
        stats_keys = [k for k in s.scalars(rec.run_id) if k.startswith("stats/")]
    assert len(stats_keys) > 50
    rc, out, _ = _main(capsys, "runs", "show", rec.run_id[:6], "--store", store)
    lines = out.splitlines()
    assert rc == 0 and len(lines) < 30, out
    assert any(ln.startswith("  config   ") and "steps=6" in ln for ln in lines), out
    assert f"  git      {_git(work, 'rev-parse', 'HEAD')} (clean)" in lines, out
    assert f"{len(stats_keys)} per-layer statistic keys" in out and "--all" in out
    assert not any(ln.strip().startswith("stats/") for ln in lines)
    rc, out, _ = _main(capsys, "runs", "show", rec.run_id, "--all", "--store", store)
    assert rc == 0 and sum(ln.strip().startswith("stats/") for ln in out.splitlines()) == len(stats_keys)
    rc, out, _ = _main(capsys, "runs", "show", rec.run_id, "--config", "--store", store)
    assert rc == 0 and RunConfig.from_toml(out) == RunConfig.from_dict(rec.config)


def test_runs_list_has_created_framework_recipe_and_group_in_120_columns(work: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored records.  Before the change the list had neither date, framework, recipe nor group."""
    rc, out, _ = _main(capsys, "runs", "list", "--store", str(work / "runs.db"))
    header, *rows = out.splitlines()
    assert rc == 0 and header.split()[:5] == ["id", "status", "steps", "created", "fw"], header
    assert "recipe" in header and "group, seed" in header
    assert all(len(line) <= 120 for line in out.splitlines()), out
    recs = _runs(work / "runs.db")
    assert [r.split()[0] for r in rows] == [r.run_id for r in recs]
    for row, rec in zip(rows, recs, strict=True):
        assert time.strftime("%m-%d %H:%M", time.localtime(rec.created_at)) in row
        assert f"{rec.group} seed {rec.manifest['seed']}" in row and " torch fp32  " in row, row


# -- 3. Ctrl-C and SIGTERM print the resume command ---------------------------------------------------------------

_SLOW_TASK = '''
import time
from pathlib import Path

from lowprec.runs import zoo


@zoo.task
def slow_from(*, seed, batch_size=None, first_slow_seed=1, marker=""):
    """mlp-digits; from seed ``first_slow_seed`` on each batch takes 30 ms, and ``marker`` appears at batch 3."""
    import dataclasses

    task = zoo.get_task("mlp-digits", seed=seed, batch_size=batch_size)

    def batch(s):
        if seed >= first_slow_seed:
            if s == 3:
                Path(marker).write_text(str(seed))
            time.sleep(0.03)
        return task.train_batch(s)

    return dataclasses.replace(task, train_batch=batch)
'''


# SIGTERM (the same resume path through another signal) runs in make test-slow: each case is a full subprocess run
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow)])
def test_an_interrupted_run_prints_the_command_that_resumes_it(tmp_path: Path, sig: int, code: int) -> None:
    """Oracle: the store, and a real signal to a real ``lowprec run`` of two seeds: seed 0 completes, seed 1 is
    interrupted; the last line names seed 1's run (the failed one, not the completed one), with --store since the
    store is not the default, and that command completes the run.  Before the change only 'lowprec: interrupted'
    was printed."""
    (tmp_path / "slowtask.py").write_text(_SLOW_TASK)
    marker = tmp_path / "started"
    (tmp_path / "c.toml").write_text(f'model = "slowtask:slow_from"\nsteps = 60\nthreads = 1\n'
                                     f'[model_options]\nmarker = "{marker}"\n[checkpoint]\ninterval = 2\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(tmp_path)]), OMP_NUM_THREADS="1")
    store = tmp_path / "st" / "runs.db"
    cmd = [sys.executable, "-m", "lowprec.cli", "run", "c.toml", "--seeds", "0", "1", "--store", str(store),
           "--quiet"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists() and marker.read_text() == "1", proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    with RunStore(store) as s:
        (done,) = s.list_runs(status="completed")
        (failed,) = s.list_runs(status="failed")
    assert (done.manifest["seed"], failed.manifest["seed"]) == (0, 1)
    last = err.strip().splitlines()[-1]
    assert last == (f"lowprec: the run is marked failed; continue it with: lowprec run --resume {failed.run_id} "
                    f"--store {store}"), err
    command = last.split("continue it with: ", 1)[1].split()
    assert command[:4] == ["lowprec", "run", "--resume", failed.run_id]
    if sig != signal.SIGINT:
        return  # the command is the same; running it once is enough
    r = subprocess.run([sys.executable, "-m", "lowprec.cli", *command[1:], "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"resumed run {failed.run_id}: completed" in r.stdout, r.stderr


# -- 7. the commands that only read the store do not import torch -------------------------------------------------

_NO_TORCH = '''
import contextlib, io, json, sys
from lowprec import cli

out = {}
for args in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = cli.main(args)
    heavy = sorted(m for m in ("torch", "jax") if m in sys.modules)
    out[" ".join(args[:2])] = [rc, heavy, err.getvalue()[-300:]]
print(json.dumps(out))
'''


def _modules_after(commands: list[list[str]]) -> dict[str, list]:
    """``{command: [exit status, heavy modules loaded so far, stderr tail]}`` from one fresh interpreter."""
    r = subprocess.run([sys.executable, "-c", _NO_TORCH, json.dumps(commands)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=300)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_commands_that_only_read_the_store_do_not_import_torch(work: Path, tmp_path: Path) -> None:
    """Oracle: ``sys.modules`` of a fresh interpreter after each command (the first one to load torch or jax is
    named).  Before the change ``compare`` and ``plan`` loaded torch (through the runner, imported by the workflow
    module), 5-6 s of a 6 s command.  (``report``: the next test.)"""
    store = str(work / "runs.db")
    rid = next(r.run_id for r in _runs(store) if r.name.endswith("seed 10"))
    st = ["--store", store]
    commands = [["runs", "list", *st], ["runs", "show", rid, *st], ["runs", "export", rid, *st],
                ["runs", "export", rid, "--format", "json", "--out", str(tmp_path / "r.json"), *st],
                ["baselines", "list", *st], ["baselines", "export", "ref", str(tmp_path / "b.json"), *st],
                ["baselines", "import", str(tmp_path / "b.json"), "--name", "copy", "--overwrite", *st],
                ["compare", "--baseline", "ref", "mlp-digits fp32", *st],
                ["plan", "--baseline", "ref", *st], ["store", "check", *st]]
    result = _modules_after(commands)
    assert len(result) == len({" ".join(c[:2]) for c in commands})
    for name, (rc, heavy, err) in result.items():
        assert rc in (0, 3), (name, rc, err)  # compare: INCONCLUSIVE (3) with two seeds each is expected
        assert heavy == [], f"{name} imported {heavy}"
    assert (tmp_path / "r.json").is_file()


def test_report_does_not_import_torch(work: Path, tmp_path: Path) -> None:
    """Oracle: as above, for ``report`` of runs without per-layer statistics."""
    store = str(work / "runs.db")
    result = _modules_after([["report", "--baseline", "ref", "mlp-digits fp32", "--out", str(tmp_path / "r.html"),
                              "--store", store]])
    ((rc, heavy, err),) = result.values()
    assert rc == 0, err
    assert heavy == [], f"report imported {heavy}"


# -- 6. the first JAX step says it compiles -----------------------------------------------------------------------

def test_jax_run_announces_the_first_step_compilation_once(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: stderr of a JAX run of two seeds: the compile line once (the second seed reuses the compiled step),
    before the first progress line."""
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    from lowprec.runs import _jax_runner

    compiled_before = bool(_jax_runner._ANNOUNCED)  # another test of this process may have compiled a JAX step
    (tmp_path / "j.toml").write_text('model = "mlp-digits"\nframework = "jax"\nsteps = 2\nthreads = 1\n'
                                     '[schedule]\nwarmup_steps = 0\n')
    rc, _, err = _main(capsys, "run", str(tmp_path / "j.toml"), "--seeds", "0", "1", "--store",
                       str(tmp_path / "runs.db"))
    assert rc == 0, err
    lines = err.splitlines()
    notes = [i for i, ln in enumerate(lines) if ln.endswith("compiling the JAX step (first step)...")]
    assert len(notes) == 1 or (compiled_before and not notes), err  # the second seed reuses the compiled step
    if notes:
        assert "seed 0" in lines[notes[0]], err
        assert notes[0] < min(i for i, ln in enumerate(lines) if "/2 " in ln), err
