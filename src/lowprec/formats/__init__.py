"""Number formats: ``FormatSpec`` and the registry of named formats."""

from ._registry import get as get
from ._registry import names as names
from ._spec import FormatSpec as FormatSpec

__all__ = ["FormatSpec", "get", "names"]
