"""Converted transformers models (tiny Llama and Mixtral, "fp8-tensorwise+attn": every projection, the Mixtral
experts and Q K^T / P V emulated) under DDP and FSDP2 (lowprec.distributed.shard_model), real torchrun, 2 gloo
ranks, 3 AdamW steps (tests/_dist_hf_worker.py); and the Mixtral ``hf-causal-lm`` task under the runner's DDP.

Oracles (each one process, on the same weights and batches):

* the full batch on every rank (``-dup``): DDP's and FSDP2's gradient average (g + g) / 2 is g exactly, so loss,
  every gradient and the updated parameters equal one process on the full batch bit for bit;
* the batch split in halves (``-split``): fp8-tensorwise scales each tensor by its own amax, so a rank's half
  batch is quantized on another fp8 grid than the full batch and the split run cannot equal the full-batch run.
  Its exact oracle is one process doing what the ranks do together: each half's forward and backward on its own,
  then the average g0 / 2 + g1 / 2 (DDP divides, then sums; FSDP2's reduce-scatter on 2 ranks does the same float
  operations): equal bit for bit.  Against the full batch it is within fp8 rounding: the distance is of the size of
  fp8-tensorwise's own distance from float32 (measured below), while the fp32 recipe split the same way differs
  only by the order of the float32 additions (``ddp_vs_single_loss_rel``).
* FSDP2 against DDP on the split batch: bit for bit (as in tests/test_dist_runner.py).

Attention under FSDP2 works: the "lowprec" attention implementation is set on the config before sharding, and
the FSDP2 runs report it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from lowprec.cli import main
from lowprec.runs._store import RunStore
from lowprec.testing import TOLERANCES, torchrun

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

TESTS = Path(__file__).parent
WORKER = TESTS / "_dist_hf_worker.py"
RECIPE = "fp8-tensorwise+attn"
FAMILIES = ("llama", "mixtral")
# fp8 split-batch vs full-batch, relative to fp8-tensorwise's own distance from float32 (both per-parameter
# relative Frobenius norms of the gradient, maximum over the parameters; loss: max relative difference over the 3
# steps).  Measured on the development machine (torch 2.13 CPU): gradient ratio 1.22 (llama) and 1.02 (mixtral)
# at step 1, up to 1.39 by step 3; loss ratio 1.03 (llama) and 0.49 (mixtral).  Both differences come from
# rounding to fp8 grids of different scales, so they are of one size; bound = 2x (a wrong gradient average or a
# rank training on the wrong rows moves the gradients by a multiple of their norm, ratio >> 2).
FP8_SPLIT_OVER_FP8_ERROR = 2.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("hf-dist")
    p = torchrun(WORKER, str(out), RECIPE, nproc=2, timeout=600)
    ranks = sorted(json.loads(f.read_text())["rank"] for f in out.glob("rank*.json"))
    assert ranks == [0, 1], p.stdout[-3000:] + p.stderr[-3000:]
    return {f.stem: torch.load(f) for f in out.glob("*.pt")}


def _equal(a: dict, b: dict) -> None:
    assert torch.equal(a["losses"], b["losses"]), (a["losses"], b["losses"])
    assert len(a["grads"]) == len(b["grads"]) == 3
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"], strict=True)):
        assert ga.keys() == gb.keys()
        for n in ga:
            assert torch.equal(ga[n], gb[n]), (step, n)
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n


def _grad_dist(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)


def _loss_rel(a: dict, b: dict) -> float:
    return float(((a["losses"] - b["losses"]).abs() / b["losses"].abs()).max())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["ddp-dup", "fsdp-dup"])
def test_full_batch_on_each_rank_equals_one_process(runs: dict, family: str, mode: str) -> None:
    got = runs[f"{family}-{mode}"]
    assert got["attn_implementation"] == "lowprec"
    _equal(got, runs[f"{family}-single"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["ddp-split", "fsdp-split"])
def test_split_batch_equals_one_process_accumulating_the_halves(runs: dict, family: str, mode: str) -> None:
    _equal(runs[f"{family}-{mode}"], runs[f"{family}-accumulated"])


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_equals_ddp_on_the_split_batch(runs: dict, family: str) -> None:
    _equal(runs[f"{family}-fsdp-split"], runs[f"{family}-ddp-split"])


@pytest.mark.parametrize("family", FAMILIES)
def test_split_batch_close_to_the_full_batch(runs: dict, family: str) -> None:
    """Against one process on the full batch: within fp8 rounding (see FP8_SPLIT_OVER_FP8_ERROR) for
    fp8-tensorwise; within the reduction-order tolerance for the fp32 recipe (so the split itself is right)."""
    split, single, fp32 = runs[f"{family}-ddp-split"], runs[f"{family}-single"], runs[f"{family}-single-fp32"]
    fp32_split = runs[f"{family}-ddp-split-fp32"]
    assert _loss_rel(fp32_split, fp32) <= TOLERANCES["ddp_vs_single_loss_rel"].value
    assert _grad_dist(fp32_split["grads"][0], fp32["grads"][0]) < 1e-5  # measured 1.5e-7
    assert 0 < _loss_rel(split, single) <= FP8_SPLIT_OVER_FP8_ERROR * _loss_rel(single, fp32)
    for step in range(3):
        d = _grad_dist(split["grads"][step], single["grads"][step])
        assert 0 < d <= FP8_SPLIT_OVER_FP8_ERROR * _grad_dist(single["grads"][step], fp32["grads"][step]), step


# ------------------------------------------------------------------------------------------ the runner, DDP x2
MIXTRAL_RUN = """model = "hf-causal-lm"
recipe = "fp8-tensorwise"
seeds = [0, 1, 2]
steps = 20
batch_size = 8
eval_interval = 20
threads = 1
group = "{group}"

[model_options]
family = "mixtral"
hidden = 64
layers = 2
heads = 4
context = 32
"""


def test_mixtral_task_ddp_runner_within_tolerance_of_one_process(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`lowprec run` of the Mixtral hf-causal-lm task, [parallel] ddp x 2, against the same config in one process:
    every step recorded, the curves within ``ddp_vs_single_hf_fp8_loss_rel`` (its source has the measurement) and
    not equal (the batch is really split)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    store = str(tmp_path / "runs.db")
    (tmp_path / "ddp.toml").write_text(MIXTRAL_RUN.format(group="ddp") + '\n[parallel]\nstrategy = "ddp"\n'
                                       "world_size = 2\n")
    (tmp_path / "one.toml").write_text(MIXTRAL_RUN.format(group="one"))
    assert main(["run", str(tmp_path / "ddp.toml"), "--store", store]) == 0
    assert main(["run", str(tmp_path / "one.toml"), "--store", store]) == 0
    rel = []
    with RunStore(store) as s:
        ddp = {r.manifest["seed"]: r for r in s.list_runs(group="ddp")}
        one = {r.manifest["seed"]: r for r in s.list_runs(group="one")}
        assert sorted(ddp) == sorted(one) == [0, 1, 2]
        for seed, rec in ddp.items():
            assert rec.status == "completed" and rec.manifest["world_size"] == 2
            steps, a = s.scalars(rec.run_id)["train/loss"]
            _, b = s.scalars(one[seed].run_id)["train/loss"]
            assert np.array_equal(steps, np.arange(1, 21))
            rel.append(float(np.max(np.abs(a - b) / np.abs(b))))
    assert 0 < max(rel) <= TOLERANCES["ddp_vs_single_hf_fp8_loss_rel"].value, rel
