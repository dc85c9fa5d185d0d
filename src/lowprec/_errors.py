"""The one exception type for user errors.

``UsageError`` is raised for input a user can fix: a bad argument, config field, recipe, file or store path.  Its
message names the field and the fix.  The ``lowprec`` command prints it on one line without a traceback and exits
with status 2; any other exception is a bug and keeps its traceback.  It derives from ``ValueError``, so library
callers that catch ``ValueError`` keep working; the run store's errors (``StoreError``) derive from it.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Input the user can fix; the message names the field (or file, or name) and the fix."""
