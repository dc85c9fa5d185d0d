"""RunConfig: TOML parsing, validation messages, resolution against task defaults, the LR schedule.

Oracles: hand-written TOML documents and hand-computed schedule values; error messages are checked to name the
field and the allowed values (the contract of every config error).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from lowprec import recipes
from lowprec.runs._config import RunConfig, ScheduleConfig, load

GOOD = """
model = "mlp-digits"
recipe = "fp8-tensorwise"
seeds = [0, 1]
steps = 50
batch_size = 32

[model_options]
hidden = 64

[optimizer]
name = "sgd"
lr = 0.1
betas = [0.8, 0.95]

[schedule]
name = "linear"
warmup_steps = 5
"""


def test_parse_good_config_and_round_trip() -> None:
    c = RunConfig.from_toml(GOOD)
    assert c.model == "mlp-digits" and c.seeds == (0, 1) and c.steps == 50 and c.batch_size == 32
    assert c.recipe == recipes.get("fp8-tensorwise")
    assert c.optimizer.name == "sgd" and c.optimizer.betas == (0.8, 0.95)
    assert c.model_options == {"hidden": 64}
    assert RunConfig.from_dict(c.to_dict()) == c  # the stored form reads back to the same config


def test_seed_shorthand_and_inline_recipe() -> None:
    r = recipes.get("bf16-sr").to_dict()
    c = RunConfig.from_dict({"model": "mlp-digits", "seed": 7, "recipe": r})
    assert c.seeds == (7,) and c.recipe == recipes.get("bf16-sr")


def test_resolve_fills_only_missing_fields() -> None:
    c = RunConfig.from_toml('model = "m"\nsteps = 10\n[optimizer]\nlr = 0.5\n')
    r = c.resolve({"steps": 99, "batch_size": 16, "eval_interval": 3, "lr": 1e-3, "optimizer": "sgd",
                   "warmup_steps": 4})
    assert (r.steps, r.batch_size, r.eval_interval) == (10, 16, 3)
    assert (r.optimizer.name, r.optimizer.lr, r.schedule.warmup_steps) == ("sgd", 0.5, 4)
    assert r.resolve({"steps": 1}) == r  # resolving twice changes nothing


@pytest.mark.parametrize(
    "text, needles",
    [
        ("model = 'm'\nstep = 3\n", ["unknown key(s) ['step']", "steps"]),
        ("steps = 3\n", ["model is required"]),
        ("model = 'm'\nsteps = 0\n", ["steps must be an integer >= 1", "0"]),
        ("model = 'm'\nsteps = 2.5\n", ["steps must be an integer"]),
        ("model = 'm'\nseeds = [1, 1]\n", ["seeds must be distinct"]),
        ("model = 'm'\nseed = 1\nseeds = [2]\n", ["either seed or seeds"]),
        ("model = 'm'\nrecipe = 'fp9'\n", ["fp9", "fp8-tensorwise"]),
        ("model = 'm'\nframework = 'flax'\n", ["framework must be one of 'torch', 'jax'", "'flax'"]),
        ("model = 'm'\n[optimizer]\nname = 'lion'\n", ["optimizer.name must be one of 'adamw', 'sgd'", "lion"]),
        ("model = 'm'\n[optimizer]\nlr = -1.0\n", ["optimizer.lr must be a finite number > 0.0", "-1.0"]),
        ("model = 'm'\n[optimizer]\nlr = nan\n", ["optimizer.lr"]),
        ("model = 'm'\n[optimizer]\nmomentun = 0.9\n", ["optimizer: unknown key(s) ['momentun']", "momentum"]),
        ("model = 'm'\n[schedule]\nname = 'step'\n", ["schedule.name must be one of", "cosine"]),
        ("model = 'm'\n[parallel]\nstrategy = 'pp'\n",
         ["parallel.strategy must be one of 'single', 'ddp', 'fsdp2', 'hsdp'"]),
        ("model = 'm'\n[parallel]\nworld_size = 2\n", ["parallel.world_size must be an integer in [1, 1]"]),
        ("model = 'm'\n[parallel]\nstrategy = 'hsdp'\nworld_size = 4\nmesh_shape = [2, 3]\n",
         ["parallel.mesh_shape [2, 3] has 6 ranks", "world_size is 4"]),
        ("model = 'm'\n[parallel]\nstrategy = 'hsdp'\nworld_size = 4\n", ["parallel.mesh_shape must be"]),
        ("model = 'm'\n[parallel]\nstrategy = 'ddp'\nworld_size = 4\nmesh_shape = [2, 2]\n",
         ["parallel.mesh_shape is for strategy 'hsdp'"]),
        ("model = 'm'\n[parallel]\nstrategy = 'ddp'\nbackend = 'mpi'\n", ["parallel.backend", "'gloo'"]),
        ("model = 'm'\n[parallel]\nstrategy = 'ddp'\nmaster_port = 80\n", ["parallel.master_port"]),
        ("model = 'm'\noptimizer = 3\n", ["optimizer must be a table"]),
        ("model = 'm\n", ["not valid TOML"]),
    ],
)
def test_errors_name_the_field_and_what_is_allowed(text: str, needles: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        RunConfig.from_toml(text, where="cfg.toml")
    msg = str(e.value)
    assert msg.startswith("cfg.toml"), msg
    for n in needles:
        assert n in msg, (n, msg)


def test_load_missing_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nope.toml")
    p = tmp_path / "c.toml"
    p.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match="cannot read config file"):
        load(p)


def test_schedule_by_hand() -> None:
    """Warm-up is linear from lr/warm; cosine ends at min_lr_ratio * lr; linear decays linearly."""
    s = ScheduleConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    assert [s.lr_at(i, lr=1.0, steps=14) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.lr_at(4, lr=1.0, steps=14) == 1.0
    assert math.isclose(s.lr_at(13, lr=1.0, steps=14), 0.1)
    mid = s.lr_at(8, lr=1.0, steps=14)  # t = (8 - 4) / (14 - 4 - 1) = 4/9
    assert math.isclose(mid, 0.1 + 0.45 * (1 + math.cos(math.pi * 4 / 9)))
    lin = dataclasses.replace(s, name="linear", warmup_steps=0)
    assert math.isclose(lin.lr_at(5, lr=2.0, steps=11), 2.0 - 1.8 * 0.5)
    assert ScheduleConfig(name="constant", warmup_steps=0).lr_at(7, lr=0.3, steps=10) == 0.3


# -- checks before work (issue 15, section 5) ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, needles",
    [
        ("model = 'm'\nsteps = 1000000000000000\n", ["steps must be at most 1_000_000_000", "typo"]),
        ("model = 'm'\neval_interval = 10000000000\n", ["eval_interval must be at most"]),
        ("model = 'm'\n[schedule]\nwarmup_steps = 10000000000\n", ["schedule.warmup_steps must be an integer in"]),
        ("model = 'm'\n[checkpoint]\ninterval = 10000000000\n", ["checkpoint.interval must be an integer in"]),
    ],
)
def test_absurd_step_counts_are_refused(text: str, needles: list[str]) -> None:
    """Oracle: MAX_STEPS = 10**9, named in the message with why (a typo, not a run)."""
    from lowprec.runs._config import MAX_STEPS

    assert MAX_STEPS == 10**9
    with pytest.raises(ValueError) as e:
        RunConfig.from_toml(text, where="cfg.toml")
    for n in needles:
        assert n in str(e.value), (n, str(e.value))
    assert RunConfig.from_toml("model = 'm'\nsteps = 1000000000\n").steps == MAX_STEPS  # the bound itself is fine


def test_a_declared_warmup_above_steps_is_refused_but_stored_configs_still_read(tmp_path) -> None:
    """Oracle: the schedule (``lr_at`` would stay below ``lr`` for the whole run).  A config file (TOML or JSON)
    with warmup_steps > steps is refused naming both; warmup_steps == steps is fine; ``RunConfig.from_dict`` of such
    a config still works (stored runs resolved with a task's longer default warm-up must read back and resume)."""
    p = tmp_path / "c.toml"
    p.write_text("model = 'm'\nsteps = 20\n[schedule]\nwarmup_steps = 50\n")
    with pytest.raises(ValueError, match=r"c.toml: schedule.warmup_steps = 50 is more than steps = 20.*<= 20"):
        load(p)
    j = tmp_path / "c.json"
    j.write_text('{"model": "m", "steps": 20, "schedule": {"warmup_steps": 50}}')
    with pytest.raises(ValueError, match="warmup_steps = 50 is more than steps = 20"):
        load(j)
    p.write_text("model = 'm'\nsteps = 20\n[schedule]\nwarmup_steps = 20\n")
    assert load(p).schedule.warmup_steps == 20
    stored = RunConfig.from_dict({"model": "m", "steps": 20, "schedule": {"warmup_steps": 50}})
    assert stored.schedule.warmup_steps == 50


def test_what_if_without_sampling_is_refused_in_a_config_file(tmp_path) -> None:
    """Oracle: the runner samples statistics only with stats.every (or a recipe fallback): a what-if table
    without it would silently measure nothing."""
    p = tmp_path / "c.toml"
    p.write_text("model = 'm'\n[stats]\nwhat_if = {m = 'mxfp4'}\n")
    with pytest.raises(ValueError, match=r"stats.what_if \['m'\] is measured only when .*stats.every = N"):
        load(p)
    p.write_text("model = 'm'\n[stats]\nevery = 5\nwhat_if = {m = 'mxfp4'}\n")
    assert load(p).stats.what_if == {"m": "mxfp4"}


def test_a_recipe_pasted_at_the_top_level_gets_a_hint_to_use_a_recipe_table() -> None:
    """Oracle: ``lowprec recipes --show`` output (Recipe.to_toml) pasted under a model line: the unknown-key error
    names the recipe fields and says to put them under [recipe]; the same text under [recipe] parses to the
    recipe."""
    pasted = recipes.get("mxfp8").to_toml()
    with pytest.raises(ValueError) as e:
        RunConfig.from_toml("model = 'm'\n" + pasted, where="cfg.toml")
    msg = str(e.value)
    assert "unknown key(s)" in msg and "are fields of a recipe" in msg and "[recipe]" in msg, msg
    assert "'linear'" in msg.split("are fields of a recipe")[0].rsplit(";", 1)[1]
    nested = "\n".join(("[recipe." + ln[1:]) if ln.startswith("[") else ln for ln in pasted.splitlines())
    top, _, rest = nested.partition("\n[recipe.")
    cfg = RunConfig.from_toml("model = 'm'\n[recipe]\n" + top + "\n[recipe." + rest)
    assert cfg.recipe == recipes.get("mxfp8")
    with pytest.raises(ValueError) as e:  # an unknown key that is no recipe field gets no hint
        RunConfig.from_toml("model = 'm'\nstep = 3\n")
    assert "recipe" not in str(e.value).split("allowed")[0]
