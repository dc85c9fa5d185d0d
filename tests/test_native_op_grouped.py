"""The grouped fake-quantization operator (``torch.ops.lowprec.fake_quantize_grouped``) that compiled regions call
for block, tile, axis and two-level specs: inside ``torch.compile`` it gives the eager bits and the eager layout,
for contiguous and transposed operands, round-to-nearest and stochastic rounding (oracle: the eager
``fake_quantize_tensors``, itself tested against the tensor route in test_native_group.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowprec.quant import QuantSpec, _native, _native_op, _random
from lowprec.quant._scaled import fake_quantize_tensors
from lowprec.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler: the kernels are not built")

SPECS = ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4", "nvfp4", "fp8_e4m3_1x128", "fp8_e4m3_128x128", "fp8_e5m2_rowwise"]


@pytest.mark.parametrize("name", SPECS)
def test_grouped_operator_compiled_gives_eager_bits(name: str) -> None:
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 160, generator=g) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=g).float())
    x[5] = 0.0
    keys, off = _random.key_tensor(11), _random.offset_tensor(7)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    for rounding in ("nearest", "stochastic"):
        spec = dataclasses.replace(QuantSpec.named(name), rounding=rounding)

        def f(t: torch.Tensor, k: torch.Tensor, o: torch.Tensor, spec: QuantSpec = spec) -> torch.Tensor:
            return _native_op.call_grouped(t * 1.0, spec, k, o)

        comp = torch.compile(f, backend=backend, fullgraph=True)
        for t in (x, x.t()):
            want = fake_quantize_tensors(t, spec, keys=keys, offset=off)
            got = comp(t, keys, off)
            assert_bitwise_equal(got, want, context=f"{name} {rounding} contiguous={t.is_contiguous()}")
            assert got.stride() == want.stride()
    assert any("fake_quantize_grouped" in str(n.target) for gm in graphs for n in gm.graph.nodes)


def test_grouped_operator_declines_to_eager_rules_for_nonfinite_groups() -> None:
    """A group holding NaN or inf: the kernel declines and the operator runs the eager kernels' rules."""
    spec = QuantSpec.named("mxfp8_e4m3")
    x = torch.randn(8, 64)
    x[2, 3] = float("nan")
    x[4, 40] = float("inf")
    got = _native_op.call_grouped(x, spec, None, None)
    assert_bitwise_equal(got, fake_quantize_tensors(x, spec), context="non-finite groups")
    assert _native_op.applies_grouped(x, spec)
    assert not _native_op.applies_grouped(torch.randn(1 << 20), spec)  # large tensors: inductor's kernels
