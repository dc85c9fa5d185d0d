"""Where a resumed run continues, and what it may load: the rules both runners (PyTorch and JAX) follow.

A checkpoint is trusted only as far as the run store vouches for it.  Each time a run writes a checkpoint, the
runner records a ``checkpoint`` event with its step, kind and digest (the payload's SHA-256 for a file, the
SHA-256 of ``MANIFEST.json`` for a sharded directory, whose manifest holds every file's SHA-256).  On resume:

1. The run must be resumable: not ``completed`` (a finished run is a result: start a new one), and not still
   running in a live process on this host (``check_resumable``).
2. The candidates are the checkpoint files and sharded directories in ``checkpoints/<run id>/`` in the folder of
   the store file that holds the run (never where the working directory or the run's saved config points), newest
   first.  A candidate is skipped, with the reason printed, when

   * its step is beyond the steps the store holds without a gap (``recorded_steps``): resuming there would leave
     the steps in between missing, e.g. after a power loss rolled back the store's last commits, or after a backup
     was taken without ``runs.db-wal``;
   * the run was started by a lowprec that records its checkpoints (manifest key ``checkpoint_records``) and the
     store has no record of this checkpoint with this digest: lowprec did not write it for this run (a planted or
     copied file, or one written just before a crash, before its record was committed);
   * it does not verify (header, checksum, manifest) or cannot be loaded into the run's model and optimizer.
3. The newest candidate that survives is used, and the store's records after its step are deleted (the resumed
   run recomputes them, bit for bit).  When none survives and the store holds recorded steps, continuing would
   start over from step 0 and delete them: that needs ``allow_restart`` (``lowprec run --resume ID
   --allow-restart``).  A run that recorded no step starts from 0 without asking; nothing is lost.

Partial files of an interrupted checkpoint write (``clean_partial``) are removed when a run is resumed.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .._errors import UsageError
from ._checkpoint import checkpoint_digest, clean_partial, list_checkpoints
from ._store import RunRecord, RunStore

RECORDS_KEY = "checkpoint_records"
"""Manifest key: true for runs whose checkpoints are recorded in the store (all runs started by this lowprec);
only recorded checkpoints of such a run are loaded."""

EVENT = "checkpoint"
"""Event kind of a checkpoint record: payload ``{"kind": "file" | "sharded", "sha256": hex}`` at its step."""

Kind = Literal["file", "sharded"]


@dataclass(frozen=True)
class Candidate:
    """A checkpoint found in a run's checkpoint folder."""

    step: int
    kind: Kind
    path: Path

    def digest(self) -> str:
        """What the store records for it (``ValueError`` when the file or manifest cannot be read)."""
        if self.kind == "file":
            return checkpoint_digest(self.path)
        from ._dcp import manifest_digest

        return manifest_digest(self.path)


@dataclass
class ResumePoint:
    """Where a resumed run continues: ``step`` (0: from the start), the checkpoint used and what ``usable``
    returned for it, the candidates skipped and why, and how many recorded steps starting over discards."""

    step: int
    candidate: Candidate | None
    loaded: Any = None
    problems: list[str] = field(default_factory=list)
    discarded: int = 0


def check_resumable(record: RunRecord) -> None:
    """``ValueError`` when ``record`` must not be resumed: it completed, or a live process on this host still
    writes it (the store's dead-process rule already shows a run whose process died as failed)."""
    if record.status in ("completed", "diverged"):  # a diverged run is a result too
        raise UsageError(f"run {record.run_id} ({record.name}) is {record.status}: there is nothing to resume, and "
                         "resuming would change a finished result; start a new run with lowprec run CONFIG")
    if record.status == "running" and record.hostname == socket.gethostname():
        raise UsageError(f"run {record.run_id} ({record.name}) is still running in process {record.pid} on this "
                         "host; stop that process (or wait for it) before resuming the run")


def recorded_steps(store: RunStore, run_id: str) -> int:
    """The largest ``k`` such that the store holds ``train/loss`` for every step ``1..k`` of the run."""
    steps = store.scalars(run_id).get("train/loss", (np.zeros(0, dtype=np.int64), None))[0]
    good = steps == np.arange(1, len(steps) + 1)
    return int(len(steps) if good.all() else np.argmin(good))


def record_checkpoint(store: RunStore, run_id: str, step: int, kind: Kind, digest: str) -> None:
    """Record that the run wrote checkpoint ``kind`` of ``step`` with ``digest`` (call after the write)."""
    store.add_event(run_id, step=step, kind=EVENT, payload={"kind": kind, "sha256": digest})


def candidates(directory: Path) -> list[Candidate]:
    """Every checkpoint in ``directory``, newest first."""
    from ._dcp import list_sharded

    found = [Candidate(s, "file", p) for s, p in list_checkpoints(directory)]
    found += [Candidate(s, "sharded", p) for s, p in list_sharded(directory)]
    return sorted(found, key=lambda c: (c.step, c.kind), reverse=True)


def choose(store: RunStore, record: RunRecord, directory: Path, usable: Callable[[Candidate], Any], *,
           allow_restart: bool, clean: bool = True) -> ResumePoint:
    """Pick where run ``record`` continues (the module docstring gives the rules).

    ``usable(candidate)`` verifies a candidate and returns what the runner needs of it (the loaded state);
    it raises ``ValueError`` saying why it cannot be used.  ``clean`` removes partial checkpoint files first: only
    for a run about to be resumed, never while another process may be writing its checkpoints."""
    run_id = record.run_id
    if clean:
        clean_partial(directory)
    held = recorded_steps(store, run_id)
    required = bool(record.manifest.get(RECORDS_KEY))
    recorded = {(e["payload"].get("kind"), e["step"], e["payload"].get("sha256"))
                for e in store.events(run_id, kind=EVENT)}
    problems: list[str] = []
    for c in candidates(directory):
        where = f"checkpoint {str(c.path)!r}"
        if c.step > held:
            problems.append(f"{where} is of step {c.step}, but the store holds the run's steps only up to {held} "
                            f"(it lost later records): resuming there would leave steps {held + 1}..{c.step} "
                            "missing")
            continue
        try:
            if required and (c.kind, c.step, c.digest()) not in recorded:
                problems.append(f"{where} was not written by run {run_id} (the store holds no record of it with "
                                "this digest): not loaded")
                continue
            return ResumePoint(step=c.step, candidate=c, loaded=usable(c), problems=problems)
        except ValueError as e:
            problems.append(str(e))
    if held and not allow_restart:
        found = f" ({'; '.join(problems)})" if problems else " (it has none)"
        raise UsageError(f"run {run_id} cannot be resumed: the store holds its steps 1..{held}, but "
                         f"{str(directory)!r} has no usable checkpoint at or before step {held}{found}. Continuing "
                         f"would start over from step 0 and delete the {held} recorded steps: pass --allow-restart "
                         "(allow_restart=True) to do that")
    return ResumePoint(step=0, candidate=None, problems=problems, discarded=held)
