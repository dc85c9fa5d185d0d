"""Import one run's curves from TensorBoard event files, an MLflow tracking store, CSV or JSON Lines into a RunStore.

The judge reads runs from a ``RunStore``; people keep their curves elsewhere.  ``import_run`` reads one run's
scalar curves, renames them to lowprec keys, checks them, and records them as one run with the manifest keys the
judge reads, so ``lowprec.accuracy`` can build a baseline from, or judge, curves no lowprec runner wrote.

Mapping.  The judge reads ``train/loss`` (required) and ``eval/<metric>``.  ``mapping`` (``--map SRC=DEST``) renames
a source tag or column; without one, a tag already named ``train/...`` or ``eval/...`` keeps its name, and the
first of ``loss``, ``train_loss``, ``loss/train``, ``Loss/train`` becomes ``train/loss``.  Every other tag is
left out (listed in the manifest's ``source.skipped``).  Each eval metric needs a direction: ``loss`` is "min",
``accuracy`` is "max"; any other is given with ``metrics={"f1": "max"}`` (``--metric f1=max``).

Formats.  TensorBoard: a log directory (its own event files, not its subdirectories) or one events file, read with
TensorBoard's ``event_accumulator`` (every value kept, no reservoir sampling, no purge of "orphaned" steps).
MLflow: a tracking URI (``file:`` or a ``mlruns`` folder, ``sqlite:///``, ...) read with ``MlflowClient``; the run
is ``run`` (an id or a run name) or the store's only run.  CSV: a header row, a ``step`` column and one column per
curve, an empty cell where a curve was not logged.  JSON Lines: one object per line with an integer ``"step"``
and numbers (``null`` = not logged; ``"nan"``, ``"inf"``, ``"-inf"`` as ``lowprec runs export --format json``
writes them).

Precision.  Values are stored as float64.  MLflow and CSV/JSON Lines keep float64, so their values arrive bit for
bit; TensorBoard's ``add_scalar`` stores float32, so a TensorBoard curve is the float32 rounding of what was logged.

Checks (each a ``UsageError`` naming the file, the tag or line, and the fix): a missing ``train/loss`` (the tags
found are listed), steps out of order or repeated within one curve, a value that is not a number, an eval metric
without a direction, a file of another format.  Non-finite values (NaN, inf) are numbers and are stored: a NaN
loss is the divergence the judge's divergence criterion must see (a baseline refuses such a run; a candidate
fails).  The run is recorded only after every check passed, and deleted again when recording fails part-way, so a
failed import leaves nothing in the store.

Provenance (``manifest["source"]``): the format, the path or URI, a sha256 of what was read (a file's bytes; a
folder's sorted relative file names and bytes; for a non-file MLflow store, of the canonical JSON of the curves
read), the importer's version, the mapping used and the tags left out.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from .._checks import literal_values
from .._errors import UsageError
from .._types import FinalStatus
from .._version import __version__
from ._store import RunStore

__all__ = ["IMPORT_FORMATS", "IMPORTER_VERSION", "import_run", "read_curves"]

ImportFormat = Literal["tensorboard", "mlflow", "csv", "jsonl"]
"""What ``import_run`` reads: TensorBoard event files, a local MLflow store, CSV or JSON Lines."""
IMPORT_FORMATS = literal_values(ImportFormat)
IMPORTER_VERSION = 1
LOSS_KEY = "train/loss"
LOSS_ALIASES = ("train/loss", "loss", "train_loss", "loss/train", "Loss/train")
DEFAULT_DIRECTIONS = {"loss": "min", "accuracy": "max"}

Curves = dict[str, tuple[list[int], list[float]]]


# --------------------------------------------------------------------------------------------- provenance
def sha256_path(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes; of a folder: over its files in sorted relative-name order, each as its name
    (UTF-8), a NUL, its size as 8 bytes big-endian and its bytes."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_file():
        h.update(p.read_bytes())
        return h.hexdigest()
    for f in sorted((f for f in p.rglob("*") if f.is_file()), key=lambda f: f.relative_to(p).as_posix()):
        data = f.read_bytes()
        h.update(f.relative_to(p).as_posix().encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ checks
def _check_curve(where: str, tag: str, steps: Sequence[int], values: Sequence[float]) -> None:
    for i in range(1, len(steps)):
        if steps[i] == steps[i - 1]:
            raise UsageError(f"{where}: {tag!r} logs step {steps[i]} twice: a curve holds one value per step "
                             "(a restarted run appended to the same log? import one attempt, e.g. one event file)")
        if steps[i] < steps[i - 1]:
            raise UsageError(f"{where}: {tag!r} steps out of order: step {steps[i]} after step {steps[i - 1]} "
                             "(a restarted run appended to the same log? import one attempt, e.g. one event file)")
    if steps and steps[0] < 0:
        raise UsageError(f"{where}: {tag!r} has negative step {steps[0]}; steps count from 0")


def _number(where: str, col: str, raw: Any) -> float:
    """A value of a CSV cell / JSON field: a number or the strings nan/inf/-inf; anything else is refused."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise UsageError(f"{where}: {col!r} value {raw!r} is not a number")
    try:
        return float(raw)
    except ValueError:
        raise UsageError(f"{where}: {col!r} value {raw!r} is not a number (write numbers, or nan / inf / -inf; "
                         "leave the cell empty where the curve was not logged)") from None


def _step(where: str, raw: Any) -> int:
    try:
        f = float(raw)
        if isinstance(raw, bool) or not math.isfinite(f) or f != int(f):
            raise ValueError
    except (TypeError, ValueError):
        raise UsageError(f"{where}: step {raw!r} is not an integer") from None
    return int(f)


# ---------------------------------------------------------------------------------------------- readers
def _read_table(path: Path, rows: Sequence[tuple[str, Mapping[str, Any]]]) -> Curves:
    """(where, {column: raw}) rows with a "step" -> curves; an empty / None cell means "not logged"."""
    curves: Curves = {}
    for where, row in rows:
        step = _step(where, row.get("step"))
        for col, raw in row.items():
            if col == "step" or raw is None or raw == "":
                continue
            steps, values = curves.setdefault(col, ([], []))
            if steps and step <= steps[-1]:
                _check_curve(where, col, [steps[-1], step], [])
            steps.append(step)
            values.append(_number(where, col, raw))
    return curves


def read_csv(path: Path) -> Curves:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a CSV text file (not UTF-8): is it another format (--format)?") from None
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if not header or "step" not in header:
        raise UsageError(f"{path} line 1: a CSV import needs a header row with a 'step' column and one column per "
                         f"curve; got {header!r}")
    if len(set(header)) != len(header):
        raise UsageError(f"{path} line 1: repeated column name in {header!r}")
    rows = []
    for n, cells in enumerate(reader, start=2):
        if not cells:
            continue
        if len(cells) != len(header):
            raise UsageError(f"{path} line {n}: {len(cells)} cells, the header has {len(header)}")
        rows.append((f"{path} line {n}", dict(zip(header, cells, strict=True))))
    return _read_table(path, rows)


def read_jsonl(path: Path) -> Curves:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a JSON Lines text file (not UTF-8): is it another format "
                         "(--format)?") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} line {n}: not JSON ({e.msg}); JSON Lines holds one object per line") from None
        if not isinstance(obj, dict) or "step" not in obj:
            raise UsageError(f"{path} line {n}: each line must be a JSON object with a \"step\"; got {line[:80]!r}")
        rows.append((f"{path} line {n}", obj))
    return _read_table(path, rows)


def read_tensorboard(path: Path) -> tuple[Curves, dict[str, Any]]:
    """Scalars of a log directory's event files (or of one events file), every value, in file order."""
    try:
        from tensorboard.backend.event_processing import event_accumulator as ea
        from tensorboard.util import tensor_util
    except ImportError as e:
        raise UsageError("a TensorBoard import needs the tensorboard package: pip install tensorboard "
                         f"(or pip install 'lowprec[tensorboard]'); import failed with: {e}") from e
    files = [path] if path.is_file() else sorted(path.glob("*tfevents*"))
    if not files:
        below = sorted({str(f.parent) for f in path.rglob("*tfevents*")})
        hint = f"; its subfolders with event files: {', '.join(below[:5])}: import one" if below else ""
        raise UsageError(f"{path} holds no TensorBoard event files (events.out.tfevents.*){hint}")
    acc = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0}, purge_orphaned_data=False)
    try:
        acc.Reload()
    except Exception as e:  # the reader raises its own errors (DataLossError, DecodeError) on a bad file
        raise UsageError(f"{path}: cannot read TensorBoard events ({type(e).__name__}: {e}): is it another "
                         "format (--format)?") from None
    tags = acc.Tags()
    curves: Curves = {}
    for tag in tags.get(ea.SCALARS, []):
        evs = acc.Scalars(tag)
        curves[tag] = ([int(e.step) for e in evs], [float(e.value) for e in evs])
    for tag in tags.get(ea.TENSORS, []):  # TF2 writes scalars as 0-d tensor summaries
        evs = acc.Tensors(tag)
        arrays = [tensor_util.make_ndarray(e.tensor_proto) for e in evs]
        if tag not in curves and arrays and all(a.size == 1 and a.dtype.kind in "fiu" for a in arrays):
            curves[tag] = ([int(e.step) for e in evs], [float(a.reshape(())) for a in arrays])
    if not curves and not any(tags.get(k) for k in (ea.SCALARS, ea.TENSORS, ea.GRAPH, "run_metadata")):
        raise UsageError(f"{path}: no TensorBoard events read from {', '.join(f.name for f in files[:3])}: is it "
                         "another format (--format)?")
    return curves, {"event_files": [f.name for f in files]}


def _mlflow_client(uri: str) -> Any:
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", uri):  # a plain folder: MLflow's file store
        uri = Path(uri).resolve().as_uri()
    if uri.startswith("file:"):  # MLflow >= 3.7 refuses its file store unless opted in; reading one is our job
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise UsageError("an MLflow import or export needs MLflow's client: pip install 'lowprec[mlflow]' "
                         f"(mlflow-skinny); import failed with: {e}") from e
    try:
        return MlflowClient(tracking_uri=uri), uri
    except Exception as e:  # MlflowException, or a missing SQLAlchemy for sqlite:///
        raise UsageError(f"cannot open MLflow tracking store {uri!r}: {e} (a sqlite:/// store needs full mlflow: "
                         "pip install mlflow)") from None


def _mlflow_run(client: Any, uri: str, run: str | None) -> Any:
    from mlflow.entities import ViewType

    exps = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    found = client.search_runs(exps, run_view_type=ViewType.ALL, max_results=50000) if exps else []
    if run is not None:
        found = [r for r in found if run in (r.info.run_id, r.info.run_name)]
    if len(found) != 1:
        listed = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in found[:10])
        raise UsageError(f"MLflow store {uri}: {len(found)} runs match{'' if run is None else f' {run!r}'}"
                         f"{': ' + listed if listed else ''}; pass --run-id ID (a run id or a unique run name)")
    return found[0]


def read_mlflow(uri: str, run: str | None) -> tuple[Curves, dict[str, Any]]:
    client, uri = _mlflow_client(uri)
    r = _mlflow_run(client, uri, run)
    curves: Curves = {}
    for key in sorted(r.data.metrics):
        hist = client.get_metric_history(r.info.run_id, key)
        curves[key] = ([int(m.step) for m in hist], [float(m.value) for m in hist])
    local = Path(uri.removeprefix("file://")) / r.info.experiment_id / r.info.run_id if uri.startswith("file:") \
        else None
    meta = {"run_id": r.info.run_id, "run_name": r.info.run_name, "experiment_id": r.info.experiment_id,
            "status": r.info.status, "params": dict(r.data.params),
            "folder": str(local) if local is not None and local.is_dir() else None}
    return curves, meta


def read_curves(path: str | os.PathLike[str], *, fmt: ImportFormat,
                run: str | None = None) -> tuple[Curves, dict[str, Any]]:
    """The source's curves (tag -> (steps, values)) as read, unchecked and unrenamed, and what the source says
    about itself (MLflow: run id, name, status, params; TensorBoard: the event files)."""
    if fmt not in IMPORT_FORMATS:
        raise UsageError(f"fmt must be one of {', '.join(IMPORT_FORMATS)}, got {fmt!r}")
    if fmt == "mlflow":
        return read_mlflow(str(path), run)
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{p} does not exist")
    if fmt == "tensorboard":
        return read_tensorboard(p)
    if not p.is_file():
        raise UsageError(f"{p} is not a file; a {fmt} import reads one file")
    return (read_csv(p) if fmt == "csv" else read_jsonl(p)), {}


# ----------------------------------------------------------------------------------------------- mapping
def map_curves(curves: Curves, mapping: Mapping[str, str] | None, where: str) -> tuple[Curves, dict[str, str],
                                                                                      list[str]]:
    """Rename ``curves`` to lowprec keys: (renamed curves, source -> key used, source tags left out)."""
    mapping = dict(mapping or {})
    for src, dest in mapping.items():
        if src not in curves:
            raise UsageError(f"{where}: --map {src}={dest}: no tag or column {src!r}; it has {sorted(curves)}")
        if not isinstance(dest, str) or not dest or dest.startswith("/") or dest.endswith("/"):
            raise UsageError(f"--map {src}={dest}: the lowprec key must be like train/loss or eval/accuracy")
    used = dict(mapping)
    if LOSS_KEY not in used.values():
        alias = next((a for a in LOSS_ALIASES if a in curves and a not in used), None)
        if alias is not None:
            used[alias] = LOSS_KEY
    for tag in curves:
        if tag not in used and tag.startswith(("train/", "eval/")) and tag not in used.values():
            used[tag] = tag
    dests = list(used.values())
    twice = sorted({d for d in dests if dests.count(d) > 1})
    if twice:
        raise UsageError(f"{where}: several tags map to {twice}: {used}; give one with --map")
    if LOSS_KEY not in dests:
        raise UsageError(f"{where}: no {LOSS_KEY!r} curve: the tags found are {sorted(curves)}; name the training "
                         f"loss with --map TAG={LOSS_KEY} (mapping={{TAG: {LOSS_KEY!r}}} in Python)")
    out = {dest: curves[src] for src, dest in used.items()}
    for src in used:
        _check_curve(where, src, *curves[src])
    return out, used, sorted(t for t in curves if t not in used)


def directions(keys: Sequence[str], given: Mapping[str, str] | None, where: str) -> dict[str, str]:
    """metric -> "min" | "max" for every ``eval/<metric>`` key: ``given``, else the defaults (loss, accuracy)."""
    given = dict(given or {})
    metrics = [k.removeprefix("eval/") for k in keys if k.startswith("eval/")]
    for m, d in given.items():
        if d not in ("min", "max"):
            raise UsageError(f"--metric {m}={d}: the direction is min (lower is better) or max")
        if m not in metrics:
            raise UsageError(f"{where}: --metric {m}={d}: no eval/{m} curve is imported; the eval metrics are "
                             f"{metrics}")
    out = {}
    for m in metrics:
        got: str | None = given.get(m, DEFAULT_DIRECTIONS.get(m.rsplit("/", 1)[-1]))
        if got is None:
            raise UsageError(f"{where}: eval/{m} has no direction: pass --metric {m}=min or --metric {m}=max "
                             f"(metrics={{{m!r}: 'max'}} in Python)")
        out[m] = got
    return out


def load_config_file(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """A JSON or TOML object (``--config``): the run's config as the judge compares it (``model``, ``steps``...)."""
    if path is None:
        return {}
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise UsageError(f"--config {p}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"--config {p}: cannot read it as {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {p}: must hold an object (a table), got {type(data).__name__}")
    return data


def recipe_hash(recipe: Any) -> str:
    """The recipe's hash: a built-in name's (``lowprec.recipes``), a recipe dict's, else sha256 (16 hex) of the text
    given; "none" when there is none."""
    if recipe is None:
        return "none"
    from .. import recipes

    if isinstance(recipe, str) and recipes.is_named(recipe):
        return str(recipes.get(recipe).hash())
    if isinstance(recipe, dict):
        try:
            return str(recipes.Recipe.from_dict(recipe).hash())
        except (ValueError, TypeError):
            pass
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _int_or_none(what: str, raw: Any) -> int | None:
    if raw is None or raw == "":
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise UsageError(f"{what} must be an integer, got {raw!r}")


# ------------------------------------------------------------------------------------------------ import
def import_run(store: RunStore, path: str | os.PathLike[str], *,
               fmt: ImportFormat, name: str | None = None,
               group: str | None = None, seed: int | None = None, mapping: Mapping[str, str] | None = None,
               metrics: Mapping[str, str] | None = None, config: Mapping[str, Any] | None = None,
               model: str | None = None, steps: int | None = None, recipe: str | None = None,
               data_hash: str | None = None, framework: str | None = None, run: str | None = None) -> str:
    """Import one run's curves from ``path`` (format ``fmt``) into ``store``; returns the new run id.

    ``mapping`` renames source tags (see the module docstring for the defaults), ``metrics`` gives eval metric
    directions beyond loss/accuracy, ``run`` picks an MLflow run (id or name).  The run's config is ``config``
    with ``model``, ``steps`` and ``recipe`` set from the arguments when given; ``steps`` defaults to the last
    ``train/loss`` step, ``model`` to "unknown".  An argument not given falls back to what an MLflow run records
    (params ``seed``, ``model``, ``steps``, ``data_hash``, ``recipe_hash``, ``framework``, ``lowprec.metrics``, as
    ``export_mlflow`` writes them).  ``UsageError`` (nothing stored) on any bad input."""
    curves, meta = read_curves(path, fmt=fmt, run=run)
    where = str(path) if fmt != "mlflow" else f"MLflow run {meta['run_id']} in {path}"
    scalars, used, skipped = map_curves(curves, mapping, where)
    params = meta.get("params", {})
    if metrics is None and params.get("lowprec.metrics"):
        metrics = json.loads(params["lowprec.metrics"])
    dirs = directions(list(scalars), metrics, where)
    cfg = dict(config or {})
    seed = _int_or_none("seed", seed if seed is not None else cfg.get("seed", params.get("seed")))
    if seed is None:
        raise UsageError(f"{where}: no seed: pass --seed S (seed=S), the seed the imported run trained with; a "
                         "baseline and a judgement need each run's seed")
    cfg["model"] = model or cfg.get("model") or params.get("model") or "unknown"
    loss_steps = scalars[LOSS_KEY][0]
    cfg["steps"] = _int_or_none("steps", steps if steps is not None else cfg.get("steps", params.get("steps")))
    if cfg["steps"] is None:
        cfg["steps"] = loss_steps[-1] if loss_steps else 0
    if recipe is not None:
        cfg["recipe"] = recipe
    rhash = recipe_hash(cfg.get("recipe")) if "recipe" in cfg else params.get("recipe_hash", "none")
    manifest = {"seed": seed, "recipe_hash": rhash, "data_hash": data_hash or params.get("data_hash") or "unknown",
                "metrics": dirs, "framework": framework or params.get("framework") or "unknown",
                "versions": {"lowprec": __version__}, "source": _provenance(path, fmt, meta, curves, used, skipped)}
    status: FinalStatus = "completed"
    error: str | None = None
    if fmt == "mlflow" and meta["status"] != "FINISHED":
        status, error = "failed", f"the MLflow run's status was {meta['status']} when it was imported"
    return _record(store, name or meta.get("run_name") or Path(str(path)).stem, group, cfg, manifest, scalars,
                   status, error)


def _provenance(path: str | os.PathLike[str], fmt: str, meta: dict[str, Any], curves: Curves,
                used: dict[str, str], skipped: list[str]) -> dict[str, Any]:
    folder = meta.get("folder") if fmt == "mlflow" else str(path)
    if folder is not None:
        digest, of = sha256_path(folder), ("file" if Path(folder).is_file() else "folder")
    else:
        digest, of = hashlib.sha256(json.dumps(curves, sort_keys=True).encode()).hexdigest(), "curves"
    src = {"format": fmt, "path": str(Path(path).resolve()) if fmt != "mlflow" or folder else str(path),
           "sha256": digest, "sha256_of": of, "importer": f"lowprec.runs.import_run {IMPORTER_VERSION}",
           "lowprec": __version__, "mapping": used, "skipped": skipped}
    src.update({k: v for k, v in meta.items() if k not in ("params", "folder")})
    return src


def _record(store: RunStore, name: str, group: str | None, config: dict[str, Any], manifest: dict[str, Any],
            scalars: Curves, status: FinalStatus, error: str | None) -> str:
    """create + log (one transaction) + finish; a failure part-way deletes the run again."""
    rid = store.create_run(name=name, config=config, manifest=manifest, group=group)
    try:
        store.log_rows(rid, [(s, key, v) for key, (steps, values) in scalars.items()
                             for s, v in zip(steps, values, strict=True)])
        store.finish_run(rid, status=status, error=error)
    except BaseException:
        store.delete_run(rid)
        raise
    return rid
