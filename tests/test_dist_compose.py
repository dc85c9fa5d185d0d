"""Data parallelism composed with tensor and pipeline parallelism under the runner, with real torchrun processes
(gloo; 2, 4 and 8 ranks): DDP x TP, HSDP x TP, DP x PP, TP inside pipeline stages (TP x PP, and DP x TP x PP on
8), and FSDP2 x TP and TP x PP checkpoints resumed across layouts.

Oracles: the layout of the same arithmetic without the model split (DDP x TP against DDP on as many replicas: each
rank quantizes the same rows; DP x PP with 2 microbatches per replica against one pipeline over the same 4
microbatches; HSDP 2x2 x TP against DDP on 4 ranks; TP x PP against PP alone on the same microbatches; DP x TP x
PP against TP x PP), equal bit for bit until a last-bit difference of the sums'
order reaches a rounding boundary, then within a bound; HSDP 2x1 x TP (FSDP2's HSDP all-reduce) against DDP x TP
(``GradReducer``), two implementations of the same replica mean, bit for bit at every step; one process on the
whole batch, within the documented tolerances; an uninterrupted FSDP2 x TP run for one resumed from its own
checkpoints (curves and checkpoint files bit for bit); the run store (every step once, resume events).
"""

from __future__ import annotations

import os
from pathlib import Path

import _dist_compose_worker as c
import _dist_layouts_worker as w
import numpy as np
import pytest
import torch

from lowprec.runs._checkpoint import checkpoint_dir, load_checkpoint
from lowprec.runs._config import ParallelConfig
from lowprec.runs._launch import RunFailed
from lowprec.runs._runner import resume_run, run_config
from lowprec.runs._store import RunStore
from lowprec.testing import TOLERANCES, torchrun

pytestmark = pytest.mark.slow  # make test-slow: real torchrun process groups

TESTS = Path(__file__).parent
LAUNCHES = {
    2: ("ddp2/fp8-tensorwise", "ddp2/mxfp8", "pp2_m4/fp8-tensorwise", "pp2_m4/mxfp8", "ddp2/fp8-bf16-grads",
        "pp2_m4/fp32", "tp2/fp32", "pp2_m4/fp8-delayed"),
    4: ("ddp2_tp2/fp8-tensorwise", "ddp2_tp2/mxfp8", "ddp2_pp2/fp8-tensorwise", "ddp2_pp2/mxfp8",
        "hsdp2x1_tp2/fp8-tensorwise", "ddp4/fp8-tensorwise", "fsdp2_tp2/fp32", "state_round_trip",
        "ddp2_tp2/fp8-bf16-grads", "hsdp2x1_tp2/fp8-bf16-grads",
        "pp2_tp2/fp32", "pp2_tp2/fp8-tensorwise", "pp2_tp2/mxfp8", "pp2_tp2_sp/fp8-tensorwise", "pp2_tp2/fp8-delayed"),
    8: ("hsdp2x2_tp2/fp8-tensorwise", "state_round_trip", "pp2_ddp2_tp2/fp8-tensorwise"),
}
# Measured (torch 2.13 CPU, gloo, the GPT of _dist_layouts_worker, batch 8, 20 AdamW steps).
SAME = {  # (composition, reference): (steps with equal losses, steps with equal gradient norms, max rel. loss diff)
    # TP: the sharded sums and the DTensor norm add in another order than DDP's whole-tensor GEMMs and norm
    ("ddp2_tp2/fp8-tensorwise", "ddp2/fp8-tensorwise"): (6, 3, 2.4e-5),
    ("ddp2_tp2/mxfp8", "ddp2/mxfp8"): (6, 16, 5.2e-8),
    # the same gradients; the recorded loss is the mean of 2 replicas' microbatch means, not of 4 microbatches
    ("ddp2_pp2/fp8-tensorwise", "pp2_m4/fp8-tensorwise"): (0, 6, 6.0e-5),
    ("ddp2_pp2/mxfp8", "pp2_m4/mxfp8"): (0, 11, 9.8e-6),
    # 2 rows per rank: TP's partial sums move float32 last bits that fp8 inputs round apart from step 1
    ("hsdp2x2_tp2/fp8-tensorwise", "ddp4/fp8-tensorwise"): (0, 0, 6.2e-5),
    # TP inside the stages: TP's sharded sums and DTensor norm, on the pipeline's microbatches
    ("pp2_tp2/fp8-tensorwise", "pp2_m4/fp8-tensorwise"): (5, 3, 6.1e-5),
    ("pp2_tp2/mxfp8", "pp2_m4/mxfp8"): (9, 11, 9.8e-6),
    # the amax each microbatch records is the TP group's at once (a shard's own: 1.2e-4 from step 1)
    ("pp2_tp2/fp8-delayed", "pp2_m4/fp8-delayed"): (10, 2, 8.8e-6),
    # 2 replicas of it, with 2 microbatches each: as DP x PP against PP
    ("pp2_ddp2_tp2/fp8-tensorwise", "pp2_tp2/fp8-tensorwise"): (0, 13, 1.0e-7),
}
EARLY = 1e-6
"""Max relative loss difference over the first 6 steps from the layout of the same arithmetic (measured 3.6e-7)."""
SINGLE = {  # composition: max relative loss difference from one process on the whole batch (DDP alone: 1.3e-4)
    "ddp2_tp2/fp8-tensorwise": 1.3e-4, "ddp2_tp2/mxfp8": 1.3e-7, "ddp2_pp2/fp8-tensorwise": 2.0e-4,
    "ddp2_pp2/mxfp8": 9.9e-8, "hsdp2x2_tp2/fp8-tensorwise": 1.7e-4,
    # PP alone: 1.9e-4 and 9.8e-6; TP alone: 7.2e-5 and 0 (mxfp8's TP sums round to one process's here)
    "pp2_tp2/fp8-tensorwise": 1.7e-4, "pp2_tp2/mxfp8": 1.1e-7, "pp2_ddp2_tp2/fp8-tensorwise": 1.7e-4,
}
ENV = {"PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}


@pytest.fixture(autouse=True)
def _workers_import_test_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """One torchrun launch per world size trains its groups; the one-process references train here."""
    tmp = tmp_path_factory.mktemp("compose")
    store_path = str(tmp / "runs.db")
    ids: dict[str, str] = {}
    for nproc, groups in LAUNCHES.items():
        done = torchrun(TESTS / "_dist_compose_worker.py", store_path, *groups, nproc=nproc, timeout=600, env=ENV)
        ids[f"stdout/{nproc}"] = done.stdout
    with RunStore(store_path) as store:
        for g in (g for groups in LAUNCHES.values() for g in groups if "/" in g):
            (ids[g],) = [x.run_id for x in store.list_runs(group=g)]
        for r in (*c.RECIPES, "fp32"):
            (ids[f"single/{r}"],) = run_config(c.config(r, ParallelConfig(), store_path, group=f"single/{r}"),
                                              store=store, progress=False)
    return tmp, ids


def _scalars(tmp: Path, rid: str) -> dict[str, np.ndarray]:
    with RunStore(tmp / "runs.db") as store:
        rec = store.get_run(rid)
        assert rec.status == "completed"
        out = {k: v[1] for k, v in store.scalars(rid).items()}
        steps = store.scalars(rid)["train/loss"][0]
    assert np.array_equal(steps, np.arange(1, c.STEPS + 1))  # every step exactly once
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.mark.parametrize(("got", "ref"), list(SAME))
def test_composition_matches_the_layout_of_the_same_arithmetic(runs: tuple[Path, dict[str, str]], got: str,
                                                               ref: str) -> None:
    """Equal to the last bit for the first steps, then within 3x the measured drift (bounds: ``SAME``)."""
    tmp, ids = runs
    a, b = _scalars(tmp, ids[got]), _scalars(tmp, ids[ref])
    n_loss, n_norm, measured = SAME[got, ref]
    assert np.array_equal(a["train/loss"][:n_loss], b["train/loss"][:n_loss])
    assert np.array_equal(a["train/grad_norm"][:n_norm], b["train/grad_norm"][:n_norm])
    assert _rel(a["train/loss"][:6], b["train/loss"][:6]) <= EARLY
    rel = _rel(a["train/loss"], b["train/loss"])
    assert 0 < rel <= 3 * measured, rel  # 0: the same run twice


@pytest.mark.parametrize("got", list(SINGLE))
def test_composition_matches_one_process(runs: tuple[Path, dict[str, str]], got: str) -> None:
    """Against one process on the whole batch: each data-parallel rank's tensorwise scales come from its own rows,
    so fp8-tensorwise differs from step 1 (not a reduction-order bound); within the documented tolerance of the
    model split (``lowprec parity``'s) and 3x the measured."""
    tmp, ids = runs
    recipe = got.split("/")[1]
    rel = _rel(_scalars(tmp, ids[got])["train/loss"], _scalars(tmp, ids[f"single/{recipe}"])["train/loss"])
    key = "pp_vs_single_loss_rel" if "pp" in got else "tp_vs_single_loss_rel"
    assert 0 < rel <= min(3 * SINGLE[got], TOLERANCES[key].value), rel


def _local_numel(tp: int) -> int:
    """Elements of the zoo GPT one TP rank holds (oracle: the plan's colwise weights and biases and rowwise
    weights split in ``tp``, everything else whole)."""
    from lowprec.distributed import EmulatedColwiseParallel, gpt_plan
    from lowprec.nn import convert
    from lowprec.runs.zoo import get_task

    model = convert(get_task("gpt-bytes", seed=0, batch_size=8, **w.GPT).model, "fp32")
    plan = gpt_plan(model, tp=tp)
    split = {f"{name}.weight" for name in plan} | {f"{n}.bias" for n, s in plan.items()
                                                   if isinstance(s, EmulatedColwiseParallel)}
    return sum(p.numel() // (tp if n in split else 1) for n, p in model.named_parameters())


def test_ddp_x_tp_is_hsdp_with_one_shard_and_sends_its_gradients(runs: tuple[Path, dict[str, str]]) -> None:
    """HSDP 2x1 x TP (FSDP2's replica all-reduce) and DDP x TP (``GradReducer``) average the same local gradients
    over the same replicas: every step bit for bit.  What they send differs by the reducer's float32 ring
    all-reduce of each rank's local gradients, 4 bytes per element (2 replicas)."""
    tmp, ids = runs
    ddp, hsdp = _scalars(tmp, ids["ddp2_tp2/fp8-tensorwise"]), _scalars(tmp, ids["hsdp2x1_tp2/fp8-tensorwise"])
    assert np.array_equal(ddp["train/loss"], hsdp["train/loss"])
    assert np.array_equal(ddp["train/grad_norm"], hsdp["train/grad_norm"])
    sent = ddp["comm/bytes_sent"] - hsdp["comm/bytes_sent"]
    assert (sent == 4 * _local_numel(2)).all(), (sent[:3], _local_numel(2))


def test_ddp_x_tp_sends_gradients_in_the_recipes_format(runs: tuple[Path, dict[str, str]]) -> None:
    """A recipe with bf16 ``grad_comm``: DDP x TP's gradient averaging sends 2 bytes per local element (over what
    HSDP 2x1 x TP, whose FSDP2 reduction is float32, sends for the same TP collectives), its loss leaves the
    float32-gradient run's after step 1 (the forward of step 1 is the same), and stays within 3x the measured
    1.5e-4 of DDP on 2 ranks with the same recipe (the compression hook's bf16 mean; TP's bf16 partial sums of the
    input gradients, ``grad_comm`` too, are what differs)."""
    tmp, ids = runs
    got = _scalars(tmp, ids["ddp2_tp2/fp8-bf16-grads"])
    fp32 = _scalars(tmp, ids["hsdp2x1_tp2/fp8-bf16-grads"])
    ddp = _scalars(tmp, ids["ddp2/fp8-bf16-grads"])
    assert (got["comm/bytes_sent"] - fp32["comm/bytes_sent"] == 2 * _local_numel(2)).all()
    assert got["train/loss"][0] == fp32["train/loss"][0] and (got["train/loss"][1:] != fp32["train/loss"][1:]).any()
    assert _rel(got["train/loss"], ddp["train/loss"]) <= 3 * 1.5e-4


def _ckpt(tmp: Path, rid: str, step: int) -> dict:
    with RunStore(tmp / "runs.db") as store:
        return load_checkpoint(checkpoint_dir(store, rid) / f"step-{step:08d}.ckpt")


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "pp2_tp2"])
def test_split_checkpoint_is_the_one_process_state(runs: tuple[Path, dict[str, str]], layout: str) -> None:
    """FSDP2 x TP's and TP x PP's full-state checkpoints have one process's keys and shapes, and after 10 fp32
    steps their tensors are within float32 drift of one process's (measured max |diff| 2e-7 or so; DTensor's own
    full_tensor() of the 2-D fused qkv put rows elsewhere: 0.12 after one step; a stage not broadcast from its
    owner, or an optimizer state not merged over the stages, would be 10 steps stale or missing)."""
    tmp, ids = runs
    got, want = _ckpt(tmp, ids[f"{layout}/fp32"], 10), _ckpt(tmp, ids["single/fp32"], 10)
    assert got["model"].keys() == want["model"].keys()
    diffs = {k: float((got["model"][k].double() - v.double()).abs().max()) for k, v in want["model"].items()
             if v.is_floating_point()}
    assert max(diffs.values()) <= 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:3]
    state, ref = got["optimizer"]["optimizer"]["state"], want["optimizer"]["optimizer"]["state"]
    assert state.keys() == ref.keys()
    for i, s in ref.items():
        for k, v in s.items():
            assert state[i][k].shape == v.shape and not isinstance(state[i][k], torch.distributed.tensor.DTensor)


@pytest.mark.parametrize(("nproc", "shape"), [(4, "(1, 2, 2)"), (8, "(2, 2, 2)")])
def test_full_state_round_trip_on_fsdp2_and_hsdp_x_tp_meshes(runs: tuple[Path, dict[str, str]], nproc: int,
                                                             shape: str) -> None:
    """``_dist_compose_worker.state_round_trip`` ran (and asserted on every rank) on the 4- and 8-rank meshes: the
    gathered state within float32 drift of one process where ``full_tensor()`` is 0.1 off, and a fresh model and
    optimizer loaded from it holding the trained shards bit for bit."""
    _, ids = runs
    assert f"state round trip on {shape}: gathered within" in ids[f"stdout/{nproc}"]


@pytest.mark.parametrize(("strategy", "par", "key", "name"), [
    ("ddp", "tp = 2", "tp", "dp_replicate2 x tp2"),
    ("ddp", "pp = 2\nmicrobatches = 2", "pp", "pp2 x dp_replicate2"),
    ("fsdp2", "tp = 2", "tp", "dp_shard2 x tp2"),  # FSDP2 sharding the TP DTensors (measured 9.5e-8)
    ("ddp", "tp = 2\npp = 2\nmicrobatches = 2", "pp", "pp2 x tp2"),  # TP inside the pipeline's stages
])
def test_parity_cli_on_data_parallel_compositions(tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str,
                                                  par: str, key: str, name: str) -> None:
    """`lowprec parity` on DDP 2 x TP 2, PP 2 x DP 2, FSDP2 2 x TP 2 and PP 2 x TP 2 (4 processes each) against one
    process, fp32, 12 steps: PASS within the split's tolerance, exit 0, the run named by its layout."""
    from lowprec.cli import main

    opts = ", ".join(f"{k} = {v}" for k, v in w.GPT.items())
    (tmp_path / "c.toml").write_text(f'model = "gpt-bytes"\nmodel_options = {{ {opts} }}\nrecipe = "fp32"\n'
                                     "steps = 12\nbatch_size = 8\nseed = 0\nthreads = 1\n"
                                     f'[parallel]\nstrategy = "{strategy}"\nworld_size = 4\n{par}\n')
    rc = main(["parity", str(tmp_path / "c.toml"), "--against", "single", "--quiet",
               "--store", str(tmp_path / "runs.db")])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("PASS") and "over 12 steps" in out, out
    assert f"tolerance {TOLERANCES[f'{key}_vs_single_loss_rel'].value:g}" in out
    with RunStore(tmp_path / "runs.db") as store:
        (rec,) = [r for r in store.list_runs() if r.manifest["world_size"] == 4]
        assert rec.name == f"gpt-bytes fp32 {name} seed 0", rec.name


def test_fsdp2_x_tp_resumes_across_layouts(runs: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """FSDP2 x TP 2x2 fails at step 7 and resumes from its step-5 checkpoint as FSDP2 x TP, fails at step 12 and
    resumes from step 10 as TP=2, fails at step 17 and resumes from step 15 on one process: every step once; the
    first 10 steps and the step-10 checkpoint (model and optimizer state) bit for bit those of the uninterrupted
    FSDP2 x TP run; the TP=2 and one-process legs within the fp32 drift of one process."""
    tmp, ids = runs
    cfg = c.config("fp32", c.LAYOUTS["fsdp2_tp2"], str(tmp_path / "runs.db"),
                   model="_dist_layouts_worker:gpt_crash_at",
                   model_options={**w.GPT, "steps": [6, 11, 16], "marker": str(tmp_path / "m")})
    with RunStore(cfg.store) as store:
        with pytest.raises(RunFailed, match="injected failure at step 6"):
            run_config(cfg, store=store, progress=False)
        (rec,) = store.list_runs()
        with pytest.raises(RunFailed, match="injected failure at step 11"):
            resume_run(rec.run_id, store=store, progress=False)  # the stored layout: FSDP2 x TP again
        resumed10 = load_checkpoint(checkpoint_dir(store, rec.run_id) / "step-00000010.ckpt")
        with pytest.raises(RunFailed, match="injected failure at step 16"):
            resume_run(rec.run_id, store=store, progress=False, parallel=w.LAYOUTS["tp2"])
        rid = resume_run(rec.run_id, store=store, progress=False, world_size=1)
        assert store.get_run(rid).status == "completed"
        events = store.events(rid, kind="resumed")
        assert [(e["step"], e["payload"]["world_size"], e["payload"]["checkpoint_world_size"]) for e in events] \
            == [(5, 4, 4), (10, 2, 4), (15, 1, 2)]
        steps, got = store.scalars(rid)["train/loss"]
    assert np.array_equal(steps, np.arange(1, c.STEPS + 1))
    want = _scalars(tmp, ids["fsdp2_tp2/fp32"])["train/loss"]
    assert np.array_equal(got[:10], want[:10])
    assert _rel(got, want) <= 1e-6  # fp32: TP=2 and one process differ from FSDP2 x TP by the sums' order
    ref10 = _ckpt(tmp, ids["fsdp2_tp2/fp32"], 10)
    for k, v in ref10["model"].items():
        assert torch.equal(resumed10["model"][k], v), k
    for i, s in ref10["optimizer"]["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(resumed10["optimizer"]["optimizer"]["state"][i][k], v), (i, k)


def test_tp_inside_pipeline_stages_is_the_pipeline_in_fp32(runs: tuple[Path, dict[str, str]]) -> None:
    """TP x PP (pp 2 x tp 2, 4 microbatches) against PP 2 alone on the same microbatches, fp32: the loss at every
    step within 1e-6 (measured: bit for bit at all 20 steps) and the gradient norm (over both stages and the TP
    shards, clipped to 1) within 1e-6 (measured: one float32 ulp, DTensor's norm of the shards).  Rank 0 (stage 0,
    TP rank 0) sends exactly half of TP 2's bytes at every step: its stage holds one of the two blocks, and the 4
    microbatches' activations are the batch's; the stage shapes worked out on the first step send none counted."""
    tmp, ids = runs
    got, pp, tp = (_scalars(tmp, ids[g]) for g in ("pp2_tp2/fp32", "pp2_m4/fp32", "tp2/fp32"))
    assert _rel(got["train/loss"], pp["train/loss"]) <= 1e-6
    assert _rel(got["train/grad_norm"], pp["train/grad_norm"]) <= 1e-6
    assert (pp["train/grad_norm"] > 1).all()  # every step clipped
    assert (2 * got["comm/bytes_sent"] == tp["comm/bytes_sent"]).all(), (got["comm/bytes_sent"][:3],
                                                                           tp["comm/bytes_sent"][:3])


def test_sequence_parallel_inside_pipeline_stages(runs: tuple[Path, dict[str, str]]) -> None:
    """TP x PP with sequence parallelism (each TP rank sends its sequence chunk across the stage boundary; fp8
    activations all-gathered as codes with the TP group's shared scale) against the same layout without it,
    fp8-tensorwise: the loss and the gradient norm at every step within 1e-6 (measured: bit for bit, both, at
    all 20 steps: the split changes where values are, not how they are rounded), and fewer bytes at every step
    (1-byte activation gathers instead of float32 partial-sum all-reduces)."""
    tmp, ids = runs
    sp, full = _scalars(tmp, ids["pp2_tp2_sp/fp8-tensorwise"]), _scalars(tmp, ids["pp2_tp2/fp8-tensorwise"])
    assert _rel(sp["train/loss"], full["train/loss"]) <= 1e-6
    assert _rel(sp["train/grad_norm"], full["train/grad_norm"]) <= 1e-6
    assert (sp["comm/bytes_sent"] < full["comm/bytes_sent"]).all()


def test_tp_x_pp_resumes_on_one_process_and_back(runs: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """TP x PP (pp 2 x tp 2, fp32) fails at step 6 and resumes from its step-5 checkpoint on one process, which
    fails at step 16 and resumes from its step-15 checkpoint as TP x PP again: every step once; the first 5 steps
    and the step-5 checkpoint bit for bit those of the uninterrupted TP x PP run; the rest within 1e-6 of it (one
    process and TP x PP differ by float32 drift, measured 1.1e-7; a stage loaded stale, or an optimizer state
    lost, is far more: a fresh AdamW's first update is lr x sign(g))."""
    tmp, ids = runs
    cfg = c.config("fp32", c.LAYOUTS["pp2_tp2"], str(tmp_path / "runs.db"), model="_dist_layouts_worker:gpt_crash_at",
                   model_options={**w.GPT, "steps": [5, 15], "marker": str(tmp_path / "m")})
    with RunStore(cfg.store) as store:
        with pytest.raises(RunFailed, match="injected failure at step 5"):
            run_config(cfg, store=store, progress=False)
        (rec,) = store.list_runs()
        first5 = load_checkpoint(checkpoint_dir(store, rec.run_id) / "step-00000005.ckpt")
        with pytest.raises(RuntimeError, match="injected failure at step 15"):
            resume_run(rec.run_id, store=store, progress=False, world_size=1)
        rid = resume_run(rec.run_id, store=store, progress=False, parallel=c.LAYOUTS["pp2_tp2"])
        assert store.get_run(rid).status == "completed"
        events = store.events(rid, kind="resumed")
        assert [(e["step"], e["payload"]["world_size"], e["payload"]["checkpoint_world_size"]) for e in events] \
            == [(5, 1, 4), (15, 4, 1)]
        steps, got = store.scalars(rid)["train/loss"]
    assert np.array_equal(steps, np.arange(1, c.STEPS + 1))
    want = _scalars(tmp, ids["pp2_tp2/fp32"])["train/loss"]
    assert np.array_equal(got[:5], want[:5])
    assert _rel(got, want) <= 1e-6
    ref5 = _ckpt(tmp, ids["pp2_tp2/fp32"], 5)
    for k, v in ref5["model"].items():
        assert torch.equal(first5["model"][k], v), k
    for i, s in ref5["optimizer"]["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(first5["optimizer"]["optimizer"]["state"][i][k], v), (i, k)
