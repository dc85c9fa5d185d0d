"""lowprec.distributed compress hooks: DDP gradient all-reduce in low-precision formats.

Oracles: (1) single process vs distributed: the gradient after DDP backward on 2 gloo ranks (one torchrun launch,
``_dist_compress_worker.py``) equals ``mean_r fake_quantize(g_r)`` computed with ``lowprec.quant`` directly, bit
for bit, with the shared scale of tensor-scaled specs from the global amax; (2) byte counts against the wire size
written out by hand per format; (3) ``lowprec.quant.fake_quantize`` for the codec without processes; (4) a z-test
for stochastic rounding's mean.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from lowprec.distributed._compress import (
    CompressState,
    compress_hook,
    ring_allgather_bytes,
    ring_allreduce_bytes,
    rounding_seed,
)
from lowprec.distributed._wire import BucketCodec, pack, resolve_spec, unpack, wire_nbytes
from lowprec.quant import QuantSpec, fake_quantize, quantize_scaled
from lowprec.testing import torchrun

pytestmark = pytest.mark.slow  # make test-slow: real torchrun process groups

WORKER = Path(__file__).with_name("_dist_compress_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist_compress")
    torchrun(WORKER, str(out), nproc=2, timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# Wire bytes per rank for n elements, written out per format (not computed by _wire): codes + scales (+ amax).
def _expected_sent(name: str, n: int) -> int:
    c = math.ceil
    table = {
        "float32": 4 * n,
        "bfloat16": 2 * n, "bfloat16_sr": 2 * n, "float16": 2 * n,
        "fp8_e4m3_tensorwise": n + 4, "fp8_e5m2_tensorwise": n + 4, "fp8_e4m3_tensorwise_sr": n + 4,
        "fp8_e5m2_sr_same_input": n + 4,  # 1 byte per element + the float32 amax of the MAX all-reduce
        "mxfp8_e4m3": n + c(n / 32), "mxfp8_e4m3_sr": n + c(n / 32),  # one E8M0 byte per 32 elements
        "mxfp6_e3m2": 3 * c(n / 4) + c(n / 32),  # four 6-bit codes in three bytes
        "nvfp4": c(n / 2) + c(n / 16) + 4,  # two codes per byte, an E4M3 byte per 16, a float32 tensor scale
    }
    return table[name]


def test_ddp_parity_bitwise_and_identical_on_ranks(ranks: list[dict]) -> None:
    r0, r1 = ranks
    assert r0["world"] == 2 and len(r0["parity"]) == 12
    for name, res in r0["parity"].items():
        for s0, s1 in zip(res["steps"], r1["parity"][name]["steps"], strict=True):
            assert s0["equal"] and s1["equal"], (name, s0["max_diff"], s1["max_diff"])
            assert s0["digest"] == s1["digest"], name  # both ranks hold the same gradient
            assert s0["buckets"] == 1


def test_ddp_bytes_match_wire_size(ranks: list[dict]) -> None:
    for rank in ranks:
        for name, res in rank["parity"].items():
            n = res["numel"]
            for s in res["steps"]:
                assert s["bytes_sent"] == _expected_sent(name, n), name
                assert s["bytes_uncompressed"] == 4 * n  # ring all-reduce of fp32 on 2 ranks: 2 * (1/2) * 4n
    fp8 = ranks[0]["parity"]["fp8_e4m3_tensorwise"]["steps"][0]
    assert fp8["bytes_uncompressed"] / fp8["bytes_sent"] >= 3.9


def test_ddp_stochastic_rounding_differs_between_ranks(ranks: list[dict]) -> None:
    # Same local gradient on both ranks: the oracle (rank-specific streams) gives different values per rank, and
    # the DDP result matches that oracle bit for bit, so the hook drew independent bits on each rank.
    steps = ranks[0]["parity"]["fp8_e5m2_sr_same_input"]["steps"]
    assert all(s["ranks_differ"] and s["equal"] for s in steps)
    digests = {s["digest"] for s in steps}
    assert len(digests) == len(steps)  # the same input rounds differently at every step


def test_ddp_multiple_buckets_and_rebuild(ranks: list[dict]) -> None:
    mb = ranks[0]["multi_bucket"]
    assert all(mb["equal"])
    assert mb["buckets"][-1] == 3  # one bucket per parameter after DDP's rebuild (step 0 uses one big bucket)
    assert mb["bytes_sent"] == 2 * mb["total_numel"]


def test_ddp_error_feedback_tracks_true_sum(ranks: list[dict]) -> None:
    on, off = ranks[0]["ef_on"], ranks[0]["ef_off"]
    # 1e-6 is below half of fp8's smallest step at this scale: without feedback it is never sent.
    assert off["tiny_err"] == pytest.approx(off["tiny_true"], rel=1e-6)
    assert on["tiny_err"] < 0.05 * on["tiny_true"]
    # sum of sent = sum of true - mean residual: the error stays within one residual instead of growing.
    assert on["telescope_err"] < 1e-7
    assert on["err"] <= on["max_residual"] * (1 + 1e-4)
    assert on["err"] < off["err"]
    assert ranks[0]["nan"]["all_nan"] and ranks[1]["nan"]["all_nan"]


# ---- without processes ------------------------------------------------------------------------------------

SPECS = ["float32", "bfloat16", "float16", "fp8_e4m3_tensorwise", "fp8_e5m2_tensorwise", "mxfp8_e4m3",
         "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4", "mxint8", "nvfp4", "float8_e4m3fn"]


def _grad(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.exp2(torch.randint(-10, 1, (n,), generator=gen).float())


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("n", [1, 31, 1027])
def test_codec_roundtrip_equals_fake_quantize(name: str, n: int) -> None:
    codec = BucketCodec(resolve_spec(name))
    spec = codec.spec
    g = _grad(n)
    amax = g.abs().amax() * 3  # a shared amax larger than this rank's own, as from another rank
    msg = codec.encode(g, seed=None, amax=amax.reshape(1))
    assert msg.dtype == torch.uint8 and msg.numel() == wire_nbytes(n, spec)
    got = codec.decode(msg, n, amax=amax.reshape(1))
    if spec.scaling == "tensor":
        expect = fake_quantize(torch.cat([g, amax.reshape(1)]), spec)[:-1]
    else:
        expect = fake_quantize(g, spec)
    assert torch.equal(got, expect)


def test_pack_unpack_layout() -> None:
    spec = QuantSpec.named("nvfp4")
    g = _grad(100)
    codes, scales = quantize_scaled(g, spec)
    buf = pack(codes, scales)
    assert buf.numel() == 50 + 7 + 4 == wire_nbytes(100, spec)
    c2, s2 = unpack(buf, 100, spec, torch.uint8, torch.float8_e4m3fn)
    assert torch.equal(c2, codes)
    assert torch.equal(s2.group.view(torch.uint8), scales.group.view(torch.uint8))
    assert torch.equal(s2.tensor, scales.tensor)
    mx = QuantSpec.named("mxfp8_e4m3")
    codes, scales = quantize_scaled(g, mx)
    buf = pack(codes, scales)
    assert torch.equal(buf[:100], codes.view(torch.uint8)) and torch.equal(buf[100:], scales.view(torch.uint8))
    with pytest.raises(ValueError, match="must be 104 uint8 bytes"):
        unpack(buf[:-1], 100, mx, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def test_byte_accounting() -> None:
    assert ring_allgather_bytes(1000, 2) == 1000 and ring_allgather_bytes(1000, 4) == 3000
    assert ring_allreduce_bytes(4000, 2) == 4000 and ring_allreduce_bytes(4000, 4) == 6000
    assert ring_allreduce_bytes(4, 1) == 0
    state = CompressState("mxfp8_e4m3")
    state._count(10, 40, last=False)
    assert state.step == 0 and state.bytes_sent == 0  # published when the step's last bucket is sent
    state._count(5, 20, last=True)
    assert (state.step, state.bytes_sent, state.bytes_uncompressed, state.buckets) == (1, 15, 60, 2)
    assert state.compression_ratio == 4.0
    state._count(7, 28, last=True)
    assert (state.bytes_sent, state.total_bytes_sent, state.total_bytes_uncompressed) == (7, 22, 88)
    state.reset_counters()
    assert state.total_bytes_sent == 0 and state.step == 2


def test_stochastic_rounding_unbiased() -> None:
    # Each element is rounded up with probability p (its position between two bfloat16 neighbours): the sum over
    # elements and draws of (rounded - x) has mean 0 and variance sum p (1 - p) step^2.  |z| < 5 fails by chance
    # with probability 6e-7.
    codec = BucketCodec(resolve_spec("bfloat16", "stochastic"))
    n, draws = 2000, 50
    x = 1.0 + torch.rand(n, generator=torch.Generator().manual_seed(3)) / 128  # bfloat16 step 2^-7 in [1, 2)
    step = 2.0**-7
    p = (x - 1.0) / step - torch.floor((x - 1.0) / step)
    errs = torch.stack([codec.decode(codec.encode(x, seed=rounding_seed(0, t, 0, 0)), n) - x
                        for t in range(draws)])
    z = float(errs.double().sum() / math.sqrt(draws * float((p * (1 - p)).double().sum()) * step**2))
    assert abs(z) < 5
    assert not torch.equal(errs[0], errs[1])


def test_rounding_seed_streams_are_distinct() -> None:
    seeds = {rounding_seed(7, t, b, r) for t in range(3) for b in range(3) for r in range(3)}
    assert len(seeds) == 27 and all(0 <= s < 2**64 for s in seeds)
    assert rounding_seed(7, 1, 2, 0) == rounding_seed(7, 1, 2, 0)


def test_hook_signature_and_names() -> None:
    state, hook = compress_hook("bfloat16", rounding="stochastic", seed=3, error_feedback=True)
    assert state.spec == QuantSpec(elem="bfloat16", scaling="none", rounding="stochastic")
    assert resolve_spec("float8_e5m2").scaling == "tensor"  # narrow formats get a shared scale per bucket
    assert callable(hook)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"spec": "nope"}, "spec: unknown name"),
        ({"spec": 3}, "spec must be"),
        ({"spec": "fp8_e4m3_rowwise"}, "QuantSpec.scaling"),
        ({"spec": "fp8_e4m3_1x128"}, "QuantSpec.scaling"),
        ({"spec": QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=32, axis=1)}, "QuantSpec.axis"),
        ({"spec": "tf32"}, "QuantSpec.elem"),
        ({"spec": QuantSpec(elem="float8_e4m3fn", scaling="block", block_size=32, scale_format="tf32")},
         "QuantSpec.scale_format"),
        ({"spec": "bfloat16", "rounding": "up"}, "QuantSpec.rounding"),
        ({"spec": "bfloat16", "seed": -1}, "seed"),
        ({"spec": "bfloat16", "seed": 1.5}, "seed"),
        ({"spec": "bfloat16", "error_feedback": "yes"}, "error_feedback"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict, field: str) -> None:
    spec = kwargs.pop("spec")
    with pytest.raises(ValueError, match=field):
        compress_hook(spec, **kwargs)
