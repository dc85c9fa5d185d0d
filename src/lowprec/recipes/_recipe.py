"""``Recipe``: a complete, serialisable description of low-precision training numerics.

A linear layer ``y = x @ W^T`` runs three GEMMs per step, and a recipe says how each operand of each is quantized
and how each accumulates:

    forward      y      = x  @ W^T      [B,K] @ [K,N] -> [B,N]     operands (input, weight)
    grad_input   dL/dx  = dY @ W        [B,N] @ [N,K] -> [B,K]     operands (grad_output, weight)
    grad_weight  dL/dW  = dY^T @ x      [N,B] @ [B,K] -> [N,K]     operands (grad_output, input)

Operands are always quantized with their reduction dimension last, so ``axis=-1`` in an operand's ``QuantSpec``
means "one scale per row of the GEMM" (rowwise) and blocks run along the reduction dimension, as hardware wants.

Around the GEMMs the recipe fixes which modules stay in high precision, how weights are stored and updated
(float32 masters, or low-precision weights updated with stochastic rounding or Kahan compensation), the formats of
optimizer state and gradients, and loss scaling.  Everything is plain data: ``to_dict``/``from_dict``, JSON and
TOML round-trip, and the hash of the canonical JSON identifies a recipe in a run record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal

from .. import formats
from .._checks import check_bool, check_finite, check_float, check_int, check_literal, check_positive, check_str
from .._errors import UsageError
from ..quant._spec import QuantSpec

ScalingKind = Literal["current", "delayed"]
"""``Scaling.kind``."""
AmaxAlgorithm = Literal["max", "most_recent"]
"""``Scaling.algorithm``."""
WeightUpdate = Literal["master", "nearest", "stochastic", "kahan"]
"""``Weights.update``."""
LossScaleKind = Literal["none", "static", "dynamic"]
"""``LossScaling.kind``."""
AccumulatorRounding = Literal["nearest", "toward_zero"]
"""``Accumulator.rounding``: rounding of each accumulation step."""
WireRounding = Literal["nearest", "stochastic"]
"""``GradComm.rounding``: rounding of gradients onto the wire."""
AttentionGranularity = Literal["tensor", "head"]
"""``Attention.granularity``: what one scale covers for an operand whose spec has ``scaling="tensor"``."""

_MAX_INT = 1 << 30


def _format_name(value: object, field: str) -> None:
    if value is None:
        return
    try:
        formats.get(value)  # type: ignore[arg-type]
    except ValueError as e:
        raise UsageError(f"{field}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scaling:
    """How an operand's scale is chosen over time."""

    kind: ScalingKind = "current"
    """"current": from the tensor being cast; "delayed": from the amax history of previous steps."""
    history_len: int = 16
    """Delayed only: steps of amax history kept (TransformerEngine's default is 1024)."""
    algorithm: AmaxAlgorithm = "max"
    """Delayed only: "max" over the history, or the "most_recent" amax."""

    def __post_init__(self) -> None:
        check_literal(self.kind, "Scaling.kind", ScalingKind)
        check_int(self.history_len, "Scaling.history_len", 1, 1 << 16)
        check_literal(self.algorithm, "Scaling.algorithm", AmaxAlgorithm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
    """One GEMM operand: its QuantSpec (None keeps it in float32) and its scaling policy."""

    spec: QuantSpec | None = None
    """How the operand is quantized; None: not quantized."""
    scaling: Scaling = Scaling()
    """Current or delayed scaling (delayed needs scaling="tensor" in ``spec``)."""

    def __post_init__(self) -> None:
        if self.spec is not None and not isinstance(self.spec, QuantSpec):
            raise UsageError(f"Operand.spec must be a QuantSpec or None; got {type(self.spec).__name__}")
        if self.scaling.kind == "delayed" and (self.spec is None or self.spec.scaling != "tensor"):
            raise UsageError("Operand.scaling kind='delayed' needs a spec with scaling='tensor'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accumulator:
    """How a GEMM accumulates ``out[m, n] = sum_k a[m, k] * b[n, k]``: one of three models.

    * ``format=None, block=None`` (the default): a float32 accumulator, i.e. a plain float32 matmul.
    * Sequential (``format`` set, ``block=None``): products are added one at a time into an accumulator rounded to
      ``format`` after every addition (``acc = Q(fl32(acc + a_k * b_k))``), and every ``chunk`` products the partial
      sum is promoted: added into a float32 total and restarted at zero.  This is the model of DeepSeek-V3's report
      on H800 fp8 tensor cores (about 14 significant bits, promoted every 128 products).
    * Blocked fused multiply-add (``block=n``): for each run of ``n`` reduction indices, the exact products and the
      accumulator are aligned to the largest exponent among them, each truncated toward zero to ``bits``
      significant bits relative to it, summed exactly, and the sum rounded once (``rounding``) into ``format``
      (float32 when None); promotion every ``chunk`` products as above.  This is the model Fasi, Higham, Mikaitis
      and Pranesh measured on NVIDIA tensor cores ("Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021:
      V100 and T4 add blocks of n = 4 fp16 products with no extra alignment bits, 24, and truncate the result).

    ``emulated`` is False only for the plain float32 accumulator.  See docs/recipes.md, "The accumulator model".
    """

    format: str | None = None
    """Accumulator format name (e.g. a custom e8m13), or None for float32."""
    chunk: int | None = None
    """Promote to float32 every ``chunk`` products (None: never); with ``block``, a multiple of it."""
    rounding: AccumulatorRounding = "nearest"
    """Rounding of each accumulation step into ``format`` (the sequential model) or of each block's sum."""
    block: int | None = None
    """Products per fused multiply-add of the blocked model (None: the sequential model)."""
    bits: int | None = None
    """The blocked model's alignment precision: significant bits kept of each term, relative to the block's largest
    exponent (24 keeps float32's significand and no extra bit).  Required with ``block``, not allowed without."""

    def __post_init__(self) -> None:
        _format_name(self.format, "Accumulator.format")
        if self.chunk is not None:
            check_int(self.chunk, "Accumulator.chunk", 1, _MAX_INT)
        check_literal(self.rounding, "Accumulator.rounding", AccumulatorRounding)
        if self.block is None:
            if self.bits is not None:
                raise UsageError("Accumulator.bits is the blocked model's alignment precision: set Accumulator.block "
                                 "(products per fused multiply-add) too, or leave bits out")
            return
        check_int(self.block, "Accumulator.block", 1, 1024)
        if self.bits is None:
            raise UsageError("Accumulator.block needs Accumulator.bits, the significant bits kept of each aligned "
                             "term (e.g. 24 for NVIDIA V100 fp16 tensor cores)")
        check_int(self.bits, "Accumulator.bits", 2, 48)
        if self.chunk is not None and self.chunk % self.block:
            raise UsageError(f"Accumulator.chunk must be a multiple of Accumulator.block ({self.block}) so that "
                             f"promotion falls between blocks; got {self.chunk}")
        if self.format is not None:
            fmt = formats.get(self.format)
            if fmt.kind != "float" or fmt.special != "ieee" or not fmt.signed:
                raise UsageError(f"Accumulator.format with block: the blocked model rounds into a signed IEEE-style "
                                 f"float format (with infinities), such as e8m13 or float16; got {self.format!r}")

    @property
    def emulated(self) -> bool:
        """Whether GEMMs through this accumulator differ from a plain float32 matmul (any model but the default)."""
        return self.format is not None or self.block is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemm:
    """One GEMM: operands a (rows) and b (columns), both with the reduction dimension last, and its accumulator."""

    a: Operand = Operand()
    b: Operand = Operand()
    accumulator: Accumulator = Accumulator()
    output_format: str | None = None
    """Round the GEMM output to this format (e.g. "bfloat16" as autocast does); None keeps float32."""

    def __post_init__(self) -> None:
        _format_name(self.output_format, "Gemm.output_format")


GEMMS: tuple[str, ...] = ("forward", "grad_input", "grad_weight")
"""The GEMMs of a linear layer, in the order they run."""

OPERAND_ROLE: dict[tuple[str, str], str] = {
    ("forward", "a"): "input",
    ("forward", "b"): "weight",
    ("grad_input", "a"): "grad_output",
    ("grad_input", "b"): "weight",
    ("grad_weight", "a"): "grad_output",
    ("grad_weight", "b"): "input",
}
"""(GEMM, operand "a" | "b") -> the tensor that operand is: each tensor feeds two GEMMs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRecipe:
    """The three GEMMs of a linear layer (see the module docstring for operand order)."""

    forward: Gemm = Gemm()
    """y = x @ W^T: a = input, b = weight."""
    grad_input: Gemm = Gemm()
    """dL/dx = dY @ W: a = grad_output, b = weight (transposed so its reduction dim is last)."""
    grad_weight: Gemm = Gemm()
    """dL/dW = dY^T @ x: a = grad_output^T, b = input^T."""

    def operands(self) -> dict[tuple[str, str], Operand]:
        """Every operand by (GEMM, "a" | "b"), in ``GEMMS`` order (``OPERAND_ROLE`` names its tensor)."""
        return {(g, o): getattr(getattr(self, g), o) for g in GEMMS for o in "ab"}


def shares_quantization(first: Operand, second: Operand) -> bool:
    """True when ``Q_second(t^T) == Q_first(t)^T`` bit for bit for every tensor ``t``, so that one quantization of
    ``t`` serves two GEMMs (the weight in forward and grad_input, the input in forward and grad_weight, the output
    gradient in grad_input and grad_weight).

    It holds when neither operand is quantized, or both use the same spec with one scale for the whole tensor (or
    none), round without random bits and take their amax the same way (current, or the same role's delayed
    history): the amax of ``t^T`` is that of ``t`` (max is exact and order-free) and the rest is elementwise.  It
    does not hold for stochastic rounding (each GEMM draws its own bits) nor for axis, block or tile scaling, which
    group ``t`` and ``t^T`` differently.
    """
    if first.spec is None or second.spec is None:
        return first.spec is None and second.spec is None
    spec = first.spec
    return (
        spec == second.spec
        and spec.scaling in ("none", "tensor")
        and spec.rounding != "stochastic"
        and first.scaling.kind == second.scaling.kind
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Loss scaling for formats with little range below 1 (fp16)."""

    kind: LossScaleKind = "none"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """Dynamic: grow the scale after this many consecutive finite steps."""

    def __post_init__(self) -> None:
        check_literal(self.kind, "LossScaling.kind", LossScaleKind)
        check_positive(self.init_scale, "LossScaling.init_scale")
        check_float(self.growth_factor, "LossScaling.growth_factor", 1.0)
        check_float(self.backoff_factor, "LossScaling.backoff_factor", 0.0, 1.0, open_lo=True, open_hi=True)
        check_int(self.growth_interval, "LossScaling.growth_interval", 1, _MAX_INT)
        for field in ("init_scale", "growth_factor", "backoff_factor"):  # 2 and 2.0: one recipe, one hash
            object.__setattr__(self, field, float(getattr(self, field)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weights:
    """How weights are stored and updated."""

    update: WeightUpdate = "master"
    """"master": float32 weights (the GEMM quantizes its own copy); "nearest", "stochastic", "kahan": weights
    stored in ``format`` and updated with that rounding (kahan: nearest plus a compensation buffer)."""
    format: str = "float32"
    """Storage format of the weights when ``update`` is not "master"."""

    def __post_init__(self) -> None:
        check_literal(self.update, "Weights.update", WeightUpdate)
        _format_name(self.format, "Weights.format")
        if self.update != "master" and self.format == "float32":
            raise UsageError(
                f"Weights.update={self.update!r} needs a low-precision Weights.format such as 'bfloat16'"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """Storage of optimizer state and gradients (None: float32)."""

    exp_avg: QuantSpec | None = None
    """First moment (Adam) or momentum buffer (SGD)."""
    exp_avg_sq: QuantSpec | None = None
    """Second moment (Adam)."""
    grad: QuantSpec | None = None
    """Gradients, quantized before the optimizer step."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradComm:
    """How data-parallel gradients travel between ranks (``lowprec.distributed.compress_hook``)."""

    spec: QuantSpec
    """Wire format: e.g. bf16 (``{elem = "bfloat16"}``), fp8 with one shared scale per bucket
    ("fp8_e4m3_tensorwise"), or an MX block format ("mxfp8_e4m3")."""
    rounding: WireRounding | None = None
    """"nearest" or "stochastic" (None: the spec's own rounding)."""
    error_feedback: bool = False
    """Add each rank's cast residual to its next gradient."""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, QuantSpec):
            raise UsageError(f"GradComm.spec must be a QuantSpec or a spec name; got {self.spec!r}")
        if self.rounding is not None:
            check_literal(self.rounding, "GradComm.rounding", WireRounding)
        check_bool(self.error_feedback, "GradComm.error_feedback")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fallback:
    """Opt-in automatic fallback: move one linear layer to a higher-precision ``LinearRecipe`` when the tensor
    statistics the runner samples (``lowprec.numerics.StatsObserver``, every ``[stats] every`` steps) cross a
    threshold on ``patience`` consecutive samples.  Any tensor role of the layer (input, weight, output,
    grad_output, grad_input, grad_weight, measured against the layer's own spec) can trigger it; a layer falls
    back once, for the rest of the run, and the run records a "fallback" event (``docs/debugging.md``)."""

    underflow_pct: float | None = None
    """Fall back when more than this % of a tensor's nonzero values quantize to zero (None: not watched)."""
    overflow_pct: float | None = None
    """Fall back when more than this % of a tensor's nonzero values overflow the format (None: not watched)."""
    sqnr_db: float | None = None
    """Fall back when a tensor's SQNR is below this many dB (None: not watched)."""
    patience: int = 2
    """Consecutive sampled steps a statistic must cross its threshold before the layer falls back."""
    to: str | LinearRecipe = "bf16"
    """Where the layer goes: a built-in recipe name (its ``linear`` part) or a ``LinearRecipe``."""

    def __post_init__(self) -> None:
        for field in ("underflow_pct", "overflow_pct"):
            v = getattr(self, field)
            if v is not None:  # 50 and 50.0: one recipe, one hash
                pct = check_float(v, f"Fallback.{field}", 0.0, 100.0, open_hi=True, note="(a percentage) or None")
                object.__setattr__(self, field, pct)
        if self.sqnr_db is not None:
            db = check_finite(self.sqnr_db, "Fallback.sqnr_db", note="(dB) or None")
            object.__setattr__(self, "sqnr_db", db)
        if self.underflow_pct is None and self.overflow_pct is None and self.sqnr_db is None:
            raise UsageError("Fallback needs a threshold: set underflow_pct, overflow_pct or sqnr_db")
        check_int(self.patience, "Fallback.patience", 1, _MAX_INT)
        if isinstance(self.to, str):
            from ._named import names

            if self.to not in names():
                raise UsageError(f"Fallback.to must be a LinearRecipe or a built-in recipe name ({', '.join(names())});"
                                 f" got {self.to!r}")
        elif not isinstance(self.to, LinearRecipe):
            raise UsageError(f"Fallback.to must be a LinearRecipe or a recipe name; got {type(self.to).__name__}")

    def target(self) -> LinearRecipe:
        """The ``LinearRecipe`` a layer falls back to."""
        if isinstance(self.to, LinearRecipe):
            return self.to
        from ._named import get

        return get(self.to).linear


ATTENTION_GEMMS: tuple[str, ...] = ("scores", "values")
"""The GEMMs of attention, in the order they run (``Attention`` fields)."""


def _check_attention_gemms(lin: object, field: str) -> None:
    if not isinstance(lin, LinearRecipe):
        raise UsageError(f"{field} must be a LinearRecipe; got {type(lin).__name__}")
    for (g, o), op in lin.operands().items():
        if op.scaling.kind == "delayed":
            raise UsageError(f"{field}.{g}.{o}: delayed scaling is not supported in attention (it keeps no amax "
                             "history); use current scaling (Scaling())")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attention:
    """How scaled dot-product attention is emulated: its two GEMMs, each a ``LinearRecipe`` (three GEMMs with
    backward), with ``O = softmax(Q K^T * scale + mask) V`` per (batch, head)::

        scores   S = Q' @ K'^T   [L,E] @ [E,S]     Q' = Q*sqrt(scale), K' = K*sqrt(scale) (PyTorch's math order)
          forward      a = Q' [L,E],    b = K' [S,E]      (b is K'^T in the weight's place: reduction dim E last)
          grad_input   a = dS [L,S],    b = K'^T [E,S]    dQ' = dS @ K'
          grad_weight  a = dS^T [S,L],  b = Q'^T [E,L]    dK' = dS^T @ Q'
        values   O = P @ V     [L,S] @ [S,E]     P = softmax(S + mask), float32 always
          forward      a = P [L,S],     b = V^T [E,S]
          grad_input   a = dO [L,E],    b = V [S,E]       dP = dO @ V^T
          grad_weight  a = dO^T [E,L],  b = P^T [S,L]     dV = P^T @ dO   (computed as (dO^T @ P)^T)

    As everywhere in lowprec, each operand is quantized with its reduction dimension last, so a block spec
    (MX: 32 elements) puts its blocks along E for Q and K, along the key positions S for P and V^T.  The softmax,
    the mask and the scale run in float32 whatever the recipe: they are elementwise or row reductions that
    hardware attention kernels keep in float32 registers; only the GEMM operands go through low-precision
    formats.  Attention is stateless: no delayed scaling, and stochastic operands draw from ``Recipe.seed``.
    """

    scores: LinearRecipe = LinearRecipe()
    """``S = Q K^T`` (the GEMM roles are in the class docstring)."""
    values: LinearRecipe = LinearRecipe()
    """``O = P V``."""
    granularity: AttentionGranularity = "tensor"
    """For operands whose spec has ``scaling="tensor"``: "tensor": one scale for the whole [B, H, L, E] operand;
    "head": one scale per (batch, head) matrix.  Block, axis and tile specs always scale within each matrix,
    along the reduction dimension ("per block")."""

    def __post_init__(self) -> None:
        for field in ATTENTION_GEMMS:
            _check_attention_gemms(getattr(self, field), f"Attention.{field}")
        check_literal(self.granularity, "Attention.granularity", AttentionGranularity)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything about the numerics of a training run.  Plain data; see the module docstring."""

    name: str = "custom"
    linear: LinearRecipe = LinearRecipe()
    """Recipe for every converted linear layer (and ``lowprec.nn.functional.matmul``)."""
    overrides: tuple[tuple[str, LinearRecipe], ...] = ()
    """Per-module recipes: (fnmatch pattern on the module's qualified name, recipe); first match wins."""
    keep_high_precision: tuple[str, ...] = ()
    """fnmatch patterns on module names (e.g. "lm_head", "*.embed") whose linears are left unconverted."""
    keep_types: tuple[str, ...] = ()
    """Module class names left unconverted (their linears too), e.g. "Embedding"."""
    weights: Weights = Weights()
    optimizer: OptimizerState = OptimizerState()
    loss_scaling: LossScaling = LossScaling()
    seed: int = 0
    """Seed of the stochastic-rounding streams (weight updates, stochastic GEMM operands)."""
    grad_comm: GradComm | None = None
    """Data-parallel gradient communication format (None: float32 all-reduce)."""
    fallback: Fallback | None = None
    """Opt-in automatic per-layer fallback to a higher-precision recipe (None: off; left out of the hash then)."""
    attention: Attention | None = None
    """Emulated attention (``lowprec.nn.emulate_attention``); None: attention is not emulated and runs in the
    model's own dtype and kernel (left out of the hash then, so recipes without it keep their hashes)."""

    def __post_init__(self) -> None:
        check_str(self.name, "Recipe.name")
        if not isinstance(self.overrides, tuple):
            raise UsageError(
                f"Recipe.overrides must be a tuple of (pattern, LinearRecipe) pairs; got {self.overrides!r}"
            )
        for i, item in enumerate(self.overrides):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], LinearRecipe)):
                raise UsageError(f"Recipe.overrides[{i}] must be a (pattern, LinearRecipe) pair; got {item!r}")
        for field in ("keep_high_precision", "keep_types"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise UsageError(f"Recipe.{field} must be a tuple of strings; got {value!r}")
        check_int(self.seed, "Recipe.seed", 0, (1 << 63) - 1)
        if self.fallback is not None and not isinstance(self.fallback, Fallback):
            raise UsageError(f"Recipe.fallback must be a Fallback or None; got {type(self.fallback).__name__}")
        if self.attention is not None and not isinstance(self.attention, Attention):
            raise UsageError(f"Recipe.attention must be an Attention or None; got {type(self.attention).__name__}")

    # ------------------------------------------------------------------------------------------- serialising
    def to_dict(self) -> dict[str, Any]:
        from ._serial import recipe_to_dict

        return recipe_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        from ._serial import recipe_from_dict

        return recipe_from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        """Parse (invalid or too deeply nested JSON is a ValueError, see ``lowprec._parse``) and validate."""
        from .._parse import parse_json

        return cls.from_dict(parse_json(text, where="recipe JSON"))

    def to_toml(self) -> str:
        from ._serial import dict_to_toml

        return dict_to_toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str) -> Recipe:
        """Parse (invalid or too deeply nested TOML is a ValueError, see ``lowprec._parse``) and validate."""
        from .._parse import parse_toml

        return cls.from_dict(parse_toml(text, where="recipe TOML"))

    def hash(self) -> str:
        """SHA-256 (first 16 hex digits) of the canonical JSON: identifies the numerics of a run."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]
