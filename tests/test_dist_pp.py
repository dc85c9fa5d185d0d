"""Pipeline parallelism (lowprec.distributed._pipeline, _pp_split): stages of a converted model on 2 ranks under
torch's GPipe and 1F1B schedules.

Oracles: one process accumulating gradients over the same microbatches (``accumulate_step``: plain
``loss.backward()`` per microbatch): losses, every parameter and every emulation buffer (``lp_step``, amax
histories) bit for bit; one process on the whole batch: losses within the measured tolerance below; the model's
own forward for the composed stages.  One torchrun launch (tests/_dist_pp_worker.py) runs every distributed case;
its JSON is parsed once per module.  The tests without torchrun (errors, composition) are not slow-marked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lowprec
from lowprec.distributed import Pipeline, accumulate_step, split_microbatches, split_stages
from lowprec.optim import LowPrecisionOptimizer
from lowprec.runs.zoo._digits import MLP
from lowprec.runs.zoo._text import TinyGPT, lm_loss
from lowprec.testing import torchrun

WORKER = Path(__file__).with_name("_dist_pp_worker.py")
STEPS, MICROBATCHES = 3, 4  # as in the worker
MODELS = ("gpt", "mlp")
RECIPES = ("fp32", "bf16", "fp8-tensorwise", "mxfp8", "bf16-sr", "fp8-delayed", "mxfp4")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")  # interleaved: 4 stages, 2 per rank
CASES = [[m, r, s] for m in MODELS for r in RECIPES for s in ("accum", "whole", *SCHEDULES)]
CASES += [["mlp", "mxfp4", "1f1b-dynamic"], ["mlp", "fp8-delayed", "1f1b-dynamic"], ["gpt", "bf16-sr", "1f1b-noindex"]]
CASES += [["gpt", "fp8-delayed", "1f1b-group"], ["gpt", "fp8-delayed", "interleaved-1f1b-group"]]
CLIP = 0.1  # as in the worker
CLIPPED = [("gpt", "fp8-tensorwise", "1f1b"), ("mlp", "bf16-sr", "gpipe")]  # global-norm clipping at CLIP
CASES += [[m, r, s] for m, r, sched in CLIPPED for s in ("accum-clip", f"{sched}-clip")]
OVERFLOW = [("mlp", "1f1b"), ("gpt", "gpipe")]  # fp16 with a dynamic loss scale from 2^19: some steps overflow
CASES += [[m, "fp16-overflow", s] for m, sched in OVERFLOW for s in ("accum", sched)]
# Relative loss difference, pipeline (= accumulation over 4 microbatches) vs one process on the whole batch, max over
# 3 AdamW steps, measured on the development machine (torch 2.13 CPU): fp32 9.4e-8 (reduction order of the mean),
# bf16 5.3e-5, bf16-sr 4.2e-5, mxfp8 5.9e-4, fp8-delayed 8.6e-4, fp8-tensorwise 1.3e-3 (per-microbatch amax),
# mxfp4 2.3e-3 (and its stochastic gradients draw other bits: lp_step counts microbatch forwards).  Bound: about 4x
# the largest of each group.
WHOLE_BATCH_LOSS_REL = {"fp32": 1e-6, "bf16": 5e-4, "bf16-sr": 5e-4}
WHOLE_BATCH_LOSS_REL_LOWP = 1e-2


@pytest.fixture(scope="module")
def dist_run(tmp_path_factory: pytest.TempPathFactory) -> dict[object, dict]:
    """rank -> (model, recipe, schedule) -> case; and "doc" -> rank -> the docs example's result."""
    out = tmp_path_factory.mktemp("pp")
    p = torchrun(WORKER, str(out), json.dumps(CASES), nproc=2, timeout=240)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1], p.stdout[-3000:] + p.stderr[-3000:]
    run: dict[object, dict] = {r["rank"]: {(c["model"], c["recipe"], c["schedule"]): c for c in r["cases"]}
                               for r in ranks}
    run["doc"] = {r["rank"]: r["doc"] for r in ranks}
    return run


def _losses(case: dict) -> list[float]:
    return [float.fromhex(v) for v in case["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", MODELS)
def test_pipeline_equals_gradient_accumulation_bitwise(dist_run: dict, model: str, recipe: str,
                                                       schedule: str) -> None:
    """Both stages: every step's loss, every parameter after 3 steps and every lp_step / amax history equal to one
    process accumulating over the same microbatches, bit for bit; the two stages together hold every parameter."""
    held: set[str] = set()
    for rank in (0, 1):
        pp, ref = dist_run[rank][(model, recipe, schedule)], dist_run[rank][(model, recipe, "accum")]
        assert pp["losses"] == ref["losses"], (rank, _losses(pp), _losses(ref))
        for kind in ("params", "buffers"):
            diff = [n for n, d in pp[kind].items() if ref[kind][n] != d]
            assert not diff, (rank, kind, diff)
        assert not held & set(pp["params"])
        held |= set(pp["params"])
    assert held == set(dist_run[0][(model, recipe, "accum")]["params"])


@pytest.mark.slow
def test_loss_is_broadcast_and_stages_are_the_split_points(dist_run: dict) -> None:
    for key in [(m, r, s) for m in MODELS for r in RECIPES for s in SCHEDULES]:
        assert dist_run[0][key]["losses"] == dist_run[1][key]["losses"], key
    assert dist_run[0][("gpt", "fp32", "1f1b")]["pieces"] == ["embed", "blocks.0"]
    assert dist_run[1][("gpt", "fp32", "1f1b")]["pieces"] == ["blocks.1", "ln_f", "lm_head"]
    assert dist_run[0][("mlp", "fp32", "gpipe")]["pieces"] == ["layers.0", "act"]
    assert dist_run[1][("mlp", "fp32", "gpipe")]["pieces"] == ["layers.1", "act", "head"]
    # interleaved: rank r holds stages r and r + 2
    assert dist_run[0][("gpt", "fp32", "interleaved-1f1b")]["pieces"] == ["embed", "blocks.1"]
    assert dist_run[1][("gpt", "fp32", "interleaved-1f1b")]["pieces"] == ["blocks.0", "ln_f", "lm_head"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", MODELS)
def test_pipeline_close_to_whole_batch(dist_run: dict, model: str, recipe: str) -> None:
    bound = WHOLE_BATCH_LOSS_REL.get(recipe, WHOLE_BATCH_LOSS_REL_LOWP)
    for schedule in SCHEDULES:
        pp, whole = _losses(dist_run[1][(model, recipe, schedule)]), _losses(dist_run[1][(model, recipe, "whole")])
        rel = max(abs(a - b) / abs(b) for a, b in zip(pp, whole, strict=True))
        assert rel < bound, (schedule, rel, pp, whole)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_lp_step_counts_microbatch_forwards(dist_run: dict, model: str) -> None:
    """mxfp4's stochastic gradients: every stochastic linear's counter is steps x microbatches after the pipeline
    (as accumulation), steps after the whole batch, whose random bits therefore differ (its parameters too)."""
    for rank in (0, 1):
        pp = dist_run[rank][(model, "mxfp4", "1f1b")]
        whole, accum = dist_run[rank][(model, "mxfp4", "whole")], dist_run[rank][(model, "mxfp4", "accum")]
        assert pp["lp_step"] and set(pp["lp_step"].values()) == {STEPS * MICROBATCHES}
        assert set(whole["lp_step"].values()) == {STEPS}
        assert any(whole["params"][n] != accum["params"][n] for n in pp["params"])


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_delayed_amax_history_has_one_entry_per_microbatch(dist_run: dict, model: str) -> None:
    for rank in (0, 1):
        pp, whole = dist_run[rank][(model, "fp8-delayed", "gpipe")], dist_run[rank][(model, "fp8-delayed", "whole")]
        assert pp["amax"]
        for name, hist in pp["amax"].items():
            assert all(v > 0 for v in hist[: STEPS * MICROBATCHES]) and not any(hist[STEPS * MICROBATCHES:]), name
            assert all(v > 0 for v in whole["amax"][name][:STEPS]) and not any(whole["amax"][name][STEPS:]), name


@pytest.mark.slow
def test_torch_dynamic_metadata_inference_would_change_the_numerics(dist_run: dict) -> None:
    """Why Pipeline hands torch static stage metadata: torch 2.13's dynamic inference runs one extra forward of every
    stage (rank 1 on torch.empty inputs), so lp_step is one ahead and an amax history gets an extra (garbage) entry.
    If this fails, torch no longer runs that forward and the static metadata could be dropped."""
    for rank in (0, 1):
        dyn = dist_run[rank][("mlp", "mxfp4", "1f1b-dynamic")]
        assert set(dyn["lp_step"].values()) == {STEPS * MICROBATCHES + 1}
        assert dist_run[rank][("mlp", "fp8-delayed", "1f1b-dynamic")]["losses"] != \
            dist_run[rank][("mlp", "fp8-delayed", "accum")]["losses"]


@pytest.mark.slow
def test_param_index_keys_the_stochastic_weight_update(dist_run: dict) -> None:
    """bf16-sr without param_index: stage 1's parameters are renumbered from 0 and draw other random bits, so the
    run leaves accumulation after the first update (the first loss is still equal)."""
    case, ref = dist_run[1][("gpt", "bf16-sr", "1f1b-noindex")], dist_run[1][("gpt", "bf16-sr", "accum")]
    assert case["losses"][0] == ref["losses"][0] and case["losses"][1:] != ref["losses"][1:]
    assert all(ref["params"][n] != d for n, d in case["params"].items())


@pytest.mark.slow
@pytest.mark.parametrize("model, schedule", OVERFLOW)
def test_loss_scaling_skips_a_step_on_every_stage(dist_run: dict, model: str, schedule: str) -> None:
    """Loss-scaled microbatch losses, ``grads_finite`` (a MIN all-reduce) deciding the skip: the same skipped steps,
    losses, parameters and loss scale path as one process.  On the GPT, stage 0's own gradients stay finite in a
    step that stage 1 overflows, so without the all-reduce stage 0 would step alone."""
    for rank in (0, 1):
        pp, ref = dist_run[rank][(model, "fp16-overflow", schedule)], dist_run[rank][(model, "fp16-overflow", "accum")]
        assert 0 < pp["skipped"] == ref["skipped"] < STEPS
        assert pp["losses"] == ref["losses"]
        assert all(ref["params"][n] == d for n, d in pp["params"].items())
    if model == "gpt":
        own = [dist_run[r][(model, "fp16-overflow", schedule)]["local_finite"] for r in (0, 1)]
        assert any(a and not b for a, b in zip(*own, strict=True)), own


@pytest.mark.slow
@pytest.mark.parametrize("model, recipe, schedule", CLIPPED)
def test_global_norm_clipping_equals_one_process(dist_run: dict, model: str, recipe: str, schedule: str) -> None:
    """``clip_grad_norm_`` across the stages against the runner's own clipping in one process (oracle:
    runs._runner._grad_norm_and_clip after accumulation): the norms, losses and parameters bit for bit, and the
    norm is above the bound, so the clipping acted."""
    for rank in (0, 1):
        pp, ref = dist_run[rank][(model, recipe, f"{schedule}-clip")], dist_run[rank][(model, recipe, "accum-clip")]
        assert pp["norms"] == ref["norms"] and pp["losses"] == ref["losses"]
        assert all(ref["params"][n] == d for n, d in pp["params"].items())
        assert all(float.fromhex(v) > CLIP for v in pp["norms"])
        assert pp["losses"] != dist_run[rank][(model, recipe, "accum")]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model", MODELS)
def test_sync_model_makes_the_whole_model_current_on_every_rank(dist_run: dict, model: str, schedule: str) -> None:
    """After ``sync_model`` each rank's whole model (every parameter and buffer) is accumulation's, bit for bit; the
    task's evaluation of it too (fp8-delayed GPT, mxfp4 MLP: their amax histories and lp_step come along)."""
    for recipe in RECIPES:
        for rank in (0, 1):
            synced, ref = dist_run[rank][(model, recipe, schedule)]["synced"], dist_run[rank][(model, recipe, "accum")]
            assert synced["params"] == ref["params"] and synced["buffers"] == ref["buffers"], (recipe, rank)
    recipe = "fp8-delayed" if model == "gpt" else "mxfp4"
    for rank in (0, 1):
        assert dist_run[rank][(model, recipe, schedule)]["eval"] == dist_run[rank][(model, recipe, "accum")]["eval"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_pipeline_on_its_own_process_group(dist_run: dict, schedule: str) -> None:
    """``group=`` a new group object (what a device mesh's "pp" dimension hands over): the same bits as on the
    default group.  Here it holds the same two ranks, so this checks that every collective and send goes through the
    group, not the translation of group ranks to global ones (that needs more than 2 processes)."""
    for rank in (0, 1):
        own, default = dist_run[rank][("gpt", "fp8-delayed", f"{schedule}-group")], \
            dist_run[rank][("gpt", "fp8-delayed", schedule)]
        assert own["losses"] == default["losses"] and own["params"] == default["params"]
        assert own["synced"] == default["synced"]


@pytest.mark.slow
def test_docs_example_trains(dist_run: dict) -> None:
    """docs/distributed.md's example, run as is (30 steps of the GPT on 2 stages): the same final loss and
    validation metrics on both ranks (after sync_model), the loss well below the untrained one."""
    a, b = dist_run["doc"][0], dist_run["doc"][1]
    assert a["final_loss"] == b["final_loss"] < 0.8 * a["initial_loss"], (a, b)
    assert a["metrics"] == b["metrics"] and a["metrics"]["loss"] < 0.8 * a["initial_loss"], (a, b)


# ------------------------------------------------------------------------------------- without torchrun
def _gpt(recipe: str = "fp32", tie_head: bool = False, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(layers=layers, d_model=32, heads=2, context=16, tie_head=tie_head)
    lowprec.convert(model, recipe)
    return model


def _mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(hidden=32, layers=2, activation="relu")


MLP_ORDER = ["layers.0", "act", "layers.1", "act", "head"]


@pytest.mark.parametrize("recipe", ["fp32", "fp8-tensorwise", "mxfp8"])
def test_composed_stages_equal_the_model(recipe: str) -> None:
    gpt = _gpt(recipe, layers=3).eval()
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    for split in ({"n_stages": 3}, {"split_points": ["blocks.1", "lm_head"]}, {"n_stages": 1}):
        y = x
        for stage in split_stages(gpt, **split):  # type: ignore[arg-type]
            y = stage(y)
        assert torch.equal(y, gpt(x)), split
    mlp = _mlp().eval()
    a, b = split_stages(mlp, split_points=["layers.1"], order=MLP_ORDER)
    x = torch.rand(8, 64)
    assert torch.equal(b(a(x)), mlp(x))


def test_stages_hold_the_models_modules() -> None:
    gpt = _gpt("fp8-tensorwise")
    s0, s1 = split_stages(gpt, split_points=["blocks.1"])
    assert s0.piece_names == ["embed", "blocks.0"] and s1.piece_names == ["blocks.1", "ln_f", "lm_head"]
    assert s1.pieces[0] is gpt.blocks[1]
    assert s1.pieces[0].attn.qkv.lowprec_name == "blocks.1.attn.qkv"  # names of the whole model
    assert {id(p) for p in [*s0.parameters(), *s1.parameters()]} == {id(p) for p in gpt.parameters()}



def test_default_split_balances_parameter_counts() -> None:
    """Oracle: every way of cutting the chain, enumerated; the default cut has the smallest largest stage."""
    import itertools

    gpt = _gpt(layers=4)  # 7 pieces: embed, 4 blocks, ln_f, lm_head
    weights = [sum(p.numel() for p in s.parameters()) for s in split_stages(gpt, n_stages=7)]  # one per stage
    for n in (2, 3, 4):
        got = max(sum(p.numel() for p in s.parameters()) for s in split_stages(gpt, n_stages=n))
        best = min(max(sum(weights[a:b]) for a, b in itertools.pairwise((0, *cuts, 7)))
                   for cuts in itertools.combinations(range(1, 7), n - 1))
        assert got == best, n
    assert [s.piece_names for s in split_stages(_gpt(), n_stages=2)] == [["embed", "blocks.0"],
                                                                         ["blocks.1", "ln_f", "lm_head"]]


@pytest.mark.parametrize("kwargs, words", [
    ({"n_stages": 6}, "more stages than the model has pieces (5"),
    ({"n_stages": 0}, "n_stages must be a positive int"),
    ({"split_points": ["blocks.7"]}, "'blocks.7' does not name a piece"),
    ({"split_points": ["embed"]}, "distinct pieces after the first"),
    ({"split_points": ["ln_f", "blocks.1"]}, "in call order"),
    ({"split_points": ["blocks.1"], "n_stages": 3}, "2 stages"),
    ({"split_points": "blocks.1"}, "list of piece names"),
])
def test_split_errors_name_the_fix(kwargs: dict, words: str) -> None:
    with pytest.raises(lowprec.UsageError) as e:
        split_stages(_gpt(), **kwargs)
    assert words in str(e.value)


def test_order_errors() -> None:
    with pytest.raises(lowprec.UsageError, match="'layers.5', which the model does not have"):
        split_stages(_mlp(), n_stages=2, order=["layers.0", "layers.5"])
    with pytest.raises(lowprec.UsageError, match="names 2 pieces"):
        split_stages(_mlp(), split_points=["act"], order=MLP_ORDER)
    with pytest.raises(lowprec.UsageError, match="pass order="):
        split_stages(_mlp(), n_stages=2)  # a ModuleList model with no pipeline_pieces()


def test_tied_head_across_stages_is_refused() -> None:
    gpt = _gpt(tie_head=True)
    with pytest.raises(lowprec.UsageError, match="tie_head=False") as e:
        split_stages(gpt, split_points=["blocks.1"])
    assert "'lm_head.weight' (stage 1)" in str(e.value) and "'embed.tok_embed.weight'" in str(e.value)
    assert len(split_stages(gpt, n_stages=1)) == 1  # one stage holds both: fine


def test_microbatch_count_must_divide_the_batch() -> None:
    parts = split_microbatches(torch.arange(12).reshape(6, 2), 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    with pytest.raises(lowprec.UsageError, match="microbatches = 4 does not divide the batch size 6"):
        split_microbatches(torch.zeros(6, 2), 4)
    with pytest.raises(lowprec.UsageError, match="does not divide the inputs' batch size 10"):
        accumulate_step(_mlp(), torch.zeros(10, 64), torch.zeros(10, dtype=torch.int64),
                        torch.nn.functional.cross_entropy, microbatches=4)


def test_pipeline_needs_a_process_group() -> None:
    with pytest.raises(lowprec.UsageError, match="init_process_group"):
        Pipeline(_gpt(), loss_fn=lm_loss, microbatches=4)


@pytest.mark.parametrize("schedule, world, per_rank, microbatches, words", [
    ("1f1b", 4, 1, 2, "at least as many microbatches as stages (4)"),
    ("gpipe", 2, 2, 4, "use schedule 'interleaved-1f1b' for several"),
    ("interleaved-1f1b", 4, 2, 9, "not a multiple of 2 rounds"),
    ("zero-bubble", 2, 1, 4, "schedule must be one of"),
    ("gpipe", 2, 1, 0, "microbatches must be a positive int"),
])
def test_layout_errors(schedule: str, world: int, per_rank: int, microbatches: int, words: str) -> None:
    """Checked before torch's schedules are built (they would raise later, or hang a peer rank)."""
    from lowprec.distributed._pipeline import _check_layout

    with pytest.raises(lowprec.UsageError) as e:
        _check_layout(schedule, world, per_rank, microbatches)
    assert words in str(e.value)
    _check_layout("interleaved-1f1b", 4, 2, 8)  # fine: 2 rounds of 4
    _check_layout("gpipe", 4, 1, 1)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A 1-process gloo group for this test only (the pipeline machinery without torchrun: every stage on rank 0)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule, per_rank", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_one_rank_pipeline_equals_accumulation(one_rank: None, schedule: str, per_rank: int) -> None:
    """Oracle: accumulate_step on a second copy.  mxfp4 (stochastic gradients): losses, gradients and lp_step bit
    for bit over two steps; the global-norm clipping equals the runner's."""
    from lowprec.runs._runner import _grad_norm_and_clip

    a, b = _gpt("mxfp4"), _gpt("mxfp4")
    pipe = Pipeline(a, loss_fn=lm_loss, microbatches=4, schedule=schedule, stages_per_rank=per_rank)
    assert pipe.is_first and pipe.is_last and len(pipe.modules) == per_rank
    assert pipe.param_index == list(range(pipe.n_params)) == list(range(len(list(a.parameters()))))
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x, y = torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8, 16), generator=g)
        assert torch.equal(pipe.step(x, y), accumulate_step(b, x, y, lm_loss, microbatches=4))
        assert pipe.grads_finite()
        assert pipe.clip_grad_norm_(0.1) == _grad_norm_and_clip(list(b.parameters()), 1.0, 0.1)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    steps = {n: int(t) for n, t in a.named_buffers() if n.endswith("lp_step")}
    assert steps and set(steps.values()) == {8} and steps == {n: int(t) for n, t in b.named_buffers()
                                                               if n.endswith("lp_step")}


def test_pipeline_layout_errors_with_a_group(one_rank: None) -> None:
    with pytest.raises(lowprec.UsageError, match="2 stages from split_points .* give 0 split points"):
        Pipeline(_gpt(), loss_fn=lm_loss, microbatches=4, split_points=["blocks.1"])
    pipe = Pipeline(_gpt(), loss_fn=lm_loss, microbatches=4, schedule="interleaved-1f1b", stages_per_rank=2)
    with pytest.raises(lowprec.UsageError, match="holds 2 stages"):
        _ = pipe.module
    with pytest.raises(lowprec.UsageError, match="does not divide the inputs' batch size 6"):
        pipe.step(torch.zeros(6, 16, dtype=torch.int64), torch.zeros(6, 16, dtype=torch.int64))


def test_accumulate_step_with_one_microbatch_is_a_plain_step() -> None:
    """Oracle: loss.backward() on the whole batch."""
    a, b = _gpt("fp8-tensorwise"), _gpt("fp8-tensorwise")
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    loss = accumulate_step(a, x, y, lm_loss, microbatches=1)
    ref = lm_loss(b(x), y)
    ref.backward()
    assert torch.equal(loss, ref.detach())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_param_index_must_match_the_parameters() -> None:
    params = list(_mlp().parameters())
    with pytest.raises(lowprec.UsageError, match="param_index has 2 entries but the optimizer holds 6"):
        LowPrecisionOptimizer(torch.optim.AdamW(params), "bf16-sr", param_index=[0, 1])
