"""``QuantSpec``: how a tensor is scaled and rounded into a low-precision format.

Scaled quantization stores ``x ≈ code * scale``.  Elements that share a scale form a *group*:

* ``"tensor"``: one scale for the whole tensor (fp8 tensorwise recipes);
* ``"axis"``: one scale per slice, the amax taken along ``axis`` (rowwise: ``axis=-1`` gives one scale per row);
* ``"block"``: blocks of ``block_size`` consecutive elements along ``axis`` (OCP MX: 32; NVFP4: 16).  A
  dimension that the block size does not divide ends in a shorter block;
* ``"tile"``: ``tile = (a, b)`` tiles over the last two dimensions (DeepSeek-V3: 1x128 activations, 128x128
  weights); edge tiles are smaller.

For each group, ``amax = max |x|`` and the scale is ``amax / max_elem`` (times ``2^margin``) cast to
``scale_format``:

* power-of-two scale formats (``float8_e8m0fnu``) follow ``scale_rounding``:
  ``"floor"``: ``2^(floor(log2 amax) - emax_elem)``, the OCP MX v1.0 rule (it can clip the block maximum, which
  the element cast then saturates); ``"ceil"``: the smallest power of two with ``scale * max_elem >= amax`` (never
  clips; NVIDIA's MXFP8 recipe); ``"nearest"``: ``amax / max_elem`` rounded to the nearest power of two.
* float32 scales follow TransformerEngine/torchao: the multiplier ``m = max_elem / amax`` (times ``2^-margin``)
  quantizes, ``codes = Q(x * m)``, and its float32 reciprocal ``fl(1/m)`` is the stored dequantization scale;
* other scale formats (bfloat16, float8_e4m3fn for NVFP4): ``amax / max_elem`` rounded to the scale format with
  ``"nearest"`` (ties to even), ``"floor"`` (down) or ``"ceil"`` (up, never clips); ``codes = Q(x / scale)``.

Scales are clamped to the scale format's positive range ``[smallest, max]``; an all-zero group thus gets the
smallest scale and zero codes (NVFP4's "te" rule below has no lower bound: scale 0).  A group containing NaN or
inf gets a NaN scale, and the whole group dequantizes to NaN (OCP MX: an E8M0 scale of 0xFF makes every element of
its block NaN).

With ``tensor_scale=True`` (NVFP4) a float32 per-tensor scale comes first; ``two_level_rule`` says how the two
levels are computed (docs/quantization.md, "NVFP4: what the kernels compute", has the sources):

* ``"te"`` (the default): what NVIDIA TransformerEngine's NVFP4 kernels compute.  With ``D = max_elem * max_scale``
  (6 * 448): the encode scale ``S_enc = fl(D / amax_tensor)`` (at most float32 max; 1 for an all-zero tensor) and
  ``S_dec = fl(1 / S_enc)``; a group's scale is ``amax * fl(S_enc * fl(1 / max_elem))`` rounded into the scale
  format, saturating, with no lower bound (a group far below the tensor's amax gets a subnormal or zero scale);
  elements are ``Q(clamp(x * m))`` with the multiplier ``m = fl(1 / fl(s_group * S_dec))`` (at most float32 max;
  a zero scale gives float32 max).  The stored tensor scale is the decode scale ``s_t = fl(amax_tensor / D)``
  that TE's GEMM and dequantization apply (torchao's and ModelOpt's per-tensor scale), and
  ``x_hat = codes * fl(s_group * s_t)``.
* ``"divide"`` (lowprec before issue 20; named spec ``"nvfp4_div"``): ``s_t = amax_tensor / D`` (at least 2^-126),
  group scales ``(amax / max_elem) / s_t`` rounded and clamped to ``[smallest, max]`` like any other group scale,
  and ``codes = Q(x / (s_group * s_t))``: one correctly rounded division per element.

With either rule the effective dequantization scale is one float32 product ``s_group * s_t``, and a NaN or inf
anywhere in the tensor makes the tensor scale, and so the whole tensor, NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from .. import formats
from .._checks import check_bool, check_int, check_literal, check_positive_int, literal_values
from .._errors import UsageError
from ..formats import FormatSpec
from ._validate import Rounding, check_rounding

Scaling = Literal["none", "tensor", "axis", "block", "tile"]
"""Scale granularity of a ``QuantSpec`` (module docstring)."""
ScaleRounding = Literal["floor", "ceil", "nearest"]
"""Rounding of a scale into its scale format."""
TwoLevelRule = Literal["te", "divide"]
"""How a two-level spec (NVFP4) computes its scales and elements (module docstring)."""
SCALINGS: tuple[str, ...] = literal_values(Scaling)
SCALE_ROUNDINGS: tuple[str, ...] = literal_values(ScaleRounding)


def _field_format(value: object, field: str) -> FormatSpec:
    try:
        return formats.get(value)  # type: ignore[arg-type]
    except ValueError as e:
        raise UsageError(f"QuantSpec.{field}: {e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How to quantize one tensor: element format, scaling granularity, scale format and rounding."""

    elem: str | FormatSpec = "float8_e4m3fn"
    """Element format (name or FormatSpec)."""
    scaling: Scaling = "tensor"
    """Scale granularity: "none", "tensor", "axis", "block" or "tile"."""
    axis: int = -1
    """"axis": the dimension reduced for the amax; "block": the dimension the blocks run along."""
    block_size: int | None = None
    """"block" only: elements per block (32 for OCP MX, 16 for NVFP4)."""
    tile: tuple[int, int] | None = None
    """"tile" only: tile shape over the last two dimensions, e.g. (1, 128) or (128, 128)."""
    scale_format: str | FormatSpec = "float32"
    """Format the scales are stored in: "float32", "bfloat16", "float8_e8m0fnu", "float8_e4m3fn", ..."""
    scale_rounding: ScaleRounding = "nearest"
    """Rounding of the scale into scale_format: "floor" (OCP MX), "ceil" (never clips), "nearest"."""
    margin: int = 0
    """Scale multiplied by 2^margin (headroom against overflow, as TransformerEngine's margin)."""
    rounding: Rounding = "nearest"
    """Element rounding: "nearest", "stochastic" or "toward_zero"."""
    saturate: bool = True
    """Clamp scaled elements to +-max of the element format (the OCP MX rule)."""
    tensor_scale: bool = False
    """Two-level scaling: an extra float32 per-tensor scale (NVFP4)."""
    two_level_rule: TwoLevelRule = "te"
    """tensor_scale=True only: "te" (TransformerEngine's NVFP4 arithmetic: reciprocal scaling, no lower bound on
    group scales) or "divide" (lowprec's earlier rule: division, group scales clamped to the smallest subnormal)."""

    def __post_init__(self) -> None:
        elem = _field_format(self.elem, "elem")
        check_literal(self.scaling, "QuantSpec.scaling", Scaling)
        check_int(self.axis, "QuantSpec.axis")
        if self.scaling == "block":
            check_positive_int(self.block_size, "QuantSpec.block_size", note="for scaling='block'")
        elif self.block_size is not None:
            raise UsageError(f"QuantSpec.block_size is only used with scaling='block'; got scaling={self.scaling!r}")
        if self.scaling == "tile":
            t = self.tile
            ok = isinstance(t, tuple) and len(t) == 2 and all(isinstance(v, int) and v > 0 for v in t)
            if not ok:
                raise UsageError(f"QuantSpec.tile must be a pair of positive ints such as (1, 128); got {t!r}")
        elif self.tile is not None:
            raise UsageError(f"QuantSpec.tile is only used with scaling='tile'; got scaling={self.scaling!r}")
        sfmt = _field_format(self.scale_format, "scale_format")
        if sfmt.kind != "float":
            raise UsageError(f"QuantSpec.scale_format must be a float format; got {sfmt.name!r}")
        check_literal(self.scale_rounding, "QuantSpec.scale_rounding", ScaleRounding)
        check_int(self.margin, "QuantSpec.margin", -64, 64)
        check_rounding(self.rounding, "QuantSpec.rounding")
        check_bool(self.saturate, "QuantSpec.saturate")
        check_bool(self.tensor_scale, "QuantSpec.tensor_scale")
        check_literal(self.two_level_rule, "QuantSpec.two_level_rule", TwoLevelRule)
        if not self.tensor_scale and self.two_level_rule != "te":
            raise UsageError(f"QuantSpec.two_level_rule={self.two_level_rule!r} applies to two-level specs only; set "
                             "tensor_scale=True (NVFP4) or leave two_level_rule at its default 'te'")
        if self.tensor_scale and self.scaling in ("none", "tensor"):
            raise UsageError("QuantSpec.tensor_scale needs scaling 'axis', 'block' or 'tile'")
        is_f32 = sfmt.mbits == 23 and sfmt.emin <= -126
        if is_f32 and self.scale_rounding != "nearest":
            raise UsageError(
                f"QuantSpec.scale_rounding={self.scale_rounding!r} needs a narrower scale format: float32 scales are "
                "one correctly rounded division; use scale_format='float8_e8m0fnu' for power-of-two scales"
            )
        if self.tensor_scale and is_f32:
            raise UsageError("QuantSpec.tensor_scale needs a narrow group scale format (NVFP4: float8_e4m3fn)")
        if self.tensor_scale and not sfmt.signed:
            raise UsageError("QuantSpec.tensor_scale is for non-power-of-two scale formats (NVFP4's float8_e4m3fn)")
        if elem.kind == "float" and not elem.signed:
            raise UsageError(f"QuantSpec.elem cannot be the unsigned scale format {elem.name!r}")

    @property
    def format(self) -> FormatSpec:
        """The element FormatSpec."""
        return formats.get(self.elem)

    @property
    def scale_spec(self) -> FormatSpec:
        """The scale FormatSpec."""
        return formats.get(self.scale_format)

    @classmethod
    def named(cls, name: str) -> QuantSpec:
        """A built-in spec: see ``QuantSpec.names()``."""
        from ._named import named_spec

        return named_spec(name)

    @staticmethod
    def names() -> list[str]:
        from ._named import spec_names

        return spec_names()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-ready); custom formats are written as their defining fields.  ``two_level_rule`` is
        written for two-level specs only (elsewhere it has no effect), so that adding it left the dicts, and the recipe
        hashes, of every other spec as they were; a two-level dict without it reads as the default "te"."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "two_level_rule" and not self.tensor_scale:
                continue
            v = getattr(self, f.name)
            if isinstance(v, FormatSpec):
                registered = v.name in formats.names() and formats.get(v.name) == v
                v = v.name if registered else dataclasses.asdict(v)
            if isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantSpec:
        """Inverse of ``to_dict``; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(data) - known
        if extra:
            raise UsageError(f"unknown QuantSpec field(s) {sorted(extra)}; valid fields: {sorted(known)}")
        kw = dict(data)
        for key in ("elem", "scale_format"):
            if isinstance(kw.get(key), dict):
                kw[key] = FormatSpec(**kw[key])
        if isinstance(kw.get("tile"), list):
            kw["tile"] = tuple(kw["tile"])
        return cls(**kw)
