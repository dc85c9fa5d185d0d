"""The reliability guard's replica groups under tensor and pipeline parallelism.

The guard compares the digests of reduced gradients (every ``grad_check_every`` steps) and of weights (every
``checksum_every``) across ranks that must hold the same values.  Under TP or PP only the data-parallel replicas
of one (stage, shard, TP rank) position do: TP peers hold other shards, pipeline stages other parameters.  Before
``layout_replicas`` a TP=2 run under ``strategy = "ddp"`` compared its two TP ranks at step 100 and stopped as
"gradients disagree: persistent" (found by benchmarks/judge_layouts.py's 300-step runs; the tests' runs were
shorter than the check interval).

Oracles: the groups against numpy's view of the row-major mesh (``init_device_mesh``'s rank order) with the
``dp_replicate`` axis last, and against ``Layout.coords``; and real torchrun runs past step 100 (slow).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from lowprec.cli import main
from lowprec.reliability._config import DEFAULT_CHECK_EVERY
from lowprec.runs._mesh import Layout
from lowprec.runs._reliable import layout_replicas
from lowprec.runs._store import RunStore

TESTS = Path(__file__).parent


@pytest.mark.parametrize("shape", [s for s in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (1, 2, 4))
                                   if np.prod(s) > 1])
def test_groups_are_the_replicate_axis_of_the_mesh(shape: tuple[int, int, int, int]) -> None:
    want = np.arange(int(np.prod(shape))).reshape(shape).transpose(0, 2, 3, 1).reshape(-1, shape[1])
    got = layout_replicas(shape)
    if shape[1] == 1:
        assert got == []
        return
    assert got == want.tolist()
    lay = Layout(pp=shape[0], dp_replicate=shape[1], dp_shard=shape[2], tp=shape[3])
    for g in got:  # one position, every replica index once
        coords = [lay.coords(r) for r in g]
        assert {c["dp_replicate"] for c in coords} == set(range(shape[1]))
        assert len({(c["pp"], c["dp_shard"], c["tp"]) for c in coords}) == 1


RUN = """model = "gpt-bytes"
recipe = "fp8-tensorwise"
steps = {steps}
batch_size = 8
eval_interval = {steps}
threads = 1
group = "{group}"
model_options = {{ layers = 1, d_model = 32, heads = 2, context = 8 }}

[parallel]
strategy = "ddp"
world_size = {world}
tp = 2
"""


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_runs_pass_the_replica_checks_at_their_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          world: int) -> None:
    """TP=2 (no replicas: nothing to compare) and DDP2 x TP2 (replicas [0, 2] and [1, 3] compared) past the
    default check interval: both complete, every step recorded once."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    steps = DEFAULT_CHECK_EVERY + 2
    path = tmp_path / "run.toml"
    path.write_text(RUN.format(steps=steps, group="g", world=world))
    store = tmp_path / "runs.db"
    assert main(["run", str(path), "--store", str(store)]) == 0
    with RunStore(store) as s:
        (rec,) = s.list_runs(group="g")
        assert rec.status == "completed", rec.error
        got, _ = s.scalars(rec.run_id)["train/loss"]
        assert np.array_equal(got, np.arange(1, steps + 1))
