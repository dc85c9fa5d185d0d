"""lowprec.jax training (``linear``, ``dot_general``, ``LowPrecisionOptimizer``) against lowprec's PyTorch training.

Oracle: PyTorch's ``EmulatedLinear`` (built with ``lowprec.convert`` from the same recipe object, loaded from the
same TOML) and ``LowPrecisionOptimizer``, bit for bit.

Where the bits depend on a float32 GEMM's summation order (XLA's and PyTorch's BLAS differ), the bitwise tests use
inputs whose quantized operands make every partial sum exact in float32 (``_order_free`` checks it: all products
are multiples of ``2^e`` and every row of ``|a| @ |b|^T`` stays below ``2^(24 + e)``), so any order gives the same
bits and the comparison isolates what lowprec computes: quantization, scales, delayed-scaling state, random
streams, accumulator emulation, output rounding, bias.  The values still round (random mantissas, power-of-two
scales).  On general data the quantized operands are compared bitwise and the GEMM outputs within twice the float32
GEMM error bound ``gamma_K * (|a| @ |b|^T)``, ``gamma_K = K u / (1 - K u)``, ``u = 2^-24`` (Higham, Accuracy and
Stability of Numerical Algorithms, 3.5), plus one output-format step where the GEMM output is rounded.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import lowprec  # noqa: E402
import lowprec.jax as lj  # noqa: E402
from lowprec import recipes  # noqa: E402
from lowprec.jax import _dense  # noqa: E402
from lowprec.nn import _linear as tlin  # noqa: E402
from lowprec.quant import _random as trandom  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
B, K, N = 8, 64, 16

# The stochastically rounded e5m2 MX spec of operand a of both gradient GEMMs (an inline TOML table).
_SR_E5M2 = ('{ elem = "float8_e5m2", scaling = "block", block_size = 32, scale_format = "float8_e8m0fnu", '
            'rounding = "stochastic" }')
# A custom recipe from TOML: MXFP8 everywhere, gradients rounded stochastically (the random-stream test).
SR_TOML = """
name = "mxfp8-sr-grad"
[linear.forward]
a = { spec = "mxfp8_e4m3" }
b = { spec = "mxfp8_e4m3" }
[linear.grad_input]
a = { spec = SR_E5M2 }
b = { spec = "mxfp8_e4m3" }
[linear.grad_weight]
a = { spec = SR_E5M2 }
b = { spec = "mxfp8_e4m3" }
""".replace("SR_E5M2", _SR_E5M2)


def _recipe(name: str) -> lowprec.Recipe:
    """A named recipe, or the TOML one above, round-tripped through TOML (the objects a config file gives)."""
    rec = lowprec.Recipe.from_toml(SR_TOML) if name == "mxfp8-sr-grad" else recipes.get(name)
    return lowprec.Recipe.from_toml(rec.to_toml())


def _grid(rng: np.random.Generator, shape: tuple[int, ...], amax: float, lo: float = 1 / 14) -> np.ndarray:
    """Values ``+-[lo * amax, amax)`` on a 2^-12 grid (12 random bits: fp8/bf16 operands still round), one of them
    ``amax`` (tensor scales 0.875 = 448 * 2^-9 = 57344 * 2^-16 are powers of two)."""
    mag = np.round(rng.uniform(amax * lo, amax, shape) * 4096) / 4096
    v = (mag * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    v.flat[0] = amax
    return v


def _normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-2, 3, shape[-1])).astype(np.float32)


def _bits(a: object) -> np.ndarray:
    a = np.asarray(a.detach() if isinstance(a, torch.Tensor) else a, dtype=np.float32)
    return a.view(np.uint32)


def _assert_bits(got: object, ref: object, what: str) -> None:
    g, r = _bits(got), _bits(ref)
    assert g.shape == r.shape, (what, g.shape, r.shape)
    ne = g != r
    if ne.any():
        gf, rf = g.view(np.float32), r.view(np.float32)
        raise AssertionError(f"{what}: {ne.sum()} of {ne.size} differ; max |diff| {np.abs(gf - rf).max():.3g}; "
                             f"first jax {gf[ne][:3]} torch {rf[ne][:3]}")


def _low_exp(v: np.ndarray) -> int:
    """The exponent of the lowest set bit over the nonzero float32 values ``v``."""
    v = v[v != 0].astype(np.float64)
    m, e = np.frexp(v)
    ints = np.round(m * 2.0**24).astype(np.int64)
    tz = np.array([(int(i) & -int(i)).bit_length() - 1 for i in ints])
    return int((e - 24 + tz).min())


def _order_free(qa: np.ndarray, qb: np.ndarray) -> bool:
    """Every partial sum of ``qa @ qb^T`` is exact in float32, in any summation order."""
    qa, qb = np.asarray(qa, np.float64), np.asarray(qb, np.float64)
    e = _low_exp(qa) + _low_exp(qb)
    return bool((np.abs(qa) @ np.abs(qb).T).max() < 2.0 ** (24 + e))


# --------------------------------------------------------------------------------------------------- helpers
def _torch_layer(rec: lowprec.Recipe, w: np.ndarray, b: np.ndarray) -> torch.nn.Sequential:
    lin = torch.nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w))
        lin.bias.copy_(torch.from_numpy(b))
    return lowprec.convert(torch.nn.Sequential(lin), rec)


def _torch_step(model: torch.nn.Sequential, x: np.ndarray, dy: np.ndarray) -> tuple[torch.Tensor, ...]:
    lin = model[0]
    lin.weight.grad = lin.bias.grad = None
    xt = torch.from_numpy(x).requires_grad_(True)
    y = model(xt)
    y.backward(torch.from_numpy(dy))
    return y, xt.grad, lin.weight.grad, lin.bias.grad


_JITTED: dict[tuple[str, str], object] = {}


def _jax_step(rec: lowprec.Recipe):
    """jitted ``(x, w, b, state, step, dy) -> (y, dx, dW, db, new_state)`` for layer "0" (``convert``'s name)."""
    if (rec.name, "step") not in _JITTED:
        def f(x, w, b, state, step, dy):
            fn = lambda x, w, b, s: lj.linear(x, w, b, recipe=rec.linear, state=s, step=step,  # noqa: E731
                                              seed=rec.seed, name="0")
            y, vjp = jax.vjp(fn, x, w, b, state)
            return (y, *vjp(dy))

        _JITTED[(rec.name, "step")] = jax.jit(f)
    return _JITTED[(rec.name, "step")]


def _jax_operands(rec: lowprec.Recipe):
    """jitted ``(x, w, dy, step) -> {"gemm.a|b": quantized operand}`` of a fresh layer "0" (current amax)."""
    if (rec.name, "ops") not in _JITTED:
        lin = rec.linear

        def f(x, w, dy, step):
            keys = _dense.step_keys(lin, step, seed=rec.seed, name="0")
            amax = {r: _dense.roll_history(t, jnp.zeros(1), "max")[0]
                    for r, t in (("input", x), ("weight", w), ("grad_output", dy))}
            tensors = {"forward": (x, w), "grad_input": (dy, w.T), "grad_weight": (dy.T, x.T)}
            return {f"{g}.{o}": _dense.quantize_operand(t, getattr(lin, g), g, o, keys, amax)
                    for g, pair in tensors.items() for o, t in zip("ab", pair, strict=True)}

        _JITTED[(rec.name, "ops")] = jax.jit(f)
    return _JITTED[(rec.name, "ops")]


def _torch_operands(rec: lowprec.Recipe, x: np.ndarray, w: np.ndarray, dy: np.ndarray, step: int):
    """EmulatedLinear's six quantized operands {"gemm.a|b": tensor} for a fresh layer "0" at ``step`` (delayed
    scaling with an empty history uses the current amax)."""
    lin = rec.linear
    xt, wt, gt = (torch.from_numpy(v) for v in (x, w, dy))
    tensors = {"forward": (xt, wt), "grad_input": (gt, wt.t()), "grad_weight": (gt.t(), xt.t())}
    amax = {"input": xt.abs().amax(), "weight": wt.abs().amax(), "grad_output": gt.abs().amax()}
    keys = {k: trandom.derive_keys(trandom.key_tensor(trandom.stream_seed(rec.seed, "0", *k)), torch.tensor(step))
            for k in _dense.ROLE}
    return {f"{g}.{o}": tlin.quantize_operand(t.contiguous(), getattr(lin, g), g, o, keys, amax)
            for g, pair in tensors.items() for o, t in zip("ab", pair, strict=True)}


def _run(name: str, x, w, b, dy, step: int = 1, state=None):
    rec = _recipe(name)
    state = lj.init_state(rec.linear) if state is None else state
    return _jax_step(rec)(x, w, b, state, step, dy)


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ["mxfp8-sr-grad"])
def test_quantized_operands_match_torch_on_general_data(name: str) -> None:
    """Oracle: ``lowprec.nn._linear.quantize_operand`` (what EmulatedLinear multiplies), bit for bit, for all six
    GEMM operands on general data (normals over five decades per column): tensorwise scales from a delayed amax,
    MX blocks along each GEMM's reduction dimension, stochastic rounding with EmulatedLinear's keys for step 3."""
    rec = _recipe(name)
    rng = np.random.default_rng(1)
    x, w, dy = _normal(rng, (B, K)), _normal(rng, (N, K)), _normal(rng, (B, N))
    got = _jax_operands(rec)(x, w, dy, 3)
    for key, ref in _torch_operands(rec, x, w, dy, step=3).items():
        _assert_bits(got[key], ref, f"{name} {key}")


@pytest.mark.parametrize("name", ["fp8-tensorwise", "mxfp8", "bf16", "h100-fp8", "mxfp8-sr-grad"])
def test_linear_forward_and_gradients_match_torch_bitwise(name: str) -> None:
    """Oracle: ``lowprec.convert``-ed ``nn.Linear`` (EmulatedLinear) at its first training step: output, grad_input,
    grad_weight and grad_bias bit for bit, on inputs whose GEMM sums are exact in any order (checked on
    EmulatedLinear's quantized operands)."""
    rng = np.random.default_rng(2)
    lo = 0.57 if name == "bf16" else 1 / 14  # bf16 keeps 8 bits: a narrower range keeps its sums exact
    x, w, dy = (_grid(rng, s, 0.875, lo) for s in ((B, K), (N, K), (B, N)))
    b = _grid(rng, (N,), 0.5)
    rec = _recipe(name)
    ops = _torch_operands(rec, x, w, dy, step=1)
    for g in _dense.GEMMS:
        assert _order_free(ops[f"{g}.a"].numpy(), ops[f"{g}.b"].numpy()), f"test input not order-free for {g}"
    ref = _torch_step(_torch_layer(rec, w, b), x, dy)
    got = _jax_step(rec)(x, w, b, lj.init_state(rec.linear), 1, dy)  # (y, dx, dW, db, d_state)
    for what, gv, rv in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, ref, strict=False):
        _assert_bits(gv, rv, f"{name} {what}")


@pytest.mark.parametrize("name", ["fp8-tensorwise", "bf16"])
def test_linear_general_data_within_gemm_error_bound(name: str) -> None:
    """Oracle: EmulatedLinear.  On general data the operands are bitwise equal (tests above and
    tests/test_jax_quant.py), so output and gradients may differ only by the two GEMMs' summation orders: within
    2 gamma_K |a||b|^T of EmulatedLinear's operands (+ one bf16 step where the recipe rounds the GEMM output, and
    the bias add's rounding)."""
    rec = _recipe(name)
    rng = np.random.default_rng(3)
    x, w, b, dy = _normal(rng, (B, K)), _normal(rng, (N, K)), _normal(rng, (N,)), _normal(rng, (B, N))
    ops = _torch_operands(rec, x, w, dy, step=1)
    ref = _torch_step(_torch_layer(rec, w, b), x, dy)
    got = _jax_step(rec)(x, w, b, lj.init_state(rec.linear), 1, dy)
    u = 2.0**-24
    for i, g in enumerate(_dense.GEMMS):
        qa, qb = (ops[f"{g}.{o}"].numpy().astype(np.float64) for o in "ab")
        k = qa.shape[1]
        r = ref[i].detach().numpy().astype(np.float64)
        bound = 2 * k * u / (1 - k * u) * (np.abs(qa) @ np.abs(qb).T).reshape(r.shape)
        if getattr(rec.linear, g).output_format == "bfloat16":
            bound = bound + 2.0**-7 * np.abs(r)  # each side rounds to bf16: one bf16 step apart at most
        if i == 0:
            bound = bound + 2 * u * np.abs(r)  # the bias add on each side rounds once more
        diff = np.abs(np.asarray(got[i], np.float64) - r)
        assert (diff <= bound).all(), f"{name} {g}: max excess {(diff - bound).max():.3g}"


def test_delayed_scaling_three_steps_match_torch() -> None:
    """Oracle: EmulatedLinear's ``amax_history_<role>`` buffers and outputs over 3 training steps of fp8-delayed:
    the JAX state (the gradient with respect to the state) equals the buffers bit for bit after every step, the
    outputs and gradients are bitwise equal, and the scale sequence 448 / amax_used lags the data by one step."""
    rec = _recipe("fp8-delayed")
    rng = np.random.default_rng(4)
    w, b = _grid(rng, (N, K), 0.875), _grid(rng, (N,), 0.5)
    model = _torch_layer(rec, w, b)
    state = lj.init_state(rec.linear)
    scales = []
    for step, factor in enumerate((1.0, 4.0, 2.0), start=1):
        x, dy = _grid(rng, (B, K), 0.875) * factor, _grid(rng, (B, N), 0.875) / factor
        before = {r: np.asarray(h) for r, h in state.items()}
        ref = _torch_step(model, x, dy)
        *got, state = _jax_step(rec)(x, w, b, state, step, dy)
        for what, gv, rv in zip(("output", "grad_input", "grad_weight", "grad_bias"), got, ref, strict=True):
            _assert_bits(gv, rv, f"step {step} {what}")
        for role in ("input", "weight", "grad_output"):
            _assert_bits(state[role], getattr(model[0], f"amax_history_{role}"), f"step {step} history {role}")
        past = before["input"].max()
        scales.append(448 / (past if past > 0 else np.abs(x).max()))
    assert scales == [512, 512, 128], scales  # step 2 scales with step 1's amax (0.875), step 3 with step 2's


def test_stochastic_streams_follow_torch_step_counter() -> None:
    """Oracle: EmulatedLinear with stochastically rounded gradients over two training steps: grad_input and
    grad_weight bit for bit at steps 1 and 2 (PyTorch's ``lp_step``), and different between the steps for the same
    inputs (the step enters the keys)."""
    rec = _recipe("mxfp8-sr-grad")
    rng = np.random.default_rng(5)
    x, w, b, dy = _grid(rng, (B, K), 0.875), _grid(rng, (N, K), 0.875), _grid(rng, (N,), 0.5), _grid(rng, (B, N), 0.875)
    model = _torch_layer(rec, w, b)
    seen = []
    for step in (1, 2):
        ref = _torch_step(model, x, dy)
        got = _jax_step(rec)(x, w, b, {}, step, dy)
        _assert_bits(got[1], ref[1], f"step {step} grad_input")
        _assert_bits(got[2], ref[2], f"step {step} grad_weight")
        seen.append(_bits(got[1]))
    assert (seen[0] != seen[1]).any()


def test_dot_general_is_linear_on_flattened_operands() -> None:
    """Oracle: ``lowprec.jax.linear`` on the operands ``dot_general`` documents (lhs free dims -> rows, rhs free
    dims -> columns, contracting dims -> K), outputs and gradients bit for bit."""
    lin = _recipe("bf16").linear
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.standard_normal((4, 8, 2)).astype(np.float32))  # contract dims 1, 2 -> K = 16
    rhs = jnp.asarray(rng.standard_normal((8, 2, 3)).astype(np.float32))  # contract dims 0, 1; free dim 2 -> N = 3
    dn = (((1, 2), (0, 1)), ((), ()))
    f = lambda a, c: lj.dot_general(a, c, dn, recipe=lin)  # noqa: E731
    g = lambda a, c: lj.linear(a.reshape(4, 16), c.reshape(16, 3).T, recipe=lin)  # noqa: E731
    dy = jnp.asarray(rng.standard_normal((4, 3)).astype(np.float32))
    both = jax.jit(lambda a, c: [jax.vjp(h, a, c)[1](dy) + (h(a, c),) for h in (f, g)])
    got, ref = both(lhs, rhs)
    assert got[2].shape == (4, 3)
    for gv, rv in zip(got, ref, strict=True):
        _assert_bits(gv, rv, "dot_general grad")
    with pytest.raises(ValueError, match="batch dimensions"):
        lj.dot_general(lhs, rhs, (((1, 2), (0, 1)), ((0,), (2,))), recipe=lin)


def test_linear_user_errors_name_the_fix() -> None:
    """Oracle: the documented argument rules (delayed scaling needs ``init_state``, stochastic operands a step)."""
    x, w = jnp.ones((2, K)), jnp.ones((N, K))
    with pytest.raises(ValueError, match="init_state"):
        lj.linear(x, w, recipe=_recipe("fp8-delayed").linear)
    with pytest.raises(ValueError, match="step="):
        lj.linear(x, w, recipe=_recipe("mxfp8-sr-grad").linear)
    with pytest.raises(ValueError, match="LinearRecipe"):
        lj.linear(x, w, recipe=_recipe("bf16"))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("name", ["fp32", "bf16-pure", "bf16-sr", "bf16-kahan"])
def test_weight_update_policies_match_torch(name: str) -> None:
    """Oracle: ``lowprec.optim.LowPrecisionOptimizer`` around an SGD step ``w <- w + g`` (lr 1, maximize) against
    ``LowPrecisionOptimizer`` around ``optax.identity()`` (``w + u`` with ``u = g``): weights bit for bit after each
    of 3 steps with small updates (which bf16-pure loses and bf16-sr/-kahan keep), gradients fake-quantized to
    e4m3 first where the recipe says so.  Leaf order of the pytree {"bias", "weight"} = PyTorch's parameter order."""
    base = recipes.get(name)
    grad_spec = lowprec.QuantSpec.named("fp8_e4m3_tensorwise") if name == "bf16-sr" else None
    rec = lowprec.Recipe.from_toml(
        lowprec.Recipe(name=base.name, weights=base.weights, seed=7,
                       optimizer=lowprec.recipes.OptimizerState(grad=grad_spec)).to_toml())
    rng = np.random.default_rng(8)
    w0, b0 = rng.standard_normal((N, K)).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    tw, tb = torch.nn.Parameter(torch.from_numpy(w0.copy())), torch.nn.Parameter(torch.from_numpy(b0.copy()))
    topt = lowprec.optim.LowPrecisionOptimizer(torch.optim.SGD([tb, tw], lr=1.0, maximize=True), rec)
    opt = lj.LowPrecisionOptimizer(optax.identity(), rec)
    params = opt.to_storage({"bias": jnp.asarray(b0), "weight": jnp.asarray(w0)})
    state = opt.init(params)
    update = jax.jit(opt.update)
    for step in range(3):
        gw = (rng.standard_normal((N, K)) * 1e-3).astype(np.float32)
        gb = (rng.standard_normal(N) * 1e-3).astype(np.float32)
        tw.grad, tb.grad = torch.from_numpy(gw), torch.from_numpy(gb)
        topt.step()
        params, state = update({"bias": jnp.asarray(gb), "weight": jnp.asarray(gw)}, state, params,
                               opt.step_keys(step))
        _assert_bits(params["weight"], tw, f"{name} step {step} weight")
        _assert_bits(params["bias"], tb, f"{name} step {step} bias")
    if name == "bf16-kahan":
        _assert_bits(state.compensation["weight"], topt.compensation[1], "kahan compensation")
    assert int(state.count) == topt.steps == 3


def test_optimizer_state_is_quantized_and_loss_scaling_refused() -> None:
    """Oracle: ``lowprec.jax.fake_quantize`` (itself PyTorch-exact): after a step of optax.adam under a recipe with
    bf16 ``exp_avg``/``exp_avg_sq``, both moments are fixed points of bf16 fake quantization and not all zero; a
    recipe with loss scaling is refused with the reason."""
    spec = lowprec.QuantSpec(elem="bfloat16", scaling="none")
    rec = lowprec.Recipe(optimizer=lowprec.recipes.OptimizerState(exp_avg=spec, exp_avg_sq=spec))
    opt = lj.LowPrecisionOptimizer(optax.adam(1e-3), rec)
    p = {"w": jnp.linspace(-1.0, 1.0, 64)}
    state = opt.init(p)
    _, state = opt.update({"w": jnp.linspace(0.1, 0.3, 64) / 3}, state, p)
    adam = state.inner[0]
    for m in (adam.mu["w"], adam.nu["w"]):
        assert jnp.any(m != 0)
        _assert_bits(lj.fake_quantize(m, spec), m, "moment on the bf16 grid")
    with pytest.raises(ValueError, match="loss scaling"):
        lj.LowPrecisionOptimizer(optax.sgd(0.1), "fp16-dynamic-loss-scale")


def test_docs_example_trains_a_tiny_mlp() -> None:
    """Oracle: the example's own assertions (the loss of a 2-layer MLP under fp8-delayed with bf16-sr weights
    falls over a few steps; the delayed-scaling state fills); docs/jax.md's Python block is run as printed."""
    text = (ROOT / "docs" / "jax.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(block, "docs/jax.md", "exec"), {})
