"""The accumulator kernels (``lowprec/quant/_native_accum.c`` through ``lowprec.nn._accum``) against their oracles.

* Sequential model: the C kernel against ``reference_loop`` (one elementwise quantizer pass per reduction index,
  the implementation it replaced), bit for bit, for the bit-mask route (formats with float32's exponent), the
  scalar IEEE route (float16, float8_e5m2) and the formats the kernel leaves to the loop (e4m3fn), over shapes that
  do not fill the kernel's 4 x 32 tiles, promotion intervals that divide K or not, both roundings, special values
  (inf and NaN operands, overflow of the accumulator into infinity, float32-subnormal partial sums, signed zeros).
* Blocked fused multiply-add model: the C kernel and the tensor route against ``blocked_reference`` (exact rational
  arithmetic), and a hand-worked example of its truncation (Fasi et al. 2021's test: small products vanish
  against a large accumulator).
* Inside ``torch.compile`` the opaque operator gives the eager bits; a training run of ``h100-fp8`` gives the same
  bits with the kernel and with the reference loop.
"""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.nn import _accum as A
from lowprec.quant import _native
from lowprec.recipes import Accumulator
from lowprec.testing import assert_bitwise_equal

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler: the kernels are not built")


def _values(shape: tuple[int, ...], seed: int, fmt: torch.dtype = torch.bfloat16, spread: float = 6.0) -> torch.Tensor:
    """float32 values representable in ``fmt``, magnitudes over ``spread`` binades, mixed signs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(shape, generator=g) * spread - spread / 2)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).to(fmt).float()


SEQ_CASES = [
    ("e8m13", "toward_zero", 128),  # h100-fp8's accumulator
    ("e8m13", "nearest", None),
    ("e8m4", "nearest", 7),
    ("e8m4", "toward_zero", 16),
    ("bfloat16", "nearest", None),
    ("e8m23", "toward_zero", 5),  # float32's own grid: the mask is empty
    ("e8m23", "nearest", None),
    ("float16", "nearest", 9),  # the scalar IEEE route
    ("float16", "toward_zero", None),
    ("float8_e5m2", "nearest", 3),
    ("float8_e4m3fn", "nearest", 4),  # not IEEE-style: the kernel leaves it to the reference loop
]


@pytest.mark.parametrize(("fmt", "rounding", "chunk"), SEQ_CASES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (5, 33, 37), (9, 70, 130), (4, 32, 64)])
def test_sequential_kernel_equals_reference_loop(fmt: str, rounding: str, chunk: int | None, m: int, n: int,
                                                 k: int) -> None:
    acc = Accumulator(format=fmt, chunk=chunk, rounding=rounding)  # type: ignore[arg-type]
    a, b = _values((m, k), seed=m + k), _values((n, k), seed=n + 2 * k)
    got = A.accumulate_matmul(a, b, acc)
    assert_bitwise_equal(got, A.reference_loop(a, b, acc), context=f"{fmt} {rounding} chunk={chunk} {m}x{n}x{k}")


def test_sequential_kernel_is_taken_and_narrow() -> None:
    """The C kernel really runs (a patched reference loop is never called) and the accumulator is narrower than
    float32 (the float32 matmul differs)."""
    acc = Accumulator(format="e8m13", chunk=128, rounding="toward_zero")
    a, b = _values((8, 256), 1), _values((40, 256), 2)
    calls = []
    orig = A.reference_loop
    A.reference_loop = lambda *args: calls.append(1) or orig(*args)  # type: ignore[assignment]
    try:
        got = A.accumulate_matmul(a, b, acc)
    finally:
        A.reference_loop = orig  # type: ignore[assignment]
    assert not calls
    assert not torch.equal(got, a @ b.t())


@pytest.mark.parametrize(("fmt", "rounding"), [("e8m13", "nearest"), ("e8m4", "toward_zero"),
                                               ("float16", "nearest"), ("float16", "toward_zero")])
def test_sequential_special_values(fmt: str, rounding: str) -> None:
    """inf and NaN operands, partial sums that overflow the format (float16: 65504; e8 formats: 2^128), float32
    subnormal partial sums (products near 2^-140), and products that are -0: the kernel gives the loop's bits."""
    acc = Accumulator(format=fmt, chunk=6, rounding=rounding)  # type: ignore[arg-type]
    a = _values((6, 24), 3)
    b = _values((35, 24), 4)
    a[0, 3] = float("inf")
    a[1, 5] = float("nan")
    b[2, 7] = float("-inf")
    a[2, :] = 2.0**-70  # products of about 2^-70 * b: float32 subnormal partial sums
    b[3, :] = 2.0**-72
    a[3, :] = -0.0  # row of -0 products: signed zeros through rounding and promotion
    big = 2.0**100 if fmt.startswith("e8") else 2.0**8
    a[4, :] = big  # partial sums beyond the format's largest value
    b[5, :] = big
    got = A.accumulate_matmul(a, b, acc)
    want = A.reference_loop(a, b, acc)
    assert_bitwise_equal(got, want, context=f"{fmt} {rounding}")
    assert torch.isinf(got).any() and torch.isnan(got).any()
    zeros = want[3] == 0
    assert torch.equal(torch.signbit(got[3][zeros]), torch.signbit(want[3][zeros]))


def test_sequential_batched_and_transposed_operands() -> None:
    """Leading batch dimensions (folded into the rows, or one GEMM per batch element when both operands have them)
    and non-contiguous operands (the kernel copies b transposed; a is made contiguous)."""
    acc = Accumulator(format="e8m7", chunk=8)
    a = _values((2, 3, 5, 40), 5)
    b = _values((40, 7), 6).t()  # non-contiguous [7, 40]
    assert_bitwise_equal(A.accumulate_matmul(a, b, acc), A.reference_loop(a, b, acc), context="folded batch")
    b3 = _values((3, 7, 40), 7)
    assert_bitwise_equal(A.accumulate_matmul(a, b3, acc), A.reference_loop(a, b3, acc), context="broadcast batch")
    at = _values((40, 5), 8).t()
    assert_bitwise_equal(A.accumulate_matmul(at, b, acc), A.reference_loop(at, b, acc), context="a transposed")


# ------------------------------------------------------------------------------------------- blocked model
BLOCK_CASES = [
    Accumulator(block=4, bits=24, rounding="toward_zero"),  # Fasi et al.: V100 / T4 fp16 tensor cores
    Accumulator(block=8, bits=24, rounding="toward_zero", chunk=32),
    Accumulator(block=16, bits=14, rounding="toward_zero", format="e8m13"),
    Accumulator(block=4, bits=26, rounding="nearest"),
    Accumulator(block=3, bits=5, rounding="nearest", format="e8m4", chunk=9),
    Accumulator(block=2, bits=12, rounding="toward_zero", format="float16"),
    Accumulator(block=1, bits=48, rounding="nearest"),  # an exact product added with one rounding: fl32(c + p)
    Accumulator(block=64, bits=48, rounding="toward_zero"),  # 48 + log2(65) > 53 bits: the int64 route
]


@pytest.mark.parametrize("acc", BLOCK_CASES, ids=lambda a: f"n{a.block}-p{a.bits}-{a.rounding}-{a.format}-c{a.chunk}")
def test_blocked_kernel_equals_exact_oracle(acc: Accumulator) -> None:
    """The C kernel (exact products in double, aligned terms as int64) and the tensor route (float64 tensor
    operations, the route without a compiler or off the CPU) against the rational-arithmetic definition, on fp16
    operands over 12 binades, K not a multiple of the block."""
    m, n, k = 5, 34, 45
    a = _values((m, k), 11, torch.float16, spread=12.0)
    b = _values((n, k), 12, torch.float16, spread=12.0)
    a[1, :8] = 0.0  # a block of zero products
    want = torch.tensor(A.blocked_reference(a.tolist(), b.tolist(), acc), dtype=torch.float32)
    assert_bitwise_equal(A.accumulate_matmul(a, b, acc), want, context=f"kernel {acc}")
    assert_bitwise_equal(A._blocked_tensor(a, b, acc), want, context=f"tensor route {acc}")


@pytest.mark.parametrize("acc", [Accumulator(block=4, bits=24, rounding="toward_zero"),
                                 Accumulator(block=8, bits=14, format="e8m13", rounding="nearest", chunk=16)],
                         ids=["float32", "e8m13"])
def test_blocked_special_and_subnormal_values(acc: Accumulator) -> None:
    """Blocks with an infinite or NaN term (the IEEE sum of the block: the kernel's scalar route), results in
    float32's subnormal range (products near 2^-140: q_ieee's scalar route), overflow past the format's largest
    value, rows of -0 products: the kernel equals the tensor route, and on the finite rows the exact oracle."""
    a = _values((6, 40), 13, torch.float16)
    b = _values((34, 40), 14, torch.float16)
    a[0, 3] = float("inf")
    a[1, 9] = float("nan")
    b[2, 17] = float("-inf")
    a[2, :] = 2.0**-70  # subnormal results
    b[3, :] = 2.0**-72
    a[3, :] = -0.0
    a[4, :] = 2.0**100  # beyond float32 / e8m13 range after a few additions
    b[5, :] = 2.0**60
    got = A.accumulate_matmul(a, b, acc)
    assert_bitwise_equal(got, A._blocked_tensor(a, b, acc), context=f"special {acc}")
    rows, cols = [2, 3, 5], [j for j in range(34) if j != 2]  # no infinite or NaN operand
    want = torch.tensor(A.blocked_reference(a[rows].tolist(), b[cols].tolist(), acc), dtype=torch.float32)
    assert_bitwise_equal(got[rows][:, cols], want, context=f"oracle {acc}")
    assert torch.isinf(got).any() and torch.isnan(got).any()
    assert ((got[2] != 0) & (got[2].abs() < 2.0**-126)).any()  # really subnormal results


def test_blocked_truncation_hand_worked() -> None:
    """Fasi et al.'s kind of distinguishing test: c = 1 (the first block) plus one product t = 3 * 2^-25 = 0.75 ulp
    of 1 in float32.

    * float32 addition (any order, FMA or not): 1 + t rounds to nearest, 1 + 2^-23;
    * 24 alignment bits: the quantum at exponent 0 is 2^-23, t truncates to 0 before the sum: 1, whatever the
      final rounding;
    * 26 alignment bits: t survives (a multiple of 2^-25); the exact 1 + 3 * 2^-25 is then rounded once: toward
      zero 1, to nearest 1 + 2^-23.
    """
    a = torch.tensor([[1.0, 3 * 2.0**-25]])
    b = torch.tensor([[1.0, 1.0]])
    up = 1.0 + 2.0**-23
    assert float((a @ b.t())[0, 0]) == up
    cases = {(24, "toward_zero"): 1.0, (24, "nearest"): 1.0, (26, "toward_zero"): 1.0, (26, "nearest"): up}
    for (bits, rounding), want in cases.items():
        for block in (1, 2):  # [1] then [c, t], or [0, 1, t] in one block: the same alignment against 1
            acc = Accumulator(block=block, bits=bits, rounding=rounding)  # type: ignore[arg-type]
            assert float(A.accumulate_matmul(a, b, acc)[0, 0]) == want, (bits, rounding, block)
            assert A.blocked_reference(a.tolist(), b.tolist(), acc)[0][0] == want
            assert float(A._blocked_tensor(a, b, acc)[0, 0]) == want


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"bits": 24}, "Accumulator.bits"),
    ({"block": 4}, "Accumulator.bits"),
    ({"block": 0, "bits": 24}, "Accumulator.block"),
    ({"block": 4, "bits": 60}, "Accumulator.bits"),
    ({"block": 4, "bits": 24, "chunk": 6}, "Accumulator.chunk"),
    ({"block": 4, "bits": 24, "format": "float8_e4m3fn"}, "Accumulator.format"),
])
def test_accumulator_fields_are_checked(kwargs: dict, field: str) -> None:
    with pytest.raises(lowprec.UsageError, match=field.replace(".", r"\.")):
        Accumulator(**kwargs)


def test_blocked_round_trips_and_default_hash_unchanged() -> None:
    """The new fields serialise with a recipe; left out (None), the dict and so every recipe hash stay as before."""
    acc = Accumulator(block=8, bits=24, rounding="toward_zero", chunk=64)
    base = lowprec.recipes.get("h100-fp8")
    import dataclasses

    lin = base.linear
    r = dataclasses.replace(base, name="blocked", linear=dataclasses.replace(
        lin, forward=dataclasses.replace(lin.forward, accumulator=acc)))
    back = lowprec.recipes.Recipe.from_dict(r.to_dict())
    assert back.linear.forward.accumulator == acc
    assert "block" not in str(base.to_dict())


# ---------------------------------------------------------------------------------- compiled and in training
@pytest.mark.parametrize("acc", [Accumulator(format="e8m13", chunk=128, rounding="toward_zero"),
                                 Accumulator(block=4, bits=24, rounding="toward_zero")], ids=["sequential", "blocked"])
def test_compiled_operator_gives_eager_bits(acc: Accumulator) -> None:
    """Inside torch.compile the accumulation is one opaque operator (``torch.ops.lowprec.accumulate_matmul``): the
    compiled function gives the eager bits, and the operator is in the captured graph."""
    a, b = _values((2, 6, 50), 21), _values((9, 50), 22)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x, y: A.accumulate_matmul(x * 1.0, y, acc), backend=backend, fullgraph=True)
    assert_bitwise_equal(fn(a, b), A.accumulate_matmul(a, b, acc), context="compiled")
    assert any("lowprec.accumulate_matmul" in str(n.target) for g in graphs for n in g.graph.nodes)


def test_h100_training_same_bits_with_kernel_and_reference_loop() -> None:
    """Three AdamW steps of a converted two-layer model under h100-fp8 (every GEMM through the e8m13 accumulator,
    promoted every 128): the weights are bit-identical with the C kernel and with the reference loop."""
    def run(native: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(150, 70), torch.nn.GELU(), torch.nn.Linear(70, 20))
        lowprec.convert(model, "h100-fp8")  # modules "0" and "2": no keep_high_precision pattern matches
        opt = lowprec.optim.LowPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "h100-fp8")
        g = torch.Generator().manual_seed(1)
        with _native.enabled(native):
            for _ in range(3):
                x = torch.randn(33, 150, generator=g)
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for i, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
        assert_bitwise_equal(got, want, context=f"parameter {i}")
