"""Every built-in recipe keeps a linear layer and a small transformer block within its SQNR floor.

Oracle: the same module in float32 PyTorch, on the same inputs and upstream gradients; floors come from the one
tolerance table (lowprec.testing.SQNR_FLOORS, which states their source).  The fp32 recipe must be bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec.testing import SQNR_FLOORS, assert_bitwise_equal, sqnr_db
from lowprec.testing._models import TinyBlock


def _linear_case(recipe: str, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    torch.manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Linear(128, 64))
    conv = lowprec.convert(copy.deepcopy(ref), recipe)
    x = torch.randn(32, 128, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(32, 64)
    y, y2 = ref(x), conv(x2)
    y.backward(g)
    y2.backward(g)
    return (y, y2), (x.grad, x2.grad), (ref[0].weight.grad, conv[0].weight.grad)  # type: ignore[return-value]


def _block_case(recipe: str, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    torch.manual_seed(seed)
    ref = TinyBlock()
    conv = lowprec.convert(copy.deepcopy(ref), recipe)
    conv.matmul_recipe = lowprec.recipes.get(recipe)
    x = torch.randn(2, 16, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 16, 64)
    y, y2 = ref(x), conv(x2)
    y.backward(g)
    y2.backward(g)
    return (y - x, y2 - x2), (x.grad, x2.grad), (ref.fc1.weight.grad, conv.fc1.weight.grad)  # type: ignore[return-value]


@pytest.mark.parametrize("recipe", sorted(SQNR_FLOORS))
@pytest.mark.parametrize("case", ["linear", "block"])
def test_recipe_within_sqnr_floor(recipe: str, case: str) -> None:
    floors = SQNR_FLOORS[recipe][case]
    build = _linear_case if case == "linear" else _block_case
    for seed in (10, 11):
        pairs = build(recipe, seed)
        for what, (ref, got), floor in zip(("output", "grad_input", "grad_weight"), pairs, floors, strict=True):
            value = sqnr_db(ref, got)
            assert value >= floor, f"{recipe} {case} {what} seed {seed}: SQNR {value:.2f} dB < floor {floor} dB"


def test_every_lossy_recipe_has_a_floor() -> None:
    """The table covers every built-in recipe except fp32 (which is exact)."""
    assert set(SQNR_FLOORS) == set(lowprec.recipes.names()) - {"fp32"}


@pytest.mark.parametrize("case", ["linear", "block"])
def test_fp32_recipe_is_bit_identical(case: str) -> None:
    build = _linear_case if case == "linear" else _block_case
    for what, (ref, got) in zip(("output", "grad_input", "grad_weight"), build("fp32", 0), strict=True):
        assert_bitwise_equal(got, ref, context=f"fp32 {case} {what}")
