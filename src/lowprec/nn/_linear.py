"""``EmulatedLinear``: an ``nn.Linear`` whose three GEMMs follow a ``LinearRecipe``.

Forward and backward of ``y = x @ W^T + b`` (x: [..., K], W: [N, K]):

    y     = Q(x) @ Q(W)^T           forward      a = input [B,K],          b = weight [N,K]
    dx    = Q(dY) @ Q(W^T)^T        grad_input   a = grad_output [B,N],    b = weight^T [K,N]
    dW    = Q(dY^T) @ Q(x^T)^T      grad_weight  a = grad_output^T [N,B],  b = input^T [K,B]

Each ``Q`` is the recipe's ``Operand`` for that GEMM, applied with the reduction dimension last; each product goes
through the GEMM's ``Accumulator`` and optional output rounding.  The bias is added in float32 after the GEMM (as
torchao's Float8Linear does).  Weights keep their ``Parameter`` objects, so optimizers and state dicts are unchanged.

Where two GEMMs quantize the same tensor identically (tensorwise or no scaling, same spec, no stochastic rounding;
see ``shares_quantization``) it is quantized once: Q(x) serves forward and grad_weight and is saved for backward
in place of x, Q(W) serves forward and grad_input, Q(dY) both backward GEMMs.  ``gemm`` is the per-GEMM reference
whose bits this reproduces.  Gradients autograd does not need (a first layer's input) are not computed.

Delayed scaling keeps one amax history per tensor role (input, weight, grad_output) in buffers named
``amax_history_<role>``; stochastic operands draw their random bits from ``(recipe seed, module, GEMM, operand,
step)`` with the step counter in the buffer ``lp_step``.  Those buffers exist only when the recipe needs them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import formats
from .._errors import UsageError
from ..quant import _native_op, _random
from ..quant import quantize as _quantize
from ..quant._elementwise import quantize_in_place
from ..quant._scaled import fake_quantize_tensors
from ..recipes import Gemm, LinearRecipe, Operand
from ..recipes._recipe import OPERAND_ROLE, shares_quantization
from ._accum import accumulate_matmul

ROLES = ("input", "weight", "grad_output")
_ROLE = OPERAND_ROLE  # (gemm, operand) -> tensor role


class _Ctx:
    """What the autograd function needs from the module (kept out of autograd's saved tensors)."""

    def __init__(self, module: EmulatedLinear, keys: Keys | None) -> None:
        self.module = module
        self.keys = keys


Keys = dict[tuple[str, str], torch.Tensor]


def _operand(t: torch.Tensor, op: Operand, keys: torch.Tensor | None, amax: torch.Tensor | None) -> torch.Tensor:
    """``t`` (float32, reduction dim last) quantized per ``op``; ``amax`` overrides the scale's amax (delayed)."""
    if op.spec is None:
        return t
    off = None
    if op.spec.rounding == "stochastic":
        if keys is None:
            raise UsageError("a stochastic-rounding operand needs random keys")
        off = torch.zeros((), dtype=torch.int32, device=t.device)
    else:
        keys = None
    return fake_quantize_tensors(t, op.spec, keys=keys, offset=off, amax=amax)


def quantize_operand(
    t: torch.Tensor, spec: Gemm, name: str, which: str, keys: Keys | None, amax: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Operand ``which`` ("a" or "b") of GEMM ``name`` quantized per ``spec`` (reduction dim last)."""
    op: Operand = getattr(spec, which)
    role_amax = amax.get(_ROLE[(name, which)]) if op.scaling.kind == "delayed" else None
    return _operand(t, op, keys.get((name, which)) if keys else None, role_amax)


def product(qa: torch.Tensor, qb: torch.Tensor, spec: Gemm) -> torch.Tensor:
    """``qa @ qb^T`` of already quantized operands through the GEMM's accumulator and output rounding."""
    out = accumulate_matmul(qa, qb, spec.accumulator)
    if spec.output_format is None:
        return out
    fmt = formats.get(spec.output_format)
    if not torch.compiler.is_compiling() and quantize_in_place(out, fmt):
        # eager: the GEMM's own fresh result, rounded in place (bfloat16 / float16: one pass, no amax pass; no
        # second tensor); compiled graphs keep the traced rounding, which inductor fuses
        return out
    return _quantize(out, fmt)


def gemm(
    a: torch.Tensor, b: torch.Tensor, spec: Gemm, name: str, keys: Keys | None, amax: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One emulated GEMM ``Q(a) @ Q(b)^T`` (reduction dim last in both) with accumulator and output rounding.

    This is the per-GEMM reference: every operand quantized for its own GEMM.  The autograd functions quantize a
    tensor once where ``shares_quantization`` says that gives the same bits.
    """
    qa = quantize_operand(a, spec, name, "a", keys, amax)
    return product(qa, quantize_operand(b, spec, name, "b", keys, amax), spec)


def delayed_roles(recipe: LinearRecipe) -> tuple[dict[str, int], dict[str, str]]:
    """The tensor roles (input, weight, grad_output) that ``recipe`` scales with delayed scaling: role -> history
    length (the longest its GEMMs ask for) and role -> amax algorithm.  One history serves every GEMM that reads
    the role, so two algorithms for one role is a UsageError."""
    lengths: dict[str, int] = {}
    algorithms: dict[str, str] = {}
    for (g, o), op in recipe.operands().items():
        if op.scaling.kind == "delayed":
            role = _ROLE[(g, o)]
            lengths[role] = max(lengths.get(role, 0), op.scaling.history_len)
            if algorithms.setdefault(role, op.scaling.algorithm) != op.scaling.algorithm:
                raise UsageError(
                    f"delayed scaling of the {role} uses two amax algorithms ({algorithms[role]!r} and "
                    f"{op.scaling.algorithm!r}) in different GEMMs; the history is shared per tensor role, "
                    "so use one algorithm per role"
                )
    return lengths, algorithms


def _is_plain(g: Gemm) -> bool:
    return g.a.spec is None and g.b.spec is None and g.accumulator.format is None and g.output_format is None


class _Plan(NamedTuple):
    """What a module's recipe implies for every call, worked out once per recipe (``EmulatedLinear._plan``)."""

    plain_forward: bool  # the forward GEMM emulates nothing: nn.Linear's own addmm
    share_x: bool  # Q(x) of the forward serves grad_weight (``shares_quantization``)
    share_w: bool  # Q(W) of the forward serves grad_input
    share_g: bool  # Q(dY) of grad_input serves grad_weight


def _plan_for(rec: LinearRecipe) -> _Plan:
    return _Plan(_is_plain(rec.forward), shares_quantization(rec.forward.a, rec.grad_weight.b),
                 shares_quantization(rec.forward.b, rec.grad_input.b),
                 shares_quantization(rec.grad_input.a, rec.grad_weight.a))


class _SharedInput(threading.local):
    """The last forward input quantization, for linears that read the same tensor (attention's q, k and v).

    ``Q(x)`` with current scaling and round-to-nearest is a function of ``x``'s values and the spec only, so a
    sibling linear called with the same tensor object, unmodified since (same ``_version``), and an equal spec gets
    the same bits by reusing it.  Only weak references are held: nothing is kept alive, and a dead or different
    tensor is a miss.  So a hit needs the first Q(x) still alive, which it is where the recipe saves it for
    grad_weight (``shares_quantization``: fp8-tensorwise, bf16, ...).  Eager only (under torch.compile, CSE merges
    the duplicate quantizations itself).
    """

    def __init__(self) -> None:
        self.x: weakref.ref[torch.Tensor] | None = None
        self.version = -1
        self.op: Operand | None = None
        self.qx: weakref.ref[torch.Tensor] | None = None

    @staticmethod
    def cacheable(x: torch.Tensor, op: Operand, amax: dict[str, torch.Tensor]) -> bool:
        spec = op.spec
        return (spec is not None and spec.rounding == "nearest" and op.scaling.kind != "delayed" and not amax
                and not torch.compiler.is_compiling() and not x.is_inference())  # inference tensors: no _version

    def get(self, x: torch.Tensor, op: Operand) -> torch.Tensor | None:
        last = self.x() if self.x is not None else None
        if last is None or last is not x or x._version != self.version or not (op is self.op or op == self.op):
            return None
        return self.qx() if self.qx is not None else None

    def put(self, x: torch.Tensor, op: Operand, qx: torch.Tensor) -> None:
        self.x, self.version, self.op, self.qx = weakref.ref(x), x._version, op, weakref.ref(qx)


_shared_input = _SharedInput()


def _quantize_input(x: torch.Tensor, x2: torch.Tensor, fwd: Gemm, keys: Keys | None,
                    amax: dict[str, torch.Tensor]) -> torch.Tensor:
    """Q(x2) for the forward GEMM (``x2``: ``x`` as [B, K] float32), reused from a sibling linear where valid."""
    op = fwd.a
    if not _SharedInput.cacheable(x, op, amax):
        return quantize_operand(x2, fwd, "forward", "a", keys, amax)
    qx = _shared_input.get(x, op)
    if qx is None or qx.shape != x2.shape:
        qx = quantize_operand(x2, fwd, "forward", "a", keys, amax)
        _shared_input.put(x, op, qx)
    return qx


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it is already that dtype (a few microseconds per call)."""
    return t if t.dtype == dtype else t.to(dtype)


class _LinearFn(torch.autograd.Function):
    """The three GEMMs of the module docstring.  Where ``shares_quantization`` allows, a tensor is quantized once:
    Q(x) serves forward and grad_weight (and is what is saved for backward instead of x), Q(W) forward and
    grad_input, Q(dY) grad_input and grad_weight.  The bits equal those of ``gemm`` run once per GEMM."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, info: _Ctx
    ) -> torch.Tensor:
        m = info.module
        rec, plan = m.recipe, m._plan()
        x2 = _as(x.reshape(-1, x.shape[-1]), torch.float32)
        w = _as(weight, torch.float32)
        amax = m._delayed_amax({"input": x2, "weight": w}) if m._delayed else {}
        fwd = rec.forward
        if plan.plain_forward:  # nothing to emulate: exactly nn.Linear's float32 addmm
            y = torch.nn.functional.linear(x2, w, None if bias is None else _as(bias, torch.float32))
            qx, qw = x2, w
        else:
            # y = x @ W^T   [B,K] @ [K,N] -> [B,N]; the bias is added after the GEMM, as torchao does
            qx = _quantize_input(x, x2, fwd, info.keys, amax)
            qw = quantize_operand(w, fwd, "forward", "b", info.keys, amax)
            y = product(qx, qw, fwd)
            if bias is not None:
                y = y.add_(_as(bias, torch.float32)) if y.dtype == torch.float32 else y + _as(bias, torch.float32)
        ctx.share_x, ctx.share_w, ctx.share_g = plan.share_x, plan.share_w, plan.share_g
        # Under torch.compile, an x that comes out of a ReLU-like activation (``input_after_mask``, found by
        # ``convert``) is saved as is and quantized again in backward (same input, same amax: the same bits), so
        # that ReLU's mask is not saved as a slow bool tensor (nn/_masked_inputs.py); that holds for the opaque
        # fused quantizer and for a traced one alike (bf16 operands: the MLP's compiled bf16 forward took 11.4 ms
        # with the masks, 5.7 without).
        ctx.requant_x = (ctx.share_x and m.input_after_mask and not plan.plain_forward and x.requires_grad
                         and fwd.a.spec is not None and torch.compiler.is_compiling())
        ctx.save_for_backward(qx if ctx.share_x and not ctx.requant_x else x2, qw if ctx.share_w else w)
        ctx.info, ctx.amax, ctx.has_bias = info, amax, bias is not None
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        out = y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])  # 2-D: no view (FSDP2 hooks need that)
        return _as(out, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x2, w = ctx.saved_tensors  # Q(x) / Q(W) where shared with the forward GEMM
        m, keys = ctx.info.module, ctx.info.keys
        gi, gw = m.recipe.grad_input, m.recipe.grad_weight
        g2 = _as(grad_out.reshape(-1, grad_out.shape[-1]), torch.float32)
        amax = ctx.amax
        if m._delayed:
            amax = dict(amax)
            amax.update(m._delayed_amax({"grad_output": g2}))
        # Gradients nobody asked for (a first layer's input) are skipped; random bits are counter-based per
        # (GEMM, operand, step), so skipping one quantization changes no other.
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        share_g = ctx.share_g
        qg = quantize_operand(g2, gi, "grad_input", "a", keys, amax) if need_x or (need_w and share_g) else g2
        gx = gw_out = gb = None
        if need_x:
            # grad_input = dY @ W   [B,N] @ [N,K] -> [B,K]   (b = W^T [K,N], reduction dim N last)
            qw_t = w.t() if ctx.share_w else quantize_operand(w.t(), gi, "grad_input", "b", keys, amax)
            gx = _as(product(qg, qw_t, gi).reshape(ctx.x_shape), ctx.x_dtype)
        if need_w:
            # grad_weight = dY^T @ x   [N,B] @ [B,K] -> [N,K]   (a = dY^T [N,B], b = x^T [K,B])
            if share_g:
                qg_t = qg.t()
            else:
                qg_t = quantize_operand(g2.t(), gw, "grad_weight", "a", keys, amax)
            if ctx.requant_x:  # Q(x) exactly as the forward GEMM quantized it (see forward)
                op = m.recipe.forward.a
                assert op.spec is not None
                x_amax = amax.get("input") if op.scaling.kind == "delayed" else None
                qx_t = _native_op.call(x2, op.spec, x_amax, after=g2).t()
            elif ctx.share_x:
                qx_t = x2.t()
            else:
                qx_t = quantize_operand(x2.t(), gw, "grad_weight", "b", keys, amax)
            gw_out = _as(product(qg_t, qx_t, gw), ctx.w_dtype)
        if ctx.has_bias and need_b:
            gb = g2.sum(0)
        return gx, gw_out, gb, None


def _copy_module_state(src: nn.Module, dst: nn.Module) -> None:
    """Carry the training flag and the hooks registered on ``src`` over to its replacement."""
    dst.training = src.training
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
        if hasattr(src, attr):
            getattr(dst, attr).update(getattr(src, attr))


class EmulatedLinear(nn.Linear):
    """``nn.Linear`` with recipe-emulated GEMMs.  Build with ``from_linear`` (or ``lowprec.convert``)."""

    recipe: LinearRecipe
    amax_reduce: Callable[[torch.Tensor], object] | None = None
    """Data-parallel training sets this to an in-place MAX all-reduce (``runs._parallel.wrap_model``).  It is
    applied to a delayed-scaling role's current amax on the first training step of that role only (while the
    history is still empty and the scale comes from the current amax): every rank then scales with the amax of
    the whole global batch, as one process would.  Later steps scale from the history, which the data-parallel
    wrapper MAX-reduces after every backward, so no collective is needed in the forward or backward pass."""
    input_after_mask: bool = False
    """The input is the output of a ReLU-like activation (set by ``convert``, nn/_masked_inputs.py): under
    torch.compile on CPU the input is saved unquantized and quantized again in backward.  Speed only."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: LinearRecipe,
                 seed: int = 0, name: str = "", device: Any = None, dtype: Any = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(recipe, seed, name)

    def _setup(self, recipe: LinearRecipe, seed: int, name: str) -> None:
        self.recipe = recipe
        self._plan_cache = (recipe, _plan_for(recipe))
        self.lowprec_name = name
        ops = recipe.operands()
        self._delayed, self._algorithm = delayed_roles(recipe)
        self._amax_started: set[str] = set()  # roles whose history has had a training step recorded
        dev = self.weight.device
        for role, n in self._delayed.items():
            self.register_buffer(f"amax_history_{role}", torch.zeros(n, dtype=torch.float32, device=dev))
        self._stochastic = any(op.spec is not None and op.spec.rounding == "stochastic" for op in ops.values())
        self._base_keys = {
            key: _random.key_tensor(_random.stream_seed(seed, name, *key), dev) for key in ops
        }
        if self._stochastic:
            self.register_buffer("lp_step", torch.zeros((), dtype=torch.int64, device=dev))

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: LinearRecipe, *, seed: int = 0, name: str = "") -> EmulatedLinear:
        """An EmulatedLinear sharing ``lin``'s Parameter objects (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        _copy_module_state(lin, new)
        new._setup(recipe, seed, name)
        return new

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this module's Parameter objects."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        _copy_module_state(self, lin)
        return lin

    def _plan(self) -> _Plan:
        """The per-recipe plan, recomputed when ``self.recipe`` is replaced (e.g. by an automatic fallback)."""
        cached = self._plan_cache
        if cached[0] is not self.recipe:
            cached = self._plan_cache = (self.recipe, _plan_for(self.recipe))
        return cached[1]

    def _delayed_amax(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """For each delayed role in ``tensors``: the amax to scale with now, and record the current amax.

        The scale uses the history of previous steps (max, or the most recent entry); on the first step, when the
        history is still empty (all zero), the current amax is used.  In eval mode nothing is recorded: evaluating
        a model never changes how it trains.
        """
        out: dict[str, torch.Tensor] = {}
        for role, t in tensors.items():
            if role not in self._delayed:
                continue
            hist: torch.Tensor = getattr(self, f"amax_history_{role}")
            with torch.no_grad():
                current = t.abs().amax() if t.numel() else t.new_zeros(())
                if self.training and self.amax_reduce is not None and role not in self._amax_started:
                    self.amax_reduce(current)  # first step: the global batch's amax (class docstring)
                past = hist.amax() if self._algorithm[role] == "max" else hist[0]
                out[role] = torch.where(past > 0, past, current)
                if self.training:  # a new tensor, not in place: see ``forward`` on lp_step
                    setattr(self, f"amax_history_{role}", torch.cat([current.reshape(1), hist[:-1]]))
                    self._amax_started.add(role)
        return out

    transposed_weight: bool = False
    """False: ``weight`` is stored [out, in] = [N, K] as in ``nn.Linear``.  ``EmulatedConv1D`` stores it [K, N]."""

    def linear_weight(self) -> torch.Tensor:
        """The weight as the GEMMs see it, [out, in] = [N, K] (``weight`` itself here; a transposed view in
        ``EmulatedConv1D``).  Code that reads the weight of any emulated linear should use this."""
        return self.weight

    def _step_keys(self) -> Keys | None:
        """This call's random keys (stochastic operands only); advances ``lp_step`` in training mode."""
        keys = None
        if self._stochastic:
            step = self._buffers["lp_step"]
            assert step is not None  # a buffer, registered in __init__ whenever _stochastic
            if self.training:  # eval reuses the current step's streams: it never advances training state
                # A new tensor, not ``step += 1``: under torch.compile the backward may recompute the keys from the
                # buffer it was given as input, which an in-place update has advanced by then (the compiled
                # backward drew the next step's random bits).
                step = step + 1
                self._buffers["lp_step"] = step
            dev = step.device
            keys = {k: _random.derive_keys(base.to(dev), step) for k, base in self._base_keys.items()}
        return keys

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self._step_keys()
        return _LinearFn.apply(x, self.weight, self.bias, _Ctx(self, keys))  # type: ignore[no-any-return]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # A plain nn.Linear state dict has no lowprec buffers: keep their current values instead of failing.
        for name, buf in self._buffers.items():
            if buf is not None and prefix + name not in state_dict:
                state_dict[prefix + name] = buf
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", lowprec={self.lowprec_name or 'linear'}"


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (GPT-2, GPT, ...), recognised without importing transformers:
    the class is named ``Conv1D``, defined in a ``transformers`` module, and its ``weight`` is 2-D."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    return (cls.__name__ == "Conv1D" and cls.__module__.split(".")[0] == "transformers"
            and isinstance(weight, torch.Tensor) and weight.dim() == 2)


class EmulatedConv1D(EmulatedLinear):
    """transformers' ``Conv1D`` with recipe-emulated GEMMs.  Build with ``from_conv1d`` (or ``lowprec.convert``).

    Why it is a linear with weight W^T: despite its name, ``Conv1D`` (GPT-2's ``c_attn``, ``c_proj``, ``c_fc``) is
    a dense layer whose weight is stored transposed, ``W: [in, out] = [K, N]``, and whose forward is
    ``addmm(bias, x, W)``, i.e. ``y = x @ W + b``.  That is exactly ``nn.Linear`` with weight ``W^T: [N, K]``, so the
    three GEMMs here are those of ``EmulatedLinear`` run on ``W^T`` (a contiguous transposed copy each call, so the
    bits equal those of an ``EmulatedLinear`` holding ``W^T``): forward ``Q(x) @ Q(W^T)^T``, grad_input
    ``Q(dY) @ Q(W)^T`` and grad_weight ``Q(dY^T) @ Q(x^T)^T``, whose [N, K] result autograd transposes back onto
    ``W`` (transposing is exact).  The module keeps ``Conv1D``'s Parameter objects and layout, so optimizer state
    and state dicts (keys and shapes) are those of the unconverted model; ``to_conv1d`` gives the original class
    back.  ``in_features``/``out_features`` follow ``nn.Linear`` (``nx``/``nf``); ``linear_weight()`` is the [N, K]
    view, which is what code treating every emulated linear alike should read instead of ``weight``.
    """

    transposed_weight = True
    nf: int
    nx: int
    _conv1d_class: type[nn.Module]

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: LinearRecipe, *, seed: int = 0,
                    name: str = "") -> EmulatedConv1D:
        """An EmulatedConv1D sharing ``conv``'s Parameter objects (no copy); ``conv`` is a transformers Conv1D."""
        if not is_hf_conv1d(conv):
            raise UsageError(f"from_conv1d needs a transformers Conv1D; got {type(conv).__name__}")
        weight = conv.weight
        assert isinstance(weight, torch.Tensor)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.nx, new.nf = weight.shape
        new.in_features, new.out_features = new.nx, new.nf
        new.weight = weight  # type: ignore[assignment]  # the same Parameter, [K, N]
        new.bias = conv.bias  # type: ignore[assignment]
        new._conv1d_class = type(conv)
        _copy_module_state(conv, new)
        new._setup(recipe, seed, name)
        return new

    def to_conv1d(self) -> nn.Module:
        """A module of the original ``Conv1D`` class sharing this module's Parameter objects."""
        conv: Any = self._conv1d_class.__new__(self._conv1d_class)
        nn.Module.__init__(conv)
        conv.nf, conv.nx = self.nf, self.nx
        conv.weight, conv.bias = self.weight, self.bias
        _copy_module_state(self, conv)
        return conv  # type: ignore[no-any-return]

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keys = self._step_keys()
        w_t = self.weight.t().contiguous()  # [N, K], laid out as an nn.Linear weight: the same GEMM bits
        return _LinearFn.apply(x, w_t, self.bias, _Ctx(self, keys))  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, bias={self.bias is not None}, lowprec={self.lowprec_name or 'conv1d'}"
