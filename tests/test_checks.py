"""``lowprec._checks``: the one module of argument checks.

Oracle: the message formats documented in each function's docstring (``{field} must be ...; got {value!r}``),
and, for the choice fields, the ``typing.Literal`` aliases they are typed with (``typing.get_args``).
"""

from __future__ import annotations

import math
import re
from typing import Literal, get_args

import pytest

from lowprec import UsageError
from lowprec._checks import (
    check_bool,
    check_choice,
    check_finite,
    check_float,
    check_int,
    check_literal,
    check_positive,
    check_positive_int,
    check_str,
    literal_values,
)


def _refuses(fn, message: str) -> None:  # type: ignore[no-untyped-def]
    """``fn()`` raises UsageError (a ValueError) with exactly ``message``."""
    with pytest.raises(UsageError, match=f"^{re.escape(message)}$"):
        fn()
    assert issubclass(UsageError, ValueError)


# ----------------------------------------------------------------------------------------------------- ints
@pytest.mark.parametrize(("value", "lo", "hi"), [(0, 0, None), (5, 1, 5), (-64, -64, 64), (7, None, None),
                                                 (10**30, 0, None)])
def test_check_int_accepts(value: int, lo: int | None, hi: int | None) -> None:
    assert check_int(value, "f", lo, hi) == value


@pytest.mark.parametrize(
    ("value", "lo", "hi", "message"),
    [
        (0, 1, None, "f must be an integer >= 1; got 0"),
        (6, 1, 5, "f must be an integer in [1, 5]; got 6"),
        (-65, -64, 64, "f must be an integer in [-64, 64]; got -65"),
        (True, 0, None, "f must be an integer >= 0; got True"),
        (1.0, 0, None, "f must be an integer >= 0; got 1.0"),
        ("3", None, None, "f must be an integer; got '3'"),
        (None, None, 5, "f must be an integer <= 5; got None"),
    ],
)
def test_check_int_refuses(value: object, lo: int | None, hi: int | None, message: str) -> None:
    _refuses(lambda: check_int(value, "f", lo, hi), message)


def test_check_int_note_and_positive_int() -> None:
    _refuses(lambda: check_int(9, "FormatSpec.ebits", 1, 8, note="so values fit float32"),
             "FormatSpec.ebits must be an integer in [1, 8] so values fit float32; got 9")
    assert check_positive_int(1, "n") == 1
    _refuses(lambda: check_positive_int(0, "n"), "n must be an integer >= 1; got 0")
    _refuses(lambda: check_positive_int(9, "n", 8), "n must be an integer in [1, 8]; got 9")
    _refuses(lambda: check_positive_int(None, "QuantSpec.block_size", note="for scaling='block'"),
             "QuantSpec.block_size must be an integer >= 1 for scaling='block'; got None")


# --------------------------------------------------------------------------------------------------- floats
def test_check_float_accepts_and_returns_float() -> None:
    assert check_float(2, "f", 0.0) == 2.0 and isinstance(check_float(2, "f", 0.0), float)
    assert check_float(0.0, "f", 0.0, 1.0) == 0.0
    assert check_float(1.0, "f", 0.0, 1.0) == 1.0
    assert check_float(-1e300, "f") == -1e300
    assert check_finite(3, "f") == 3.0
    assert check_positive(1e-300, "f") == 1e-300


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"lo": 0.0}, -0.5, "f must be a finite number >= 0.0; got -0.5"),
        ({"lo": 0.0, "hi": 1.0}, 2, "f must be a finite number >= 0.0 and <= 1.0; got 2"),
        ({"lo": 0.0, "open_lo": True}, 0.0, "f must be a finite number > 0.0; got 0.0"),
        ({"lo": 0.0, "hi": 1.0, "open_lo": True, "open_hi": True}, 1.0, "f must be a finite number > 0.0 and < 1.0; "
                                                                         "got 1.0"),
        ({"hi": 1.0, "open_hi": True}, 1.0, "f must be a finite number < 1.0; got 1.0"),
        ({"lo": 0.0}, math.inf, "f must be a finite number >= 0.0; got inf"),
        ({}, math.nan, "f must be a finite number; got nan"),
        ({}, False, "f must be a finite number; got False"),
        ({}, "1", "f must be a finite number; got '1'"),
        ({"lo": 0.0, "hi": 100.0, "open_hi": True, "note": "(a percentage) or None"}, 100,
         "f must be a finite number >= 0.0 and < 100.0 (a percentage) or None; got 100"),
    ],
)
def test_check_float_refuses(kwargs: dict, value: object, message: str) -> None:
    _refuses(lambda: check_float(value, "f", **kwargs), message)


def test_check_finite_and_positive_refuse() -> None:
    _refuses(lambda: check_finite(-math.inf, "Fallback.sqnr_db"), "Fallback.sqnr_db must be a finite number; got -inf")
    _refuses(lambda: check_finite(None, "x", note="(dB) or None"), "x must be a finite number (dB) or None; got None")
    _refuses(lambda: check_positive(0, "LossScaling.init_scale"),
             "LossScaling.init_scale must be a finite number > 0.0; got 0")
    _refuses(lambda: check_positive(math.inf, "s"), "s must be a finite number > 0.0; got inf")


# --------------------------------------------------------------------------------------------- bool and str
def test_check_bool() -> None:
    assert check_bool(True, "b") is True and check_bool(False, "b") is False
    for bad in (0, 1, "true", None):
        _refuses(lambda bad=bad: check_bool(bad, "QuantSpec.saturate"),  # type: ignore[misc]
                 f"QuantSpec.saturate must be True or False; got {bad!r}")


def test_check_str() -> None:
    assert check_str("x", "s") == "x"
    assert check_str("", "s", empty=True) == ""
    for bad in ("", "  ", None, 3):
        _refuses(lambda bad=bad: check_str(bad, "Recipe.name"), f"Recipe.name must be a non-empty string; got {bad!r}")
    _refuses(lambda: check_str(3, "s", empty=True), "s must be a string; got 3")


# ------------------------------------------------------------------------------------------------- choices
def test_check_choice() -> None:
    assert check_choice("b", "c", ("a", "b")) == "b"
    for bad in ("c", "A", None, 1, ["a"]):
        _refuses(lambda bad=bad: check_choice(bad, "c", ("a", "b")), f"c must be one of 'a', 'b'; got {bad!r}")


Color = Literal["red", "green", "blue"]


def test_check_literal_takes_choices_from_the_literal() -> None:
    assert literal_values(Color) == get_args(Color) == ("red", "green", "blue")
    assert literal_values(Color | None) == ("red", "green", "blue")
    assert literal_values(Literal[Color, "cyan"]) == ("red", "green", "blue", "cyan")
    for v in get_args(Color):
        assert check_literal(v, "color", Color) == v
    _refuses(lambda: check_literal("Red", "color", Color), "color must be one of 'red', 'green', 'blue'; got 'Red'")
    _refuses(lambda: check_literal(None, "color", Color), "color must be one of 'red', 'green', 'blue'; got None")
    with pytest.raises(TypeError):
        literal_values(str)
    with pytest.raises(TypeError):
        literal_values(Literal[1, 2])


# ------------------------------------------------------------------ the library's Literal aliases and tuples
def _aliases() -> list[tuple[str, object, tuple[str, ...]]]:
    from lowprec.accuracy import _baseline, _stats
    from lowprec.formats import _spec as fspec
    from lowprec.quant import _spec as qspec
    from lowprec.quant import _validate
    from lowprec.recipes import _recipe

    return [
        ("Rounding", _validate.Rounding, _validate.ROUNDINGS),
        ("Scaling", qspec.Scaling, qspec.SCALINGS),
        ("ScaleRounding", qspec.ScaleRounding, qspec.SCALE_ROUNDINGS),
        ("Special", fspec.Special, fspec.SPECIALS),
        ("Kind", fspec.Kind, fspec.KINDS),
        ("Direction", _stats.Direction, _stats.DIRECTIONS),
        ("Direction (baseline)", _stats.Direction, _baseline.DIRECTIONS),
        ("CurveRole", _stats.CurveRole, _stats.CURVE_ROLES),
        ("Outcome", _stats.Outcome, _stats.OUTCOMES),
        ("TestMethod", _stats.TestMethod, get_args(_stats.TestMethod)),
        ("ScalingKind", _recipe.ScalingKind, get_args(_recipe.ScalingKind)),
        ("AmaxAlgorithm", _recipe.AmaxAlgorithm, get_args(_recipe.AmaxAlgorithm)),
        ("WeightUpdate", _recipe.WeightUpdate, get_args(_recipe.WeightUpdate)),
        ("LossScaleKind", _recipe.LossScaleKind, get_args(_recipe.LossScaleKind)),
        ("AccumulatorRounding", _recipe.AccumulatorRounding, get_args(_recipe.AccumulatorRounding)),
        ("WireRounding", _recipe.WireRounding, get_args(_recipe.WireRounding)),
    ]


def test_literal_aliases_and_runtime_tuples_agree() -> None:
    """Each alias's runtime tuple is exactly ``get_args`` of the alias (one source of the allowed values)."""
    for name, alias, values in _aliases():
        assert tuple(values) == get_args(alias), name
        assert len(set(values)) == len(values), name


def _field_cases() -> list[tuple[str, object, str, tuple[str, ...]]]:
    """(field, a constructor taking the value, the field name in the message, the allowed values)."""
    from lowprec import QuantSpec
    from lowprec.accuracy._stats import Criteria, CurveRole
    from lowprec.formats import FormatSpec
    from lowprec.formats._spec import Kind, Special
    from lowprec.quant._spec import ScaleRounding, Scaling
    from lowprec.quant._validate import Rounding
    from lowprec.recipes import _recipe as R

    def fmt(**kw):  # type: ignore[no-untyped-def]
        return FormatSpec(name="x", ebits=4, mbits=3, bias=7, **kw)

    return [
        ("QuantSpec.scaling", lambda v: QuantSpec(scaling=v), get_args(Scaling)),
        ("QuantSpec.scale_rounding", lambda v: QuantSpec(scale_format="float8_e8m0fnu", scale_rounding=v),
         get_args(ScaleRounding)),
        ("QuantSpec.rounding", lambda v: QuantSpec(rounding=v), get_args(Rounding)),
        ("FormatSpec.special", lambda v: fmt(special=v), get_args(Special)),
        ("FormatSpec.kind", lambda v: fmt(kind=v), get_args(Kind)),
        ("criteria.curve_role", lambda v: Criteria(curve_role=v), get_args(CurveRole)),
        ("Scaling.kind", lambda v: R.Scaling(kind=v), get_args(R.ScalingKind)),
        ("Scaling.algorithm", lambda v: R.Scaling(algorithm=v), get_args(R.AmaxAlgorithm)),
        ("Weights.update", lambda v: R.Weights(update=v, format="bfloat16"), get_args(R.WeightUpdate)),
        ("LossScaling.kind", lambda v: R.LossScaling(kind=v), get_args(R.LossScaleKind)),
        ("Accumulator.rounding", lambda v: R.Accumulator(rounding=v), get_args(R.AccumulatorRounding)),
        ("GradComm.rounding", lambda v: R.GradComm(spec=QuantSpec(elem="bfloat16", scaling="none"), rounding=v),
         get_args(R.WireRounding)),
    ]


def test_choice_fields_accept_exactly_their_literal() -> None:
    """Every value of a field's Literal is accepted (where the rest of the object allows it) and anything else is
    refused with check_literal's message listing those values."""
    for field, build, values in _field_cases():
        allowed = ", ".join(map(repr, values))
        _refuses(lambda build=build: build("nope"), f"{field} must be one of {allowed}; got 'nope'")
        for v in values:
            try:
                build(v)  # type: ignore[operator]
            except UsageError as e:  # another field's rule (scaling="block" needs a block_size): not this check
                assert f"{field} must be one of" not in str(e), (field, v, str(e))


def test_baseline_directions_checked_against_the_literal() -> None:
    from lowprec.accuracy._stats import worse_test

    _refuses(lambda: worse_test([1.0, 2.0], [1.0], direction="lower", margin=0.0),  # type: ignore[arg-type]
             "direction must be one of 'min', 'max'; got 'lower'")
