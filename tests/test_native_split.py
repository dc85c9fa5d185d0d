"""Large CPU tensors take the native kernels split across threads (``lowprec.quant._parallel``), with the bits of
the tensor route.

Oracle: the same public quantizer eagerly with the fast paths off (``_backend.backend("eager")`` and
``_backend.fast_paths(False)``): the tensor-operation kernels of ``_scaled``, ``_scale`` and ``_round``, checked
against ml_dtypes, torch casts and torchao elsewhere (and, compiled, against themselves in tests/test_compiled.py).
The native route runs under the library's default backend ("auto"), which for tensors of 2^20 elements or more
used to compile; a spy on ``_parallel.run`` checks that the split calls really ran.  Torch is given three threads
and ranges may be as small as 2^18 elements here, so the ranges are uneven (no even split can hide an off-by-one)
and the split happens on any machine.

Covered: every named spec and stochastic-rounding variants, on 2^20-element tensors with magnitudes over 120
binades, zero, subnormal and near-float32-max rows, and over 24 binades (where tensor scales leave most elements
nonzero); transposed 2-D inputs (read in place); bfloat16 inputs; 1-D
and 3-D tensors with partial blocks (splits by column ranges and by batches); stochastic rounding at an offset,
whose words must not depend on where the ranges start (split equals one call equals the tensor route); a NaN or
inf in one range only: the kernel declines and the quantizer keeps the tensor route's bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_native_group import _varied

from lowprec.quant import QuantSpec, _backend, _native, _native_group, _parallel, _random, fake_quantize, quantize
from lowprec.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler here: the native kernels are not built")

SHAPE = (256, 4096)  # 2^20 elements: the smallest size "auto" used to compile
NAMED = QuantSpec.names()
SR = {f"{n}+sr": dataclasses.replace(QuantSpec.named(n), rounding="stochastic")
      for n in ("nvfp4", "nvfp4_div", "mxfp8_e4m3", "mxint8", "fp8_e4m3_rowwise", "fp8_e4m3_tensorwise",
                "fp8_e4m3_128x128")}
SPECS = {**{n: QuantSpec.named(n) for n in NAMED}, **SR,
         "mxfp4+toward_zero": dataclasses.replace(QuantSpec.named("mxfp4"), rounding="toward_zero")}


@pytest.fixture(autouse=True)
def _three_ranges(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Three threads, and ranges from 2^18 elements: 2^20-element tensors split into three."""
    monkeypatch.setattr(_parallel, "SPLIT_MIN_PER_THREAD", 1 << 18)
    monkeypatch.setattr(_parallel, "PASS_MIN_PER_THREAD", 1 << 18)
    old = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture
def splits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(kernel name, number of ranges) of every ``_parallel.run`` call in the test."""
    seen: list[tuple[str, int]] = []
    real = _parallel.run

    def spy(fn: Callable[..., Any], calls: Any) -> list[Any]:
        seen.append((getattr(fn, "__name__", str(fn)), len(calls)))
        return real(fn, calls)

    monkeypatch.setattr(_parallel, "run", spy)
    return seen


def _moderate(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Magnitudes over 2^-12 .. 2^12 (so that tensor and two-level scales leave most elements nonzero, and the
    random words matter everywhere) with 1024 zeros and 1024 subnormals in the last range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    flat = x.view(-1)
    flat[-3072:-2048] = 0.0
    flat[-2048:-1024] *= 1e-41
    return x


def _cases(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    return [_varied(shape, seed), _moderate(shape, seed)]


def _reference(x: torch.Tensor, spec: QuantSpec, offset: int = 0) -> torch.Tensor:
    with _backend.backend("eager"), _backend.fast_paths(False):
        return fake_quantize(x, spec, seed=7, offset=offset)


def _native_route(x: torch.Tensor, spec: QuantSpec, offset: int = 0) -> torch.Tensor:
    with _backend.backend("auto"):
        return fake_quantize(x, spec, seed=7, offset=offset)


def _assert_split(seen: list[tuple[str, int]], context: str) -> None:
    assert any(name in ("lp_group_fake", "lp_round_nearest") and n > 1 for name, n in seen), (context, seen)


def test_ranges_cover_the_tensor_in_aligned_cuts() -> None:
    for n, k, align in [(10, 3, 1), (1 << 20, 3, 1024), (1000, 8, 16), (5, 8, 4), (0, 3, 1), (17, 1, 4)]:
        r = _parallel.ranges(n, k, align)
        assert r[0][0] == 0 and r[-1][1] == n and len(r) <= max(1, k)
        assert all(b0 == a1 for (_, a1), (b0, _) in zip(r, r[1:], strict=False))
        assert all(a % align == 0 for a, _ in r)
    assert _parallel.parts(1 << 20) == 3 and _parallel.parts(1000) == 1 and _parallel.parts(1 << 20, 1 << 19) == 2


@pytest.mark.parametrize("name", list(SPECS))
def test_large_tensors_take_the_split_native_route_with_the_tensor_routes_bits(
        name: str, splits: list[tuple[str, int]]) -> None:
    spec = SPECS[name]
    for x in _cases(SHAPE, 11):
        splits.clear()
        got = _native_route(x, spec, offset=12345)
        _assert_split(splits, name)
        assert_bitwise_equal(got, _reference(x, spec, offset=12345), context=name)


@pytest.mark.parametrize("name", ["fp8_e4m3_tensorwise", "fp8_e4m3_rowwise", "mxfp8_e4m3", "nvfp4", "nvfp4+sr",
                                  "fp8_e4m3_1x128", "fp8_e4m3_128x128", "mxint8+sr"])
def test_transposed_and_bfloat16_inputs(name: str, splits: list[tuple[str, int]]) -> None:
    spec = SPECS[name]
    x, y = _cases((4096, 256), 12)
    for t in (x.t(), x.to(torch.bfloat16), y.t(), y.to(torch.bfloat16), y.t().to(torch.bfloat16)):
        splits.clear()
        got = _native_route(t, spec, offset=99)
        _assert_split(splits, f"{name} {t.dtype} {t.stride()}")
        ref = _reference(t, spec, offset=99)
        assert got.stride() == ref.stride() and got.dtype == ref.dtype
        assert_bitwise_equal(got, ref, context=f"{name} {t.dtype} stride {t.stride()}")


@pytest.mark.parametrize("shape", [(1 << 20,), (3, 701, 499)])
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4", "nvfp4+sr", "fp8_e4m3_rowwise", "fp8_e4m3_tensorwise+sr"])
def test_1d_and_3d_tensors_with_partial_blocks(name: str, shape: tuple[int, ...],
                                               splits: list[tuple[str, int]]) -> None:
    spec = SPECS[name]
    for x in _cases(shape, 13):
        splits.clear()
        got = _native_route(x, spec, offset=5)
        _assert_split(splits, f"{name} {shape}")
        assert_bitwise_equal(got, _reference(x, spec, offset=5), context=f"{name} {shape}")


@pytest.mark.parametrize("name", ["nvfp4+sr", "mxfp8_e4m3+sr", "fp8_e4m3_tensorwise+sr"])
def test_stochastic_words_do_not_depend_on_the_split(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offsets near 2^32 wrap inside a range; one call, three and seven ranges and the tensor route agree."""
    spec = SPECS[name]
    x = _moderate(SHAPE, 14)
    keys, off = _random.key_tensor(3), _random.offset_tensor((1 << 32) - 1000)
    results = []
    for k in (1, 3, 7):
        monkeypatch.setattr(_parallel, "parts", lambda n, k=k: k)
        y = _native_group.fake(x, spec, keys, off)
        assert y is not None
        results.append(y)
    with _backend.backend("eager"), _backend.fast_paths(False):
        from lowprec.quant._scaled import fake_quantize_tensors

        ref = fake_quantize_tensors(x, spec, keys=keys, offset=off)
    for k, y in zip((1, 3, 7), results, strict=True):
        assert_bitwise_equal(y, ref, context=f"{name}, {k} ranges")


def test_bf16_stochastic_rounding_of_a_large_tensor(splits: list[tuple[str, int]]) -> None:
    x = _moderate(SHAPE, 15)
    with _backend.backend("auto"):
        got = quantize(x, "bfloat16", rounding="stochastic", seed=5, offset=77)
    _assert_split(splits, "bf16 stochastic")
    with _backend.backend("eager"), _backend.fast_paths(False):
        ref = quantize(x, "bfloat16", rounding="stochastic", seed=5, offset=77)
    assert_bitwise_equal(got, ref, context="bf16 stochastic")
    with _backend.backend("auto"):
        near = quantize(x, "float8_e4m3fn")
    with _backend.backend("eager"), _backend.fast_paths(False):
        assert_bitwise_equal(near, quantize(x, "float8_e4m3fn"), context="e4m3 nearest")


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3_rowwise", "fp8_e4m3_tensorwise", "nvfp4+sr"])
def test_a_nonfinite_value_in_one_range_declines_and_the_tensor_route_runs(name: str) -> None:
    spec = SPECS[name]
    x = _moderate(SHAPE, 16)
    x[200, 3000] = float("nan")  # in the last of the three ranges only
    x[201, 17] = float("-inf")
    keys, off = _random.key_tensor(7), _random.offset_tensor(0)
    assert _native_group.fake(x, spec, keys, off) is None
    with _backend.backend("eager"):  # the declined native route falls back to the tensor route, eagerly here
        got = fake_quantize(x, spec, seed=7)
    assert_bitwise_equal(got, _reference(x, spec), context=name)


def test_compiled_backend_and_disabled_native_kernels_keep_the_old_routes(splits: list[tuple[str, int]]) -> None:
    assert not _backend.runs_native(1 << 20) or _backend.get_backend() != "compiled"
    with _backend.backend("compiled"):
        assert not _backend.runs_native(1 << 20)
    with _backend.backend("auto"):
        assert _backend.runs_native(1 << 20) and not _backend.runs_eager(1 << 20)
        with _backend.fast_paths(False):
            assert not _backend.runs_native(1 << 20)
    x = _varied((64, 64), 17)  # small: no split
    with _backend.backend("auto"):
        fake_quantize(x, QuantSpec.named("mxfp8_e4m3"))
    assert all(n == 1 for _, n in splits)
