"""``compress_hook``: a DDP communication hook that all-reduces gradients in any lowprec format.

Why not sum on the wire.  A ring all-reduce adds partial sums as they travel, in the dtype of the buffer: in fp8
every addition would round again (and needs a common scale), and torch's own ``bf16_compress_hook`` refuses gloo.
This hook never adds in the low-precision format.  Per bucket (a flat float32 buffer of ``n`` elements):

    1. g   = local gradient (+ the error-feedback residual of the last step, if on)
    2. amax = MAX all-reduce of max|g|           only for scaling="tensor" (fp8 with one shared scale per bucket):
                                                 one float32 per rank; every rank then derives the same scale
    3. msg = codes (+ per-block scales)          ``lowprec.quant`` quantization of g, packed into uint8 (``_wire``)
    4. all_gather(msg) from every rank           uint8: works on gloo and NCCL alike
    5. out = (deq(msg_0) + deq(msg_1) + ... + deq(msg_{W-1})) / W      in float32, in rank order

Every rank decodes the same bytes and adds them in the same order, so every rank gets the identical averaged
gradient, and it equals ``mean_r fake_quantize(g_r)`` computed in one process (the tests' oracle).  Error feedback
keeps ``residual = g - deq(msg_own)`` per parameter and adds it to the next step's gradient, so the sum over steps
of what was sent tracks the sum of the true gradients (the difference is the last residual, not a growing bias).

Stochastic rounding uses lowprec's counter-based streams: rank ``r`` rounds bucket ``b`` of step ``t`` with the seed
``rounding_seed(seed, t, b, r)`` (SHA-256 of the four), element ``i`` with counter ``i``; ranks draw independent
bits and nothing touches torch's global RNG.

Bytes.  ``CompressState`` counts what this rank sends, by the ring algorithm's count for ``W`` ranks: an
all_gather of ``b`` bytes per rank sends ``(W-1) b``, an all-reduce of ``b`` bytes sends ``ceil(2 (W-1) b / W)``.
The fp32 reference (``bytes_uncompressed``) is the default hook's all-reduce of the bucket buffer.  For 2 ranks,
per element: fp32 4 bytes -> bf16/fp16 2, fp8 1 (+ 4 bytes per bucket for the amax: >= 3.99x fewer on a 1k-element
bucket), MXFP8 1 + 1/32 (3.88x), MXFP4 1/2 + 1/32.  Limitation: an all-gather sends ``(W-1) b`` while a ring
all-reduce sends ``2 (W-1)/W`` of its buffer, so the saving shrinks as ``8/W`` for fp8 (none left at 8 ranks); a
reduce-scatter of codes with a second quantization of the partial sums would keep 4x at any W but would no longer
equal the single-process mean of quantized gradients.  Communication is not overlapped with the amax
all-reduce (a blocking 4-byte collective per shared-scale bucket); the all_gather itself runs asynchronously.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import UsageError
from ..quant import QuantSpec
from ..quant._random import stream_seed
from ..quant._validate import check_bool
from ._wire import BucketCodec, resolve_spec

# Real (not string) annotations in this module: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def rounding_seed(seed: int, step: int, bucket_index: int, rank: int) -> int:
    """The stochastic-rounding seed of one rank's bucket at one step (a 64-bit value)."""
    return stream_seed(seed, "ddp_compress", f"step={step}", f"bucket={bucket_index}", f"rank={rank}")


def ring_allgather_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all_gather of ``nbytes`` per rank."""
    return (world_size - 1) * nbytes


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` buffer (reduce-scatter + all-gather)."""
    return math.ceil(2 * (world_size - 1) * nbytes / world_size)


class CompressState:
    """State of ``compress_allreduce_hook``: the spec, the step counter, byte counts, error-feedback residuals.

    Pass it as DDP's hook state: ``ddp.register_comm_hook(state, compress_allreduce_hook)``.

    Readable after each backward (a step ends with DDP's last bucket):
        step: completed steps (the hook's own count, used by the stochastic-rounding streams);
        bytes_sent: bytes this rank sent in the last completed step (ring count, see the module docstring);
        bytes_uncompressed: bytes the default fp32 all-reduce of the same buckets would have sent;
        total_bytes_sent, total_bytes_uncompressed: sums over all steps;
        buckets: number of buckets in the last completed step.
    """

    def __init__(
        self,
        spec: QuantSpec | str,
        *,
        rounding: str | None = None,
        seed: int = 0,
        error_feedback: bool = False,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.spec = resolve_spec(spec, rounding)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64:
            raise UsageError(f"seed must be an int in [0, 2**64); got {seed!r}")
        self.seed = seed
        self.error_feedback = check_bool(error_feedback, "error_feedback")
        self.process_group = process_group
        self.codec = BucketCodec(self.spec)
        self.step = 0
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self.total_bytes_sent = 0
        self.total_bytes_uncompressed = 0
        self.buckets = 0
        self._pending = [0, 0, 0]  # bytes sent, bytes uncompressed, buckets of the step in progress
        self.residuals: dict[int, torch.Tensor] = {}
        """Error feedback: ``id(parameter)`` -> float32 residual (parameter-keyed, so DDP's bucket rebuild after
        the first step keeps them)."""

    def snapshot(self) -> tuple[Any, ...]:
        """What a step changes here (counters, step, residuals: a shallow copy, since each step replaces the
        residual tensors rather than writing into them), for ``restore``: rerunning a step must not advance it."""
        return (self.step, self.bytes_sent, self.bytes_uncompressed, self.total_bytes_sent,
                self.total_bytes_uncompressed, self.buckets, list(self._pending), dict(self.residuals))

    def restore(self, saved: tuple[Any, ...]) -> None:
        (self.step, self.bytes_sent, self.bytes_uncompressed, self.total_bytes_sent, self.total_bytes_uncompressed,
         self.buckets, pending, residuals) = saved
        self._pending, self.residuals = list(pending), dict(residuals)

    @property
    def compression_ratio(self) -> float:
        """``bytes_uncompressed / bytes_sent`` of the last completed step (0 before the first)."""
        return self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 0.0

    def reset_counters(self) -> None:
        """Zero the byte counters (not the step, which the random streams depend on)."""
        self.bytes_sent = self.bytes_uncompressed = self.total_bytes_sent = self.total_bytes_uncompressed = 0

    def _count(self, sent: int, uncompressed: int, last: bool) -> None:
        p = self._pending
        p[0] += sent
        p[1] += uncompressed
        p[2] += 1
        if last:
            self.bytes_sent, self.bytes_uncompressed, self.buckets = p
            self.total_bytes_sent += p[0]
            self.total_bytes_uncompressed += p[1]
            self.step += 1
            self._pending = [0, 0, 0]

    def _residual(self, params: list[torch.Tensor], g: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        sizes = [p.numel() for p in params]
        if sum(sizes) != g.numel():
            raise UsageError(f"bucket of {g.numel()} elements holds parameters of {sum(sizes)}: cannot map residuals")
        parts = [self.residuals.get(id(p)) for p in params]
        if all(r is None for r in parts):
            return None
        return torch.cat(
            [torch.zeros(n, device=g.device) if r is None else r for r, n in zip(parts, sizes, strict=True)]
        )

    def _keep_residual(self, params: list[torch.Tensor], r: torch.Tensor) -> None:
        for p, piece in zip(params, r.split([p.numel() for p in params]), strict=True):
            self.residuals[id(p)] = piece


def start_compressed_mean(state: CompressState, g: torch.Tensor, index: int, params: list[torch.Tensor],
                          last: bool, out_dtype: torch.dtype) -> tuple[Any, Callable[[], torch.Tensor]]:
    """Start averaging one flat float32 gradient bucket ``g`` (bucket ``index`` of the step; ``params``: the
    parameters it holds, for error feedback; ``last``: it ends the step) over ``state.process_group`` in
    ``state.spec`` (module docstring): (the all-gather's Work, a function that waits for it and returns the mean in
    ``out_dtype``).  The DDP hook and ``GradReducer`` (data parallelism next to tensor or pipeline parallelism) both
    run it."""
    pg = state.process_group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    n = g.numel()
    prev = state._residual(params, g)
    if prev is not None:
        g.add_(prev)
    sent = 0
    amax = None
    if state.codec.shared_scale:
        amax = torch.nan_to_num(g.abs().amax().reshape(1), nan=math.inf)  # NaN anywhere -> NaN scale for all
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=pg)
        sent += ring_allreduce_bytes(amax.numel() * amax.element_size(), world)
    seed = rounding_seed(state.seed, state.step, index, rank) if state.spec.rounding == "stochastic" else None
    msg = state.codec.encode(g, seed=seed, amax=amax)
    sent += ring_allgather_bytes(msg.numel(), world)
    state._count(sent, ring_allreduce_bytes(n * out_dtype.itemsize, world), last)
    gathered = [torch.empty_like(msg) for _ in range(world)]
    work = dist.all_gather(gathered, msg, group=pg, async_op=True)
    assert work is not None  # async_op=True returns a Work handle

    def finish() -> torch.Tensor:
        total = None
        for r, m in enumerate(gathered):  # rank order: the same sum on every rank
            d = state.codec.decode(m, n, amax=amax)
            if r == rank and state.error_feedback:
                state._keep_residual(params, g - d)
            total = d if total is None else total.add_(d)
        assert total is not None
        return total.div_(world).to(out_dtype)

    return work, finish


def compress_allreduce_hook(state: CompressState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket``'s gradient over ranks through ``state.spec`` (module docstring)."""
    buf = bucket.buffer()
    g = buf.detach().to(torch.float32, copy=True)
    work, finish = start_compressed_mean(state, g, bucket.index(), bucket.parameters(), bucket.is_last(), buf.dtype)

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()  # re-raises a failed collective
        return finish()

    return work.get_future().then(done)


def compress_hook(
    spec: QuantSpec | str,
    *,
    rounding: str | None = None,
    seed: int = 0,
    error_feedback: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[CompressState, HookFn]:
    """A DDP communication hook that averages gradients sent in ``spec``, and its state.

    ``ddp.register_comm_hook(*compress_hook("fp8_e4m3_tensorwise"))`` registers it; keep the state to read
    ``state.bytes_sent`` after each backward.

    Args:
        spec: a ``QuantSpec`` with scaling "none", "tensor" (one shared scale per bucket from a MAX all-reduce of
            amax) or "block" (MX, NVFP4); or a name: a ``QuantSpec`` name ("fp8_e4m3_tensorwise", "mxfp8_e4m3")
            or a format name ("bfloat16", "float16", "float32" unscaled; "float8_e4m3fn", "float8_e5m2" with a
            shared scale).
        rounding: "nearest", "stochastic" or "toward_zero"; None keeps the spec's own.
        seed: stochastic rounding's seed in [0, 2**64) (streams per step, bucket and rank: ``rounding_seed``).
        error_feedback: add the last step's cast residual to each gradient before the cast.
        process_group: the group DDP reduces over (None: the default group).

    Returns:
        ``(state, hook)`` in the order ``DistributedDataParallel.register_comm_hook`` takes them.
    """
    state = CompressState(spec, rounding=rounding, seed=seed, error_feedback=error_feedback,
                          process_group=process_group)
    return state, compress_allreduce_hook
