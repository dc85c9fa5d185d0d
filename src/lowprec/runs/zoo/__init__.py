"""The model zoo: small, fully deterministic training tasks for judging low-precision recipes.

``get_task(name, seed=...)`` builds a :class:`Task` (model, pure batch function, loss, held-out metrics, data
hash, suggested defaults); ``names()`` lists the built-in tasks.  A user-defined task builder is declared with
the decorator :func:`task` (``@lowprec.runs.zoo.task``) and named ``"pkg.mod:fn"``, or declared by an installed
package in the ``lowprec.tasks`` entry-point group and named by its entry-point name; ``get_task`` and
``load_entry_point`` refuse to call any function that is not declared (see ``_declare``).
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

__all__ = ["ENTRY_POINT_GROUP", "Task", "entry_point_names", "get_task", "is_task", "load_entry_point", "names",
           "resolve_builder", "task"]
