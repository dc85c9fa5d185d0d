"""Recipes as data: serialisation round trips, hashes, hand-written TOML, validation messages, the named recipes.

Oracles: dataclass equality after a round trip (the frozen dataclasses define what "the same recipe" means),
recipes written out by hand from the ``_recipe`` module docstring and the OCP MX v1.0 rules, and the validation
rules stated in the field docstrings (each error must name the dotted path of the bad field, as
``recipe_from_dict``'s docstring promises).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib

import pytest

import lowprec
from lowprec import QuantSpec
from lowprec.recipes import (
    PROFILES,
    Accumulator,
    Gemm,
    LinearRecipe,
    LossScaling,
    Operand,
    OptimizerState,
    Recipe,
    Scaling,
    Weights,
)
from lowprec.recipes import _named as named_module

NAMES = lowprec.recipes.names()




def _raises(fn, *needles: str) -> str:  # type: ignore[no-untyped-def]
    """Call ``fn``; it must raise ValueError whose message contains every needle (literally)."""
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in error message: {msg}"
    return msg


# ------------------------------------------------------------------------------------------------ round trips
def test_names_nonempty_and_unique() -> None:
    """names() lists each built-in once, and every name builds a Recipe whose .name is that name (oracle: the
    names themselves)."""
    assert len(NAMES) == len(set(NAMES)) >= 1
    for n in NAMES:
        r = lowprec.recipes.get(n)
        assert isinstance(r, Recipe)
        assert r.name == n


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_dict_json_toml(name: str) -> None:
    """to_dict/from_dict, JSON and TOML each give back an equal frozen dataclass (oracle: dataclass equality), and
    the TOML text is parsed by the standard tomllib into the same plain dict as to_dict."""
    r = lowprec.recipes.get(name)
    d = r.to_dict()
    assert Recipe.from_dict(d) == r
    assert Recipe.from_dict(json.loads(json.dumps(d))) == r
    assert Recipe.from_json(r.to_json()) == r
    text = r.to_toml()
    assert Recipe.from_toml(text) == r
    assert tomllib.loads(text) == json.loads(json.dumps(d))
    # The plain data is plain: only JSON types.
    assert json.loads(r.to_json()) == d


@pytest.mark.parametrize("name", NAMES)
def test_hash_stable(name: str) -> None:
    """The hash is a 16-hex-digit string, the same for two separately built copies and after JSON/TOML round
    trips (oracle: equal recipes must hash equal)."""
    h = lowprec.recipes.get(name).hash()
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert lowprec.recipes.get(name).hash() == h
    r = lowprec.recipes.get(name)
    assert Recipe.from_json(r.to_json()).hash() == h
    assert Recipe.from_toml(r.to_toml()).hash() == h


@pytest.mark.parametrize("text", ["naïve-run", "run 😀", 'quote" and \\ backslash', "tab\tand\nnewline"])
def test_toml_round_trip_of_arbitrary_strings(text: str) -> None:
    """Strings (recipe name, keep patterns, override patterns) survive TOML and JSON whatever characters they hold,
    including characters outside the Basic Multilingual Plane (oracle: string equality; TOML documents are UTF-8
    and its escapes must be Unicode scalar values, so a JSON surrogate-pair escape is not valid TOML)."""
    r = Recipe(name=text, keep_high_precision=(text, "*head"), overrides=((text, LinearRecipe()),))
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_toml(r.to_toml()) == r


def test_hashes_differ_between_recipes() -> None:
    """Different recipes have different hashes: all built-ins, and variants differing in one deep field each
    (oracle: the recipes are unequal as dataclasses, so they describe different numerics)."""
    base = lowprec.recipes.get("h100-fp8")
    acc = base.linear.forward.accumulator
    variants = [lowprec.recipes.get(n) for n in NAMES] + [
        dataclasses.replace(base, seed=1),
        dataclasses.replace(base, name="h100-fp8-copy"),
        dataclasses.replace(
            base,
            linear=dataclasses.replace(
                base.linear, forward=dataclasses.replace(base.linear.forward,
                                                         accumulator=dataclasses.replace(acc, chunk=64)),
            ),
        ),
        dataclasses.replace(base, overrides=(("blocks.0.*", LinearRecipe()),)),
        dataclasses.replace(base, loss_scaling=LossScaling(kind="dynamic", growth_interval=1000)),
    ]
    assert len({id(v) for v in variants}) == len(variants)
    for i, a in enumerate(variants):
        for b in variants[i + 1:]:
            assert a != b
    hashes = [v.hash() for v in variants]
    assert len(set(hashes)) == len(hashes)


def test_equal_recipes_hash_equal_int_vs_float() -> None:
    """Recipes that compare equal have equal hashes, whatever Python number type a float field was given as.

    Oracle: ``Recipe.hash`` "identifies the numerics of a run"; ``LossScaling(init_scale=65536)`` and the default
    ``init_scale=65536.0`` compare equal and describe the same numerics.  A hand-written TOML file saying
    ``init_scale = 65536`` (TOML integer) must therefore give the hash of the built-in recipe.
    """
    a = Recipe(name="x", loss_scaling=LossScaling(kind="dynamic", init_scale=65536, growth_factor=2))
    b = Recipe(name="x", loss_scaling=LossScaling(kind="dynamic", init_scale=65536.0, growth_factor=2.0))
    assert a == b
    assert a.hash() == b.hash()
    builtin = lowprec.recipes.get("fp16-dynamic-loss-scale")
    text = builtin.to_toml().replace("init_scale = 65536.0", "init_scale = 65536")
    assert "init_scale = 65536\n" in text
    loaded = Recipe.from_toml(text)
    assert loaded == builtin
    assert loaded.hash() == builtin.hash()


# ------------------------------------------------------------------------------------------------ hand-written TOML
CUSTOM_TOML = """
name = "fp8-mxfp4-weights"
keep_high_precision = ["lm_head", "*.embed"]
keep_types = ["Embedding"]
seed = 7

[linear.forward.a]
spec = "fp8_e4m3_tensorwise"

[linear.forward.b]
spec = "mxfp4"

[linear.forward.accumulator]
format = "e8m13"
chunk = 128
rounding = "toward_zero"

[linear.grad_input]
output_format = "bfloat16"

[linear.grad_input.a]
spec = "fp8_e5m2_tensorwise"

[linear.grad_input.b]
spec = "mxfp4"

[linear.grad_weight.a.spec]
elem = "float8_e5m2"
scaling = "tensor"
margin = 1

[linear.grad_weight.b]
spec = "fp8_e4m3_tensorwise"
scaling = { kind = "delayed", history_len = 32, algorithm = "most_recent" }

[weights]
update = "stochastic"
format = "bfloat16"

[optimizer]
exp_avg = { elem = "bfloat16", scaling = "none" }
exp_avg_sq = "mxfp8_e4m3"

[loss_scaling]
kind = "static"
init_scale = 1024.0

[[overrides]]
pattern = "blocks.*.attn.*"

[overrides.linear.forward]
output_format = "bfloat16"

[overrides.linear.forward.a]
spec = { elem = "float8_e4m3fn", scaling = "axis", axis = -1 }

[[overrides]]
pattern = "blocks.0.mlp.up"
linear = {}
"""


def test_hand_written_toml_loads_into_expected_dataclasses() -> None:
    """A TOML file written by hand (spec names as strings, inline spec tables, a custom "e8m13" accumulator,
    delayed scaling on one operand, two override tables) loads into dataclasses written out independently here.

    Oracle: the expected Recipe is spelled out field by field from the formats' definitions (e4m3 tensorwise
    = float8_e4m3fn with one float32 scale per tensor; MXFP4 = OCP MX v1.0: float4_e2m1fn elements, blocks of 32
    along the last axis, E8M0 scales with the floor rule), not from the library's spec table.
    """
    e4m3_t = QuantSpec(elem="float8_e4m3fn", scaling="tensor", scale_format="float32")
    e5m2_t = QuantSpec(elem="float8_e5m2", scaling="tensor", scale_format="float32")
    mxfp4 = QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=32, axis=-1,
                      scale_format="float8_e8m0fnu", scale_rounding="floor", saturate=True)
    mxfp8 = dataclasses.replace(mxfp4, elem="float8_e4m3fn")
    expected = Recipe(
        name="fp8-mxfp4-weights",
        linear=LinearRecipe(
            forward=Gemm(a=Operand(spec=e4m3_t), b=Operand(spec=mxfp4),
                         accumulator=Accumulator(format="e8m13", chunk=128, rounding="toward_zero")),
            grad_input=Gemm(a=Operand(spec=e5m2_t), b=Operand(spec=mxfp4), output_format="bfloat16"),
            grad_weight=Gemm(
                a=Operand(spec=QuantSpec(elem="float8_e5m2", scaling="tensor", margin=1)),
                b=Operand(spec=e4m3_t, scaling=Scaling(kind="delayed", history_len=32, algorithm="most_recent")),
            ),
        ),
        overrides=(
            ("blocks.*.attn.*", LinearRecipe(forward=Gemm(
                a=Operand(spec=QuantSpec(elem="float8_e4m3fn", scaling="axis", axis=-1)),
                output_format="bfloat16"))),
            ("blocks.0.mlp.up", LinearRecipe()),
        ),
        keep_high_precision=("lm_head", "*.embed"),
        keep_types=("Embedding",),
        weights=Weights(update="stochastic", format="bfloat16"),
        optimizer=OptimizerState(exp_avg=QuantSpec(elem="bfloat16", scaling="none"), exp_avg_sq=mxfp8),
        loss_scaling=LossScaling(kind="static", init_scale=1024.0),
        seed=7,
    )
    got = Recipe.from_toml(CUSTOM_TOML)
    # Field by field first, for a readable failure.
    assert got.linear.forward == expected.linear.forward
    assert got.linear.grad_input == expected.linear.grad_input
    assert got.linear.grad_weight == expected.linear.grad_weight
    assert got.overrides == expected.overrides
    assert got.optimizer == expected.optimizer
    assert got == expected
    assert isinstance(got.keep_high_precision, tuple) and isinstance(got.overrides, tuple)
    # ... and it survives the writers.
    assert Recipe.from_toml(got.to_toml()) == expected
    assert Recipe.from_json(got.to_json()) == expected
    assert got.hash() == expected.hash()


def test_hand_written_toml_minimal_uses_defaults() -> None:
    """A TOML file with only a name gives the documented defaults: float32 everywhere, master weights, no loss
    scaling, seed 0 (oracle: the field defaults in the dataclass definitions)."""
    r = Recipe.from_toml('name = "only-a-name"\n')
    assert r == Recipe(name="only-a-name")
    assert r.linear.forward.a.spec is None and r.linear.forward.accumulator.format is None
    assert r.weights.update == "master" and r.loss_scaling.kind == "none" and r.seed == 0
    assert r.linear == lowprec.recipes.get("fp32").linear


# ------------------------------------------------------------------------------------------------ validation errors
@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"accumulatr": {}}, ["recipe:", "'accumulatr'", "'linear'"]),
        ({"linear": {"forward": {"accumulatr": {"format": "e8m13"}}}},
         ["recipe.linear.forward", "'accumulatr'", "'accumulator'"]),
        ({"linear": {"grad_input": {"a": {"spek": "mxfp4"}}}}, ["recipe.linear.grad_input.a", "'spek'", "'spec'"]),
        ({"linear": {"forward": {"a": {"scaling": {"kind": "current", "histroy_len": 4}}}}},
         ["recipe.linear.forward.a.scaling", "'histroy_len'", "'history_len'"]),
        ({"linear": {"forward": {"a": {"spec": {"elem": "float8_e4m3fn", "blok": 32}}}}},
         ["recipe.linear.forward.a.spec", "'blok'"]),
        ({"weights": {"update": "stochastic", "format": "bfloat16", "rounding": "x"}},
         ["recipe.weights", "'rounding'"]),
        ({"overrides": [{"pattern": "a.*", "linear": {"forward": {"b": {"spek": 1}}}}]},
         ["recipe.overrides[0].linear.forward.b", "'spek'"]),
        ({"overrides": [{"pattern": "a.*", "linaer": {}}]}, ["recipe.overrides[0]", "'pattern'", "'linear'"]),
        ({"loss_scaling": {"kind": "dynamic", "backof_factor": 0.5}}, ["recipe.loss_scaling", "'backof_factor'"]),
    ],
    ids=["top", "gemm", "operand", "scaling", "spec", "weights", "override", "override-keys", "loss-scaling"],
)
def test_unknown_keys_name_their_path(data: dict, needles: list[str]) -> None:
    """An unknown key anywhere raises ValueError naming the dotted path of its table and the key, and lists the
    allowed keys where there are any (oracle: the ``_serial`` docstring)."""
    _raises(lambda: Recipe.from_dict(data), *needles)


@pytest.mark.parametrize(
    ("data", "needles"),
    [
        ({"linear": {"forward": {"a": {"scaling": {"kind": "dynamic"}}}}},
         ["recipe.linear.forward.a.scaling", "Scaling.kind", "'dynamic'"]),
        ({"linear": {"forward": {"a": {"scaling": {"algorithm": "mean"}}}}},
         ["recipe.linear.forward.a.scaling", "Scaling.algorithm", "'mean'"]),
        ({"linear": {"forward": {"a": {"scaling": {"history_len": 0}}}}},
         ["recipe.linear.forward.a.scaling", "Scaling.history_len"]),
        ({"linear": {"grad_weight": {"b": {"spec": "mxfp8_e4m3", "scaling": {"kind": "delayed"}}}}},
         ["recipe.linear.grad_weight.b", "delayed", "tensor"]),
        ({"linear": {"forward": {"a": {"scaling": {"kind": "delayed"}}}}}, ["recipe.linear.forward.a", "delayed"]),
        ({"linear": {"forward": {"a": {"spec": "fp8_e4m3_rowwise", "scaling": {"kind": "delayed"}}}}},
         ["recipe.linear.forward.a", "delayed", "tensor"]),
        ({"weights": {"update": "stochastic"}}, ["recipe.weights", "Weights.update", "'stochastic'", "Weights.format"]),
        ({"weights": {"update": "stochastic", "format": "float32"}}, ["recipe.weights", "Weights.update"]),
        ({"weights": {"update": "kahan"}}, ["recipe.weights", "Weights.update", "'kahan'"]),
        ({"weights": {"update": "sometimes", "format": "bfloat16"}}, ["recipe.weights", "Weights.update"]),
        ({"weights": {"update": "nearest", "format": "bfloat17"}}, ["recipe.weights", "Weights.format", "'bfloat17'"]),
        ({"linear": {"forward": {"accumulator": {"format": "e9m99"}}}},
         ["recipe.linear.forward.accumulator", "Accumulator.format", "'e9m99'"]),
        ({"linear": {"forward": {"accumulator": {"format": "e8m13", "chunk": 0}}}},
         ["recipe.linear.forward.accumulator", "Accumulator.chunk"]),
        ({"linear": {"forward": {"accumulator": {"rounding": "stochastic"}}}},
         ["recipe.linear.forward.accumulator", "Accumulator.rounding"]),
        ({"linear": {"grad_input": {"output_format": "fp7"}}},
         ["recipe.linear.grad_input", "Gemm.output_format", "'fp7'"]),
        ({"linear": {"forward": {"a": {"spec": "mxfp9"}}}}, ["recipe.linear.forward.a.spec", "'mxfp9'", "mxfp4"]),
        ({"linear": {"forward": {"a": {"spec": {"elem": "fp8"}}}}},
         ["recipe.linear.forward.a.spec", "QuantSpec.elem", "'fp8'"]),
        ({"linear": {"forward": {"a": {"spec": 8}}}}, ["recipe.linear.forward.a.spec"]),
        ({"optimizer": {"exp_avg_sq": "fp9"}}, ["recipe.optimizer.exp_avg_sq", "'fp9'"]),
        ({"linear": 3}, ["recipe.linear", "table"]),
        ({"seed": -1}, ["recipe", "Recipe.seed"]),
        ({"name": ""}, ["recipe", "Recipe.name"]),
    ],
)
def test_invalid_values_name_their_path(data: dict, needles: list[str]) -> None:
    """Each rule in the field docstrings (Scaling.kind/algorithm/history_len; delayed scaling needs a tensorwise
    spec; low-precision weight updates need a low-precision format; format names must exist) is enforced when
    loading, and the message names the dotted path and the field."""
    _raises(lambda: Recipe.from_dict(data), *needles)


@pytest.mark.parametrize("bad", [0, 0.0, 1, 1.0, 1.5, -0.5, float("nan"), True])
def test_backoff_factor_outside_open_unit_interval(bad: float) -> None:
    """LossScaling.backoff_factor must lie in the open interval (0, 1): both ends, outside values, NaN and a bool
    are rejected, from the constructor and from a dict (with the path)."""
    _raises(lambda: LossScaling(kind="dynamic", backoff_factor=bad), "LossScaling.backoff_factor")
    _raises(lambda: Recipe.from_dict({"loss_scaling": {"kind": "dynamic", "backoff_factor": bad}}),
            "recipe.loss_scaling", "backoff_factor")


@pytest.mark.parametrize("good", [1e-6, 0.25, 0.5, 0.999])
def test_backoff_factor_inside_interval_accepted(good: float) -> None:
    """Values strictly inside (0, 1) are accepted and round-trip through TOML (oracle: the interval rule)."""
    r = Recipe(name="ls", loss_scaling=LossScaling(kind="dynamic", backoff_factor=good))
    assert Recipe.from_toml(r.to_toml()).loss_scaling.backoff_factor == good


def test_constructor_errors_name_the_field() -> None:
    """The dataclasses validate on construction too, naming Class.field (oracle: the field docstrings)."""
    _raises(lambda: Scaling(kind="sometimes"), "Scaling.kind", "'sometimes'")  # type: ignore[arg-type]
    _raises(lambda: Operand(spec=QuantSpec.named("mxfp8_e4m3"), scaling=Scaling(kind="delayed")), "delayed", "tensor")
    _raises(lambda: Operand(spec="mxfp4"), "Operand.spec")  # type: ignore[arg-type]
    _raises(lambda: Weights(update="stochastic"), "Weights.update")
    _raises(lambda: Weights(update="nearest", format="nope"), "Weights.format", "'nope'")
    _raises(lambda: Accumulator(format="e8m99"), "Accumulator.format")
    _raises(lambda: LossScaling(growth_factor=0.5), "LossScaling.growth_factor")
    _raises(lambda: LossScaling(init_scale=0), "LossScaling.init_scale")
    _raises(lambda: Recipe(overrides=(("a", Gemm()),)), "Recipe.overrides[0]")  # type: ignore[arg-type]
    _raises(lambda: Recipe(keep_high_precision=["lm_head"]), "Recipe.keep_high_precision")  # type: ignore[arg-type]
    # Legal edge values are accepted.
    Weights(update="kahan", format="e8m7")
    Accumulator(format="e8m13", chunk=1)
    Operand(spec=QuantSpec.named("fp8_e5m2_tensorwise"), scaling=Scaling(kind="delayed", history_len=1))


def test_overrides_must_be_a_tuple_like_the_other_sequence_fields() -> None:
    """``Recipe.overrides`` is typed ``tuple[tuple[str, LinearRecipe], ...]`` and, like ``keep_high_precision``
    and ``keep_types`` (which reject lists with "must be a tuple"), must not accept a list: a list makes the frozen
    Recipe unhashable and unequal to the same recipe with a tuple, although both have the same ``hash()``.

    Oracle: the field's declared type and the sibling fields' rule.
    """
    item = ("blocks.*", LinearRecipe())
    _raises(lambda: Recipe(overrides=[item]), "Recipe.overrides")  # type: ignore[arg-type]
    r = Recipe(overrides=(item,))
    assert hash(r) == hash(Recipe(overrides=(item,)))


def test_format_name_bit_count_must_match() -> None:
    """A format name whose ``float{bits}_`` prefix contradicts its exponent and mantissa widths is a bad format name:
    "float16_e4m3" is not a 16-bit format (1 + 4 + 3 = 8 bits), so a recipe asking for it must be rejected rather
    than silently given an 8-bit e4m3.

    Oracle: the ``formats.get`` docstring: ``float{bits}_`` prefixes an ExMy name, bits being its total width.
    """
    _raises(lambda: Recipe.from_dict({"weights": {"update": "nearest", "format": "float16_e4m3"}}),
            "recipe.weights", "'float16_e4m3'")
    # The consistent spelling is accepted.
    assert Recipe.from_dict({"weights": {"update": "nearest", "format": "float8_e4m3"}}).weights.format == "float8_e4m3"


# ------------------------------------------------------------------------------------------------ get / profiles
def test_get_unknown_name_lists_valid_names() -> None:
    """get("no-such-recipe") raises ValueError quoting the bad name and listing every valid name."""
    msg = _raises(lambda: lowprec.recipes.get("no-such-recipe"), "'no-such-recipe'")
    for n in NAMES:
        assert n in msg


def test_get_returns_recipe_instances_unchanged() -> None:
    """get(recipe) returns the Recipe itself (documented), and each get(name) builds a fresh equal object."""
    r = Recipe(name="mine", seed=3)
    assert lowprec.recipes.get(r) is r
    assert lowprec.recipes.get("mxfp8") == lowprec.recipes.get("mxfp8")


def test_profiles_are_named_and_documented_as_emulations() -> None:
    """Every hardware profile is a valid name, and its docstring says it is an emulation (the ``_named`` module
    docstring: profiles reproduce publicly described numerics, not exact hardware behaviour)."""
    assert len(PROFILES) >= 1
    for p in PROFILES:
        assert p in NAMES
        recipe = lowprec.recipes.get(p)
        assert recipe.name == p
        builders = [fn for fn in vars(named_module).values() if callable(fn) and getattr(fn, "__doc__", None)
                    and fn.__module__ == named_module.__name__ and _builds(fn, p)]
        assert len(builders) == 1, f"no unique builder function for profile {p!r}"
        doc = builders[0].__doc__ or ""
        assert "emulation" in doc.lower(), f"profile {p!r} docstring does not say it is an emulation: {doc!r}"


def _builds(fn, name: str) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``fn`` is a zero-argument builder returning the recipe called ``name``."""
    import inspect

    try:
        if inspect.signature(fn).parameters:
            return False
        r = fn()
    except (TypeError, ValueError):
        return False
    return isinstance(r, Recipe) and r.name == name


def test_profile_h100_accumulator_matches_its_docstring() -> None:
    """h100-fp8 says: e8m13 accumulator, truncating, promoted every 128 products, in all three GEMMs (oracle: the
    profile's own docstring, read as a specification)."""
    r = lowprec.recipes.get("h100-fp8")
    for g in (r.linear.forward, r.linear.grad_input, r.linear.grad_weight):
        assert g.accumulator == Accumulator(format="e8m13", chunk=128, rounding="toward_zero")


def test_deeply_nested_recipe_documents_are_a_value_error() -> None:
    """Python's json/tomllib recurse per nesting level: 100,000 levels used to end in RecursionError."""
    with pytest.raises(ValueError, match="recipe JSON is nested too deeply"):
        Recipe.from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="recipe TOML is nested too deeply"):
        Recipe.from_toml("a = " + "[" * 100_000 + "]" * 100_000)
