"""One native kernel call split across threads: contiguous ranges of whole scaling groups, run at once.

The native kernels (``_native.c``, ``_native_group.c``) are single-threaded C loops called through ctypes, which
releases the GIL for the duration of every foreign call.  A call on a large tensor is therefore split here, in
Python, into ``parts(numel)`` calls on disjoint ranges of the tensor, which run at the same time: the calling
thread runs the first, a small persistent pool of worker threads the others.  Each range holds whole scaling
groups and passes its own first random counter (the counter of an element is its row-major index plus the
offset), so every element is computed by the same operations on the same values as in one call: the bits do not
depend on the split.  Where a group's scale needs the whole tensor (tensor scaling, the float32 tensor scale of a
two-level spec) the tensor's amax is computed first, itself split, and handed to every range.

How many: ``torch.get_num_threads()`` (the threads torch itself uses for one large operation, such as the
``torch.clone`` the benchmarks compare with), but at most one per ``SPLIT_MIN_PER_THREAD`` elements for the
grouped kernel and one per ``PASS_MIN_PER_THREAD`` for the single passes of ``_native`` (amax, round to nearest):
handing a range to a worker and collecting it costs 50 to 100 microseconds, which a range must outweigh.
Measured on 2 cores (best of 15, eager, one call vs two ranges): the grouped kernel gains from 2^20 elements
(mxfp8 507 -> 329 us, nvfp4 792 -> 570, bf16 stochastic 821 -> 489) and loses below 2^19; the tensorwise passes
gain once the output no longer comes from reused heap memory, i.e. page faults dominate (2^22: 1.48 -> 1.70 ms,
2^23: 16.9 -> 12.5 ms, 2^24: 36.6 -> 22.9 ms).  Tensors below 2^20 elements keep the single call they always had
(also inside compiled regions, whose opaque operators call the same functions).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

SPLIT_MIN_PER_THREAD = 1 << 19
"""Elements per thread below which a grouped-kernel call is not split further (see the module docstring)."""
PASS_MIN_PER_THREAD = 1 << 21
"""The same for the single passes over memory of ``_native`` (amax, round to nearest)."""

T = TypeVar("T")
_lock = threading.Lock()
_pool: dict[str, Any] = {}


def parts(numel: int, per_thread: int | None = None) -> int:
    """How many ranges a native call on ``numel`` elements is split into (1: not split), at least ``per_thread``
    elements each (default ``SPLIT_MIN_PER_THREAD``)."""
    return max(1, min(torch.get_num_threads(), numel // (per_thread or SPLIT_MIN_PER_THREAD)))


def ranges(n: int, k: int, align: int = 1) -> list[tuple[int, int]]:
    """``[0, n)`` cut into at most ``k`` consecutive non-empty ranges of nearly equal length, every cut at a
    multiple of ``align`` (``[(0, 0)]`` for ``n == 0``)."""
    if n <= 0:
        return [(0, 0)]
    units = -(-n // align)
    k = max(1, min(k, units))
    cuts = [min(n, (units * i // k) * align) for i in range(k + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _executor(workers: int) -> ThreadPoolExecutor:
    """The worker pool, with at least ``workers`` threads (made again after a fork: a child has no threads)."""
    with _lock:
        ex = _pool.get("ex")
        if ex is None or _pool.get("pid") != os.getpid() or _pool.get("size", 0) < workers:
            if ex is not None and _pool.get("pid") == os.getpid():
                ex.shutdown(wait=False)
            ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowprec-native")
            _pool.update(ex=ex, pid=os.getpid(), size=workers)
        return ex  # type: ignore[no-any-return]


def run(fn: Callable[..., T], calls: Sequence[Sequence[Any]]) -> list[T]:
    """``[fn(*args) for args in calls]``, the calls at the same time (the first on this thread); ``fn`` is a
    ctypes function, which releases the GIL while it runs."""
    if len(calls) <= 1:
        return [fn(*args) for args in calls]
    ex = _executor(len(calls) - 1)
    futures = [ex.submit(fn, *args) for args in calls[1:]]
    first = fn(*calls[0])
    return [first, *(f.result() for f in futures)]
