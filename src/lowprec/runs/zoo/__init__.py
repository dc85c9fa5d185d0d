"""The model zoo: small, fully deterministic training tasks for judging low-precision recipes.

``get_task(name, seed=...)`` builds a :class:`Task` (model, pure batch function, loss, held-out metrics, data
hash, suggested defaults); ``names()`` lists the built-in tasks; ``load_entry_point("pkg.mod:fn")`` loads a
user-defined task builder (``get_task`` also accepts such a spec as the name).
"""

from ._registry import get_task as get_task
from ._registry import load_entry_point as load_entry_point
from ._registry import names as names
from ._task import Task as Task

__all__ = ["Task", "get_task", "load_entry_point", "names"]
