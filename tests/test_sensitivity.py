"""Layer sensitivity (``lowprec.numerics._sensitivity``) and the ``lowprec sensitivity`` command.

Oracles: an independent hand computation of the quantized forward pass (``lowprec.quant.fake_quantize`` on the
layer's input and weight, ``torch.nn.functional.linear``, the SQNR and loss written out in float64); literal
expected groupings; the run store read back directly; a second, in-process library call on the stored run's model
for the CLI's printed numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec import QuantSpec
from lowprec.cli import main
from lowprec.nn import EmulatedLinear
from lowprec.numerics._sensitivity import (
    group_layers,
    layer_sensitivity,
    linear_names,
    resolve_candidate,
    sensitivity_table,
)
from lowprec.quant import fake_quantize
from lowprec.runs._store import RunStore


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _mlp() -> tuple[nn.Sequential, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    batches = [(torch.randn(16, 32, generator=g) * 3, torch.randint(0, 10, (16,), generator=g)) for _ in range(3)]
    return model, batches


def _by_hand(model: nn.Sequential, x: torch.Tensor, quantized: set[int], spec: str | QuantSpec) -> torch.Tensor:
    """The forward pass written out: layers in ``quantized`` use Q(input) @ Q(weight)^T + bias."""
    h = x
    for i, m in enumerate(model):
        if isinstance(m, nn.Linear) and i in quantized:
            h = F.linear(fake_quantize(h, spec), fake_quantize(m.weight.detach(), spec), m.bias.detach())
        else:
            h = m(h)
    return h


def _hand_sqnr_and_loss(model: nn.Sequential, batches: list, quantized: set[int],
                        spec: str | QuantSpec) -> tuple[float, float]:
    signal = noise = 0.0
    losses = []
    with torch.no_grad():
        for x, y in batches:
            ref = model(x).double()
            got = _by_hand(model, x, quantized, spec)
            signal += float((ref**2).sum())
            noise += float(((ref - got.double()) ** 2).sum())
            losses.append(float(F.cross_entropy(got, y)) - float(F.cross_entropy(model(x), y)))
    return 10 * math.log10(signal / noise), sum(losses) / len(losses)


HAND_SPECS = {"mxfp4": "mxfp4", "nvfp4": "nvfp4", "bf16": QuantSpec(elem="bfloat16", scaling="none", saturate=False)}


@pytest.mark.parametrize("spec", list(HAND_SPECS))
def test_each_layer_matches_a_hand_quantized_forward_pass(spec: str) -> None:
    """Oracle: fake_quantize of the layer's input and weight + F.linear, SQNR and loss delta in float64 by hand."""
    model, batches = _mlp()
    rows = layer_sensitivity(model, batches, F.cross_entropy, spec)
    assert sorted(r.name for r in rows) == ["0", "2", "4"]
    assert [r.sqnr_db for r in rows] == sorted(r.sqnr_db for r in rows)  # most sensitive first
    label = resolve_candidate(spec)[0]
    for r in rows:
        sqnr, delta = _hand_sqnr_and_loss(model, batches, {int(r.name)}, HAND_SPECS[spec])
        assert r.spec == label and r.modules == (r.name,)
        assert r.sqnr_db == pytest.approx(sqnr, abs=1e-3), r
        assert r.loss_delta == pytest.approx(delta, abs=1e-5), r
        assert r.params == model[int(r.name)].weight.numel()


def test_a_group_is_quantized_together_and_the_model_is_left_alone() -> None:
    """Oracle: the hand computation with both layers of the group quantized; the state dict before and after."""
    model, batches = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = sensitivity_table(model, batches, F.cross_entropy, ["mxfp4", "mxfp6_e2m3"],
                              groups={"hidden": ["0", "2"], "out": ["4"]})
    assert [(r.name, r.spec) for r in table] == [("hidden", "mxfp4"), ("hidden", "mxfp6_e2m3"),
                                                  ("out", "mxfp4"), ("out", "mxfp6_e2m3")]
    sqnr, _ = _hand_sqnr_and_loss(model, batches, {0, 2}, "mxfp4")
    assert table[0].sqnr_db == pytest.approx(sqnr, abs=1e-3)
    assert table[0].shapes == ((64, 32), (32, 64)) and table[0].params == 64 * 32 * 2
    assert not any(isinstance(m, EmulatedLinear) for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_block_size_variants_of_named_block_specs() -> None:
    """Oracle: the QuantSpec written out field by field (OCP MX layout with another block size) and the bits per
    element counted by hand (4 + 8/64, 4 + 8/128; NVFP4 with blocks of 32: 4 + 8/32 + 32/(32*32))."""
    from lowprec.numerics._autoprecision import bits_per_element

    label, spec = resolve_candidate("mxfp4/b64")
    assert label == "mxfp4/b64" and spec == QuantSpec(elem="float4_e2m1fn", scaling="block", block_size=64,
                                                       scale_format="float8_e8m0fnu", scale_rounding="floor")
    assert resolve_candidate("mxfp4/b32") == ("mxfp4", QuantSpec.named("mxfp4"))
    assert bits_per_element("mxfp4/b64", (128, 128)) == 4 + 8 / 64
    assert bits_per_element("mxfp4/b128", (128, 128)) == 4 + 8 / 128
    assert bits_per_element("nvfp4/b32", (32, 32)) == 4 + 8 / 32 + 32 / 1024
    for bad in ("mxfp4/b0", "mxfp4/bx", "fp8_e4m3_tensorwise/b64"):
        with pytest.raises(ValueError, match="block size after '/b'|unknown spec"):
            resolve_candidate(bad)


def test_grouping_by_name_prefix() -> None:
    """Oracle: the expected groupings written out."""
    names = ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.attn.qkv", "lm_head"]
    assert group_layers(names, "block") == {"blocks.0": ("blocks.0.attn.qkv", "blocks.0.mlp.fc"),
                                            "blocks.1": ("blocks.1.attn.qkv",), "lm_head": ("lm_head",)}
    assert group_layers(names, 3) == {"blocks.0.attn": ("blocks.0.attn.qkv",), "blocks.0.mlp": ("blocks.0.mlp.fc",),
                                      "blocks.1.attn": ("blocks.1.attn.qkv",), "lm_head": ("lm_head",)}
    assert list(group_layers(names)) == names
    assert linear_names(_mlp()[0]) == ["0", "2", "4"]


def test_bad_inputs_name_the_field_and_the_fix() -> None:
    """Oracle: the messages promised by the docstrings."""
    model, batches = _mlp()
    with pytest.raises(ValueError, match="unknown spec 'mxfp3'.*mxfp4"):
        layer_sensitivity(model, batches, F.cross_entropy, "mxfp3")
    with pytest.raises(ValueError, match="group_by must be one of layer, block"):
        group_layers(["a"], "row")
    with pytest.raises(ValueError, match=r"groups\['g'\] must name nn.Linear modules.*bad: \['1'\]"):
        layer_sensitivity(model, batches, F.cross_entropy, "mxfp4", groups={"g": ["1"]})
    with pytest.raises(ValueError, match="batches must hold at least one"):
        layer_sensitivity(model, [], F.cross_entropy, "mxfp4")
    import lowprec

    lowprec.convert(model, "mxfp8")
    with pytest.raises(ValueError, match="model is converted.*unconvert"):
        layer_sensitivity(model, batches, F.cross_entropy, "mxfp4")


# ================================================================================================ CLI
def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "mlp.toml"
    cfg.write_text(f'model = "mlp-digits"\nseed = 0\nsteps = 6\nbatch_size = 16\nthreads = 1\n'
                   f'store = "{tmp_path / "runs.db"}"\n[model_options]\nhidden = 32\n', encoding="utf-8")
    return cfg


def test_cli_prints_a_ranked_table_and_stores_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the stored event read back, and layer_sensitivity on the stored run's model with the same batches."""
    from lowprec.runs._trained import eval_batches, load_trained

    assert main(["sensitivity", str(_config(tmp_path)), "--spec", "mxfp4", "--batches", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "most sensitive first" in out and "stored as event 'sensitivity'" in out
    with RunStore(tmp_path / "runs.db") as store:
        (run,) = store.list_runs(group="calibration/mlp-digits")
        (event,) = store.events(run.run_id, kind="sensitivity")
        cal = load_trained(store, run.run_id)
    rows = event["payload"]["rows"]
    assert event["step"] == 6 and [r["name"] for r in rows] == [ln.split()[1] for ln in out.splitlines()[2:5]]
    again = layer_sensitivity(cal.model, eval_batches(cal, 2), cal.task.loss_fn, "mxfp4")
    assert [r.to_dict() for r in again] == rows
    for line, r in zip(out.splitlines()[2:5], again, strict=True):
        assert f"{r.sqnr_db:.2f}" in line.split()
    assert main(["sensitivity", "--run", run.run_id, "--spec", "mxfp4", "--batches", "2", "--json",
                 "--store", str(tmp_path / "runs.db")]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == rows


def test_cli_probe_ranks_by_the_training_loss_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle: the probe runs' final eval losses read back from the run store (one float32 run, one run per layer
    with only that layer's recipe overridden); the printed order is by their difference, largest first."""
    from lowprec.recipes import Recipe

    assert main(["sensitivity", str(_config(tmp_path)), "--spec", "mxfp4", "--batches", "2", "--quiet",
                 "--metric", "probe", "--probe-steps", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    with RunStore(tmp_path / "runs.db") as store:
        final = {}
        for r in store.list_runs(group="probe/mlp-digits"):
            rec = Recipe.from_dict(r.config["recipe"])
            assert r.config["steps"] == 3 and int(r.manifest["seed"]) == 0
            final[rec.name] = (float(store.scalars(r.run_id)["eval/loss"][1][-1]),
                               sorted(p for p, _ in rec.overrides))
    deltas = {f"probe {n} mxfp4": final[f"probe {n} mxfp4"][0] - final["fp32"][0]
              for n in ("layers.0", "layers.1", "head")}
    assert {k: v[1] for k, v in final.items()} == {"fp32": [], "probe layers.0 mxfp4": ["layers.0"],
                                                   "probe layers.1 mxfp4": ["layers.1"],
                                                   "probe head mxfp4": ["head"]}
    expected = sorted(deltas, key=lambda k: -deltas[k])
    assert "probe delta" in out[1]
    assert [f"probe {ln.split()[1]} mxfp4" for ln in out[2:5]] == expected
    for line, key in zip(out[2:5], expected, strict=True):
        assert line.split()[-1] == f"{deltas[key]:+.3g}"


@pytest.mark.parametrize(("flags", "message"), [
    (["--spec", "mxfp3"], "unknown spec 'mxfp3'"),
    (["--spec", "mxfp4", "--batches", "0"], "--batches must be >= 1"),
    (["--spec", "mxfp4", "--calib-steps", "0"], "--calib-steps must be >= 1"),
    (["--spec", "mxfp4", "--group-by", "rows"], "--group-by: group_by must be one of layer, block"),
    (["--spec", "mxfp4", "--metric", "probe", "--probe-steps", "0"], "--probe-steps must be >= 1"),
    (["--spec", "mxfp4", "--metric", "probe", "--probe-seeds", "0"], "--probe-seeds must be >= 1"),
])
def test_cli_bad_flags_exit_2_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              flags: list[str], message: str) -> None:
    """Oracle: exit status 2, the message on stderr without a traceback, and no run in the store."""
    assert main(["sensitivity", str(_config(tmp_path)), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowprec: error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "runs.db").exists()


def test_dict_batches_and_dict_outputs_are_analysed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face style task (examples/own_task: dict batches, a model returning {"logits", "loss"}) is ranked by
    ``lowprec sensitivity``.  Oracle: the same trained model driven through tuple batches and a plain logits
    function gives the same rows (the dict path feeds model(**batch) and compares the logits)."""
    from lowprec.runs._trained import eval_batches, load_trained

    example = Path(__file__).resolve().parents[1] / "examples" / "own_task" / "run.toml"
    cfg = tmp_path / "run.toml"
    cfg.write_text(example.read_text().replace('store = "lowprec-runs/runs.db"', f'store = "{tmp_path / "r.db"}"'))
    (tmp_path / "mytask.py").write_text((example.parent / "mytask.py").read_text())
    assert main(["sensitivity", str(cfg), "--spec", "mxfp4", "--batches", "2", "--calib-steps", "5", "--quiet",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted(r["name"] for r in rows) == ["fc", "head"]
    with RunStore(tmp_path / "r.db") as store:
        (run,) = store.list_runs(group="calibration/mytask:make")
        cal = load_trained(store, run.run_id)

    class Logits(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.fc, self.head, self.embed = inner.fc, inner.head, inner.embed

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(F.relu(self.fc(self.embed(ids).mean(1))))

    tuples = [(b["input_ids"], b["labels"]) for b in eval_batches(cal, 2)]
    again = layer_sensitivity(Logits(cal.model), tuples, F.cross_entropy, "mxfp4")
    assert [r.to_dict() for r in again] == rows
