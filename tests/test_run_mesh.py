"""Layouts in run configs (runs/_mesh.py): ``[parallel]`` tp / pp / dp degrees, the mesh's rank order, and every
check that runs before a process starts.  In process, no process group.

Oracles: the literal stored form of a data-parallel ``[parallel]`` table before the mesh fields existed (old
configs' data and digests must not change); ``torch.arange(world).reshape(shape)``, which is how
``init_device_mesh`` lays ranks out, for the coordinates of each rank; hand-counted pieces, heads and block
sizes of the zoo GPT for the model checks; the CLI's exit status 2 and an empty store for errors before launch.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from lowprec import recipes
from lowprec.cli import main
from lowprec.runs._config import ParallelConfig, RunConfig
from lowprec.runs._mesh import MESH_DIMS, Layout, check_model_layout, layout_of
from lowprec.runs._parallel import World
from lowprec.runs._pp_runner import local_optimizer_state
from lowprec.runs._store import RunStore
from lowprec.runs.zoo import get_task

GPT = {"layers": 2, "d_model": 64, "heads": 4, "context": 16}


def test_data_parallel_configs_serialise_as_before() -> None:
    """The mesh fields are left out at their defaults: the literal table a config stored before them."""
    old = {"strategy": "ddp", "world_size": 2, "backend": "auto", "max_restarts": 0, "master_port": None,
           "mesh_shape": None}
    c = RunConfig(model="mlp-digits", parallel=ParallelConfig(strategy="ddp", world_size=2))
    assert c.to_dict()["parallel"] == old
    hsdp = RunConfig(model="mlp-digits", parallel=ParallelConfig(strategy="hsdp", world_size=4, mesh_shape=(2, 2)))
    assert hsdp.to_dict()["parallel"] == {**old, "strategy": "hsdp", "world_size": 4, "mesh_shape": [2, 2]}
    assert RunConfig(model="mlp-digits").to_dict()["parallel"] == {**old, "strategy": "single", "world_size": 1}
    assert c.label == "mlp-digits fp32 ddpx2"


def test_mesh_fields_round_trip_through_toml() -> None:
    c = RunConfig.from_toml('model = "gpt-bytes"\n[parallel]\nstrategy = "ddp"\nworld_size = 4\npp = 2\n'
                            'microbatches = 4\npp_schedule = "gpipe"\ntp = 2\n')
    assert c.to_dict()["parallel"] == {"strategy": "ddp", "world_size": 4, "backend": "auto", "max_restarts": 0,
                                       "master_port": None, "mesh_shape": None, "tp": 2, "pp": 2,
                                       "pp_schedule": "gpipe", "microbatches": 4}
    assert RunConfig.from_dict(c.to_dict()) == c
    assert layout_of(c.parallel) == Layout(pp=2, tp=2, microbatches=4, pp_schedule="gpipe")
    assert c.label == "gpt-bytes fp32 pp2 x tp2"


@pytest.mark.parametrize(("par", "want"), [
    (ParallelConfig(strategy="ddp", world_size=2, tp=2), Layout(tp=2)),
    (ParallelConfig(strategy="ddp", world_size=2, pp=2), Layout(pp=2, microbatches=2)),
    (ParallelConfig(strategy="fsdp2", world_size=4, tp=2), Layout(dp_shard=2, tp=2)),
    (ParallelConfig(strategy="ddp", world_size=8, tp=2, pp=2), Layout(pp=2, dp_replicate=2, tp=2, microbatches=2)),
    (ParallelConfig(strategy="hsdp", world_size=8, tp=2, mesh_shape=(2, 2)), Layout(dp_replicate=2, dp_shard=2,
                                                                                    tp=2)),
    (ParallelConfig(strategy="hsdp", world_size=8, tp=2, dp_replicate=2, dp_shard=2), Layout(dp_replicate=2,
                                                                                             dp_shard=2, tp=2)),
    (ParallelConfig(strategy="fsdp2", world_size=4, tp=2, dp_shard=2), Layout(dp_shard=2, tp=2)),
    (ParallelConfig(strategy="hsdp", world_size=4, mesh_shape=(2, 2)), Layout(dp_replicate=2, dp_shard=2)),
])
def test_layout_degrees(par: ParallelConfig, want: Layout) -> None:
    assert layout_of(par) == want and want.world_size == par.world_size


def test_rank_coordinates_are_init_device_mesh_order() -> None:
    """Oracle: init_device_mesh puts rank r at the index of r in arange(world).reshape(shape)."""
    for shape in [(2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 1, 1), (3, 1, 1, 2)]:
        lay = Layout(pp=shape[0], dp_replicate=shape[1], dp_shard=shape[2], tp=shape[3])
        grid = torch.arange(lay.world_size).reshape(shape)
        for idx in itertools.product(*(range(n) for n in shape)):
            rank = int(grid[idx])
            assert lay.coords(rank) == dict(zip(MESH_DIMS, idx, strict=True))
            assert lay.dp_index(rank) == idx[1] * shape[2] + idx[2]


def test_tp_and_pp_peers_train_on_the_same_rows() -> None:
    """pp 1 x dp_shard 2 x tp 2 (4 ranks): ranks 0, 1 (one TP group) get rows 0-3 of 8, ranks 2, 3 rows 4-7."""
    lay = Layout(dp_shard=2, tp=2)
    batch = (torch.arange(8), torch.arange(8) * 10)
    got = [World(rank=r, size=4, strategy="fsdp2", layout=lay).shard(batch) for r in range(4)]
    for r, (x, y) in enumerate(got):
        assert x.tolist() == list(range(4 * (r // 2), 4 * (r // 2) + 4)) and torch.equal(y, x * 10)
    only_tp = World(rank=1, size=2, strategy="ddp", layout=Layout(tp=2)).shard(batch)
    assert only_tp is batch  # no data-parallel ranks: the whole batch on both


@pytest.mark.parametrize(("kw", "match"), [
    ({"strategy": "ddp", "world_size": 3, "tp": 2}, r"parallel.world_size = 3 is not divisible by parallel.tp x "
                                                     r"parallel.pp = 2 x 1"),
    ({"tp": 2}, r"parallel.tp = 2 .* need several processes: set parallel.strategy"),
    ({"strategy": "ddp", "world_size": 2, "microbatches": 2}, r"parallel.microbatches = 2 is for pipeline"),
    ({"strategy": "ddp", "world_size": 2, "sequence_parallel": True}, r"sequence_parallel = true needs tensor"),
    ({"strategy": "ddp", "world_size": 2, "pp": 2, "microbatches": 1}, r"\"1f1b\" needs at least as many "
                                                                        r"microbatches as stages \(2\)"),
    ({"strategy": "ddp", "world_size": 4, "tp": 2, "dp_shard": 2}, r"parallel.dp_shard = 2 does not fit "
                                                                    r"parallel.strategy 'ddp'.*\"fsdp2\""),
    ({"strategy": "fsdp2", "world_size": 4, "tp": 2, "dp_shard": 4}, r"parallel.dp_shard = 4 .*leave it out"),
    ({"strategy": "hsdp", "world_size": 8, "tp": 2, "mesh_shape": (2, 2), "dp_shard": 1},
     r"parallel.dp_shard = 1 but parallel.mesh_shape says 2"),
    ({"strategy": "hsdp", "world_size": 8, "tp": 2, "mesh_shape": (2, 1)}, r"mesh_shape \[2, 1\] has 2 ranks but "
                                                                            r"the data-parallel degree is 4"),
    ({"strategy": "hsdp", "world_size": 4, "tp": 2, "dp_replicate": 2}, r"parallel.mesh_shape must be "
                                                                         r"\[replicas, shards\]"),
    ({"strategy": "ddp", "world_size": 2, "pp": 2, "pp_schedule": "zb"}, r"parallel.pp_schedule"),
    ({"strategy": "ddp", "world_size": 2, "tp": 0}, r"parallel.tp"),
])
def test_degree_errors_name_the_field_and_fix(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kw)


def test_jax_refuses_model_parallel_layouts() -> None:
    with pytest.raises(ValueError, match="framework = \"jax\" trains in one process"):
        RunConfig(model="mlp-digits", framework="jax", parallel=ParallelConfig(strategy="ddp", world_size=2, tp=2))


def _gpt_config(recipe: str = "fp8-tensorwise", **par: object) -> tuple[RunConfig, object]:
    opts = {**GPT, **par.pop("model_options", {})}  # type: ignore[dict-item]
    cfg = RunConfig(model="gpt-bytes", model_options=opts, recipe=recipes.get(recipe),
                    parallel=ParallelConfig(**{"strategy": "ddp", **par}))  # type: ignore[arg-type]
    return cfg, get_task("gpt-bytes", seed=0, batch_size=8, **opts)


@pytest.mark.parametrize(("recipe", "par", "batch", "match"), [
    # 4 heads: TP=8 (8 ranks) leaves no whole head per rank
    ("fp8-tensorwise", {"world_size": 8, "tp": 8}, 8, r"parallel.tp = 8: .*4 attention heads, which TP=8 does not "
                                                      r"divide"),
    # d_model 64 under MXFP8: q, k, v pieces of 16 rows at TP=4 straddle the 32-element blocks
    ("mxfp8", {"world_size": 4, "tp": 4}, 8, r"parallel.tp = 4: .*block"),
    # 2 layers: embed, blocks.0, blocks.1, ln_f, lm_head are 5 pieces
    ("fp32", {"world_size": 8, "pp": 8, "microbatches": 8}, 8, r"parallel.pp = 8: n_stages = 8 is more stages "
                                                               r"than the model has pieces \(5"),
    ("fp32", {"world_size": 2, "pp": 2, "model_options": {"tie_head": True}}, 8, r"parallel.pp = 2: .*tied weight"),
    ("fp32", {"world_size": 2, "pp": 2, "microbatches": 3}, 8, r"batch_size 8 is not divisible by dp 1 x "
                                                               r"microbatches 3 = 3"),
    # FSDP2 shards inside pipeline stages: the runner replicates pipelines only
    ("fp32", {"world_size": 4, "pp": 2, "strategy": "fsdp2"}, 8, r"parallel.pp = 2 with parallel.strategy 'fsdp2' "
                                                                 r"\(dp_shard = 2\).*set parallel.strategy = \"ddp\""),
    ("fp32", {"world_size": 8, "pp": 2, "strategy": "hsdp", "mesh_shape": (2, 2)}, 8, r"parallel.pp = 2 with "
                                                                                       r"parallel.strategy 'hsdp'"),
    # DP x PP: 2 replicas x 4 microbatches are 8 pieces, which a batch of 12 rows does not split into
    ("fp32", {"world_size": 4, "pp": 2, "microbatches": 4}, 12, r"batch_size 12 is not divisible by dp 2 x "
                                                                r"microbatches 4 = 8"),
    # TP inside pipeline stages trains; FSDP2 shards inside them still do not, nor Kahan's per-shard compensation
    ("fp32", {"world_size": 8, "tp": 2, "pp": 2, "strategy": "fsdp2"}, 8, r"parallel.tp = 2 and parallel.pp = 2 "
                                                                          r"with parallel.strategy 'fsdp2' "
                                                                          r"\(dp_shard = 2\).*not FSDP2 shards"),
    ("bf16-kahan", {"world_size": 4, "tp": 2, "pp": 2}, 8, r"parallel.tp = 2 and parallel.pp = 2: "
                                                           r"recipe.weights.update = 'kahan'.*compensation buffer"),
    ("bf16-kahan", {"world_size": 2, "tp": 2}, 8, r"recipe.weights.update = 'kahan'.*do not gather"),
])
def test_model_checks_before_any_process(recipe: str, par: dict, batch: int, match: str) -> None:
    cfg, task = _gpt_config(recipe, **par)
    with pytest.raises(ValueError, match=match):
        check_model_layout(cfg, task, batch)  # type: ignore[arg-type]


def test_model_checks_accept_what_the_runner_trains() -> None:
    for recipe, par in [("mxfp8", {"world_size": 2, "tp": 2}), ("fp8-tensorwise", {"world_size": 2, "tp": 2,
                                                                                    "sequence_parallel": True}),
                        ("mxfp8", {"world_size": 2, "pp": 2, "microbatches": 4, "pp_schedule": "gpipe"}),
                        ("fp8-tensorwise", {"world_size": 4, "tp": 2, "strategy": "fsdp2"}),
                        ("mxfp8", {"world_size": 4, "tp": 2}),  # DDP x TP: dp_replicate 2 x tp 2
                        ("fp8-tensorwise", {"world_size": 8, "tp": 2, "strategy": "hsdp", "mesh_shape": (2, 2)}),
                        ("mxfp8", {"world_size": 4, "pp": 2, "microbatches": 2}),  # DP x PP
                        ("bf16-sr", {"world_size": 2, "tp": 2}),  # stochastic updates by global element
                        ("bf16-sr", {"world_size": 2, "pp": 2}),
                        ("fp8-tensorwise", {"world_size": 4, "tp": 2, "pp": 2, "microbatches": 4}),  # TP x PP
                        ("mxfp8", {"world_size": 4, "tp": 2, "pp": 2, "sequence_parallel": True}),
                        ("mxfp8", {"world_size": 8, "tp": 2, "pp": 2})]:  # DP x TP x PP
        cfg, task = _gpt_config(recipe, **par)
        check_model_layout(cfg, task, 8)  # type: ignore[arg-type]


def test_fsdp2_x_tp_takes_checkpoints() -> None:
    """FSDP2 x TP writes full-state checkpoints (``lowprec.distributed.full_model_state``): no longer refused."""
    cfg, task = _gpt_config("fp32", world_size=4, tp=2, strategy="fsdp2")
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, interval=10))
    check_model_layout(cfg, task, 8)  # type: ignore[arg-type]


def test_pp_needs_a_model_with_pieces() -> None:
    cfg = RunConfig(model="mlp-digits", parallel=ParallelConfig(strategy="ddp", world_size=2, pp=2))
    with pytest.raises(ValueError, match=r"parallel.pp = 2: a .* has no pipeline_pieces\(\) method"):
        check_model_layout(cfg, get_task("mlp-digits", seed=0), 64)


def test_pp_refuses_reliability_and_stats() -> None:
    cfg, task = _gpt_config("fp32", world_size=2, pp=2)
    cfg = dataclasses.replace(cfg, stats=dataclasses.replace(cfg.stats, every=5))
    with pytest.raises(ValueError, match=r"parallel.pp = 2: \[reliability\], \[\[faults\]\] and \[stats\]"):
        check_model_layout(cfg, task, 8)  # type: ignore[arg-type]


def test_cli_refuses_a_bad_layout_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c.toml").write_text('model = "gpt-bytes"\nbatch_size = 8\nrecipe = "mxfp8"\n'
                                     "[model_options]\nlayers = 2\nd_model = 64\nheads = 4\ncontext = 16\n"
                                     '[parallel]\nstrategy = "ddp"\nworld_size = 4\ntp = 4\n')
    assert main(["run", str(tmp_path / "c.toml"), "--store", str(tmp_path / "runs.db")]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp = 4" in err and "Traceback" not in err
    with RunStore(tmp_path / "runs.db") as store:
        assert store.list_runs() == []


class _Stage:
    """What local_optimizer_state reads of a Pipeline: the stage's parameters' whole-model indices."""

    def __init__(self, param_index: list[int]) -> None:
        self.param_index = param_index


def test_stage_optimizer_state_is_its_part_of_the_whole() -> None:
    """Oracle: a stage optimizer stepped on the same parameters as the whole-model optimizer has the whole one's
    state for those parameters, renumbered 0..k-1."""
    from lowprec.optim import LowPrecisionOptimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    whole = LowPrecisionOptimizer(torch.optim.AdamW(params, lr=0.1), "fp32")
    for p in params:
        p.grad = torch.ones(3)
    whole.step()
    stage = _Stage([1, 3])
    part = local_optimizer_state(stage, whole.state_dict())  # type: ignore[arg-type]
    copies = [torch.nn.Parameter(params[i].detach().clone()) for i in stage.param_index]
    mine = LowPrecisionOptimizer(torch.optim.AdamW(copies, lr=0.1), "fp32", param_index=stage.param_index)
    mine.load_state_dict(part)
    for k, i in enumerate(stage.param_index):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(mine.optimizer.state[copies[k]][key], whole.optimizer.state[params[i]][key])
    assert mine.steps == 1


def test_parity_refuses_a_reference_it_cannot_train(tmp_path: Path) -> None:
    from lowprec.testing import check_parity

    cfg, _ = _gpt_config("fp32", world_size=2, tp=2)
    with RunStore(tmp_path / "runs.db") as store:
        with pytest.raises(ValueError, match=r"--against single is one process; --tp 2 / --pp 1 need --against ddp"):
            check_parity(cfg, store=store, against="single", tp=2)
        with pytest.raises(ValueError, match="is the config's own layout"):
            check_parity(cfg, store=store, against="ddp", tp=2)
        assert store.list_runs() == []


def test_docs_layout_example_is_a_valid_config() -> None:
    """Oracle: RunConfig.from_toml and the model checks accept docs/runs.md's layout example as is."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "runs.md").read_text()
    (block,) = re.findall(r"```toml layout\n(.*?)```", text, flags=re.S)
    cfg = RunConfig.from_toml(block, where="docs/runs.md")
    assert layout_of(cfg.parallel) == Layout(tp=2)
    check_model_layout(cfg, get_task(cfg.model, seed=0, **cfg.model_options), int(cfg.batch_size or 0))
