"""A run config may call only declared task builders (issue 14, item 5).

Oracles: the file system (a file that ``logging.basicConfig(filename=..., filemode="w")`` would truncate keeps its
bytes, a marker file that a called function would write does not appear), the error message's definition (it
names the ``model`` field and the fix), and ``importlib.metadata`` reading a real ``*.dist-info`` directory put
on ``sys.path`` for the entry-point group ``lowprec.tasks``.
"""

from __future__ import annotations

import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lowprec.cli import main
from lowprec.runs import zoo
from lowprec.runs._config import RunConfig
from lowprec.runs._runner import build_task
from lowprec.runs._store import RunStore
from lowprec.runs.zoo import get_task, load_entry_point

ROOT = Path(__file__).resolve().parents[1]
REFUSED = r"model = '{spec}': .* is not declared a lowprec task.*decorate it with @lowprec\.runs\.zoo\.task"

# Functions that nobody declared a task (this module does not use lowprec's declarations at all).
PLAIN_MODULE = """
    import pathlib

    from lowprec.runs import zoo


    def undeclared(*, seed, batch_size=None, marker=""):
        pathlib.Path(marker).write_text("called")
        return zoo.get_task("mlp-digits", seed=seed, batch_size=batch_size)


    def by_entry_point(*, seed, batch_size=None, hidden=8):
        return zoo.get_task("mlp-digits", seed=seed, batch_size=batch_size, hidden=hidden)


    class _Sneaky:
        def __getattr__(self, name):
            return True

        def __call__(self, **kwargs):
            pathlib.Path(kwargs["marker"]).write_text("called")


    sneaky = _Sneaky()
"""

DECLARED_MODULE = """
    from lowprec.runs import zoo


    @zoo.task
    def declared(*, seed, batch_size=None, hidden=8):
        return zoo.get_task("mlp-digits", seed=seed, batch_size=batch_size, hidden=hidden)
"""


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> Iterator[str]:
    """An importable throw-away module ``name`` in ``tmp_path`` (put on sys.path); removed from sys.modules
    afterwards so that each test imports it afresh."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture
def plain_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from _module(tmp_path, monkeypatch, "registry_plain_tasks", PLAIN_MODULE)


@pytest.fixture
def declared_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from _module(tmp_path, monkeypatch, "registry_declared_tasks", DECLARED_MODULE)


def _same_weights(a: zoo.Task, b: zoo.Task) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_logging_basicconfig_is_refused_and_no_file_is_touched(tmp_path: Path) -> None:
    """The reported attack: basicConfig(filename=..., filemode="w", force=True) opens (truncates) the file."""
    victim, fresh = tmp_path / "precious.txt", tmp_path / "new.log"
    victim.write_text("keep me")
    handlers = list(logging.getLogger().handlers)
    spec = "logging:basicConfig"
    for path in (victim, fresh):
        options = {"filename": str(path), "filemode": "w", "force": True}
        with pytest.raises(ValueError, match=REFUSED.format(spec=spec)):
            get_task(spec, seed=0, **options)
        with pytest.raises(ValueError, match=REFUSED.format(spec=spec)):
            build_task(RunConfig(model=spec, model_options=options), 0)
    assert victim.read_text() == "keep me" and not fresh.exists()
    assert logging.getLogger().handlers == handlers


def test_os_system_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(ValueError, match=REFUSED.format(spec="os:system")):
        get_task("os:system", seed=0, command=f"touch {marker}")
    assert not marker.exists()


def test_an_undeclared_function_is_refused_before_it_is_called(plain_module: str, tmp_path: Path) -> None:
    marker = tmp_path / "called"
    for attr in ("undeclared", "sneaky"):  # sneaky: a __getattr__ that answers True to everything is no declaration
        spec = f"{plain_module}:{attr}"
        with pytest.raises(ValueError, match=REFUSED.format(spec=spec)) as e:
            get_task(spec, seed=0, marker=str(marker))
        assert "'lowprec.tasks' entry-point group" in str(e.value)
        with pytest.raises(ValueError, match=REFUSED.format(spec=spec)):
            load_entry_point(spec)
    assert not marker.exists()


def test_a_stored_config_naming_an_undeclared_function_is_refused_on_resume(
        plain_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run planted in a store (as a hostile or old store would hold it): resuming it must not call the function.

    Checked at the two layers: the task built from the stored config, and ``lowprec run --resume`` itself."""
    marker = tmp_path / "called"
    db = tmp_path / "runs.db"
    cfg = RunConfig(model=f"{plain_module}:undeclared", model_options={"marker": str(marker)}, steps=4,
                    store=str(db))
    with RunStore(db) as store:
        rid = store.create_run(name="planted", config=cfg.to_dict(), manifest={"seed": 0})
        store.finish_run(rid, status="failed", error="planted")  # resumable: not running, not completed
        stored = RunConfig.from_dict(store.get_run(rid).config, where="stored config")
    with pytest.raises(ValueError, match=REFUSED.format(spec=cfg.model)):
        build_task(stored, 0)
    assert main(["run", "--resume", rid, "--store", str(db), "--quiet"]) == 2
    assert re.search(REFUSED.format(spec=cfg.model), capsys.readouterr().err)
    assert not marker.exists()


def test_a_declared_function_builds_its_task(declared_module: str) -> None:
    # Oracle: the declared builder returns the built-in task with the same options.
    t = get_task(f"{declared_module}:declared", seed=2, hidden=4)
    assert _same_weights(t, get_task("mlp-digits", seed=2, hidden=4))
    assert zoo.is_task(load_entry_point(f"{declared_module}:declared"))
    assert _same_weights(build_task(RunConfig(model=f"{declared_module}:declared", model_options={"hidden": 4}), 2), t)
    with pytest.raises(ValueError, match="has no option 'width'; its options are: hidden"):
        get_task(f"{declared_module}:declared", seed=0, width=3)


def test_the_decorator_marks_and_may_register_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowprec.runs.zoo import _declare

    monkeypatch.setattr(_declare, "_NAMED", {})

    def plain(*, seed: int, batch_size: int | None = None) -> zoo.Task:
        return get_task("synthetic-regression", seed=seed, batch_size=batch_size)

    assert not zoo.is_task(plain)
    assert zoo.task(plain) is plain and zoo.is_task(plain) and plain.__lowprec_task__ is True  # type: ignore[attr-defined]

    @zoo.task(name="registry-test-task")
    def named(*, seed: int, batch_size: int | None = None) -> zoo.Task:
        return get_task("synthetic-regression", seed=seed, batch_size=batch_size)

    assert zoo.is_task(named)
    assert get_task("registry-test-task", seed=1).data_hash == get_task("synthetic-regression", seed=1).data_hash
    with pytest.raises(ValueError, match="declared tasks: registry-test-task"):
        get_task("registry-test-tusk", seed=0)
    with pytest.raises(ValueError, match="'mlp-digits' is a built-in task"):
        zoo.task(name="mlp-digits")(plain)
    with pytest.raises(ValueError, match="no colon"):
        zoo.task(name="a:b")(plain)
    with pytest.raises(ValueError, match="already registered"):
        zoo.task(name="registry-test-task")(plain)
    with pytest.raises(TypeError, match="takes no attributes"):
        zoo.task(len)


@pytest.fixture
def installed_entry_point(tmp_path: Path, plain_module: str) -> str:
    """A distribution ``lowprec-registry-test`` 'installed' on sys.path: a real ``.dist-info`` directory, next to
    ``plain_module`` in ``tmp_path`` (which that fixture put on sys.path), whose ``entry_points.txt`` declares
    ``registry-ep-task = registry_plain_tasks:by_entry_point`` (a function without the decorator)."""
    info = tmp_path / "lowprec_registry_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lowprec-registry-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[lowprec.tasks]\nregistry-ep-task = {plain_module}:by_entry_point\n")
    return "registry-ep-task"


def test_an_entry_point_declares_a_task_by_name(installed_entry_point: str, plain_module: str) -> None:
    assert installed_entry_point in zoo.entry_point_names()
    t = get_task(installed_entry_point, seed=3, hidden=4)
    assert _same_weights(t, get_task("mlp-digits", seed=3, hidden=4))
    # its target may also be named as module:function, although it carries no decorator
    assert _same_weights(get_task(f"{plain_module}:by_entry_point", seed=3, hidden=4), t)
    assert _same_weights(build_task(RunConfig(model=installed_entry_point, model_options={"hidden": 4}), 3), t)
    with pytest.raises(ValueError, match=f"unknown task 'registry-ep-tusk'.*declared tasks: .*{installed_entry_point}"):
        get_task("registry-ep-tusk", seed=0)


def test_without_the_entry_point_the_same_function_is_refused(plain_module: str) -> None:
    # Oracle: the control for the test above; no distribution declares by_entry_point here.
    spec = f"{plain_module}:by_entry_point"
    with pytest.raises(ValueError, match=REFUSED.format(spec=spec)):
        get_task(spec, seed=0)
    with pytest.raises(ValueError, match="unknown task 'registry-ep-task'"):
        get_task("registry-ep-task", seed=0)


def test_the_documented_custom_task_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: the python example of docs/runs.md, saved as the module ``mypkg.tasks`` it says it is."""
    text = (ROOT / "docs" / "runs.md").read_text()
    (block,) = re.findall(r"```python\n(# mypkg/tasks\.py\n.*?)```", text, flags=re.S)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tasks.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        t = build_task(RunConfig.from_toml('model = "mypkg.tasks:make"\n[model_options]\nhidden = 16\n'), 0)
        assert _same_weights(t, get_task("mlp-digits", seed=0, hidden=16))
    finally:
        for name in ("mypkg.tasks", "mypkg"):
            sys.modules.pop(name, None)
