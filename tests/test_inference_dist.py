"""quantize_model's calibration on data-parallel ranks (lowprec.inference._sync), in real torchrun processes.

Oracle: one process calibrating on all the ranks' batches in rank order (``distributed_sync=False``, no process
group).  The ``exact`` model's layers read dyadic inputs, so every float64 sum (Gram matrix, ``sum |x|``) is exact
and every algorithm must match it bit for bit; the zoo GPT's max / mse scales must too (MAX and a rank-order
gather are exact); its GPTQ weights matched bit for bit here as well, though in general a rank-grouped float64 sum
may round differently.  Every rank must hold the same bits.  ``distributed_sync=False`` shows the oracle can fail:
each rank's own shard gives other scales.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from lowprec import UsageError
from lowprec import inference as inf
from lowprec.testing import torchrun

pytestmark = pytest.mark.slow  # make test-slow: real torchrun process groups

WORKER = Path(__file__).with_name("_dist_inference_worker.py")


def _worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_dist_inference_worker", WORKER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = _worker()


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("dist_inference")
    torchrun(WORKER, str(d), nproc=2, timeout=300)
    return d


def _ranks(out: Path, case: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return load_file(str(out / f"{case}.rank0.safetensors")), load_file(str(out / f"{case}.rank1.safetensors"))


def _single(kind: str, preset: str, data: list[torch.Tensor], **kw: object) -> dict[str, torch.Tensor]:
    model = W.build(kind)
    inf.quantize_model(model, inf.get(preset), data, distributed_sync=False, **kw)
    return W.state(model)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("case", sorted(W.CASES))
def test_ranks_equal_one_process_on_all_shards(out: Path, case: str) -> None:
    kind, preset, algorithm, kw = W.CASES[case]
    r0, r1 = _ranks(out, case)
    _assert_equal(r0, r1)
    oracle = _single(kind, preset, W.batches(kind), algorithm=algorithm, **kw)
    _assert_equal(r0, oracle)
    if algorithm in ("max", "percentile", "mse") or "static" in case:
        assert any(k.endswith(("input_scale", "input_global_scale")) for k in r0)
    if algorithm in ("smoothquant",) or case == "exact-awq-static":
        assert any(k.endswith("smooth") for k in r0)


def test_an_empty_shard_contributes_nothing(out: Path) -> None:
    r0, r1 = _ranks(out, "empty-shard")
    _assert_equal(r0, r1)
    _assert_equal(r0, _single("exact", "fp8-static", W.batches("exact")[:2]))


def test_without_sync_each_rank_calibrates_alone(out: Path) -> None:
    r0, r1 = _ranks(out, "local")
    _assert_equal(r0, _single("exact", "fp8-static", W.batches("exact")[:2]))
    _assert_equal(r1, _single("exact", "fp8-static", W.batches("exact")[2:]))
    assert not torch.equal(r0["a.input_scale"], r1["a.input_scale"])  # the shards differ: syncing matters


def test_errors_reach_every_rank(out: Path) -> None:
    e0, e1 = (json.loads((out / f"errors.rank{r}.json").read_text()) for r in range(2))
    assert "layer 'a' expects inputs [..., 128]" in e1["bad-batch"] and "got [2, 64]" in e1["bad-batch"]
    assert "calibration failed on rank(s) [1]" in e0["bad-batch"]
    for e in (e0, e1):
        assert "ranks disagree on the model, scheme and algorithm (rank(s) [1] differ from rank 0)" in e["disagree"]
        assert "calibration_data is empty" in e["all-empty"] and "on at least one rank" in e["all-empty"]


def test_sync_arguments_are_checked() -> None:
    model = W.build("exact")
    with pytest.raises(UsageError, match="distributed_sync must be True or False"):
        inf.quantize_model(model, inf.get("fp8-static"), W.batches("exact"), distributed_sync="yes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="torch.distributed is not initialized"):
        inf.quantize_model(model, inf.get("fp8-static"), W.batches("exact"), process_group=object())
    with pytest.raises(UsageError, match="process_group is given but distributed_sync=False"):
        inf.quantize_model(model, inf.get("fp8-static"), W.batches("exact"), distributed_sync=False,
                           process_group=object())
