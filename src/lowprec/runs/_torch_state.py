"""The PyTorch state of one run, and its checkpoints: saving it and resuming from it.

``State`` is what the runner trains: the (wrapped) model, the ``LowPrecisionOptimizer`` (with the recipe's
loss-scaler, Kahan and step state), the step, the fallback controller and the statistics observer.  Training
batches are a pure function of (seed, step), so a checkpoint holds only the model, the optimizer, the CPU random
state and the fallback decisions, and resuming gives the same curve, bit for bit, as an uninterrupted run.

- ``save_state``: single process and DDP write the full state (rank 0, one checksummed file,
  ``_checkpoint.save_checkpoint``); FSDP2/HSDP (``SHARDED``) write every rank's shards with
  torch.distributed.checkpoint (``_dcp``).  Rank 0 records each checkpoint's digest in the store (``_resume``).
- ``restore_state``: continue a stored run where ``_resume.choose`` says, trying each candidate file checkpoint
  by loading it into this process's model and optimizer, and reopen the run in the store from that step.

Either kind of checkpoint resumes on any world size and layout.  Tensor- and pipeline-parallel runs (``parallel.tp``
/ ``pp``) write the file kind with the full state gathered (``_tp_full_state``; ``_pp_runner.full_optimizer_state``)
in a single process's format, so they resume on one process and one process's checkpoints resume in them;
torch.distributed.checkpoint cannot save the fused qkv's ``_StridedShard`` placement (torch 2.13).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch

from .._errors import UsageError
from ..optim import LowPrecisionOptimizer
from ._checkpoint import checkpoint_digest, checkpoint_dir, load_checkpoint, save_checkpoint
from ._lifecycle import ResolvedConfig, RunLifecycle, warn_resume
from ._parallel import World, Wrapped, unwrap
from ._replay import Snapshot
from ._resume import Candidate, ResumePoint, choose, record_checkpoint
from ._store import RunRecord, RunStore

SHARDED = ("fsdp2", "hsdp")
"""Layouts whose checkpoints are sharded (torch.distributed.checkpoint)."""


@dataclasses.dataclass
class State:
    """One run's PyTorch training state: what a step changes, and what a checkpoint saves and restores."""

    model: torch.nn.Module
    """The module as trained (DistributedDataParallel under "ddp", fully sharded under "fsdp2")."""
    optimizer: LowPrecisionOptimizer
    world: World
    wrapped: Wrapped
    step: int = 0
    observer: Any = None
    """``lowprec.numerics.StatsObserver`` on rank 0 when ``config.stats.every`` is set."""
    snapshot: Snapshot = dataclasses.field(default_factory=lambda: Snapshot())
    """The start of the current step, for replaying it."""
    fallback: Any = None
    """``lowprec.numerics.FallbackController`` when the recipe has a ``fallback`` policy (on every rank: rank 0
    decides from its statistics and every replica applies the decision)."""
    sample_every: int = 0
    """The statistics' sampling interval (steps ``s`` with ``s % sample_every == 0`` are sampled; 0: off)."""
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    """Where the model and every batch live (``world_device``)."""
    guard: Any = None
    """``_reliable.Guard``: injected faults, the spike detector, the skip ledger and the checks."""
    pipeline: Any = None
    """``lowprec.distributed.Pipeline`` under ``parallel.pp`` > 1 (``_pp_runner``): this rank's stage."""


def _collective(world: World) -> bool:
    """Whether saving or loading the state takes every rank (sharded, tensor- or pipeline-parallel layouts), so
    rank 0 cannot try a checkpoint on its own."""
    return world.strategy in SHARDED or world.tp > 1 or world.pp > 1


def _tp_full_state(st: State) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: the full (unsharded) state of a tensor-parallel model (FSDP2- or HSDP-sharded as well), in a
    single process's format (the inner optimizer's state keyed by parameter index, as
    ``torch.optim.Optimizer.state_dict`` keys it); ``lowprec.distributed.full_model_state`` gathers each DTensor
    per mesh dimension, which ``full_tensor()`` gets wrong for FSDP2 over the fused qkv (torch 2.13)."""
    from ..distributed import full_model_state, full_optimizer_state

    model = unwrap(st.model)
    return full_model_state(model), {**st.optimizer.state_dict(), "optimizer": full_optimizer_state(
        st.optimizer.optimizer)}


def _tp_load_full_state(st: State, model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> None:
    """Load a full state (any layout's) into a tensor-parallel model: each DTensor parameter and its optimizer
    state take this rank's piece (no communication).  The optimizer's ``foreach`` stays this layout's (DTensor
    parameters take the per-parameter loop)."""
    from ..distributed import load_full_model_state, load_full_optimizer_state

    load_full_model_state(unwrap(st.model), model_sd)
    inner = st.optimizer.optimizer
    native = opt_sd["optimizer"]
    groups = [{**g, "foreach": own.get("foreach")} for g, own in zip(native["param_groups"], inner.param_groups,
                                                                      strict=True)]
    load_full_optimizer_state(inner, {**native, "param_groups": groups})
    st.optimizer.load_state_dict({**opt_sd, "optimizer": None})


def _full_state(st: State) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state of an unsharded layout (single process or DDP replicas), or the full state of a
    tensor- or pipeline-parallel one (collective), in a single process's format."""
    if st.pipeline is not None:  # TP inside the stages too
        from ._pp_runner import pp_full_state

        return pp_full_state(st)
    if st.world.tp > 1:
        return _tp_full_state(st)
    return unwrap(st.model).state_dict(), st.optimizer.state_dict()


def _load_full_state(st: State, model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> None:
    """Load a full (unsharded) model and optimizer state into ``st``, whatever its layout."""
    if st.pipeline is not None:  # every rank holds the whole model object; its optimizer, one stage's part
        from ._pp_runner import pp_load_full_state

        pp_load_full_state(st, model_sd, opt_sd)
        return
    if st.world.tp > 1:
        _tp_load_full_state(st, model_sd, opt_sd)
        return
    if st.world.strategy not in SHARDED:
        unwrap(st.model).load_state_dict(model_sd)
        st.optimizer.load_state_dict(opt_sd)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True)
    set_model_state_dict(st.model, model_sd, options=o)
    set_optimizer_state_dict(st.model, st.optimizer.optimizer, opt_sd["optimizer"], options=o)
    st.optimizer.load_state_dict({**opt_sd, "optimizer": None})


def save_state(r: ResolvedConfig, run_id: str, st: State, store: RunStore) -> None:
    """Single/DDP: rank 0 saves the full state (replicas are identical) in one checksummed file.  FSDP2/HSDP: every
    rank saves its shards with torch.distributed.checkpoint.  Either kind resumes on any world size and layout.
    The files go next to the store that holds the run, and rank 0 records each one's digest in it (``_resume``)."""
    directory = checkpoint_dir(store, run_id)
    extra = {"run_id": run_id, "step": st.step, "torch_rng": torch.get_rng_state(), "config": r.config.to_dict(),
             "world_size": st.world.size, "fallback": st.fallback.state_dict() if st.fallback is not None else None}
    if st.world.strategy in SHARDED and st.world.tp == 1:  # TP: DCP cannot save a fused qkv (docs/runs.md)
        from ._dcp import manifest_digest, save_sharded

        path = save_sharded(directory, st.step, st.model, st.optimizer, extra, keep=r.checkpoint_keep,
                            is_main=st.world.is_main)
        if st.world.is_main:
            record_checkpoint(store, run_id, st.step, "sharded", manifest_digest(path))
        return
    model_sd, opt_sd = _full_state(st)
    if st.world.is_main:
        path = save_checkpoint(directory, st.step, {**extra, "model": model_sd, "optimizer": opt_sd},
                               keep=r.checkpoint_keep)
        record_checkpoint(store, run_id, st.step, "file", checkpoint_digest(path))


_STATE_KEYS = ("run_id", "step", "torch_rng", "model", "optimizer")
"""What a file checkpoint must hold for the runner to load it."""


def _check_file_state(state: dict[str, Any], c: Candidate, run_id: str) -> None:
    """``ValueError`` unless ``state`` (a verified file checkpoint) is a PyTorch checkpoint of step ``c.step`` of
    ``run_id`` with every part the runner loads."""
    where = f"checkpoint {str(c.path)!r}"
    if state.get("framework", "torch") != "torch":
        raise UsageError(f"{where} was written by a framework = {state.get('framework')!r} run; resume it with that "
                         f"framework (lowprec run --resume {run_id} picks the run's own)")
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise UsageError(f"{where} is not a lowprec training checkpoint (it has no {', '.join(missing)})")
    if state["run_id"] != run_id:
        raise UsageError(f"{where} belongs to run {state['run_id']!r}, not {run_id!r}")
    if state["step"] != c.step:
        raise UsageError(f"{where} holds step {state['step']!r}, not the step {c.step} its name says")


def _load_file_state(st: State, state: dict[str, Any]) -> None:
    """Load a verified file checkpoint (fallback decisions, model, optimizer, CPU random state) into ``st``."""
    if st.fallback is not None:  # swap the fallen-back layers first: their buffers are in the state dict
        st.fallback.load_state_dict(state.get("fallback") or {})
    _load_full_state(st, state["model"], state["optimizer"])
    torch.set_rng_state(state["torch_rng"])


def _pick(st: State, store: RunStore, record: RunRecord, directory: Path, *,
          allow_restart: bool) -> ResumePoint:
    """Rank 0: where the run continues.  Outside FSDP2/HSDP a file checkpoint is tried by loading it into this
    process's model and optimizer (a file whose checksum verifies but whose state does not fit is skipped like a
    corrupted one); when every candidate fails, the initial state is put back."""
    from ._dcp import verify

    trial = not _collective(st.world)
    initial: tuple[dict[str, Any], dict[str, Any], Any] | None = None

    def usable(c: Candidate) -> Any:
        nonlocal initial
        if c.kind == "sharded":
            verify(c.path)
            return None
        state = load_checkpoint(c.path)
        _check_file_state(state, c, record.run_id)
        if trial:
            if initial is None:
                model_sd, opt_sd = _full_state(st)
                initial = (copy.deepcopy(model_sd), copy.deepcopy(opt_sd), torch.get_rng_state())
            try:
                _load_file_state(st, state)
            except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
                raise UsageError(f"checkpoint {str(c.path)!r} verifies but does not fit this run's model and "
                                 f"optimizer: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        return state

    point = choose(store, record, directory, usable, allow_restart=allow_restart)
    if point.candidate is None and initial is not None:
        _load_full_state(st, initial[0], initial[1])
        torch.set_rng_state(initial[2])
    return point


def restore_state(life: RunLifecycle, run_id: str, st: State, *, allow_restart: bool) -> None:
    """Continue ``run_id`` where ``_resume.choose`` says (rank 0 decides; every rank loads), reopen it in the
    store from that step and record a "resumed" event."""
    from ._dcp import load_sharded

    store = life.store
    directory = checkpoint_dir(store, run_id)
    picked: Any = None
    loaded: Any = None
    if st.world.is_main:
        try:
            point = _pick(st, store, store.get_run(run_id), directory, allow_restart=allow_restart)
            c, loaded = point.candidate, point.loaded
            picked = (point.step, c.kind if c else "none", c.path if c else None, point.problems, point.discarded)
        except ValueError as e:
            picked = str(e)
    picked = st.world.broadcast(picked)
    if isinstance(picked, str):  # every rank raises the same error
        raise UsageError(picked)
    step, kind, path, problems, discarded = picked
    if st.world.is_main:
        warn_resume(run_id, problems, discarded)
    state: dict[str, Any] | None = None
    if kind == "file":
        if st.world.is_main and not _collective(st.world):
            state = loaded  # loaded into this process's model and optimizer by _pick
        else:
            state = load_checkpoint(path)
            _load_file_state(st, state)
    elif kind == "sharded":
        state = load_sharded(path, st.model if st.world.strategy in SHARDED else unwrap(st.model), st.optimizer)
        if state.get("run_id") != run_id:
            raise UsageError(f"checkpoint of step {step} belongs to run {state.get('run_id')!r}, not {run_id!r}")
        torch.set_rng_state(state["torch_rng"])
    if state is not None:
        st.step = int(state["step"])
    if st.world.is_main:
        life.resumed(run_id, st.step, world_size=st.world.size, checkpoint_world_size=(state or {}).get("world_size"),
                     checkpoint=kind, skipped=list(problems), discarded_steps=discarded)
