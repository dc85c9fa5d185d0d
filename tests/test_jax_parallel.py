"""Data-parallel JAX (``lowprec.jax.data_parallel``) on 2 host devices, against one device and the PyTorch hook's codec.

The 2 devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` before JAX starts its backend, which the
pytest process has already done for the other JAX tests, so one subprocess (this file run as a script) computes
everything and prints JSON; each test checks its part.  Oracles:

* one device on the full batch (``jax.value_and_grad`` of the same loss): bitwise on a coarse grid where every
  partial sum is exact; within ``DP_VS_SINGLE_REL`` on general data over several AdamW steps;
* quantize-then-mean by hand with the PyTorch DDP hook's own codec (``lowprec.distributed._wire.BucketCodec``:
  encode/decode per rank with the MAX-reduced amax, float32 sum in rank order, / W), on each rank's gradient
  computed separately on one device: bitwise, for bf16, fp8 with a shared scale, MXFP8, stochastic bf16 (the
  hook's ``rounding_seed`` streams) and fp8 with error feedback over 3 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lowprec.testing.tolerances import DP_VS_SINGLE_REL

ROOT = Path(__file__).resolve().parents[1]

COMMS = {
    "bf16": {"spec": {"elem": "bfloat16"}},
    "fp8_tensor": {"spec": "fp8_e4m3_tensorwise"},
    "mxfp8": {"spec": "mxfp8_e4m3"},
    "bf16_sr": {"spec": {"elem": "bfloat16"}, "rounding": "stochastic"},
    "fp8_ef": {"spec": "fp8_e4m3_tensorwise", "error_feedback": True},
}


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_two_devices_see_two_devices(results: dict) -> None:
    """Oracle: ``jax.device_count()`` in the subprocess (the flag took effect, so the mesh really splits)."""
    assert results["devices"] == 2


def test_data_parallel_gradient_equals_full_batch_bitwise_on_a_grid(results: dict) -> None:
    """Oracle: one device's gradient of the full-batch loss; operands on a 1/64 grid make every sum exact, so the
    2-device mean must be identical bit for bit (and so must the loss)."""
    assert results["grid"]["grads_equal"] and results["grid"]["loss_equal"], results["grid"]


def test_data_parallel_training_tracks_one_device(results: dict) -> None:
    """Oracle: 5 AdamW steps (``lj.LowPrecisionOptimizer`` around optax) on one device with the full batch;
    tolerance ``DP_VS_SINGLE_REL`` (float32 summation order only)."""
    t = results["train"]
    assert t["max_rel"] < DP_VS_SINGLE_REL, t
    assert t["moved"] > 1e-3, t  # the parameters did train


@pytest.mark.parametrize("name", list(COMMS))
def test_compressed_allreduce_equals_quantize_then_mean_by_hand(results: dict, name: str) -> None:
    """Oracle: the PyTorch hook's codec applied per rank by hand, then the float32 mean in rank order (module
    docstring); bitwise.  ``changed`` shows the wire format really rounded the gradients (else equality is free)."""
    c = results["comm"][name]
    assert c["equal"], c
    assert c["changed"], c


# ------------------------------------------------------------------------------------------ the subprocess


def _worker() -> dict:  # pragma: no cover - runs in the subprocess
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    import lowprec
    import lowprec.jax as lj
    from lowprec.distributed._compress import rounding_seed
    from lowprec.distributed._wire import BucketCodec

    world = jax.device_count()
    mesh = jax.make_mesh((world,), ("data",))

    def loss_fn(params, batch):
        x, t = batch
        y = jnp.dot(x, params["w"].T, precision=jax.lax.Precision.HIGHEST) + params["b"]
        return jnp.mean((y - t) ** 2)

    def grid(rng, shape, lo=-64, hi=64):
        return jnp.asarray(rng.integers(lo, hi, shape) / 64.0, jnp.float32)

    rng = np.random.default_rng(0)
    out: dict = {"devices": world}
    # ---- bitwise on a grid (w [8,15], b [8]: 128 gradient elements; batch 8 = 2 shards of 4)
    params = {"w": grid(rng, (8, 15)), "b": grid(rng, (8,))}
    batch = (grid(rng, (8, 15)), grid(rng, (8, 8)))
    plain = lj.data_parallel(loss_fn, mesh)
    loss, grads, _ = plain(params, batch, lj.init_comm_state(params, None, world))
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, batch)
    out["grid"] = {"loss_equal": bool(np.array_equal(loss, ref_loss)),
                   "grads_equal": all(np.array_equal(grads[k], ref_grads[k]) for k in params)}

    # ---- 5 AdamW steps on general data, 2 devices vs 1
    recipe = lowprec.recipes.get("fp32")
    p0 = {"w": jnp.asarray(rng.standard_normal((8, 15)) / 4, jnp.float32), "b": jnp.zeros(8, jnp.float32)}
    data = [(jnp.asarray(rng.standard_normal((8, 15)), jnp.float32), jnp.asarray(rng.standard_normal((8, 8)),
                                                                                jnp.float32)) for _ in range(5)]
    final = []
    for dp in (True, False):
        opt = lj.LowPrecisionOptimizer(optax.adamw(1e-2), recipe)
        p, s = p0, opt.init(p0)
        for b in data:
            g = plain(p, b, lj.init_comm_state(p, None, world))[1] if dp else jax.grad(loss_fn)(p, b)
            p, s = opt.update(g, s, p)
        final.append(p)
    rel = max(float(np.max(np.abs(final[0][k] - final[1][k]) / (np.abs(final[1][k]) + 1e-6))) for k in p0)
    out["train"] = {"max_rel": rel, "moved": float(np.max(np.abs(final[1]["w"] - p0["w"])))}

    # ---- compressed all-reduce vs the PyTorch hook's codec by hand (grid data: local gradients are exact)
    out["comm"] = {}
    shards = [(batch[0][r * 4:(r + 1) * 4], batch[1][r * 4:(r + 1) * 4]) for r in range(world)]
    for name, table in COMMS.items():
        gc = lowprec.Recipe.from_dict({"name": "t", "grad_comm": table}).grad_comm
        t0 = time.perf_counter()
        step_fn = lj.data_parallel(loss_fn, mesh, grad_comm=gc)
        codec = BucketCodec(lj.comm_spec(gc))
        state = lj.init_comm_state(params, gc, world)
        residual = [torch.zeros(128) for _ in range(world)]
        equal, changed, p = True, False, params
        for step in range(3 if gc.error_feedback else 1):
            keys = lj.comm_keys(gc, seed=0, step=step, world=world)
            _, got, state = step_fn(p, batch, state, keys)
            local = []
            for r in range(world):
                gr = jax.grad(loss_fn)(p, shards[r])
                flat = torch.from_numpy(np.concatenate([np.asarray(gr[k]).ravel() for k in sorted(gr)]).copy())
                local.append(flat + residual[r] if gc.error_feedback else flat)
            amax = None
            if codec.shared_scale:
                amax = torch.stack([torch.nan_to_num(g.abs().amax(), nan=float("inf")) for g in local]).amax()
                amax = amax.reshape(1)
            total = None
            for r, g in enumerate(local):
                seed = rounding_seed(0, step, 0, r) if codec.spec.rounding == "stochastic" else None
                d = codec.decode(codec.encode(g, seed=seed, amax=amax), 128, amax=amax)
                changed = changed or not torch.equal(d, g)
                residual[r] = g - d
                total = d if total is None else total + d
            want = (total / world).numpy()
            have = np.concatenate([np.asarray(got[k]).ravel() for k in sorted(got)])
            equal = equal and bool(np.array_equal(have, want))
            # move on, so the next step differs (host round trip: the oracle runs on one device)
            p = jax.tree_util.tree_map(lambda a, g: jnp.asarray(np.asarray(a) - 0.25 * np.asarray(g)), p, got)
        out["comm"][name] = {"equal": equal, "changed": changed, "s": round(time.perf_counter() - t0, 2)}
    return out


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(_worker()))
