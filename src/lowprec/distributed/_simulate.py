"""Reductions at scale, simulated exactly: what all-reducing W ranks' gradients gives, for W up to 10^5, on one
machine.

A collective's result depends on the order of its additions and on where it rounds: every value that crosses a
link is in the *payload* format (bf16, fp8 with one scale per message, MX blocks), every addition happens in the
*accumulation* format.  ``simulate_reduction`` replays that arithmetic hop by hop, streaming over the ranks (the
state is one partial sum per simulated element, or ``log2 W`` of them for a tree: no W processes, no W copies),
and compares the result with the float64 sum of the same gradients.

Which elements: an all-reduce of W ranks splits the gradient into W chunks, and every chunk's elements follow the
same path with a different starting rank.  ``chunks`` representative chunks of ``chunk`` elements are simulated
(their starting ranks spread evenly over the ring), so the result is exact for those elements of an all-reduce of
a ``W * chunk``-element gradient.  Rank ``r``'s gradient at element ``e`` comes from ``gradients(ranks, elements)``
(default ``gaussian_gradients(seed)``: a counter-based normal, the same value for the same ``(seed, r, e)`` on
every machine, so hop ``h`` can draw rank ``(start + h) mod W``'s values directly).

Algorithms (``P``: round to the payload, ``A``: to the accumulation format, ``I``: the rank's own gradient buffer
format, ``input`` = the payload for plain float payloads, float32 for scaled ones):

* ``"ring"`` (NCCL's ring reduce-scatter, then an all-gather that only copies): the chunk starting at rank ``s``
  travels ``s, s+1, ..., s-1``: ``p = P(I(g_s))``, then at each of the ``W - 1`` hops ``p = P(A(p) + A(I(g_r)))``.
* ``"tree"``: a balanced binary tree over the ranks in order (a binary counter: equal-size subtrees merge as soon as
  both exist; for W not a power of two, the leftover subtrees merge from the right at the end); leaves
  ``P(I(g_r))``, every merge ``P(A(left) + A(right))``.
* ``"halving"``: recursive halving (Rabenseifner's reduce-scatter): rank ``r`` first combines with ``r xor W/2``,
  then ``W/4``, ...; the summation tree of ``"tree"`` over the ranks in bit-reversed order (W a power of two).
* ``"alltoall"``: every rank sends its contribution ``P(I(g_r))`` to the element's owner, which sums all W in the
  accumulation format in rank order, ``acc = A(A(acc) + A(P(I(g_r))))``, with no payload rounding after the
  first: lowprec's ``compress_hook`` (each rank quantizes once, the decoded values are summed in float32).
* ``"sequential"``: gradient accumulation over W micro-batches into a buffer in the accumulation format,
  ``acc = A(A(acc) + A(I(g_m)))`` (the payload is not used).

Additions are torch's in the accumulation dtype; rounding to a payload is ``lowprec.quant.quantize`` (plain float
formats, round to nearest even) or ``lowprec.quant.fake_quantize`` with the payload ``QuantSpec`` applied to each
message (a chunk: ``"fp8_e4m3_rowwise"`` is one scale per message, ``"mxfp8_e4m3"`` one per 32 elements).

The analysis ``predicted_rel_l2`` compares with: for zero-mean independent gradients of equal variance, a
rounding of a value ``x`` errs by ``x * d`` with ``E[d^2] = u^2 / (8 ln 2)`` (round to nearest, error uniform
within half an ulp, significands log-uniform; ``u = 2^-p``, ``p`` the significand bits with the hidden one), and
independent errors add in variance.  The ring rounds partial sums of ``2, 3, .., W`` terms, so its relative L2
error is ``sqrt(E[d^2] (sum_{k=2}^{W} k + W) / W)``, about ``u sqrt(W / (16 ln 2))``: it grows as ``sqrt(W)``.  A
tree rounds every level once (``log2 W`` levels of ``W`` terms in all): ``sqrt(E[d^2] (log2 W + 1))``.  All-to-all
rounds only the inputs: ``sqrt(E[d^2])``, flat in W (its float32 additions add ``~ 2^-24 sqrt(W)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import torch

from .. import formats
from .._errors import UsageError

Algorithm = Literal["ring", "tree", "halving", "alltoall", "sequential"]
ALGORITHMS: tuple[str, ...] = ("ring", "tree", "halving", "alltoall", "sequential")
ACCUMULATE: tuple[str, ...] = ("float64", "float32", "bfloat16", "float16")
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_WORLD = 1_000_000
_MASK = 0xFFFFFFFF

Gradients = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _MASK
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def gaussian_gradients(seed: int = 0, *, std: float = 1.0, mean: float = 0.0) -> Gradients:
    """Counter-based normal gradients: ``g(r, e)`` is a float32 draw of ``N(mean, std^2)`` fixed by ``(seed, r,
    e)`` alone (a 32-bit hash of the counter, two 24-bit uniforms, Box-Muller in float64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"gaussian_gradients: seed must be an int >= 0; got {seed!r}")

    def draw(ranks: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
        key = _hash32(_hash32(torch.full_like(ranks, seed & _MASK) ^ ranks) ^ (elements * 2))
        u1 = ((_hash32(key ^ 0x9E3779B9) >> 8).double() + 0.5) / 2.0**24
        u2 = ((_hash32(key ^ 0x85EBCA6B) >> 8).double() + 0.5) / 2.0**24
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return (mean + std * z).float()

    return draw


@dataclasses.dataclass(frozen=True)
class ReductionResult:
    """The simulated all-reduce of ``world`` ranks against the float64 sum of the same float32 gradients."""

    world: int
    algorithm: str
    payload: str
    accumulate: str
    input: str
    chunk: int
    chunks: int
    values: torch.Tensor
    """float64 ``[chunks, chunk]``: what the reduction gives."""
    exact: torch.Tensor
    """float64 ``[chunks, chunk]``: the float64 sum of the gradients (error ~ ``W 2^-53``, negligible here)."""
    rel_l2: float
    """``||values - exact|| / ||exact||`` over all simulated elements."""
    max_abs_error: float
    """``max |values - exact|`` in units of the gradients' rms times ``sqrt(W)`` (the exact sum's scale)."""
    predicted_rel_l2: float | None
    """The analysis of the module docstring, for plain float payloads and zero-mean gradients; None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("world", "algorithm", "payload", "accumulate", "input", "chunk",
                                              "chunks", "rel_l2", "max_abs_error", "predicted_rel_l2")}


def _rounder(name: str, what: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], float | None]:
    """``(round to format name, its unit roundoff u or None for scaled formats)``."""
    from ..quant import QuantSpec, fake_quantize, quantize

    if name == "float64":
        return (lambda x: x.double()), 2.0**-53
    if name in formats.names():
        fmt = formats.get(name)
        if name == "float32":
            return (lambda x: x.float()), 2.0**-24
        return (lambda x: quantize(x.float(), fmt)), 2.0 ** -(fmt.mbits + 1)
    if name in QuantSpec.names():
        spec = QuantSpec.named(name)
        return (lambda x: fake_quantize(x.float(), spec)), None
    raise UsageError(f"simulate_reduction: {what}={name!r} is neither a float format ({', '.join(formats.names())})"
                     f" nor a QuantSpec name ({', '.join(QuantSpec.names())})")


def _check(world: object, chunk: object, chunks: object, algorithm: object, accumulate: object) -> None:
    for name, v, lo in (("world", world, 1), ("chunk", chunk, 1), ("chunks", chunks, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise UsageError(f"simulate_reduction: {name} must be an int >= {lo}; got {v!r}")
    if world > MAX_WORLD:  # type: ignore[operator]
        raise UsageError(f"simulate_reduction: world={world} is above {MAX_WORLD:,}")
    if algorithm not in ALGORITHMS:
        raise UsageError(f"simulate_reduction: unknown algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")
    if accumulate not in ACCUMULATE:
        raise UsageError(f"simulate_reduction: accumulate must be one of {', '.join(ACCUMULATE)}; got "
                         f"{accumulate!r}")
    if algorithm == "halving" and world & (world - 1):  # type: ignore[operator]
        raise UsageError(f"simulate_reduction: algorithm='halving' needs a power-of-two world; got {world} (use "
                         "'tree', the same summation tree for any W)")


def _bit_reverse(r: int, bits: int) -> int:
    return int(f"{r:0{bits}b}"[::-1], 2) if bits else 0


def predicted_rel_l2(algorithm: str, world: int, u: float, u_input: float | None = None) -> float:
    """The module docstring's analysis: the relative L2 error of reducing ``world`` zero-mean i.i.d. gradients
    rounded to a format of unit roundoff ``u`` at every hop, inputs to ``u_input`` (default ``u``)."""
    d2 = u * u / (8 * math.log(2))
    di = (u if u_input is None else u_input) ** 2 / (8 * math.log(2))
    w = world
    if algorithm == "ring":
        return math.sqrt((d2 * (w * (w + 1) / 2 - 1) + di * w) / w)
    if algorithm in ("tree", "halving"):
        return math.sqrt(d2 * math.log2(w) + di) if w > 1 else math.sqrt(di)
    return math.sqrt(di)  # alltoall, sequential with no rounding between additions beyond the accumulation


def simulate_reduction(world: int, *, algorithm: Algorithm = "ring", payload: str = "bfloat16",
                       accumulate: str = "float32", input: str | None = None, chunk: int = 1024, chunks: int = 4,
                       gradients: Gradients | None = None, seed: int = 0) -> ReductionResult:
    """Simulate all-reducing ``world`` ranks' gradients exactly (module docstring) and compare with float64.

    Args:
        world: the number of ranks (or micro-batches for ``"sequential"``), 1 to 10^6.
        algorithm: ``"ring"``, ``"tree"``, ``"halving"``, ``"alltoall"`` or ``"sequential"``.
        payload: the format on the wire: a float format name (``"bfloat16"``, ``"float32"``, ...) or a lowprec
            ``QuantSpec`` name applied to each message (``"fp8_e4m3_rowwise"``: one scale per message,
            ``"mxfp8_e4m3"``: one per 32 elements).
        accumulate: the dtype additions are computed in (``float64``, ``float32``, ``bfloat16``, ``float16``).
        input: the format of each rank's own gradient buffer (default: the payload when it is a plain float
            format, else float32).
        chunk, chunks: the simulated elements: ``chunks`` chunks of ``chunk`` elements.
        gradients: ``(ranks, elements) -> float32 values`` (int64 tensors of equal shape); default
            ``gaussian_gradients(seed)``.
    """
    _check(world, chunk, chunks, algorithm, accumulate)
    to_payload, u = _rounder(payload, "payload")
    if input is None:
        input = payload if payload in formats.names() else "float32"
    to_input, u_in = _rounder(input, "input")
    if u_in is None:
        raise UsageError(f"simulate_reduction: input={input!r} must be a plain float format (a gradient buffer's "
                         "dtype)")
    adt = _DTYPES[accumulate]
    grads = gradients or gaussian_gradients(seed)
    elements = torch.arange(chunks * chunk, dtype=torch.int64).reshape(chunks, chunk)
    if algorithm == "sequential":
        to_payload = to_input

    def draw(ranks: torch.Tensor) -> torch.Tensor:
        g = grads(ranks.expand_as(elements).contiguous(), elements)
        if not isinstance(g, torch.Tensor) or g.shape != elements.shape:
            raise UsageError(f"simulate_reduction: gradients(ranks, elements) must return a tensor of shape "
                             f"{list(elements.shape)}; got {getattr(g, 'shape', type(g).__name__)}")
        return g.float()

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.to(adt) + b.to(adt)

    exact = torch.zeros(chunks, chunk, dtype=torch.float64)
    if algorithm == "ring":
        starts = torch.tensor([(j * world) // chunks for j in range(chunks)], dtype=torch.int64).reshape(chunks, 1)
        g = draw(starts % world)
        exact += g.double()
        p = to_payload(to_input(g))
        for h in range(1, world):
            g = draw((starts + h) % world)
            exact += g.double()
            p = to_payload(add(p, to_input(g)))
        values = p
    elif algorithm in ("tree", "halving"):
        bits = max(world - 1, 0).bit_length() if algorithm == "halving" else 0
        stack: list[tuple[int, torch.Tensor]] = []
        for r in range(world):
            rank = _bit_reverse(r, bits) if algorithm == "halving" else r
            g = draw(torch.full((1, 1), rank, dtype=torch.int64))
            exact += g.double()
            node = (1, to_payload(to_input(g)))
            while stack and stack[-1][0] == node[0]:
                size, left = stack.pop()
                node = (size + node[0], to_payload(add(left, node[1])))
            stack.append(node)
        while len(stack) > 1:
            size_r, right = stack.pop()
            size_l, left = stack.pop()
            stack.append((size_l + size_r, to_payload(add(left, right))))
        values = stack[0][1]
    else:  # alltoall, sequential: one sum in the accumulation format
        acc = torch.zeros(chunks, chunk, dtype=adt)
        for r in range(world):
            g = draw(torch.full((1, 1), r, dtype=torch.int64))
            exact += g.double()
            acc = add(acc, to_payload(to_input(g)))
        values = acc
    v = values.double()
    err = v - exact
    norm = float(exact.norm())
    rms = float(exact.square().mean().sqrt())
    pred = None
    if u is not None or algorithm == "sequential":
        pu = u_in if algorithm == "sequential" else u
        assert pu is not None
        if algorithm in ("alltoall", "sequential"):
            pu_acc = 2.0**-53 if accumulate == "float64" else 2.0 ** -(formats.get(accumulate).mbits + 1)
            pred = math.sqrt(predicted_rel_l2("alltoall", world, pu) ** 2
                             + predicted_rel_l2("ring", world, pu_acc, 0.0) ** 2)
        else:
            pred = predicted_rel_l2(algorithm, world, pu, u_in)
    return ReductionResult(world=world, algorithm=algorithm, payload=payload, accumulate=accumulate, input=input,
                           chunk=chunk, chunks=chunks, values=v, exact=exact,
                           rel_l2=float(err.norm()) / norm if norm > 0 else float(err.norm()),
                           max_abs_error=float(err.abs().max()) / rms if rms > 0 else float(err.abs().max()),
                           predicted_rel_l2=pred)
