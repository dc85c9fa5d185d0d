"""benchmarks/accumulator_error.py (quick grid): the error of each accumulator model against a float64 GEMM behaves
as its analysis says, and the published DeepSeek-V3 figure is placed against the models.

* Truncating after every addition has a bias: each of the K additions loses on average half a unit in the last
  of 14 bits of the partial sum, toward zero, so the relative error grows about linearly with K (here from about 1%
  at K = 128 to about 28% at K = 4096); promotion every 128 products restarts the partial sum, so the error stays
  at its K = 128 level whatever K is.
* DeepSeek-V3's "nearly 2%" at K = 4096 (14 bits, no promotion) lies between the blocked FMA model (n = 16, 14
  alignment bits: about 0.9%) and per-addition truncation (about 28%): per-addition truncation overstates the
  error of real tensor cores, which truncate once per block of products.
* float32 accumulation: about 1e-5 at most.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lowprec.quant import _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C compiler: the kernels are not built")


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "accumulator_error.py"
    spec = importlib.util.spec_from_file_location("accumulator_error", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["accumulator_error"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_accumulator_error_grows_and_promotion_bounds_it() -> None:
    bench = _bench()
    res = bench.run(bench.QUICK_KS, 1)
    rows = {name: row["by_k"] for name, row in res["models"].items()}
    seq = [rows["e8m13 toward zero, no promotion"][str(k)]["max_rel_err"] for k in bench.QUICK_KS]
    promo = [rows["e8m13 toward zero, promoted every 128 (h100-fp8)"][str(k)]["max_rel_err"] for k in bench.QUICK_KS]
    assert seq == sorted(seq) and seq[-1] > 10 * seq[0]  # K = 4096 vs 128: about linear growth (32x in K)
    assert max(promo) < 1.5 * min(promo)  # flat in K
    assert promo[-1] < seq[-1] / 10
    at = res["deepseek_check"]["max_rel_err_at_k"]
    assert at["blocked n=16, 14 bits, toward zero, no promotion"] < 0.02 < at["e8m13 toward zero, no promotion"]
    assert at["float32 (sequential, nearest)"] < 1e-4
    assert res["speed"]["reference_loop_over_kernel"] > 1
    assert bench.markdown(res).count("\n") == len(bench.MODELS) + 1
