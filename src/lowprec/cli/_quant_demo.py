"""The short quantization demo behind ``lowprec demo`` (and ``make demo``)."""

from __future__ import annotations

import torch

from .._errors import UsageError
from ..quant import QuantSpec, fake_quantize, quantize
from ..testing import sqnr_db


def run_demo(seed: int = 0) -> None:
    """Quantize one activation-like tensor (heavy-tailed, with outliers) with every named spec."""
    if seed < 0:
        raise UsageError(f"--seed must be >= 0; got {seed}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 1024, generator=g) * torch.exp(torch.randn(256, 1, generator=g))
    x[0, :8] *= 50.0  # a few outliers, as in real activations
    print(f"\nQuantizing a 256x1024 float32 tensor (seed {seed}); SQNR = 20 log10(|x| / |x - q(x)|)")
    print(f"{'spec':<22}{'SQNR dB':>9}  {'max abs err':>12}")
    for name in QuantSpec.names():
        y = fake_quantize(x, name)
        print(f"{name:<22}{sqnr_db(x, y):9.2f}  {float((x - y).abs().max()):12.4g}")
    print("\nStochastic rounding is unbiased: fp16, start at 1024, add 0.5 2048 times")
    acc_rn = torch.tensor([1024.0])
    acc_sr = torch.full((1000,), 1024.0)
    for step in range(2048):
        acc_rn = quantize(acc_rn + 0.5, "float16")
        acc_sr = quantize(acc_sr + 0.5, "float16", rounding="stochastic", seed=seed, offset=step * 1000)
    print(f"  nearest-even: {float(acc_rn[0]):.1f}   stochastic (mean of 1000 runs): {float(acc_sr.mean()):.1f}"
          f"   exact: {1024 + 0.5 * 2048:.1f}")
