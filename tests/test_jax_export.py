"""Exported programs (``lowprec.jax.export`` / ``save`` / ``load``): serialized StableHLO that reloads and runs with
the same bits.

Oracles: the same functions jitted in this process with lowprec's CPU kernel on (the fast route, itself tested
against the XLA route and PyTorch elsewhere), and lowprec's PyTorch quantizers for every named spec.  A program is
exported, serialized to bytes (through a file for one case), deserialized and called; the bits must match.  What
"any PJRT backend" can be checked here: the program lowers for CPU, CUDA and TPU at once and holds no custom call;
running it on those devices needs them.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("flatbuffers")  # serialization
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax import export as jax_export  # noqa: E402

import lowprec  # noqa: E402
import lowprec.jax as lj  # noqa: E402
from lowprec import recipes  # noqa: E402
from lowprec.quant import QuantSpec  # noqa: E402

SPECS = QuantSpec.names()


def _bits(a: object) -> np.ndarray:
    arr = np.asarray(a)
    return arr.view({4: np.int32, 2: np.int16, 1: np.int8}[arr.dtype.itemsize])


def _reload(exported: jax_export.Exported) -> jax_export.Exported:
    return jax_export.deserialize(exported.serialize())


def _varied(shape: tuple[int, ...], seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = (g.standard_normal(shape) * np.exp2(g.integers(-20, 20, shape))).astype(np.float32)
    x.reshape(-1)[:6] = [0.0, -0.0, 1e-40, -3e38, 448.0, 1e-30]
    return x


@pytest.mark.slow  # make test-slow: one program of ~20 quantizers compiles for tens of seconds on 2 cores
def test_every_named_spec_exports_and_reloads_with_the_same_bits() -> None:
    """fake_quantize with every named spec, in one exported program (one output per spec): the reloaded
    program's bits equal the jitted functions' in this process (CPU kernel on) and lowprec's PyTorch quantizer's
    on the same input; no custom call in the module."""
    x = _varied((64, 256), 1)

    def every_spec(x):  # type: ignore[no-untyped-def]
        return {name: lj.fake_quantize(x, name) for name in SPECS}

    exported = lj.export(every_spec, x)
    assert lj.custom_call_targets(exported) == []
    got = _reload(exported).call(x)
    assert sorted(got) == sorted(SPECS)
    for name in SPECS:
        np.testing.assert_array_equal(_bits(got[name]), _bits(jax.jit(lj.fake_quantize, static_argnames="spec")(
            x, spec=name)), err_msg=name)
        want = lowprec.fake_quantize(torch.from_numpy(x), name).view(torch.int32).numpy()
        np.testing.assert_array_equal(_bits(got[name]), want, err_msg=f"{name} vs PyTorch")


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "nvfp4", "fp8_e5m2_tensorwise"])
def test_stochastic_rounding_and_storage_export_with_the_same_bits(name: str) -> None:
    """quantize_scaled (codes and scales) and fake_quantize with stochastic rounding (seed and offset baked into
    the program: the random words are a function of them and the element index)."""
    x = _varied((32, 128), 2)
    spec = dataclasses.replace(QuantSpec.named(name), rounding="stochastic")
    fake = functools.partial(lj.fake_quantize, spec=spec, seed=11, offset=3)
    np.testing.assert_array_equal(_bits(_reload(lj.export(fake, x)).call(x)), _bits(jax.jit(fake)(x)))
    want = lowprec.fake_quantize(torch.from_numpy(x), spec, seed=11, offset=3)
    np.testing.assert_array_equal(_bits(jax.jit(fake)(x)), want.view(torch.int32).numpy())
    store = functools.partial(lj.quantize_scaled, spec=name)
    got, ref = _reload(lj.export(store, x)).call(x), jax.jit(store)(x)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=f"{name} storage")


def _mlp_step(recipe: lowprec.Recipe, opt: lj.LowPrecisionOptimizer):  # type: ignore[no-untyped-def]
    """One training step of a 2-layer MLP with the recipe's GEMMs and weight policy; keys: the optimizer's random
    keys of the step (a zero array when the recipe has none), step: the 1-based step (SR operand streams)."""
    lin = recipe.linear

    def loss(params, states, x, y, step):  # type: ignore[no-untyped-def]
        h = lj.linear(x, params["w1"], params["b1"], recipe=lin, state=states[0], step=step, name="fc1")
        out = lj.linear(jax.nn.relu(h), params["w2"], params["b2"], recipe=lin, state=states[1], step=step,
                        name="fc2")
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()

    def step_fn(params, opt_state, states, x, y, step, keys):  # type: ignore[no-untyped-def]
        value, (g, new_states) = jax.value_and_grad(loss, argnums=(0, 1))(params, states, x, y, step)
        new_params, new_opt = opt.update(g, opt_state, params,
                                         keys if opt.update_kind == "stochastic" else None)
        return value, new_params, new_opt, new_states

    return step_fn


@pytest.mark.slow  # make test-slow: four whole training steps exported for three platforms
@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8", "bf16-sr", "fp8-delayed"])
def test_a_training_step_exports_and_trains_with_the_same_bits(name: str, tmp_path: Path) -> None:
    """A whole training step (forward, backward through the emulated GEMMs, AdamW, the recipe's weight policy and
    delayed-scaling state) exported once for CPU, CUDA and TPU, saved to a file, loaded and run for 4 steps: the
    loss, parameters and state equal the jitted step's at every step, bit for bit."""
    recipe = recipes.get(name)
    g = np.random.default_rng(3)
    params = {"w1": jnp.asarray(g.standard_normal((64, 32), np.float32) * 0.2), "b1": jnp.zeros(64, jnp.float32),
              "w2": jnp.asarray(g.standard_normal((10, 64), np.float32) * 0.2), "b2": jnp.zeros(10, jnp.float32)}
    x = jnp.asarray(g.standard_normal((16, 32), np.float32))
    y = jnp.asarray(g.integers(0, 10, 16))
    opt = lj.LowPrecisionOptimizer(optax.adamw(1e-2), recipe)
    params = opt.to_storage(params)
    opt_state = opt.init(params)
    states = (lj.init_state(recipe.linear), lj.init_state(recipe.linear))
    step_fn = _mlp_step(recipe, opt)
    keys0 = opt.step_keys(0)
    keys0 = jnp.zeros((4, 2), jnp.uint32) if keys0 is None else keys0
    exported = lj.export(step_fn, params, opt_state, states, x, y, jnp.int32(1), keys0,
                         platforms=("cpu", "cuda", "tpu"))
    assert exported.platforms == ("cpu", "cuda", "tpu")
    assert lj.custom_call_targets(exported) == []
    loaded = lj.load(lj.save(exported, tmp_path / "step.jax"))
    a = b = (params, opt_state, states)
    jitted = jax.jit(step_fn)
    for step in range(4):
        keys = opt.step_keys(step)
        keys = jnp.zeros((4, 2), jnp.uint32) if keys is None else keys
        la, *a_rest = loaded.call(*a, x, y, jnp.int32(step + 1), keys)
        lb, *b_rest = jitted(*b, x, y, jnp.int32(step + 1), keys)
        a, b = tuple(a_rest), tuple(b_rest)
        assert float(la) == float(lb), f"{name} step {step}: loss {float(la)} vs {float(lb)}"
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
            np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=f"{name} step {step}")
    assert float(la) < 2.5  # it trains (log 10 = 2.30 at the start)


def test_portable_traces_drop_the_cpu_kernel_and_plain_export_refuses_it() -> None:
    """With the CPU kernel on, a plain jax.export of tensorwise fp8 meets lowprec's custom call and refuses it;
    within ``portable()`` the same call succeeds and holds none.  Skipped where the kernel is not built."""
    from lowprec.jax import _native

    if not _native.available():
        pytest.skip("lowprec's JAX CPU kernel is not built here (no C compiler): nothing to drop")
    x = _varied((64, 256), 4)
    fn = functools.partial(lj.fake_quantize, spec="fp8_e4m3_tensorwise")
    jax.clear_caches()
    with pytest.raises(ValueError, match=_native.TARGET):
        jax_export.export(jax.jit(fn))(x)
    with lj.portable():
        exported = jax_export.export(jax.jit(fn))(x)
    assert lj.custom_call_targets(exported) == []


def test_bad_arguments_get_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(lowprec.UsageError, match="function to export"):
        lj.export("fake_quantize", np.zeros(4, np.float32))  # type: ignore[arg-type]
    with pytest.raises(lowprec.UsageError, match="no exported program"):
        lj.load(tmp_path / "missing.jax")
    junk = tmp_path / "junk.jax"
    junk.write_bytes(b"not a program")
    with pytest.raises(lowprec.UsageError, match="not a serialized JAX program"):
        lj.load(junk)


@pytest.mark.slow  # make test-slow: lowering for three platforms and compiling an mxfp8 step take ~20 s here
def test_the_xla_page_example_runs_as_printed(tmp_path: Path) -> None:
    """docs/xla.md's Python block: an mxfp8 training step exported for three platforms, saved, loaded and run for
    5 steps with the jitted step's losses (its own asserts)."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "xla.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    block = block.replace("/tmp/lowprec_mxfp8_step.jax", str(tmp_path / "step.jax"))
    exec(compile(block, "docs/xla.md", "exec"), {})
