"""The operations lowprec's kernels are made of, on the XLA device against eager CPU, bit for bit.

Oracle: the same torch operation on CPU tensors in this process.  ``lowprec.quant._xla`` replaces torch_xla 2.9's
lowerings of the shifts and of ``view(dtype)``; these tests check each one on edge values (negative operands,
shifts by 0 and 31, the int32 range) and that none takes torch_xla's CPU fallback.  Also recorded here, as facts
the kernels' XLA forms rest on: XLA flushes float32 subnormals (which is why ``_round`` builds subnormal results
from bits on XLA) and it does not contract ``a * b + c`` into a fused multiply-add (a difference in the last bit
that would change rounding emulation; the accumulator test in test_xla_quant.py checks it on lowprec's own loop).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _helpers import assert_same_bits, run_on_xla

from lowprec.quant import _xla

_xla.register()

G = torch.Generator().manual_seed(0)
K = torch.cat([torch.tensor([0, 1, -1, -8, 5, 2**31 - 1, -2**31, 0x7F800000, 0x7FFFFF, -65536], dtype=torch.int32),
               torch.randint(-2**31, 2**31 - 1, (4086,), dtype=torch.int32, generator=G)])
S = torch.cat([torch.tensor([0, 1, 3, 22, 23, 30, 31, 16, 15, 8], dtype=torch.int32),
               torch.randint(0, 32, (4086,), dtype=torch.int32, generator=G)])

INT_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "x >> 3": lambda k, s: k >> 3,
    "x >> t": lambda k, s: k >> s,
    "x >> 0-d int64": lambda k, s: k >> torch.tensor(5, device=k.device),
    "5 >> t": lambda k, s: 5 >> s,
    "1 << t": lambda k, s: 1 << s,
    "x << 3": lambda k, s: k << 3,
    "x << t": lambda k, s: k << s,
    "bitwise_right_shift(x, 3)": lambda k, s: torch.bitwise_right_shift(k, 3),
    "bitwise_left_shift(x, 3)": lambda k, s: torch.bitwise_left_shift(k, 3),
    "x & 0x7FFFFFFF": lambda k, s: k & 0x7FFFFFFF,
    "x | -2^31": lambda k, s: k | -(1 << 31),
    "x ^ t": lambda k, s: k ^ s,
    "x + 0x7FFF (wraps)": lambda k, s: k + 0x7FFF,
    "x * 0x21F0AAAD (wraps)": lambda k, s: k * 0x21F0AAAD,
    "where(x > 0, x, 0)": lambda k, s: torch.where(k > 0, k, 0),
    "clamp(x, 0, 22)": lambda k, s: torch.clamp(k, 0, 22),
    "x.view(float32).view(int32)": lambda k, s: k.view(torch.float32).view(torch.int32),
    "int32 -> float32": lambda k, s: k.to(torch.float32),
}


@pytest.mark.parametrize("name", list(INT_OPS))
def test_integer_operations_give_the_cpu_bits(name: str) -> None:
    fn = INT_OPS[name]
    want = fn(K, S)
    assert_same_bits(run_on_xla(fn, K, S), want, name)


def test_float_bits_views_round_trip_every_pattern() -> None:
    """view(int32) / view(float32) / bf16 <-> int16 are one BitcastConvert each: NaN payloads, -0, subnormals kept."""
    x = K.view(torch.float32)
    assert_same_bits(run_on_xla(lambda t: t.view(torch.int32), x), K, "float32 -> int32")
    h = K.to(torch.int16)
    assert_same_bits(run_on_xla(lambda t: t.view(torch.bfloat16).view(torch.int16), h), h, "int16 <-> bf16")


def test_xla_flushes_float32_subnormals() -> None:
    """The fact the kernels' XLA forms work around: 1e-40 * 2 is 0 on XLA, 2e-40 on the CPU; 1e-40 > 0 is False."""
    x = torch.tensor([1e-40, 1.0])
    got = run_on_xla(lambda t: (t * 2.0, t > 0), x)
    assert got[0].tolist() == [0.0, 2.0] and (x * 2.0)[0].item() == pytest.approx(2e-40, rel=1e-4)
    assert got[1].tolist() == [False, True]


_FMA_PROBE = ("import torch, torch_xla; d = torch_xla.device(); a = torch.full((64,), 1.0 + 2.0**-12, device=d); "
              "c = torch.full((64,), -(1.0 + 2.0**-11), device=d); print((a * a + c).cpu()[0].item())")


@pytest.mark.parametrize("max_isa", [None, "AVX"])
def test_fused_multiply_add_contraction(max_isa: str | None) -> None:
    """a * b + c with a = b = 1 + 2^-12, c = -(1 + 2^-11): rounded separately 0 (torch on the CPU), fused 2^-24.
    XLA's CPU code generator contracts the two into an FMA on a CPU with FMA instructions (fresh processes: the
    flag is read when the PJRT client starts); ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (this suite's conftest) leaves
    FMA out.  The quantizers are unaffected either way (their float products are exact); the optimizer's
    updates are not."""
    import os

    a = torch.full((64,), 1.0 + 2.0**-12)
    assert (a * a + torch.full((64,), -(1.0 + 2.0**-11)) == 0).all()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if max_isa:
        env["XLA_FLAGS"] = f"--xla_cpu_max_isa={max_isa}"
    out = subprocess.run([sys.executable, "-c", _FMA_PROBE], capture_output=True, text=True, timeout=300, check=True,
                         env=env)
    got = float(out.stdout.split()[-1])
    fma = "fma" in Path("/proc/cpuinfo").read_text().split()
    assert got == (2.0**-24 if fma and max_isa is None else 0.0), out.stdout + out.stderr


def test_this_suite_runs_without_fma() -> None:
    assert run_on_xla(lambda a, c: a * a + c, torch.full((64,), 1.0 + 2.0**-12),
                      torch.full((64,), -(1.0 + 2.0**-11))).eq(0).all()


def test_torch_xla_alone_gets_the_shifts_wrong() -> None:
    """Why ``_xla`` exists (a fresh process, nothing registered): torch_xla 2.9 computes -1 >> 3 as 0 and 1 << 31
    as +2^31 in int64.  When a torch_xla release fixes these, this test says so and the overrides can go."""
    code = ("import torch, torch_xla; d = torch_xla.device(); "
            "k = torch.tensor([-1, -8], dtype=torch.int32, device=d); "
            "s = torch.tensor([31], dtype=torch.int32, device=d); "
            "print((k >> 3).cpu().tolist(), (1 << s).cpu().tolist(), (1 << s).dtype)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[0] == "[0, -1] [2147483648] torch.int64", out.stdout + out.stderr
