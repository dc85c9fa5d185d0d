"""``import lowprec.jax`` (and formats, specs, recipes) without PyTorch; the public names of ``lowprec`` unchanged.

The torch-free runs happen in a subprocess in which a ``sys.meta_path`` finder makes ``import torch`` (and every
``torch.*``) raise ``ImportError``, as on a machine without torch.  The same script runs in a normal subprocess
(torch importable, and imported first) for the bitwise comparison.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lowprec
import lowprec.quant

pytestmark = pytest.mark.slow  # make test-slow: fresh interpreters that import and compile JAX

SRC = Path(__file__).resolve().parents[1] / "src"

# Installed before anything else in the "no torch" subprocess: torch and torch.* cannot be imported.
_BLOCK_TORCH = '''
import sys
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch imported at start-up"

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
'''

# The calls a JAX user makes; every array result as the hex of its bytes (bits).
_SCRIPT = '''
import json
import sys

import numpy as np

if sys.argv[1] == "normal":
    import torch  # noqa: F401  (a normal process: torch is there and loaded)

import jax
import jax.numpy as jnp
import optax

import lowprec
import lowprec.jax as lj

out = {}


def bits(a):
    return np.asarray(a).tobytes().hex()


fmt = lowprec.formats.get("float8_e4m3fn")
out["e4m3_max"] = float(fmt.max).hex()
out["fp8_tensorwise_toml"] = lowprec.recipes.get("fp8-tensorwise").to_toml()
rec = lowprec.Recipe.from_toml("""
name = "mx-toml"
[linear.forward]
a = { spec = "mxfp8_e4m3" }
b = { spec = "mxfp8_e4m3" }
""")
out["toml_recipe"] = rec.to_toml()

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
w = jnp.asarray(rng.standard_normal((8, 64)).astype(np.float32))
b = jnp.asarray(rng.standard_normal(8).astype(np.float32))
out["mx_fake"] = bits(lj.fake_quantize(x, lowprec.QuantSpec.named("mxfp8_e4m3")))
sr = lowprec.QuantSpec(elem="float8_e5m2", scaling="tensor", rounding="stochastic")
out["sr_fake"] = bits(lj.fake_quantize(x, sr, seed=3))
codes, scales = lj.quantize_scaled(x, "nvfp4")
assert isinstance(scales, lowprec.quant.TwoLevelScales), type(scales)
out["nvfp4"] = [bits(codes), bits(scales.group), bits(scales.tensor)]

lin = lowprec.recipes.get("fp8-tensorwise").linear
y, vjp = jax.vjp(lambda x_, w_, b_: lj.linear(x_, w_, b_, recipe=lin), x, w, b)
out["linear"] = [bits(y)] + [bits(g) for g in vjp(jnp.ones_like(y))]

opt = lj.LowPrecisionOptimizer(optax.sgd(0.5), "bf16-sr")
params = opt.to_storage({"w": w})
state = opt.init(params)
params, state = opt.update({"w": w * 1e-3}, state, params, opt.step_keys(0))
out["optimizer_step"] = bits(params["w"])

gc = lowprec.recipes.GradComm(spec=lowprec.QuantSpec.named("mxfp8_e4m3"), rounding="stochastic")
keys = lj.comm_keys(gc, seed=5, step=0, world=2)
mean = jax.vmap(lambda g, k: lj.compressed_mean({"g": g}, gc, axis_name="d", keys=k)[0]["g"], axis_name="d")(
    jnp.stack([x, -0.5 * x]), keys
)
out["compressed_mean"] = bits(mean)

errors = {}
for name in ("convert", "fake_quantize", "nn", "optim"):
    try:
        getattr(lowprec, name)
    except ImportError as err:
        errors[name] = [type(err).__name__, str(err), err.name]
try:
    from lowprec.quant import quantize  # noqa: F401
except ImportError as err:
    errors["from lowprec.quant import quantize"] = [type(err).__name__, str(err), err.name]
out["errors"] = errors
out["torch_modules"] = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(json.dumps(out))
'''


def _run(mode: str) -> dict[str, Any]:
    """The script's results in a fresh interpreter; ``mode`` "no-torch" (torch blocked) or "normal"."""
    code = (_BLOCK_TORCH if mode == "no-torch" else "") + _SCRIPT
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert proc.returncode == 0, f"{mode} subprocess failed:\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def no_torch() -> dict[str, Any]:
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    return _run("no-torch")


@pytest.fixture(scope="module")
def normal() -> dict[str, Any]:
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    return _run("normal")


def test_jax_workflow_runs_without_torch(no_torch: dict[str, Any]) -> None:
    """Oracle: the module table (``sys.modules``) of a subprocess in which ``import torch`` fails: after importing
    lowprec, lowprec.jax, formats and recipes, reading a TOML recipe, fake quantization (MX, stochastic), NVFP4
    storage, ``lj.linear`` forward and backward, a ``LowPrecisionOptimizer`` step and a compressed gradient mean,
    no ``torch`` module is loaded (and every step produced its result)."""
    assert no_torch["torch_modules"] == []
    for key in ("e4m3_max", "mx_fake", "sr_fake", "nvfp4", "linear", "optimizer_step", "compressed_mean"):
        assert no_torch[key], key
    assert no_torch["e4m3_max"] == float.fromhex("0x1.cp8").hex()  # 448
    assert 'name = "mx-toml"' in no_torch["toml_recipe"]


def test_torch_names_raise_import_error_naming_torch(no_torch: dict[str, Any]) -> None:
    """Oracle: the documented contract of the lazy names: without torch, ``lowprec.convert``, ``lowprec.fake_quantize``,
    ``lowprec.nn``, ``lowprec.optim`` and ``from lowprec.quant import quantize`` raise ``ImportError`` whose message
    says PyTorch is needed and names what works without it, with ``err.name == "torch"``."""
    errors = no_torch["errors"]
    assert sorted(errors) == sorted(["convert", "fake_quantize", "nn", "optim", "from lowprec.quant import quantize"])
    for name, (kind, message, err_name) in errors.items():
        assert kind == "ImportError", name
        assert "needs PyTorch" in message and "pip install torch" in message and "lowprec.jax" in message, message
        assert err_name == "torch", name
    assert errors["convert"][1].startswith("lowprec.convert needs PyTorch")


def test_torch_free_results_equal_normal_process_bits(no_torch: dict[str, Any], normal: dict[str, Any]) -> None:
    """Oracle: the same calls in a normal subprocess (torch importable and imported first): every result, array
    bits included (hex of the bytes), is identical; the normal process does load torch, so the comparison is
    between the two import paths."""
    assert normal["torch_modules"], "the normal process should have torch loaded"
    assert normal["errors"] == {}
    keys = sorted(set(normal) - {"torch_modules", "errors"})
    assert keys == sorted(set(no_torch) - {"torch_modules", "errors"})
    for key in keys:
        assert no_torch[key] == normal[key], key


# The public names of lowprec and lowprec.quant before the lazy imports (the release they must keep), plus
# UsageError (issue 16: the one exception type for user errors).
LOWPREC_NAMES = [
    "FormatSpec", "QuantSpec", "Recipe", "UsageError", "__version__", "convert", "dequantize", "fake_quantize",
    "formats", "nn", "optim", "quant", "quantize", "quantize_scaled", "recipes", "unconvert",
]
QUANT_NAMES = [
    "QuantSpec", "TwoLevelScales", "backend", "dequantize", "fake_quantize", "get_backend", "quantize",
    "quantize_scaled", "set_backend",
]


def _loaded(package: str) -> set[str]:
    """Names of ``package``'s submodules imported so far that are not in its ``__all__``."""
    names = {m.split(".")[package.count(".") + 1] for m in sys.modules if m.startswith(package + ".")}
    return names - set(sys.modules[package].__all__)


def test_public_names_unchanged() -> None:
    """Oracle: the literal lists of public names of ``lowprec`` and ``lowprec.quant`` before the change: ``__all__``
    equals them, the public part of ``dir()`` equals them (less submodules imported elsewhere), and each name
    resolves to the object of its defining module (``lowprec.convert is lowprec.nn.convert``, ...)."""
    import lowprec.nn
    from lowprec.quant import _backend, _elementwise, _scaled

    assert lowprec.__all__ == LOWPREC_NAMES
    assert lowprec.quant.__all__ == QUANT_NAMES
    # Submodules other tests imported (lowprec.jax, lowprec.runs, ...) become attributes too, as they always did.
    loaded = _loaded("lowprec")
    public = [n for n in dir(lowprec) if (not n.startswith("_") or n == "__version__") and n not in loaded]
    assert public == sorted(LOWPREC_NAMES)
    quant_public = [n for n in dir(lowprec.quant) if not n.startswith("_") and n not in _loaded("lowprec.quant")]
    assert quant_public == QUANT_NAMES
    assert lowprec.convert is lowprec.nn.convert and lowprec.unconvert is lowprec.nn.unconvert
    for name in ("dequantize", "fake_quantize", "quantize_scaled"):
        assert getattr(lowprec, name) is getattr(lowprec.quant, name) is getattr(_scaled, name)
    assert lowprec.quantize is lowprec.quant.quantize is _elementwise.quantize
    for name in ("backend", "get_backend", "set_backend"):
        assert getattr(lowprec.quant, name) is getattr(_backend, name)
    from lowprec import convert, optim

    assert convert is lowprec.nn.convert and optim.__name__ == "lowprec.optim"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        lowprec.not_a_name  # noqa: B018
    with pytest.raises(ImportError, match="cannot import name"):
        from lowprec.quant import not_a_name  # type: ignore[attr-defined]  # noqa: F401


def test_moved_helpers_have_one_definition() -> None:
    """Oracle: object identity: each helper the JAX binding shares is the same object under its old (torch module)
    name and its new (torch-free module) name, and is defined in the torch-free module."""
    from lowprec.distributed import _wire
    from lowprec.quant import (
        _codec,
        _groups,
        _layout,
        _random,
        _random_py,
        _scale,
        _scale_rules,
        _scaled,
        _spec_args,
        _storage,
    )

    moved = [
        (_scale, _scale_rules, ["uses_multiplier", "_mantissa_bits", "_F32_MAX", "_SCALE_ROUNDING_TO_ELEM"]),
        (_scaled, _scale_rules, ["TwoLevelScales"]),
        (_scaled, _spec_args, ["_resolve"]),
        (_wire, _spec_args, ["resolve_spec"]),
        (_groups, _layout, ["check_layout", "reduce_dims"]),
        (_codec, _storage, ["code_value"]),
        (_random, _random_py, ["seed_keys", "stream_seed", "hash32_py", "random_bits_py", "derive_keys_py"]),
    ]
    for old, new, names in moved:
        for name in names:
            assert getattr(old, name) is getattr(new, name), f"{old.__name__}.{name}"
            obj = getattr(new, name)
            if callable(obj):
                assert obj.__module__ == new.__name__, f"{name} defined in {obj.__module__}"


def test_torch_dtype_names_match_codec() -> None:
    """Oracle: torch's own dtypes: ``_storage.has_torch_dtype`` (torch-free) is true exactly for the formats
    ``_codec.torch_dtype`` maps, and each such format's ``torch.<name>`` dtype has the format's bit width."""
    import torch

    from lowprec.quant import _codec, _storage

    for name in lowprec.formats.names():
        fmt = lowprec.formats.get(name)
        dt = _codec.torch_dtype(fmt)
        assert (dt is not None) == _storage.has_torch_dtype(fmt), name
        if dt is not None:
            assert dt is getattr(torch, name) and dt.itemsize * 8 == fmt.bits, name
