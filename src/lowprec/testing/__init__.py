"""Helpers for comparing low-precision results, shipped so users can run the same checks on their own tensors."""

from ._compare import assert_bitwise_equal as assert_bitwise_equal
from ._compare import sqnr_db as sqnr_db
from ._parity import ParityResult as ParityResult
from ._parity import check_parity as check_parity
from ._torchrun import free_port as free_port
from ._torchrun import torchrun as torchrun
from .tolerances import SQNR_FLOORS as SQNR_FLOORS
from .tolerances import TOLERANCES as TOLERANCES
from .tolerances import Tolerance as Tolerance

__all__ = [
    "SQNR_FLOORS",
    "TOLERANCES",
    "ParityResult",
    "Tolerance",
    "assert_bitwise_equal",
    "check_parity",
    "free_port",
    "sqnr_db",
    "torchrun",
]
