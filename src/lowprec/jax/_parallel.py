"""Data-parallel JAX training with a recipe's low-precision gradient all-reduce (``Recipe.grad_comm``).

``data_parallel(loss_fn, mesh)`` turns a per-example-mean loss into a jitted function that splits the batch over
the mesh axis (``jax.shard_map``), differentiates on every device, and averages the gradients across devices the
way the PyTorch DDP hook ``lowprec.distributed.compress_hook`` does (see its module docstring).  The gradient pytree
is one bucket: its leaves flattened and concatenated in leaf order, ``n`` float32 elements.  Per step, on device
``r`` of ``W``:

    1. g_r  = local gradient (+ device r's error-feedback residual, if ``GradComm.error_feedback``)
    2. amax = max over devices of max|g_r|          scaling="tensor" only (one shared scale; NaN counts as inf)
    3. d_r  = fake_quantize(g_r, spec [, amax])     the values the rank's message stands for (bf16, fp8, MX, ...)
    4. out  = (d_0 + d_1 + ... + d_{W-1}) / W       float32, in device order, identical on every device
    5. residual_r = g_r - d_r                       error feedback only

so ``out`` equals ``mean_r fake_quantize(g_r)`` computed in one process, bit for bit (the tests' oracle), and
equals what the PyTorch hook computes for a DDP bucket holding the same elements in the same order.  Without
``grad_comm`` the mean is the float32 one, ``(g_0 + ... + g_{W-1}) / W``.  Stochastic rounding draws device r's
words from ``rounding_seed(seed, step, 0, r)`` (counter = element index), PyTorch's stream for bucket 0 of rank r:
``comm_keys`` computes the keys on the host, one row per device.

Equality with one device on the full batch.  The mean over W shards of per-shard mean gradients is the full-batch
mean gradient in exact arithmetic (equal shard sizes).  In float32 the sums run in another order (each device
reduces its shard, then the shards are added), so the results agree to rounding (``gamma_B`` times the sum of
magnitudes); they are bitwise equal when every partial sum is exact, e.g. operands on a coarse power-of-two grid
(tested).  This is an emulation of the numerics: the devices exchange float32 values (an ``all_gather``), not
packed codes, so it does not save bandwidth.

Multi-host: call ``jax.distributed.initialize(...)`` on every host before anything else, build the mesh over
``jax.devices()`` (all hosts' devices), and feed each host its part of the global batch
(``jax.make_array_from_process_local_data``); the function itself is unchanged (docs/jax.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .._errors import UsageError
from ..quant._random_py import stream_seed
from ..quant._spec import QuantSpec
from ..quant._spec_args import resolve_spec
from ..recipes import GradComm
from . import _random
from ._bits import INF
from ._scaled import _amax, fake_quantize_traced


class CommState(NamedTuple):
    """Per-device state of the compressed all-reduce."""

    residual: Any
    """Error feedback: a pytree like the gradients with a leading device axis ``[W, ...]`` (device r's residual in
    row r, sharded over the mesh axis); None without error feedback."""


def comm_spec(grad_comm: GradComm | None) -> QuantSpec | None:
    """The wire ``QuantSpec`` of ``grad_comm`` (its rounding applied), validated as the PyTorch hook does; None for
    a float32 all-reduce."""
    if grad_comm is None:
        return None
    if not isinstance(grad_comm, GradComm):
        raise UsageError(f"grad_comm must be a lowprec.GradComm (Recipe.grad_comm) or None; got "
                         f"{type(grad_comm).__name__}")
    return resolve_spec(grad_comm.spec, grad_comm.rounding)


def init_comm_state(params: Any, grad_comm: GradComm | None, world: int) -> CommState:
    """Zero residuals ``[world, *leaf.shape]`` float32 per parameter leaf (error feedback), else ``CommState(None)``."""
    if grad_comm is None or not grad_comm.error_feedback:
        return CommState(None)
    return CommState(jax.tree_util.tree_map(lambda p: jnp.zeros((world, *p.shape), jnp.float32), params))


def comm_keys(grad_comm: GradComm | None, *, seed: int, step: int, world: int) -> jax.Array | None:
    """uint32 ``[world, 2]``: device r's stochastic-rounding keys at ``step`` (0-based; the PyTorch hook's
    ``rounding_seed(seed, step, 0, r)``); None unless the wire rounds stochastically.  Runs on the host."""
    spec = comm_spec(grad_comm)
    if spec is None or spec.rounding != "stochastic":
        return None
    seeds = [stream_seed(seed, "ddp_compress", f"step={step}", "bucket=0", f"rank={r}") for r in range(world)]
    return jnp.stack([_random.key_array(s) for s in seeds])


def compressed_mean(grads: Any, grad_comm: GradComm | None, *, axis_name: str, residual: Any = None,
                    keys: jax.Array | None = None) -> tuple[Any, Any]:
    """Inside ``shard_map`` over ``axis_name``: ``(mean over devices of grads through the wire format, new
    residual)`` (module docstring).  ``grads``: this device's float32 gradient pytree; ``residual``: this device's
    residual pytree (error feedback) or None; ``keys``: this device's uint32 ``[2]`` (stochastic wire) or None."""
    spec = comm_spec(grad_comm)
    leaves, tree = jax.tree_util.tree_flatten(grads)
    g = jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])  # the bucket [n]
    use_residual = residual is not None and grad_comm is not None and grad_comm.error_feedback
    if use_residual:
        g = g + jnp.concatenate([r.ravel() for r in jax.tree_util.tree_leaves(residual)])
    d = g
    if spec is not None:
        amax = None
        if spec.scaling == "tensor":
            own = jnp.minimum(_amax(g, (0,)).reshape(()), jnp.int32(INF))  # NaN -> inf, as the hook's nan_to_num
            amax = jax.lax.pmax(own, axis_name)
        d = fake_quantize_traced(g, spec, keys=keys, amax=amax)
    gathered = jax.lax.all_gather(d, axis_name)  # [W, n]: every device sums the same values in device order
    total = gathered[0]
    for r in range(1, gathered.shape[0]):
        total = total + gathered[r]
    mean = total / jnp.float32(gathered.shape[0])
    out, start = [], 0
    for x in leaves:
        out.append(mean[start:start + x.size].reshape(x.shape).astype(x.dtype))
        start += x.size
    new_residual = None
    if grad_comm is not None and grad_comm.error_feedback:
        r_flat, start, parts = g - d, 0, []
        for x in leaves:
            parts.append(r_flat[start:start + x.size].reshape(x.shape))
            start += x.size
        new_residual = jax.tree_util.tree_unflatten(tree, parts)
    return jax.tree_util.tree_unflatten(tree, out), new_residual


def data_parallel(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    *,
    grad_comm: GradComm | None = None,
    axis_name: str | None = None,
) -> Callable[..., tuple[jax.Array, Any, CommState]]:
    """Data-parallel ``value_and_grad`` of ``loss_fn`` over ``mesh``'s axis, with ``grad_comm``'s all-reduce.

    Args:
        loss_fn: ``(params, batch) -> scalar``, the mean over the examples of ``batch`` (a pytree whose leaves have
            the example dimension first).
        mesh: a 1-D ``jax.sharding.Mesh`` (e.g. ``jax.make_mesh((W,), ("data",))``).
        grad_comm: ``Recipe.grad_comm`` (None: float32 mean).
        axis_name: the mesh axis to split the batch over (default: the mesh's only axis).
    Returns:
        jitted ``step(params, batch, comm_state, keys=None) -> (loss, grads, comm_state)``: params replicated,
        the batch split into W equal shards (its size must divide by W), ``loss`` the mean of the shard losses,
        ``grads`` the averaged gradients (identical on every device), ``comm_state`` from ``init_comm_state``,
        ``keys`` from ``comm_keys`` for a stochastic wire.
    """
    if not isinstance(mesh, Mesh):
        raise UsageError(f"mesh must be a jax.sharding.Mesh; got {type(mesh).__name__}")
    axis = axis_name or (mesh.axis_names[0] if len(mesh.axis_names) == 1 else None)
    if axis is None or axis not in mesh.axis_names:
        raise UsageError(f"axis_name must name one of the mesh axes {mesh.axis_names}; got {axis_name!r}")
    spec = comm_spec(grad_comm)
    stochastic = spec is not None and spec.rounding == "stochastic"
    explicit = mesh.axis_types[mesh.axis_names.index(axis)] == AxisType.Explicit

    def place(tree: Any, pspec: P) -> Any:
        # an Explicit mesh axis (jax.make_mesh's default) needs the inputs resharded; an Auto one a constraint
        move = jax.reshard if explicit else jax.lax.with_sharding_constraint
        return jax.tree_util.tree_map(lambda x: move(x, NamedSharding(mesh, pspec)), tree)

    def local(params, batch, residual, keys):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        res = None if residual is None else jax.tree_util.tree_map(lambda r: r[0], residual)
        mean, new_res = compressed_mean(grads, grad_comm, axis_name=axis, residual=res,
                                        keys=None if keys is None else keys[0])
        loss = jax.lax.pmean(loss, axis)
        new_res = None if new_res is None else jax.tree_util.tree_map(lambda r: r[None], new_res)
        return loss, mean, new_res

    @jax.jit
    def step(params: Any, batch: Any, comm_state: CommState, keys: jax.Array | None = None):
        if stochastic and keys is None:
            raise UsageError("grad_comm rounds stochastically: pass keys=comm_keys(grad_comm, seed=..., step=..., "
                             "world=...)")
        sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis), P(axis), P(axis)),
                                out_specs=(P(), P(), P(axis)), check_vma=False)
        loss, grads, res = sharded(place(params, P()), place(batch, P(axis)), place(comm_state.residual, P(axis)),
                                   place(keys, P(axis)) if stochastic else None)
        return loss, grads, CommState(res)

    return step
