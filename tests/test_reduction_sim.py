"""lowprec.distributed.simulate_reduction: the exact arithmetic of all-reduce algorithms at scale.

Oracles: hand-worked bfloat16 examples (the ring's result depends on the chunk's starting rank), float64 payloads
(every algorithm is the float64 sum to 1e-15), a two-rank MX ring written out with ``fake_quantize``, and the
rounding-error analysis of the module docstring.  The analysis is compared on 4096 elements, where the measured
relative L2 error has a relative standard deviation of about 1/sqrt(2 * 4096) = 1.1%: a band of [0.8, 1.25] around
the prediction is 18 standard deviations wide on the low side, so a failure is a model or simulator error, not
chance."""

from __future__ import annotations

import math

import pytest
import torch

from lowprec import UsageError
from lowprec.distributed import gaussian_gradients, simulate_reduction
from lowprec.quant import fake_quantize


def _constant(values: list[float]) -> object:
    table = torch.tensor(values, dtype=torch.float32)

    def g(ranks: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
        return table[ranks]

    return g


def test_ring_order_matters_hand_worked() -> None:
    # ranks hold 1, 3*2^-10, 3*2^-10; bf16's half ulp at 1 is 2^-8 = 0.0039
    g = _constant([1.0, 3 * 2**-10, 3 * 2**-10])
    r = simulate_reduction(3, algorithm="ring", payload="bfloat16", chunk=2, chunks=3, gradients=g)  # type: ignore[arg-type]
    # chunk 0 starts at rank 0: 1 + 0.0029 -> 1, + 0.0029 -> 1.  chunk 1 starts at rank 1: 0.0029 + 0.0029 =
    # 1.5 * 2^-8 (exact), + 1 = 1.00586 -> 1 + 2^-7.  chunk 2 starts at rank 2: like chunk 0.
    assert r.values[:, 0].tolist() == [1.0, 1.0 + 2**-7, 1.0]
    assert torch.equal(r.exact, torch.full((3, 2), 1.0 + 6 * 2**-10, dtype=torch.float64))
    t = simulate_reduction(3, algorithm="tree", payload="bfloat16", chunk=2, chunks=3, gradients=g)  # type: ignore[arg-type]
    assert t.values.unique().tolist() == [1.0]  # (g0 + g1) -> 1, then + g2 -> 1
    a = simulate_reduction(3, algorithm="alltoall", payload="bfloat16", chunk=2, chunks=3, gradients=g)  # type: ignore[arg-type]
    assert a.values.unique().tolist() == [1.0 + 6 * 2**-10] and a.rel_l2 == 0.0  # one float32 sum: exact here


def test_mx_ring_two_ranks_written_out() -> None:
    grads = gaussian_gradients(3)
    r = simulate_reduction(2, algorithm="ring", payload="mxfp8_e4m3", chunk=64, chunks=2, gradients=grads)
    elements = torch.arange(128).reshape(2, 64)
    starts = torch.tensor([[0], [1]])
    g0 = grads(starts.expand(2, 64).contiguous(), elements)
    g1 = grads(((starts + 1) % 2).expand(2, 64).contiguous(), elements)
    want = fake_quantize(fake_quantize(g0, "mxfp8_e4m3") + g1, "mxfp8_e4m3")  # own gradient in float32
    assert torch.equal(r.values, want.double())
    assert torch.equal(r.exact, g0.double() + g1.double())


@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving", "alltoall", "sequential"])
def test_float64_is_exact(algorithm: str) -> None:
    r = simulate_reduction(64, algorithm=algorithm, payload="float64", accumulate="float64", input="float32")  # type: ignore[arg-type]
    assert r.rel_l2 < 1e-15


@pytest.mark.parametrize("algorithm,accumulate", [("ring", "float32"), ("tree", "float32"), ("halving", "float32"),
                                                  ("alltoall", "float32"), ("sequential", "bfloat16")])
def test_error_follows_the_analysis(algorithm: str, accumulate: str) -> None:
    r = simulate_reduction(1024, algorithm=algorithm, payload="bfloat16", accumulate=accumulate)  # type: ignore[arg-type]
    assert r.predicted_rel_l2 is not None
    assert 0.8 <= r.rel_l2 / r.predicted_rel_l2 <= 1.25, (r.rel_l2, r.predicted_rel_l2)


def test_ring_grows_as_sqrt_w_alltoall_is_flat() -> None:
    ring = [simulate_reduction(w, algorithm="ring").rel_l2 for w in (64, 4096)]
    flat = [simulate_reduction(w, algorithm="alltoall").rel_l2 for w in (64, 4096)]
    assert 6.5 <= ring[1] / ring[0] <= 9.5  # sqrt(4096 / 64) = 8
    assert 0.9 <= flat[1] / flat[0] <= 1.15
    assert flat[1] < ring[1] / 20


def test_gaussian_gradients_are_counter_based() -> None:
    g = gaussian_gradients(7)
    ranks = torch.randint(0, 10**5, (50_000,), generator=torch.Generator().manual_seed(0))
    elems = torch.randint(0, 10**6, (50_000,), generator=torch.Generator().manual_seed(1))
    a = g(ranks, elems)
    assert torch.equal(a[1000:2000], g(ranks[1000:2000], elems[1000:2000]))  # a value depends on (r, e) alone
    assert not torch.equal(a, gaussian_gradients(8)(ranks, elems))
    z_mean = float(a.double().mean()) * math.sqrt(a.numel())  # N(0, 1): |z| < 5 fails with probability 6e-7
    assert abs(z_mean) < 5
    var = float(a.double().var())  # sd of the sample variance: sqrt(2 / n) = 0.0063
    assert abs(var - 1.0) < 5 * math.sqrt(2 / a.numel())


def test_bad_input() -> None:
    with pytest.raises(UsageError, match="needs a power-of-two world; got 12"):
        simulate_reduction(12, algorithm="halving")
    with pytest.raises(UsageError, match="world must be an int >= 1"):
        simulate_reduction(0)
    with pytest.raises(UsageError, match="unknown algorithm 'butterfly'"):
        simulate_reduction(4, algorithm="butterfly")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="payload='fp7' is neither a float format"):
        simulate_reduction(4, payload="fp7")
    with pytest.raises(UsageError, match="accumulate must be one of"):
        simulate_reduction(4, accumulate="int8")
    with pytest.raises(UsageError, match="must return a tensor of shape"):
        simulate_reduction(4, gradients=lambda r, e: torch.zeros(3))
