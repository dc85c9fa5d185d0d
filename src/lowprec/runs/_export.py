"""Export one stored run to CSV, JSON, TensorBoard event files or an MLflow tracking store.

CSV is **wide**: one row per step, a ``step`` column first and then one column per scalar key (keys sorted), a cell
left empty where that key was not logged at that step (eval metrics appear only every ``eval_interval`` steps).
Wide form loads straight into a spreadsheet or ``pandas.read_csv`` as one column per curve.  Values are written as
Python's shortest round-trip repr (``float(cell)`` gives back the stored float64 exactly); NaN and infinities as
``nan``, ``inf``, ``-inf``, which both ``float()`` and pandas read back.

JSON holds the ``RunRecord`` fields, then ``scalars`` (key -> ``{"steps": [...], "values": [...]}``) and
``events`` (``[{"step", "kind", "payload"}]``), under ``"format": "lowprec-run"`` and a ``format_version``.  It is
strict JSON (RFC 8259 has no NaN), so non-finite floats anywhere in it are written as the strings ``"nan"``,
``"inf"``, ``"-inf"``; ``float()`` reads them back.

Files are written atomically (temporary file in the same directory, fsync, ``os.replace``): a reader never sees a
half-written export, and a failed export leaves the previous file untouched.

TensorBoard export writes real event files with ``torch.utils.tensorboard.SummaryWriter`` (one ``add_scalar`` per
stored value, stored as float32 by the event format), plus the config, manifest and events as text summaries.

MLflow export (``export_mlflow``) writes one MLflow run with MLflow's own client: every scalar as a metric value
(float64, bit for bit), the judge's manifest keys as params, the config, manifest and events as JSON artifacts;
``lowprec.runs.import_run(..., fmt="mlflow")`` reads it back.

Every export reads through the store's verified reads: a run whose stored values do not match their checksums is
refused (``StoreCorrupt``), never exported.  The run id becomes a directory name under ``logdir``; the store
refuses ids that are not 12 lowercase hex characters, and ``run_dir`` checks again that the directory it builds is
inside ``logdir`` (a planted id such as ``../..`` or ``/abs/path`` cannot make an export write elsewhere).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Literal, TextIO

from .._checks import literal_values
from .._errors import UsageError
from ._atomic import atomic_write_bytes, atomic_write_text
from ._store import _RUN_ID, RunRecord, RunStore

__all__ = ["atomic_write_bytes", "atomic_write_text", "export_mlflow", "export_run", "export_tensorboard", "run_dir",
           "run_to_dict"]

ExportFormat = Literal["csv", "json"]
"""What ``export_run`` writes (TensorBoard and MLflow have their own exporters)."""
FORMATS = literal_values(ExportFormat)
FORMAT_VERSION = 1


def _finite_or_str(x: Any) -> Any:
    """Replace non-finite floats (at any depth) by "nan" / "inf" / "-inf" so the result is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _finite_or_str(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite_or_str(v) for v in x]
    return x


def run_to_dict(store: RunStore, run_id: str) -> dict[str, Any]:
    """The JSON export of one run as a dict (strict-JSON-able: non-finite floats are strings)."""
    rec: RunRecord = store.get_run(run_id)
    scalars = {key: {"steps": [int(s) for s in steps], "values": [float(v) for v in values]}
               for key, (steps, values) in sorted(store.scalars(rec.run_id).items())}
    out = {"format": "lowprec-run", "format_version": FORMAT_VERSION, "run_id": rec.run_id, "name": rec.name,
           "group": rec.group, "status": rec.status, "created_at": rec.created_at, "finished_at": rec.finished_at,
           "config": rec.config, "manifest": rec.manifest, "error": rec.error, "scalars": scalars,
           "events": store.events(rec.run_id)}
    return dict(_finite_or_str(out))


def _wide_csv(store: RunStore, run_id: str) -> str:
    scalars = store.scalars(run_id)
    keys = sorted(scalars)
    table: dict[int, dict[str, float]] = {}
    for key in keys:
        steps, values = scalars[key]
        for s, v in zip(steps.tolist(), values.tolist(), strict=True):
            table.setdefault(s, {})[key] = v
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["step", *keys])
    for step in sorted(table):
        row = table[step]
        writer.writerow([step, *(repr(row[k]) if k in row else "" for k in keys)])
    return buf.getvalue()


def export_run(store: RunStore, run_id: str, *, fmt: ExportFormat,
               out: str | os.PathLike[str] | TextIO) -> Path | None:
    """Write run ``run_id`` (id or unique prefix) as ``fmt`` to ``out``: a path (written atomically; returned) or an
    open text stream (written, not closed; returns None).  See the module docstring for both layouts."""
    if fmt not in FORMATS:
        raise UsageError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if fmt == "csv":
        text = _wide_csv(store, store.get_run(run_id).run_id)
    else:
        text = json.dumps(run_to_dict(store, run_id), allow_nan=False) + "\n"  # compact: one line
    if hasattr(out, "write"):
        out.write(text)  # type: ignore[union-attr]
        return None
    if not isinstance(out, str | os.PathLike):
        raise UsageError(f"out must be a file path or a text stream, got {type(out).__name__}")
    return atomic_write_text(out, text)


def _summary_writer() -> type:
    try:
        with warnings.catch_warnings():  # third-party import: keep its warnings out of the caller's filters
            warnings.simplefilter("ignore")
            from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UsageError("TensorBoard export needs the tensorboard package: pip install tensorboard "
                         f"(or pip install 'lowprec[tensorboard]'); import failed with: {e}") from e
    return SummaryWriter  # type: ignore[no-any-return]


def run_dir(base: str | os.PathLike[str], run_id: str) -> Path:
    """``base/<run_id>``, refused (ValueError) unless ``run_id`` is a run id (12 lowercase hex characters) and
    the result, with every symlink resolved, lies inside ``base``: defence in depth behind the store's own check."""
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"refusing to build a directory for run id {run_id!r}: a run id is 12 lowercase hex "
                         "characters")
    root = Path(base)
    path = root / run_id
    if not path.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"refusing to write {path}: it resolves to {path.resolve()}, outside {root.resolve()}")
    return path


def export_tensorboard(store: RunStore, run_id: str, logdir: str | os.PathLike[str], *,
                       overwrite: bool = False) -> Path:
    """Write run ``run_id`` as TensorBoard event files under ``logdir/<run_id>/``; returns the event file's path
    (``tensorboard --logdir LOGDIR`` takes ``logdir``, not that file; ``lowprec runs export`` defaults to ``tb``).

    Every stored scalar becomes ``add_scalar(key, value, step)`` (TensorBoard keeps float32), all stamped with the
    run's creation time (the store keeps no per-value wall time, so re-exports are reproducible).  The config,
    manifest and events go in as JSON text summaries.  A directory that already holds event files is refused
    unless ``overwrite`` (which deletes those files first): two exports of one run would otherwise be shown as
    duplicated curves.  Point TensorBoard at ``logdir`` to see several exported runs side by side.
    """
    SummaryWriter = _summary_writer()
    rec = store.get_run(run_id)
    out_dir = run_dir(logdir, rec.run_id)
    scalars, events = store.scalars(rec.run_id), store.events(rec.run_id)  # verified before anything is written
    old = sorted(out_dir.glob("events.out.tfevents.*")) if out_dir.is_dir() else []
    if old and not overwrite:
        raise UsageError(f"{out_dir} already holds TensorBoard event files ({old[0].name}, ...) of an earlier export "
                         "of this run: replace them (lowprec runs export --overwrite; overwrite=True in Python) or "
                         "export to another logdir (--out)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in old:
            f.unlink()
    except OSError as e:
        raise UsageError(f"cannot write TensorBoard files in {out_dir}: {e.strerror or e}") from e
    writer = SummaryWriter(log_dir=str(out_dir))
    try:
        t = rec.created_at
        for key, (steps, values) in sorted(scalars.items()):
            for s, v in zip(steps.tolist(), values.tolist(), strict=True):
                writer.add_scalar(key, v, global_step=s, walltime=t)
        for tag, obj in (("config", rec.config), ("manifest", rec.manifest), ("events", events)):
            text = json.dumps(_finite_or_str(obj), indent=2, sort_keys=True)
            writer.add_text(tag, "    " + text.replace("\n", "\n    "), global_step=0, walltime=t)  # markdown code
    finally:
        writer.close()
    (event_file,) = out_dir.glob("events.out.tfevents.*")  # the old ones were deleted above
    return event_file


_MLFLOW_STATUS = {"completed": "FINISHED", "diverged": "FAILED", "failed": "FAILED", "running": "RUNNING"}
_MLFLOW_KEY = re.compile(r"[\w\-. /:]+")


def export_mlflow(store: RunStore, run_id: str, tracking_uri: str | os.PathLike[str], *,
                  experiment: str = "lowprec") -> str:
    """Write run ``run_id`` as an MLflow run in experiment ``experiment`` (created when missing) of the tracking
    store ``tracking_uri`` (a folder or ``file:`` URI is MLflow's file store); returns the MLflow run id.

    Every stored scalar becomes a metric value at its step (MLflow keeps float64: values arrive bit for bit),
    stamped with the run's creation time; params ``seed``, ``model``, ``steps``, ``data_hash``, ``recipe_hash``,
    ``framework`` and ``lowprec.metrics`` (the directions, JSON) carry what ``import_run`` reads back; tags
    ``lowprec.run_id``, ``lowprec.group``, ``lowprec.status``, and the config, manifest and events as JSON
    artifacts under ``lowprec/``.  A key MLflow refuses (characters outside letters, digits, ``_-. /:``) is left
    out and listed in the tag ``lowprec.skipped_keys``."""
    from ._import import _mlflow_client

    client, _ = _mlflow_client(str(tracking_uri))
    from mlflow.entities import Metric, Param, RunTag

    rec = store.get_run(run_id)
    scalars, events = store.scalars(rec.run_id), store.events(rec.run_id)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    t_ms = int(rec.created_at * 1000)
    skipped = sorted(k for k in scalars if not _MLFLOW_KEY.fullmatch(k) or os.path.normpath(k) != k)
    m = rec.manifest
    params = {"seed": m.get("seed"), "model": rec.config.get("model"), "steps": rec.config.get("steps"),
              "data_hash": m.get("data_hash"), "recipe_hash": m.get("recipe_hash"), "framework": m.get("framework"),
              "lowprec.metrics": json.dumps(m.get("metrics") or {}, sort_keys=True)}
    tags = {"lowprec.run_id": rec.run_id, "lowprec.group": rec.group or "", "lowprec.status": rec.status,
            "lowprec.skipped_keys": json.dumps(skipped)}
    run = client.create_run(exp_id, start_time=t_ms, run_name=rec.name, tags=tags)
    mid = run.info.run_id
    try:
        metrics = [Metric(key, v, t_ms, s) for key, (steps, values) in sorted(scalars.items()) if key not in skipped
                   for s, v in zip(steps.tolist(), values.tolist(), strict=True)]
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            client.log_batch(mid, metrics=metrics[i:i + 1000])
        client.log_batch(mid, params=[Param(k, str(v)) for k, v in params.items() if v is not None],
                         tags=[RunTag("lowprec.exported_by", "lowprec.runs.export_mlflow")])
        for name, obj in (("config", rec.config), ("manifest", m), ("events", events)):
            client.log_dict(mid, _finite_or_str(obj), f"lowprec/{name}.json")
        client.set_terminated(mid, status=_MLFLOW_STATUS.get(rec.status, "FAILED"),
                              end_time=int((rec.finished_at or rec.created_at) * 1000))
    except BaseException:
        client.delete_run(mid)
        raise
    return str(mid)
