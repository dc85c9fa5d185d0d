"""XLA lowerings for the integer operations of lowprec's kernels, where torch_xla's own give other bits or none.

On a lazy XLA tensor every PyTorch operation is recorded into a graph that XLA compiles; an operation without an
XLA lowering runs through torch_xla's CPU fallback (copy to the host, compute there, copy back), which cuts the
graph and keeps ``torch.export`` programs from converting to StableHLO.  The quantizers are integer and float32
operations on float32 bit patterns, and torch_xla 2.9 gets some of the integer ones wrong:

* ``x >> n`` (``aten::__rshift__``) is lowered as a division by ``2^n``, which truncates toward zero: ``-1 >> 3``
  gives 0 where torch gives -1 (an arithmetic shift), and ``(2^31 - 1) >> t`` for a tensor ``t`` gives 0;
* ``1 << t`` and ``torch.bitwise_right_shift(x, 3)`` (a Python int with an int32 tensor), and shifts of an int32
  tensor by a 0-d int64 one (what ``torch.export`` graphs hold), come out int64 where torch's promotion rules give
  int32, so ``1 << 31`` is 2^31 instead of -2^31;
* ``x.view(torch.int32)`` (its functional form ``aten::view_copy.dtype``: the bit reinterpretation every kernel
  starts and ends with) has no lowering and takes the CPU fallback.

``register()`` gives each of these an XLA kernel that computes torch's result with operations torch_xla lowers
correctly: ``torch.bitwise_right_shift`` of two int32 tensors (XLA's ShiftRightArithmetic), the Python int
broadcast to the tensor's dtype first, and a ``BitcastConvert`` for views between dtypes of one size (other views
keep the fallback's host round trip).  The kernels replace torch_xla's for the whole process (PyTorch prints no
warning for that here: it is silenced, the override is the point); they give the CPU's bits, which
``tests_xla/test_xla_ops.py`` checks op by op against eager CPU on edge values, so other code on XLA tensors can
only gain.  The quantizers call ``register()`` when they first see an XLA tensor (``_backend.traces_lazily``);
torch_xla is imported then and never before.

Also wrong in torch_xla 2.9 and not used by the kernels: integer floor division of large int32 values (computed in
float32; ``(2^31 - 1) // 7`` is off by 14).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None}
_BITCAST: dict[tuple[torch.dtype, torch.dtype], Any] = {}


def _xla_type(dtype: torch.dtype) -> Any:
    import torch_xla.core.xla_builder as xb

    return {torch.float32: xb.Type.F32, torch.int32: xb.Type.S32, torch.bfloat16: xb.Type.BF16,
            torch.float16: xb.Type.F16, torch.int16: xb.Type.S16, torch.int8: xb.Type.S8,
            torch.uint8: xb.Type.U8}.get(dtype)


def _bitcast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x``'s bits as ``dtype`` (same element size) through one XLA BitcastConvert."""
    import torch_xla.core.xla_op_registry as xor

    op = _BITCAST.get((x.dtype, dtype))
    if op is None:
        to = _xla_type(dtype)
        op = _BITCAST[(x.dtype, dtype)] = xor.register(
            f"lowprec_bitcast_{str(x.dtype)[6:]}_{str(dtype)[6:]}", lambda a, to=to: a.bitcast(to))
    return op(x)  # type: ignore[no-any-return]


def _view_copy_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x.clone()
    if (x.element_size() == torch.empty((), dtype=dtype).element_size() and _xla_type(x.dtype) is not None
            and _xla_type(dtype) is not None):
        return _bitcast(x, dtype)
    return x.cpu().view(dtype).to(x.device)  # what torch_xla's fallback does: other element sizes change the shape


def _full(scalar: Any, like: torch.Tensor) -> torch.Tensor:
    """``scalar`` as a tensor of ``like``'s shape and of the dtype torch's promotion gives the pair."""
    return torch.full_like(like, scalar, dtype=torch.result_type(like, scalar))


def _rshift_tensor(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    dtype = torch.result_type(x, n)  # torch_xla's own promotes an int32 tensor and a 0-d int64 one to int64
    return torch.bitwise_right_shift(x.to(dtype), n.to(dtype))


def _rshift_scalar(x: torch.Tensor, n: Any) -> torch.Tensor:
    return torch.bitwise_right_shift(x, _full(n, x))


def _lshift_scalar(x: torch.Tensor, n: Any) -> torch.Tensor:
    return torch.bitwise_left_shift(x, _full(n, x))


def _scalar_lshift(s: Any, n: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_left_shift(_full(s, n), n)


def _scalar_rshift(s: Any, n: torch.Tensor) -> torch.Tensor:
    return torch.bitwise_right_shift(_full(s, n), n)


_KERNELS = {
    "view_copy.dtype": _view_copy_dtype,
    "__rshift__.Tensor": _rshift_tensor,
    "__rshift__.Scalar": _rshift_scalar,
    "bitwise_right_shift.Tensor_Scalar": _rshift_scalar,
    "bitwise_left_shift.Tensor_Scalar": _lshift_scalar,
    "bitwise_right_shift.Scalar_Tensor": _scalar_rshift,
    "bitwise_left_shift.Scalar_Tensor": _scalar_lshift,
}


def register() -> None:
    """Register the XLA kernels above (once per process; later calls return at once)."""
    if _state["lib"] is not None:
        return
    with _lock:
        if _state["lib"] is not None:
            return
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel for the same operator and the same dispatch key": the aim
            warnings.simplefilter("ignore", UserWarning)
            for name, fn in _KERNELS.items():
                lib.impl(name, fn, "XLA")
        _state["lib"] = lib


def registered() -> bool:
    return _state["lib"] is not None
