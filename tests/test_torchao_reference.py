"""fp8-tensorwise against torchao's Float8Linear (dynamic tensorwise scaling), an independent implementation.

torchao casts with ``m = fp8_max / amax`` (float64 division rounded to float32), saturates, casts to float8, and
runs ``torch._scaled_mm`` with the reciprocal scales, which on CPU dequantizes both operands and multiplies in
float32.  lowprec's float32-scale convention and float32 GEMM reproduce that, so forward and backward are
bit-identical (HYBRID: e4m3 input/weight, e5m2 grad_output in both backward GEMMs).
"""

from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec.testing import TOLERANCES, assert_bitwise_equal, sqnr_db

torchao_float8 = pytest.importorskip("torchao.float8")




def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32)
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("x_shape", [(32, 64), (4, 8, 64)])
def test_forward_and_backward_bit_identical_to_torchao(seed: int, x_shape: tuple[int, ...]) -> None:
    """Oracle: torchao.float8.convert_to_float8_training on a copy of the same model and inputs."""
    base = _mlp(seed)
    ref = torchao_float8.convert_to_float8_training(copy.deepcopy(base))
    ours = lowprec.convert(copy.deepcopy(base), "fp8-tensorwise")
    g = torch.Generator().manual_seed(100 + seed)
    x = (torch.randn(x_shape, generator=g) * 3).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y_ref, y = ref(x), ours(x2)
    assert_bitwise_equal(y, y_ref, context="forward")
    (y_ref.square().mean()).backward()
    (y.square().mean()).backward()
    assert x.grad is not None and x2.grad is not None
    assert_bitwise_equal(x2.grad, x.grad, context="grad_input")
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        assert p_ref.grad is not None and p.grad is not None
        assert_bitwise_equal(p.grad, p_ref.grad, context=f"grad of {name}")


def test_fp8_rowwise_close_to_torchao_rowwise() -> None:
    """Oracle: torchao's rowwise recipe (e4m3 everywhere, power-of-two scales).  lowprec's fp8-rowwise uses the
    same formats and scale rule, but torchao's backward takes a different route for grad_weight (it re-scales
    along the other axis), so only SQNR is compared: above the torchao float8 cast floor."""
    base = _mlp(3)
    config = torchao_float8.Float8LinearConfig.from_recipe_name("rowwise")
    ref = torchao_float8.convert_to_float8_training(copy.deepcopy(base), config=config)
    ours = lowprec.convert(copy.deepcopy(base), "fp8-rowwise")
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    y_ref, y = ref(x), ours(x)
    floor = TOLERANCES["sqnr_fp8_cast"].value
    assert sqnr_db(y_ref, y) >= floor, sqnr_db(y_ref, y)
