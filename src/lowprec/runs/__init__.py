"""Training runs: the run config, the runners (PyTorch and JAX), checkpoints, the run store and the model zoo.

A run is one seed of one config.  ``run_config`` trains every seed of a ``RunConfig`` (``load_config`` reads one
from TOML) and records each run in a ``RunStore`` (one SQLite file): the resolved config, a manifest (versions,
hardware, git commit, data hash), per-step scalars (``train/loss``, ``eval/<metric>``, ...), events and
checkpoints.  Runs of your own loop are recorded with ``track``; runs kept in TensorBoard, MLflow, CSV or JSON Lines
come in with ``import_run``.  ``lowprec.accuracy`` judges the runs a store holds; ``train_baseline`` trains a
baseline's seeds and stores the baseline.

``import lowprec.runs`` does not import torch: the config, the store and the exports are pure Python; the runner,
the zoo and the tasks are imported on first use (``lowprec._lazy``).
"""

import typing as _typing

from .. import _lazy
from ._config import RunConfig as RunConfig
from ._config import load as load_config
from ._export import export_mlflow as export_mlflow
from ._export import export_run as export_run
from ._export import export_tensorboard as export_tensorboard
from ._import import IMPORT_FORMATS as IMPORT_FORMATS
from ._import import import_run as import_run
from ._seeds import train_baseline as train_baseline
from ._store import RunRecord as RunRecord
from ._store import RunStore as RunStore
from ._store import StoreCorrupt as StoreCorrupt
from ._store import StoreError as StoreError
from ._track import TrackedRun as TrackedRun
from ._track import track as track

if _typing.TYPE_CHECKING:
    from . import zoo as zoo
    from ._runner import build_task as build_task
    from ._runner import resume_run as resume_run
    from ._runner import run_config as run_config
    from .zoo import Task as Task
    from .zoo import task as task

__all__ = [
    "IMPORT_FORMATS",
    "RunConfig",
    "RunRecord",
    "RunStore",
    "StoreCorrupt",
    "StoreError",
    "Task",
    "TrackedRun",
    "build_task",
    "export_mlflow",
    "export_run",
    "export_tensorboard",
    "import_run",
    "load_config",
    "resume_run",
    "run_config",
    "task",
    "track",
    "train_baseline",
    "zoo",
]

_TORCH_ATTRS: _lazy.LazyTable = {
    "zoo": (".zoo", None),
    "Task": (".zoo", "Task"),
    "task": (".zoo", "task"),
    "build_task": ("._runner", "build_task"),
    "resume_run": ("._runner", "resume_run"),
    "run_config": ("._runner", "run_config"),
}

if not _typing.TYPE_CHECKING:
    __getattr__, __dir__ = _lazy.attach(__name__, _TORCH_ATTRS, globals())
