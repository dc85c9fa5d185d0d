"""Post-training quantization schemes, as data (compressed-tensors' ``QuantizationScheme`` shape).

A ``Scheme`` says, per module pattern, how a served model's weights, input activations and KV cache are quantized.
It holds one or more ``ConfigGroup``s (compressed-tensors' ``config_groups``): each names its ``targets`` (class
names such as ``"Linear"`` or fnmatch patterns on qualified module names) and a ``TensorScheme`` for the weights
and, optionally, for the input activations.  ``Scheme.ignore`` lists modules left in high precision (``"lm_head"``).

A ``TensorScheme`` is one tensor's quantization.  Its ``granularity`` says which elements share a scale; for a
weight ``W [N, K]`` (``N`` = out_features, ``K`` = in_features, the reduction dimension) and an activation
``X [..., K]``:

    granularity    shares one scale                         lowprec QuantSpec (float formats)
    tensor         the whole tensor                         scaling="tensor"
    channel        one output row of W (weights only)       scaling="axis", axis=-1
    token          one row of X (activations only)          scaling="axis", axis=-1
    group          group_size consecutive elements along K  scaling="block", block_size=group_size (MX: 32)
    tensor_group   group + one float32 tensor scale (NVFP4)  scaling="block", tensor_scale=True
    block          a (a, b) tile of W; activations: (1, b)  scaling="tile", tile=block

``scale_format`` is the scale's storage format: "float32" (int and fp8 schemes), "float8_e8m0fnu" (MX, with
``scale_rounding="floor"``, the OCP rule) or "float8_e4m3fn" (NVFP4).  Integer formats may be asymmetric (a zero
point per scale); float formats are always symmetric.  Activation scales are ``dynamic`` (computed from each
input at run time), static (``False``: fixed by calibration) or ``"local"`` (compressed-tensors' NVFP4: the
float32 tensor scale is calibrated, the group scales are dynamic).

Plain data: ``to_dict``/``from_dict``, JSON and TOML round trips, and ``hash()`` of the canonical JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Literal

from .. import formats
from .._checks import check_bool, check_literal, check_positive_int, check_str, literal_values
from .._errors import UsageError
from ..formats import FormatSpec
from ..quant._spec import QuantSpec, ScaleRounding

Granularity = Literal["tensor", "channel", "token", "group", "tensor_group", "block"]
"""Which elements share one scale (module docstring)."""
Role = Literal["weights", "input_activations", "kv_cache"]
"""The tensor a ``TensorScheme`` describes."""
GRANULARITIES: tuple[str, ...] = literal_values(Granularity)

_GROUPED = ("group", "tensor_group")


def _element_format(name: object, field: str) -> FormatSpec:
    check_str(name, field)
    try:
        fmt = formats.get(name)  # type: ignore[arg-type]
    except ValueError as e:
        raise UsageError(f"{field}: {e}") from None
    if fmt.kind == "float" and not fmt.signed:
        raise UsageError(f"{field} cannot be the unsigned scale format {fmt.name!r}; use it as scale_format")
    if fmt.kind == "int" and fmt.frac_bits:
        raise UsageError(f"{field}={fmt.name!r} is MXINT8's fixed-point element; schemes take plain integers "
                         "('int8', 'int4') or float formats")
    return fmt


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorScheme:
    """How one tensor (weights, input activations or KV cache) is quantized for inference."""

    format: str = "float8_e4m3fn"
    """Element format name: "int8", "int4", "float8_e4m3fn", "float4_e2m1fn", ... (``lowprec.formats.names()``)."""
    granularity: Granularity = "tensor"
    """"tensor", "channel" (weights), "token" (activations), "group", "tensor_group" (NVFP4) or "block"."""
    group_size: int | None = None
    """"group" and "tensor_group" only: elements per group along the reduction dimension (128, 32 MX, 16 NVFP4)."""
    block: tuple[int, int] | None = None
    """"block" only: (rows, cols) of a weight tile, e.g. (128, 128); activations use (1, cols)."""
    symmetric: bool = True
    """False: integer formats only, one zero point per scale (``_affine`` for the exact rule)."""
    dynamic: bool | Literal["local"] = False
    """Activations: True = scales from each input at run time; False = static, fixed by calibration; "local" =
    "tensor_group" only, static tensor scale and dynamic group scales.  Weights are always static (False)."""
    scale_format: str = "float32"
    """Scale storage format: "float32", "float8_e8m0fnu" (MX, power-of-two) or "float8_e4m3fn" (NVFP4)."""
    scale_rounding: ScaleRounding = "nearest"
    """Rounding of a scale into a narrow ``scale_format``: "floor" (OCP MX), "ceil" or "nearest"."""

    def __post_init__(self) -> None:
        fmt = _element_format(self.format, "TensorScheme.format")
        check_literal(self.granularity, "TensorScheme.granularity", Granularity)
        if self.granularity in _GROUPED:
            check_positive_int(self.group_size, "TensorScheme.group_size",
                               note=f"for granularity={self.granularity!r} (e.g. 128; MX 32, NVFP4 16)")
        elif self.group_size is not None:
            raise UsageError(f"TensorScheme.group_size is only used with granularity 'group' or 'tensor_group'; "
                             f"got granularity={self.granularity!r}: remove group_size or set granularity='group'")
        if self.granularity == "block":
            b = self.block
            ok = isinstance(b, tuple) and len(b) == 2 and all(isinstance(v, int) and v > 0 for v in b)
            if not ok:
                raise UsageError(f"TensorScheme.block must be a pair of positive ints such as (128, 128); got {b!r}")
        elif self.block is not None:
            raise UsageError(f"TensorScheme.block is only used with granularity='block'; got {self.granularity!r}")
        check_bool(self.symmetric, "TensorScheme.symmetric")
        if not self.symmetric and fmt.kind != "int":
            raise UsageError(f"TensorScheme.symmetric=False needs an integer format; {fmt.name!r} is a float format,"
                             " which has no zero point: set symmetric=True (or format='int8'/'int4')")
        if self.dynamic != "local":
            check_bool(self.dynamic, "TensorScheme.dynamic")
        elif self.granularity != "tensor_group":
            raise UsageError("TensorScheme.dynamic='local' needs granularity='tensor_group' (NVFP4); use True or "
                             "False")
        check_str(self.scale_format, "TensorScheme.scale_format")
        try:
            sfmt = formats.get(self.scale_format)
        except ValueError as e:
            raise UsageError(f"TensorScheme.scale_format: {e}") from None
        if sfmt.kind != "float":
            raise UsageError(f"TensorScheme.scale_format must be a float format; got {sfmt.name!r}")
        check_literal(self.scale_rounding, "TensorScheme.scale_rounding", ScaleRounding)
        if fmt.kind == "int" and self.scale_format != "float32":
            raise UsageError(f"TensorScheme.scale_format must be 'float32' for the integer format {fmt.name!r} "
                             f"(affine integer scales are float32); got {self.scale_format!r}")
        if self.scale_format == "float32" and self.scale_rounding != "nearest":
            raise UsageError("TensorScheme.scale_rounding only applies to narrow scale formats; keep 'nearest' "
                             "with scale_format='float32'")
        if self.granularity == "tensor_group" and self.scale_format == "float32":
            raise UsageError("TensorScheme.granularity='tensor_group' needs a narrow group scale_format "
                             "(NVFP4: 'float8_e4m3fn')")
        if fmt.kind == "float" and self.scale_format != "float32":
            try:
                self.quant_spec()
            except ValueError as e:
                raise UsageError(f"TensorScheme: {e}") from None

    @property
    def is_int(self) -> bool:
        """True for integer element formats (affine quantization, ``_affine``)."""
        return formats.get(self.format).kind == "int"

    def quant_spec(self) -> QuantSpec:
        """The lowprec ``QuantSpec`` with the same groups, element and scale formats (float formats only).

        Exact for narrow scale formats (MX, NVFP4).  With float32 scales ``QuantSpec`` follows the training
        convention (multiplier ``max/amax``, stored ``fl(1/m)``) while inference stacks divide by
        ``amax/max``: ``lowprec.inference.fake_quantize_weight`` uses the latter.
        """
        if self.is_int:
            raise UsageError(f"TensorScheme.format={self.format!r}: integer schemes use the affine rule of "
                             "torchao/compressed-tensors (scale = amax / ((qmax - qmin) / 2)), which QuantSpec does "
                             "not express; use lowprec.inference.fake_quantize_weight")
        common: dict[str, Any] = dict(elem=self.format, scale_format=self.scale_format,
                                      scale_rounding=self.scale_rounding)
        g = self.granularity
        if g == "tensor":
            return QuantSpec(scaling="tensor", **common)
        if g in ("channel", "token"):
            return QuantSpec(scaling="axis", axis=-1, **common)
        if g in _GROUPED:
            return QuantSpec(scaling="block", block_size=self.group_size, tensor_scale=g == "tensor_group",
                             **common)
        return QuantSpec(scaling="tile", tile=self.block, **common)

    def check_role(self, role: Role, field: str) -> None:
        """UsageError when this scheme cannot describe ``role`` (``field`` names it in the message)."""
        if role == "weights":
            if self.granularity == "token":
                raise UsageError(f"{field}.granularity='token' is for activations; weights use 'channel' (one "
                                 "scale per output row)")
            if self.dynamic is not False:
                raise UsageError(f"{field}.dynamic must be False for weights (their scales are computed once); got "
                                 f"{self.dynamic!r}")
        elif self.granularity == "channel":
            raise UsageError(f"{field}.granularity='channel' is for weights; activations use 'token' (one scale "
                             "per row)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigGroup:
    """One config group: which modules, and how their weights and input activations are quantized."""

    name: str = "group_0"
    """The group's key in a compressed-tensors ``config_groups`` table."""
    targets: tuple[str, ...] = ("Linear",)
    """Module class names ("Linear") or fnmatch patterns on qualified module names ("*.mlp.*")."""
    weights: TensorScheme | None = None
    """Weight quantization; None leaves weights in high precision."""
    input_activations: TensorScheme | None = None
    """Input activation quantization; None: weight-only (W4A16-style)."""

    def __post_init__(self) -> None:
        check_str(self.name, "ConfigGroup.name")
        _check_patterns(self.targets, "ConfigGroup.targets", empty_ok=False)
        for role in ("weights", "input_activations"):
            ts = getattr(self, role)
            if ts is None:
                continue
            if not isinstance(ts, TensorScheme):
                raise UsageError(f"ConfigGroup.{role} must be a TensorScheme or None; got {type(ts).__name__}")
            ts.check_role(role, f"ConfigGroup.{role}")  # type: ignore[arg-type]
        if self.weights is None and self.input_activations is None:
            raise UsageError(f"ConfigGroup {self.name!r} quantizes nothing: set weights and/or input_activations")


def _check_patterns(value: object, field: str, *, empty_ok: bool) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise UsageError(f"{field} must be a tuple of non-empty strings such as ('Linear',); got {value!r}")
    if not value and not empty_ok:
        raise UsageError(f"{field} must name at least one module class or pattern, e.g. ('Linear',)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scheme:
    """A post-training quantization scheme: config groups (first match wins), modules to skip, KV cache."""

    name: str = "custom"
    config_groups: tuple[ConfigGroup, ...] = ()
    """Tried in order for every module; the first group whose targets match it applies."""
    ignore: tuple[str, ...] = ()
    """Class names or fnmatch patterns of modules left in high precision (ignore wins over targets)."""
    kv_cache: TensorScheme | None = None
    """KV cache quantization (compressed-tensors' top-level ``kv_cache_scheme``); None: not quantized."""

    def __post_init__(self) -> None:
        check_str(self.name, "Scheme.name")
        if not isinstance(self.config_groups, tuple) or not all(isinstance(g, ConfigGroup)
                                                                 for g in self.config_groups):
            raise UsageError(f"Scheme.config_groups must be a tuple of ConfigGroup; got {self.config_groups!r}")
        if not self.config_groups:
            raise UsageError("Scheme.config_groups is empty: add a ConfigGroup (e.g. targets=('Linear',))")
        seen = [g.name for g in self.config_groups]
        dup = sorted({n for n in seen if seen.count(n) > 1})
        if dup:
            raise UsageError(f"Scheme.config_groups: duplicate group name(s) {dup}; give each group its own name")
        _check_patterns(self.ignore, "Scheme.ignore", empty_ok=True)
        if self.kv_cache is not None:
            if not isinstance(self.kv_cache, TensorScheme):
                raise UsageError(f"Scheme.kv_cache must be a TensorScheme or None; got {type(self.kv_cache).__name__}")
            self.kv_cache.check_role("kv_cache", "Scheme.kv_cache")

    # ------------------------------------------------------------------------------------------- serialising
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/TOML-ready data; None fields are left out (TOML has no null)."""
        out: dict[str, Any] = {"name": self.name,
                               "config_groups": [_plain(g) for g in self.config_groups]}
        if self.ignore:
            out["ignore"] = list(self.ignore)
        if self.kv_cache is not None:
            out["kv_cache"] = _plain(self.kv_cache)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Scheme:
        """Inverse of ``to_dict``; errors name the dotted path of the bad key (``scheme.config_groups[0]...``)."""
        d = _keys(data, cls, "scheme")
        kw: dict[str, Any] = dict(d)
        groups = d.get("config_groups", [])
        if not isinstance(groups, list):
            raise UsageError(f"scheme.config_groups must be an array of tables; got {groups!r}")
        kw["config_groups"] = tuple(_group(g, f"scheme.config_groups[{i}]") for i, g in enumerate(groups))
        if "ignore" in d:
            kw["ignore"] = _str_tuple(d["ignore"], "scheme.ignore")
        if "kv_cache" in d:
            kw["kv_cache"] = _tensor(d["kv_cache"], "scheme.kv_cache")
        return _build(cls, kw, "scheme")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Scheme:
        from .._parse import parse_json

        return cls.from_dict(parse_json(text, where="scheme JSON"))

    def to_toml(self) -> str:
        from ..recipes._serial import dict_to_toml

        return dict_to_toml(self.to_dict())

    @classmethod
    def from_toml(cls, text: str) -> Scheme:
        from .._parse import parse_toml

        return cls.from_dict(parse_toml(text, where="scheme TOML"))

    def hash(self) -> str:
        """SHA-256 (first 16 hex digits) of the canonical JSON: identifies a scheme in a run or checkpoint."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, tuple):
        return [_plain(v) for v in obj]
    return obj


def _keys(data: Any, cls: type, path: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise UsageError(f"{path} must be a table/object; got {type(data).__name__} {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(data) - names)
    if extra:
        raise UsageError(f"{path}: unknown key(s) {extra}; allowed: {sorted(names)}")
    return data


def _build(cls: Any, kw: dict[str, Any], path: str) -> Any:
    try:
        return cls(**kw)
    except ValueError as e:
        raise UsageError(f"{path}: {e}") from None


def _str_tuple(value: Any, path: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise UsageError(f"{path} must be an array of strings; got {value!r}")
    return tuple(value)


def _tensor(data: Any, path: str) -> TensorScheme:
    kw = dict(_keys(data, TensorScheme, path))
    if isinstance(kw.get("block"), list):
        kw["block"] = tuple(kw["block"])
    return _build(TensorScheme, kw, path)  # type: ignore[no-any-return]


def _group(data: Any, path: str) -> ConfigGroup:
    kw = dict(_keys(data, ConfigGroup, path))
    if "targets" in kw:
        kw["targets"] = _str_tuple(kw["targets"], f"{path}.targets")
    for role in ("weights", "input_activations"):
        if role in kw:
            kw[role] = _tensor(kw[role], f"{path}.{role}")
    return _build(ConfigGroup, kw, path)  # type: ignore[no-any-return]
