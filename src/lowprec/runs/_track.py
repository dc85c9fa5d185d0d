"""``track``: record a run from your own training loop in the run store, so the accuracy judge can see it.

``lowprec run`` trains configs it knows; ``track`` is for every other loop (plain PyTorch, a Lightning or HF
Trainer, JAX, anything).  It writes the same records the runner writes: a run with a config and a manifest
(versions, hardware, git commit, seed, metric directions, data hash, framework, recipe hash, ``source = "track"``),
per-step scalars (``train/loss``, ``eval/<metric>``) and events, and marks the run completed on a normal exit and
failed (with the exception's text) when the block raises.  ``lowprec baseline --from-runs`` and ``lowprec compare``
then treat tracked runs exactly like runner-made ones.

Batched writes.  One SQLite transaction per ``log()`` call would cost ~0.1-1 ms, 1-10% of a 10 ms step.  So
``log()`` only validates and appends to a list; the rows are written in one transaction every ``flush_every``
distinct steps or ``flush_seconds`` seconds (whichever comes first, checked at each ``log``), at ``flush()`` and
when the block exits.  A process that is killed therefore loses at most the rows since the last flush (one batch);
the run itself is recorded at once, with the writing process's host, pid and start time, so a killed process's run
is shown as failed ("process <pid> ended without finishing the run": the store's dead-process rule).

Distributed.  Under torchrun (``RANK`` in the environment) or an initialised ``torch.distributed`` process group,
only rank 0 writes; every other rank gets a ``TrackedRun`` that checks its input the same way and writes nothing.

This module does not import torch: values are converted with ``float()``, which takes Python and NumPy numbers and
0-d (one-element) tensors alike; ``torch.distributed`` is consulted only when torch is already imported.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .._errors import UsageError
from .._types import DIRECTIONS
from .._version import __version__
from ._manifest import cpu_model, git_state
from ._store import RunStore

__all__ = ["TrackedRun", "track"]

FLUSH_EVERY = 50
"""Default: write the buffered rows at least every this many distinct logged steps ..."""
FLUSH_SECONDS = 5.0
"""... and at least every this many seconds (checked at each ``log``)."""


def _number(key: str, value: Any, step: int) -> float:
    """``value`` as a float (NaN and infinities kept: the judge fails divergence on them); UsageError otherwise."""
    if type(value) is float or type(value) is int:
        return float(value)
    if not isinstance(value, (str, bytes, bool)) and value is not None:
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            pass
    shape = getattr(value, "shape", None)
    what = f"a {type(value).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else f" ({value!r})")
    raise UsageError(f"log: value of {key!r} at step {step} must be a number (a float, an int, a NumPy scalar or a "
                     f"one-element tensor such as loss.detach()); got {what}")


def _check_step(step: Any, where: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) and not hasattr(step, "__index__"):
        raise UsageError(f"{where}: step must be an integer >= 0 (the training step), got {step!r}")
    s = int(step)
    if s < 0:
        raise UsageError(f"{where}: step must be an integer >= 0 (the training step), got {step!r}")
    return s


class TrackedRun:
    """The handle ``track`` yields: ``log``, ``log_eval``, ``event``, ``flush``.

    On rank 0 (or a single process) it writes to ``store``; on other ranks ``store`` is None and nothing is
    written (``run_id`` is None there), but every input is checked alike, so a bad call fails on every rank."""

    def __init__(self, store: RunStore | None, run_id: str | None, *, metrics: Mapping[str, str],
                 flush_every: int = FLUSH_EVERY, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.store = store
        self.run_id = run_id
        """The stored run's id (12 hex characters), or None on a rank that does not write."""
        self.metrics = dict(metrics)
        self._flush_every = flush_every
        self._flush_seconds = flush_seconds
        self._rows: list[tuple[int, str, float]] = []
        self._events: list[tuple[int, str, dict]] = []
        self._last: dict[str, int] = {}  # key -> last logged step (steps must increase per key)
        self._steps_buffered = 0
        self._buffered_step = -1
        self._last_flush = time.monotonic()
        self._closed = False

    @property
    def writes(self) -> bool:
        """True on the process that records the run (rank 0), False on the others."""
        return self.store is not None

    @property
    def last_step(self) -> int:
        """The largest step logged so far (0 before any)."""
        return max(self._last.values(), default=0)

    def log(self, values: Mapping[str, Any], step: int) -> None:
        """Record ``values`` (key -> number) at ``step``, e.g. ``run.log({"train/loss": loss}, step=step)``.

        Each key's steps must increase (a key logged twice at one step, or at an earlier step, is a UsageError).
        A value is a Python/NumPy number or a one-element tensor; NaN and infinities are stored as they are (the
        judge FAILs a run whose loss is not finite).  ``float()`` of a GPU tensor waits for the GPU: log
        ``loss.detach()`` every step if that is cheap for you, or ``.item()`` values you already synchronised."""
        if self._closed:
            raise UsageError("log: the run has ended (its `with track(...)` block exited); log inside the block")
        if not isinstance(values, Mapping):
            raise UsageError(f"log: values must be a dict of key -> number, e.g. {{'train/loss': 0.5}}; got "
                             f"{type(values).__name__}")
        s = step if type(step) is int and step >= 0 else _check_step(step, "log")
        last = self._last
        rows = []
        for key, value in values.items():
            if type(key) is not str or not key:
                raise UsageError(f"log: keys must be non-empty strings such as 'train/loss'; got {key!r}")
            prev = last.get(key, -1)
            if s <= prev:
                raise UsageError(f"log: {key!r} was already logged at step {prev}; step {s} must be greater (each "
                                 f"key's steps must increase: pass step=<the training step>, once per key)")
            rows.append((s, key, _number(key, value, s)))
        for s_, key, _ in rows:
            last[key] = s_
        self._rows.extend(rows)
        if s != self._buffered_step:
            self._buffered_step = s
            self._steps_buffered += 1
        if self._steps_buffered >= self._flush_every or time.monotonic() - self._last_flush >= self._flush_seconds:
            self.flush()

    def log_eval(self, values: Mapping[str, Any], step: int) -> None:
        """Record eval metrics (stored as ``eval/<metric>``) at ``step``; every name must be one of the ``metrics``
        declared to ``track`` (their directions are what the judge compares).  The judge reads each metric's value
        at the last training step as the run's final value."""
        if not isinstance(values, Mapping):
            raise UsageError(f"log_eval: values must be a dict of metric -> number, e.g. {{'loss': 0.3}}; got "
                             f"{type(values).__name__}")
        unknown = [m for m in values if m not in self.metrics]
        if unknown:
            raise UsageError(f"log_eval: metric(s) {unknown} are not declared; track(metrics=...) names "
                             f"{sorted(self.metrics)}: add them there with 'min' or 'max', or fix the name "
                             f"(without 'eval/')")
        self.log({f"eval/{m}": v for m, v in values.items()}, step)

    def event(self, kind: str, payload: Mapping[str, Any] | None = None, *, step: int | None = None) -> None:
        """Record an event (``kind`` a short name, ``payload`` a JSON-able dict) at ``step`` (default: the last
        logged step).  Kinds "nonfinite" and "diverged" make the judge FAIL the run's divergence check."""
        if self._closed:
            raise UsageError("event: the run has ended (its `with track(...)` block exited); record events inside it")
        if not isinstance(kind, str) or not kind.strip():
            raise UsageError(f"event: kind must be a non-empty string such as 'note'; got {kind!r}")
        body = {} if payload is None else payload
        if not isinstance(body, Mapping):
            raise UsageError(f"event: payload must be a dict (or None); got {type(body).__name__}")
        try:
            json.dumps(body)
        except (TypeError, ValueError) as e:
            raise UsageError(f"event: payload of {kind!r} must be JSON-serialisable (dict, list, str, int, float, "
                             f"bool, None): {e}") from e
        s = self.last_step if step is None else _check_step(step, "event")
        self._events.append((s, kind, dict(body)))

    def flush(self) -> None:
        """Write the buffered rows and events now (one transaction for the rows)."""
        rows, events = self._rows, self._events
        self._rows, self._events = [], []
        self._steps_buffered = 0
        self._buffered_step = -1
        self._last_flush = time.monotonic()
        if self.store is None or self.run_id is None:
            return
        if rows:
            self.store.log_rows(self.run_id, rows)
        for s, kind, payload in events:
            self.store.add_event(self.run_id, step=s, kind=kind, payload=payload)

    def _finish(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self.store is None or self.run_id is None:
            return
        if exc is None:
            self.flush()
            self.store.finish_run(self.run_id, status="completed")
            return
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        try:
            self.flush()
        except Exception as e:  # the run is still marked failed, with both reasons
            error += f" (and its last rows could not be written: {e})"
        self.store.finish_run(self.run_id, status="failed", error=error)


def _rank() -> tuple[int, int]:
    """(rank, world size): from an initialised torch.distributed group when torch is imported, else torchrun's
    RANK / WORLD_SIZE environment, else (0, 1)."""
    if "torch" in sys.modules:
        dist = getattr(sys.modules["torch"], "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        raise UsageError(f"RANK / WORLD_SIZE in the environment must be integers (torchrun sets them); got "
                         f"{os.environ.get('RANK')!r} / {os.environ.get('WORLD_SIZE')!r}") from None


def _recipe_hash(recipe: Any, config: Mapping[str, Any]) -> str:
    if recipe is not None:
        from ..recipes import get as get_recipe  # torch-free

        return get_recipe(recipe).hash()
    if config.get("recipe") is None:
        return "none"
    return hashlib.sha256(json.dumps(config["recipe"], sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_track_manifest(*, seed: int, metrics: Mapping[str, str], data_hash: str, recipe_hash: str,
                         framework: str, device: str, world_size: int) -> dict[str, Any]:
    """The manifest of a tracked run: the keys ``build_manifest`` writes for runner-made runs (versions, hardware,
    host, git), plus ``framework``, ``world_size`` and ``source = "track"``; torch's version, threads and GPU only
    when torch is imported."""
    torch = sys.modules.get("torch")
    versions: dict[str, Any] = {"lowprec": __version__, "python": platform.python_version()}
    if "numpy" in sys.modules:
        versions["numpy"] = sys.modules["numpy"].__version__
    gpu = None
    if torch is not None:
        versions["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    return {
        "seed": seed,
        "recipe_hash": recipe_hash,
        "data_hash": data_hash,
        "data_source": "user" if data_hash != "none" else "none",
        "metrics": dict(metrics),
        "versions": versions,
        "hardware": {"cpu": cpu_model(), "gpu": gpu, "device": device,
                     "torch_threads": torch.get_num_threads() if torch is not None else None},
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "executable": sys.executable},
        "git": git_state(),
        "framework": framework,
        "world_size": world_size,
        "source": "track",
    }


def _check_inputs(*, name: Any, group: Any, seed: Any, config: Any, metrics: Any, data_hash: Any, framework: Any,
                  device: Any, flush_every: Any, flush_seconds: Any) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"track: seed must be an integer >= 0 (the run's random seed); got {seed!r}")
    if not isinstance(config, Mapping):
        raise UsageError(f"track: config must be a dict of the run's settings, e.g. {{'model': 'my-mlp', "
                         f"'steps': 300, 'lr': 1e-3}}; got {type(config).__name__}")
    model = config.get("model")
    if not isinstance(model, str) or not model.strip():
        raise UsageError(f"track: config['model'] must name the model (a non-empty string such as 'my-mlp': the "
                         f"judge compares only runs of one model); got {model!r}")
    steps = config.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise UsageError(f"track: config['steps'] must be the planned number of training steps (an integer >= 1) "
                         f"or left out; got {steps!r}")
    if not isinstance(metrics, Mapping) or not metrics:
        raise UsageError(f"track: metrics must map each eval metric to 'min' or 'max' (which is better), e.g. "
                         f"{{'loss': 'min', 'accuracy': 'max'}}; got {metrics!r}")
    for m, d in metrics.items():
        if not isinstance(m, str) or not m.strip() or m.startswith("eval/"):
            raise UsageError(f"track: metrics keys are metric names without 'eval/' (e.g. 'accuracy'); got {m!r}")
        if d not in DIRECTIONS:
            raise UsageError(f"track: metrics[{m!r}] must be 'min' (lower is better) or 'max' (higher is better); "
                             f"got {d!r}")
    for field, value, optional in (("name", name, True), ("group", group, True), ("data_hash", data_hash, True),
                                   ("framework", framework, False), ("device", device, False)):
        if not (optional and value is None) and (not isinstance(value, str) or not value.strip()):
            raise UsageError(f"track: {field} must be a non-empty string{' or None' if optional else ''}; got "
                             f"{value!r}")
    if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
        raise UsageError(f"track: flush_every must be an integer >= 1 (steps between writes); got {flush_every!r}")
    if isinstance(flush_seconds, bool) or not isinstance(flush_seconds, int | float) or not (
            math.isfinite(flush_seconds) and flush_seconds > 0):
        raise UsageError(f"track: flush_seconds must be a number > 0 (seconds between writes); got "
                         f"{flush_seconds!r}")


@contextmanager
def track(*, store: str | os.PathLike[str] | RunStore, seed: int, config: Mapping[str, Any],
          metrics: Mapping[str, str], name: str | None = None, group: str | None = None,
          data_hash: str | None = None, recipe: Any = None, framework: str = "torch", device: str = "cpu",
          flush_every: int = FLUSH_EVERY, flush_seconds: float = FLUSH_SECONDS) -> Iterator[TrackedRun]:
    """Record one run (one seed of one experiment) of your own training loop in ``store``.

    ``store``: a ``RunStore`` or the path of one (created when missing).  ``seed``: the run's seed; runs of one
    ``group`` differ only in the seed.  ``config``: the run's settings as JSON-able data; ``config["model"]``
    names the model (the judge compares runs of one model), ``config["steps"]`` the planned steps (else the last
    logged ``train/loss`` step).  ``metrics``: eval metric -> "min" | "max".  ``name``: a label (default
    ``"<group or model> seed <seed>"``).  ``data_hash``: a digest of your data set (runs with different ones are
    not compared), or None ("none").  ``recipe``: the lowprec ``Recipe`` (or its name) your loop used; its hash is
    recorded (else a digest of ``config["recipe"]``, else "none").  ``framework`` / ``device``: recorded in the
    manifest.  ``flush_every`` / ``flush_seconds``: write batched rows at least that often (see the module
    docstring: a killed process loses at most one batch).

    Yields a ``TrackedRun``.  On a normal exit the rows are flushed and the run is marked "completed"; when the
    block raises, "failed" with the exception's text (the exception propagates).  Under torchrun only rank 0
    writes."""
    _check_inputs(name=name, group=group, seed=seed, config=config, metrics=metrics, data_hash=data_hash,
                  framework=framework, device=device, flush_every=flush_every, flush_seconds=flush_seconds)
    cfg = dict(config)
    try:
        json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise UsageError(f"track: config must be JSON-serialisable (dict, list, str, int, finite float, bool, "
                         f"None): {e}") from e
    label = name or f"{group or cfg['model']} seed {seed}"
    rank, world = _rank()
    if rank != 0:
        run = TrackedRun(None, None, metrics=metrics, flush_every=flush_every, flush_seconds=flush_seconds)
        try:
            yield run
        finally:
            run._finish(None)
        return
    manifest = build_track_manifest(seed=seed, metrics=metrics, data_hash=data_hash or "none",
                                    recipe_hash=_recipe_hash(recipe, cfg), framework=framework, device=device,
                                    world_size=world)
    own = not isinstance(store, RunStore)
    st = RunStore(store) if not isinstance(store, RunStore) else store
    try:
        rid = st.create_run(name=label, config=cfg, manifest=manifest, group=group)
        run = TrackedRun(st, rid, metrics=metrics, flush_every=flush_every, flush_seconds=flush_seconds)
        try:
            yield run
        except BaseException as e:
            run._finish(e)
            raise
        run._finish(None)
    finally:
        if own:
            st.close()
