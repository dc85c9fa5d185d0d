"""lowprec.inference schemes: serialisation, validation, plan(), and fake_quantize_weight against references.

Oracles: torchao 0.18's ``torchao.quantization.quant_primitives`` (``choose_qparams_affine`` /
``quantize_affine`` / ``dequantize_affine`` for integers; ``_choose_scale_float8`` / ``_quantize_affine_float8``
/ ``_dequantize_affine_float8`` for fp8 with float32 scales), compared bit for bit; for MX and NVFP4,
``lowprec.quant.fake_quantize`` with the named ``QuantSpec`` (the same code path, so that test checks the mapping,
not the numerics, which tests/test_quant* check against their own oracles).  compressed-tensors is not installed
here; when it is, its ``quantize``/``dequantize`` should be added as a second oracle.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec import inference as I
from lowprec.quant import QuantSpec, fake_quantize

DOCS = Path(__file__).resolve().parents[1] / "docs" / "inference.md"


def _weight(n: int = 256, k: int = 512, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    w[3] = 0.0  # an all-zero row: the eps clamp of the scale
    w[5, :] = w[5, :].abs()  # a row with no negative values: the asymmetric zero point at qmin
    return w


# ---------------------------------------------------------------------------------------------- serialising
@pytest.mark.parametrize("name", I.names())
def test_preset_round_trips_json_and_toml(name: str) -> None:
    s = I.get(name)
    assert s.name == name
    for back in (I.Scheme.from_json(s.to_json()), I.Scheme.from_toml(s.to_toml()), I.Scheme.from_dict(s.to_dict())):
        assert back == s
        assert back.hash() == s.hash()
    assert s.ignore == ("lm_head",)


def test_hashes_differ_between_presets() -> None:
    hashes = {I.get(n).hash() for n in I.names()}
    assert len(hashes) == len(I.names())


def test_required_presets_exist() -> None:
    need = {"w8a8-int8", "w4a16-int4", "fp8-static", "fp8-dynamic", "fp8-block", "mxfp8", "mxfp4", "nvfp4"}
    assert need <= set(I.names())
    with pytest.raises(ValueError, match="unknown scheme name 'w3a3'; valid names: w8a8-int8"):
        I.get("w3a3")


def test_presets_mirror_compressed_tensors_defaults() -> None:
    w4 = I.get("w4a16-int4").config_groups[0]
    assert w4.weights == I.TensorScheme(format="int4", granularity="group", group_size=128, symmetric=True)
    assert w4.input_activations is None
    w8 = I.get("w8a8-int8").config_groups[0]
    assert (w8.weights.granularity, w8.input_activations.granularity) == ("channel", "token")  # type: ignore[union-attr]
    assert w8.input_activations.dynamic is True  # type: ignore[union-attr]
    fb = I.get("fp8-block").config_groups[0]
    assert fb.weights.block == (128, 128) and fb.input_activations.group_size == 128  # type: ignore[union-attr]


def test_kv_cache_round_trips() -> None:
    s = dataclasses.replace(I.get("fp8-dynamic"), kv_cache=I.TensorScheme(format="float8_e4m3fn"))
    assert I.Scheme.from_toml(s.to_toml()) == s and I.Scheme.from_json(s.to_json()).hash() == s.hash()
    assert s.hash() != I.get("fp8-dynamic").hash()


def test_docs_toml_example_parses() -> None:
    text = DOCS.read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert blocks, "docs/inference.md has a TOML example"
    s = I.Scheme.from_toml(blocks[0])
    assert s.name == "my-w4a8" and [g.name for g in s.config_groups] == ["attention", "mlp"]
    assert tomllib.loads(s.to_toml()) == s.to_dict()


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(format="float8_e4m3fn", symmetric=False), r"TensorScheme.symmetric=False needs an integer format.*"
                                                        r"set symmetric=True"),
        (dict(format="int4", granularity="group", group_size=0), r"TensorScheme.group_size must be an integer >= 1 "
                                                                 r"for granularity='group'"),
        (dict(format="int4", granularity="group"), r"TensorScheme.group_size must be an integer >= 1"),
        (dict(format="int5"), r"TensorScheme.format: .*'int5'"),
        (dict(granularity="row"), r"TensorScheme.granularity must be one of 'tensor', 'channel', 'token'"),
        (dict(group_size=32), r"TensorScheme.group_size is only used with granularity 'group'.*remove group_size"),
        (dict(granularity="block", block=(128,)), r"TensorScheme.block must be a pair of positive ints"),
        (dict(format="int8", scale_format="bfloat16"), r"TensorScheme.scale_format must be 'float32' for the "
                                                       r"integer format 'int8'"),
        (dict(dynamic="local"), r"TensorScheme.dynamic='local' needs granularity='tensor_group'"),
        (dict(format="float4_e2m1fn", granularity="tensor_group", group_size=16),
         r"granularity='tensor_group' needs a narrow group scale_format"),
        (dict(format="float8_e8m0fnu"), r"TensorScheme.format cannot be the unsigned scale format"),
    ],
)
def test_tensor_scheme_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        I.TensorScheme(**kwargs)  # type: ignore[arg-type]


def test_role_validation() -> None:
    tok = I.TensorScheme(granularity="token")
    with pytest.raises(ValueError, match=r"ConfigGroup.weights.granularity='token' is for activations; weights use "
                                         r"'channel'"):
        I.ConfigGroup(weights=tok)
    with pytest.raises(ValueError, match=r"ConfigGroup.weights.dynamic must be False for weights"):
        I.ConfigGroup(weights=I.TensorScheme(dynamic=True))
    with pytest.raises(ValueError, match=r"ConfigGroup.input_activations.granularity='channel' is for weights"):
        I.ConfigGroup(input_activations=I.TensorScheme(granularity="channel"))
    with pytest.raises(ValueError, match=r"quantizes nothing"):
        I.ConfigGroup()
    with pytest.raises(ValueError, match=r"Scheme.config_groups is empty"):
        I.Scheme()
    g = I.ConfigGroup(weights=I.TensorScheme())
    with pytest.raises(ValueError, match=r"duplicate group name\(s\) \['group_0'\]"):
        I.Scheme(config_groups=(g, g))


def test_from_dict_names_the_path() -> None:
    d = I.get("w4a16-int4").to_dict()
    d["config_groups"][0]["weights"]["group_size"] = 0
    with pytest.raises(ValueError, match=r"scheme.config_groups\[0\].weights: TensorScheme.group_size must be"):
        I.Scheme.from_dict(d)
    d = I.get("w4a16-int4").to_dict()
    d["config_groups"][0]["weights"]["groupsize"] = 64
    with pytest.raises(ValueError, match=r"scheme.config_groups\[0\].weights: unknown key\(s\) \['groupsize'\]"):
        I.Scheme.from_dict(d)
    with pytest.raises(ValueError, match=r"scheme: unknown key\(s\) \['kv_cache_scheme'\]"):
        I.Scheme.from_dict({**d, "kv_cache_scheme": {}})


# ---------------------------------------------------------------------------------------------- plan()
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 10))


def test_plan_sequential_first_match_and_ignore() -> None:
    s = dataclasses.replace(I.get("w4a16-int4"), ignore=("3",))
    first = I.ConfigGroup(name="first", targets=("0",), weights=I.TensorScheme(format="int8",
                                                                               granularity="channel"))
    s = dataclasses.replace(s, config_groups=(first, *s.config_groups))
    entries = I.plan(_mlp(), s)
    assert [(e.name, e.group) for e in entries] == [("0", "first"), ("2", "group_0")]
    assert entries[1].weights == I.get("w4a16-int4").config_groups[0].weights
    assert isinstance(entries[0].module, nn.Linear)


def test_plan_unknown_pattern() -> None:
    s = I.get("fp8-dynamic")  # ignores lm_head, which this model lacks: allowed (the presets' output head)
    assert [e.name for e in I.plan(_mlp(), s)] == ["0", "2", "3"]
    typo = dataclasses.replace(s, ignore=("lm_haed",))
    with pytest.raises(ValueError, match=r"Scheme.ignore\[0\]: unknown module pattern 'lm_haed'.*module names are "
                                         r"'0', '1', '2', '3'; fix the pattern or remove it"):
        I.plan(_mlp(), typo)
    grp = dataclasses.replace(s.config_groups[0], targets=("Linear", "*.mlpp.*"))
    with pytest.raises(ValueError, match=r"config_groups\[0\].targets\[1\]: unknown module pattern '\*.mlpp.\*'"):
        I.plan(_mlp(), dataclasses.replace(s, ignore=(), config_groups=(grp,)))


def test_plan_shape_errors() -> None:
    model = nn.Sequential(nn.Linear(96, 64))
    s = dataclasses.replace(I.get("w4a16-int4"), ignore=())
    with pytest.raises(ValueError, match=r"config_groups\[0\].weights.group_size=128 does not divide "
                                         r"in_features=96 of module '0' \(weight \[64, 96\]\); choose a group size "
                                         r"that divides 96 or add '0' to Scheme.ignore"):
        I.plan(model, s)
    with pytest.raises(ValueError, match=r"weights.block=\(128, 128\) does not divide the weight \[64, 96\]"):
        I.plan(model, dataclasses.replace(I.get("fp8-block"), ignore=()))
    with pytest.raises(ValueError, match=r"group_size=16 does not divide in_features=24"):
        I.plan(nn.Sequential(nn.Linear(24, 16)), dataclasses.replace(I.get("nvfp4"), ignore=()))


def test_plan_tiny_llama() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    entries = I.plan(model, I.get("w8a8-int8"))
    assert [e.name for e in entries] == [n for n in linears if n != "lm_head"]
    assert len(entries) == 2 * 7
    attn = I.ConfigGroup(name="attn", targets=("*.self_attn.*",), weights=I.TensorScheme(granularity="channel"))
    s = dataclasses.replace(I.get("w4a16-int4"), config_groups=(attn, *I.get("w4a16-int4").config_groups))
    groups = {e.name: e.group for e in I.plan(model, s)}
    assert groups["model.layers.0.self_attn.q_proj"] == "attn"
    assert groups["model.layers.1.mlp.down_proj"] == "group_0"


# ---------------------------------------------------------------------------------------------- fake_quantize_weight
def _torchao_int(w: torch.Tensor, ts: I.TensorScheme) -> torch.Tensor:
    qp = pytest.importorskip("torchao.quantization.quant_primitives")
    n, k = w.shape
    block = {"channel": (1, k), "group": (1, ts.group_size), "tensor": (n, k)}[ts.granularity]
    qmin, qmax = (-128, 127) if ts.format == "int8" else (-8, 7)
    mapping = qp.MappingType.SYMMETRIC if ts.symmetric else qp.MappingType.ASYMMETRIC
    scale, zp = qp.choose_qparams_affine(w, mapping, block, torch.int8, qmin, qmax)
    q = qp.quantize_affine(w, block, scale, zp, torch.int8, qmin, qmax)
    return qp.dequantize_affine(q, block, scale, zp, torch.int8, qmin, qmax, output_dtype=torch.float32)


@pytest.mark.parametrize(
    "ts",
    [
        I.get("w8a8-int8").config_groups[0].weights,
        I.get("w4a16-int4").config_groups[0].weights,
        I.get("w4a16-int4-asym").config_groups[0].weights,
        I.TensorScheme(format="int8", granularity="tensor", symmetric=False),
    ],
    ids=["int8-channel-sym", "int4-g128-sym", "int4-g128-asym", "int8-tensor-asym"],
)
def test_int_weights_match_torchao_bit_for_bit(ts: I.TensorScheme) -> None:
    """torchao rounds with torch.round (half to even), quantizes with ``x * (1 / scale)``, symmetric scale
    ``amax / ((qmax - qmin) / 2)``, zero point ``qmin - round(min / scale)``, eps = float32 smallest normal."""
    w = _weight()
    got = I.fake_quantize_weight(w, ts)
    ref = _torchao_int(w, ts)
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} elements differ"
    assert got[3].abs().max() == 0


def _torchao_fp8(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    qp = pytest.importorskip("torchao.quantization.quant_primitives")
    s = qp._choose_scale_float8(w, list(block), torch.float8_e4m3fn)
    return qp._dequantize_affine_float8(qp._quantize_affine_float8(w, s, torch.float8_e4m3fn), s)


@pytest.mark.parametrize("name", ["fp8-static", "fp8-dynamic", "fp8-block"])
def test_fp8_weights_match_torchao_bit_for_bit(name: str) -> None:
    """torchao's float8 inference primitives: scale = amax / 448 (float32), x / scale, clamp, cast to e4m3 (ties
    to even), dequantize codes * scale.  torchao gives NaN for an all-zero group (0 / 0), so none here."""
    w = _weight()
    w[3] = 1.0
    ts = I.get(name).config_groups[0].weights
    assert ts is not None
    n, k = w.shape
    block = {"tensor": (n, k), "channel": (1, k), "block": ts.block}[ts.granularity]
    got = I.fake_quantize_weight(w, ts)
    ref = _torchao_fp8(w, block)  # type: ignore[arg-type]
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} elements differ"


def test_fp8_all_zero_group_is_zero_not_nan() -> None:
    w = _weight()
    got = I.fake_quantize_weight(w, I.get("fp8-dynamic").config_groups[0].weights)  # type: ignore[arg-type]
    assert torch.equal(got[3], torch.zeros(512)) and not got.isnan().any()


@pytest.mark.parametrize(("name", "spec"), [("mxfp8", "mxfp8_e4m3"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")])
def test_block_formats_are_the_named_quant_specs(name: str, spec: str) -> None:
    grp = I.get(name).config_groups[0]
    assert grp.weights is not None and grp.input_activations is not None
    w = _weight()
    assert I.weight_spec(grp.weights, tuple(w.shape)) == QuantSpec.named(spec)
    assert torch.equal(I.fake_quantize_weight(w, grp.weights), fake_quantize(w, QuantSpec.named(spec)))
    assert dataclasses.replace(grp.input_activations, dynamic=False).quant_spec() == QuantSpec.named(spec)


def test_weight_spec_float32_schemes_and_ints() -> None:
    ts = I.get("fp8-dynamic").config_groups[0].weights
    assert ts is not None
    assert I.weight_spec(ts, (256, 512)) == QuantSpec.named("fp8_e4m3_rowwise")
    blk = I.get("fp8-block").config_groups[0]
    assert I.weight_spec(blk.weights, (256, 512)) == QuantSpec.named("fp8_e4m3_128x128")  # type: ignore[arg-type]
    assert blk.input_activations is not None
    with pytest.raises(ValueError, match=r"integer schemes use the affine rule.*use lowprec.inference."
                                         r"fake_quantize_weight"):
        I.weight_spec(I.get("w8a8-int8").config_groups[0].weights, (256, 512))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"group_size=128 does not divide in_features=96"):
        I.fake_quantize_weight(torch.ones(8, 96), I.get("w4a16-int4").config_groups[0].weights)  # type: ignore


def test_fake_quantize_weight_keeps_dtype_and_is_deterministic() -> None:
    w = _weight().to(torch.bfloat16)
    for name in I.names():
        ts = I.get(name).config_groups[0].weights
        assert ts is not None
        a, b = I.fake_quantize_weight(w, ts), I.fake_quantize_weight(w, ts)
        assert a.dtype == torch.bfloat16 and a.shape == w.shape and torch.equal(a, b)
