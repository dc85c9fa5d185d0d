"""The model zoo: small, fully deterministic training tasks for judging low-precision recipes.

``get_task(name, seed=...)`` builds a :class:`Task` (model, pure batch function, loss, held-out metrics, data
hash, suggested defaults); ``names()`` lists the built-in tasks.  A user-defined task builder is declared with
the decorator :func:`task` (``@lowprec.runs.zoo.task``) and named ``"pkg.mod:fn"``, or declared by an installed
package in the ``lowprec.tasks`` entry-point group and named by its entry-point name; ``get_task`` and
``load_entry_point`` refuse to call any function that is not declared (see ``_declare``).

What a task of your own needs to be deterministic and to follow the runner's batch contract is public here too
(docs/runs.md, "Your own task"):

* seeds and data: :func:`seeded` (initialise the model from the seed without touching the caller's random
  state), :func:`generator` and :func:`derive_seed` (a seeded ``torch.Generator`` per purpose, e.g. per step),
  :func:`epoch_sampler` (``step -> indices`` sweeping a data set in epochs), :func:`check_step`;
* the batch contract: :func:`batch_loss` (how a dict, tuple or tensor batch is fed to the model and the loss),
  :func:`model_loss` (the loss the model returns itself), :func:`batch_rows`, :func:`to_device`,
  :func:`model_device`, :func:`mean_loss` and :func:`restoring_mode` (evaluation functions);
* the data's identity: :func:`hash_arrays` and :func:`hash_batches` (the ``data_hash`` every run records), and
  :func:`count_params`.
"""

from ._declare import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from ._declare import is_task as is_task
from ._declare import task as task
from ._registry import entry_point_names as entry_point_names
from ._registry import get_task as get_task
from ._registry import load_entry_point as load_entry_point
from ._registry import names as names
from ._registry import resolve_builder as resolve_builder
from ._task import Task as Task
from ._task import batch_loss as batch_loss
from ._task import batch_rows as batch_rows
from ._task import check_step as check_step
from ._task import count_params as count_params
from ._task import derive_seed as derive_seed
from ._task import epoch_sampler as epoch_sampler
from ._task import generator as generator
from ._task import hash_arrays as hash_arrays
from ._task import hash_batches as hash_batches
from ._task import mean_loss as mean_loss
from ._task import model_device as model_device
from ._task import model_loss as model_loss
from ._task import restoring_mode as restoring_mode
from ._task import seeded as seeded
from ._task import to_device as to_device

__all__ = ["ENTRY_POINT_GROUP", "Task", "batch_loss", "batch_rows", "check_step", "count_params", "derive_seed",
           "entry_point_names", "epoch_sampler", "generator", "get_task", "hash_arrays", "hash_batches", "is_task",
           "load_entry_point", "mean_loss", "model_device", "model_loss", "names", "resolve_builder",
           "restoring_mode", "seeded", "task", "to_device"]
