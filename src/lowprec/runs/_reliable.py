"""The reliability side of the PyTorch training loop: ``[reliability]`` and ``[[faults]]`` (``lowprec.reliability``).

``Guard`` is consulted by ``_runner._train_step`` at three points of every step:

1. ``before_forward`` / ``after_backward``: the configured faults are injected (``FaultInjector``) and, with
   ``fingerprints``, every module's output digest is recorded;
2. ``check``: once the step's global loss and gradient norm are known, and before the optimizer step, the step is
   *rejected* when they are non-finite or the loss is a spike, or *examined* when a periodic check is due (the
   replicas' reduced-gradient digests every ``grad_check_every`` steps; a replay every ``replay_every``).  A
   rejected or examined step is run again in place, and, when the rerun reproduces it, once more with every rank
   computing its neighbour's batch shard; ``lowprec.reliability.diagnose`` gives the verdict (transient /
   persistent / reproducible) and the config's policy the action: continue (with the rerun's result for a
   transient fault), skip the update, roll back, stop, or stop as "diverged" (a reproducible non-finite step);
3. ``after_step``: every ``checksum_every`` steps the replicas' weight digests are compared (DDP: every rank;
   HSDP: the replicas of each shard, across the replicate dimension of the mesh).

Every rank takes every decision from the same gathered data, so the ranks never part ways in a collective.  Each
diagnosis is a "rerun" event (with the reason: "nonfinite", "spike", "gradients disagree", "sampled replay"), a
spike also a "spike" event, a rollback a "rollback" event and the batches it skips a "skip" event (the ledger);
weight mismatches are "sdc" events and injected faults "fault_injected" events.  The ledger kinds are kept when a
rollback or resume truncates the run (``_store.DURABLE_EVENTS``), and ``load`` reads them back on resume.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..reliability._diagnose import Computation, Diagnosis, diagnose, odd_in_groups, replica_groups
from ..reliability._digest import ModuleFingerprints, digests, local
from ..reliability._faults import FaultInjector
from ..reliability._ledger import SkipLedger
from ..reliability._spike import SpikeDetector
from ._lifecycle import ResolvedConfig, RunLifecycle
from ._parallel import unwrap
from ._replay import Snapshot

if TYPE_CHECKING:
    from ._torch_state import State

ForwardBackward = Callable[[int | None, bool], tuple[torch.Tensor, float]]
"""``fb(shard, rerun)``: the step's forward and backward on batch shard ``shard`` (None: this rank's) through the
trained (wrapped) model; ``rerun``: injected transient faults do not fire.  Returns (local loss, gradient norm)."""


@dataclasses.dataclass
class Outcome:
    """What ``check`` decided for the step."""

    action: str = "ok"
    """"ok" (apply the optimizer step), "skip" (no update), "rollback" (done: the state is the checkpoint's),
    "stop" (end the run, failed, ``reason``) or "diverge" (end it "diverged": a reproducible non-finite step)."""
    loss: float | None = None
    """The step's global loss when the rerun's result replaced the original's."""
    norm: float | None = None
    reason: str = ""


def layout_replicas(shape: tuple[int, int, int, int]) -> list[list[int]]:
    """The rank groups of a ``(pp, dp_replicate, dp_shard, tp)`` device mesh that hold the same local weights and
    reduced gradients: for each (stage p, shard s, TP rank t) the ``dp_replicate`` ranks ``((p * R + r) * S + s) *
    T + t``, r = 0 .. R-1 (the row-major rank order of ``init_device_mesh``).  None without replicas (R = 1): a TP
    group's ranks, or a pipeline's stages, hold different parameters and must not be compared."""
    pp, reps, shards, tp = shape
    if reps < 2:
        return []
    return [[((p * reps + r) * shards + s) * tp + t for r in range(reps)]
            for p in range(pp) for s in range(shards) for t in range(tp)]


class Guard:
    """One run's faults, spike detector, skip ledger and checks (module docstring)."""

    def __init__(self, r: ResolvedConfig, st: State) -> None:
        self.cfg = c = r.config.reliability
        self.interval = r.checkpoint_interval
        model = unwrap(st.model)
        self.params = [p for g in st.optimizer.param_groups for p in g["params"]]
        names = {id(p): n for n, p in model.named_parameters()}
        self.names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self.injector = FaultInjector(model, r.config.faults, rank=st.world.rank) if r.config.faults else None
        self.detector = None if c.spike == "off" else SpikeDetector(
            c.spike, factor=c.factor, window=c.spike_window, mad_k=c.spike_mad, samples=c.spike_samples)
        self.ledger = SkipLedger()
        self.fingerprints = ModuleFingerprints(model) if c.fingerprints else None
        if self.fingerprints is not None:
            self.fingerprints.enabled = False
        self.rollbacks = 0
        w = st.world
        self.replicas = ([] if not w.distributed else layout_replicas(w.layout.shape) if w.layout is not None
                         else replica_groups(w.strategy, w.size, w.mesh_shape))
        """Groups of ranks whose weights and reduced gradients must agree: DDP's every rank; HSDP's replicas of
        each shard; none under FSDP2; with tensor or pipeline parallelism only the data-parallel replicas of one
        (stage, shard, TP rank) position (``layout_replicas``: TP and PP peers hold other parameters)."""
        self._reported = 0
        self.unbucketed = w.distributed and w.strategy == "ddp" and w.size > 2
        """DDP rebuilds its gradient buckets once, after the first backward of the process: a rerun of that step
        all-reduces with other buckets, which with three or more ranks sums in another order (two operands
        commute), so its gradients are not compared bit for bit (its forward still is)."""

    # -- resume ---------------------------------------------------------------------------------------------------
    def load(self, life: RunLifecycle, st: State) -> None:
        """Read the ledger, the rollback count and the loss history of a resumed (or rolled-back) run: rank 0 from
        the store, every rank the same."""
        if st.step == 0:
            return  # a new run: nothing recorded yet
        data: Any = None
        if st.world.is_main:
            events = life.store.events(life.run_id, verify=False)
            data = ([e for e in events if e["kind"] == "skip"], sum(e["kind"] == "rollback" for e in events))
        skips, self.rollbacks = st.world.broadcast(data)
        self.ledger = SkipLedger.from_events(skips)
        self.load_history(life, st)

    # -- the step -------------------------------------------------------------------------------------------------
    def batch(self, step: int) -> int:
        """The batch index 0-based step ``step`` trains on (the skip ledger)."""
        return self.ledger.batch_for(step)

    def before_forward(self, step1: int, rerun: bool) -> None:
        if self.injector is not None:
            self.injector.before_forward(step1, replay=rerun)
        if self.fingerprints is not None:
            self.fingerprints.records = []
            self.fingerprints.enabled = True

    def after_backward(self, step1: int, rerun: bool) -> None:
        if self.fingerprints is not None:
            self.fingerprints.enabled = False
        if self.injector is not None:
            self.injector.after_backward(step1, replay=rerun)

    def update_skipped(self, step1: int) -> bool:
        """Whether the ledger says step ``step1`` (1-based) keeps its batch but skips its update."""
        return step1 in self.ledger.steps

    def _computation(self, st: State, loss: torch.Tensor | float, norm: float, shard: int) -> Computation:
        fp = tuple(self.fingerprints.records) if self.fingerprints is not None else ()
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        grads = [None if p.grad is None else local(p.grad.detach()) for p in self.params]
        norms = tuple(0.0 if g is None else float(torch.linalg.vector_norm(g.float())) for g in grads)
        return Computation(st.world.rank, shard, value, float(norm), tuple(digests(grads)),
                           tuple(digests(self.params)), fp, norms)

    def _due(self, every: int, step1: int) -> bool:
        return bool(every) and step1 % every == 0

    def check(self, st: State, life: RunLifecycle, step1: int, loss: torch.Tensor, norm: float, global_loss: float,
              any_bad: bool, snap: Snapshot, fb: ForwardBackward) -> Outcome:
        """Reject or examine the step (module docstring); every rank calls it with the same global values."""
        c, world = self.cfg, st.world
        reason, evidence = "", {}
        if not math.isfinite(global_loss) or any_bad:
            reason = "nonfinite"
        elif self.detector is not None:
            spike = self.detector.check(global_loss)
            if spike is not None:
                reason, evidence = "spike", spike
        if not reason and self.replicas and self._due(c.grad_check_every, step1):
            rows = world.all_gather(digests(p.grad for p in self.params))
            odd, cols = odd_in_groups(rows, self.replicas)
            if cols:
                reason = "gradients disagree"
                evidence = {"tensors": [self.names[i] for i in cols], "ranks": odd}
        sampled = not reason and self._due(c.replay_every, step1)
        if sampled:
            reason = "sampled replay"
        if not reason:
            self._accept(global_loss)
            return Outcome()
        if reason == "spike" and life.is_main:
            life.store.add_event(life.run_id, step=step1, kind="spike", payload=evidence)
        diag: Diagnosis | None = None
        out = Outcome(reason=reason)
        if c.rerun or sampled or reason == "gradients disagree":
            diag, out = self._rerun(st, step1, loss, norm, snap, fb, reason)
        if sampled and diag is not None and diag.verdict == "reproducible":
            self._accept(global_loss)
            return Outcome()
        action = self._policy(reason, diag, rerun_ok=out.loss is not None)
        payload = {"reason": reason, "evidence": evidence, "action": action,
                   **(diag.to_dict() if diag is not None else {"verdict": "not rerun"})}
        if action == "rollback" and self.rollbacks >= c.max_rollbacks:
            action = "stop"
            payload["action"] = "stop"
            payload["detail_action"] = f"reliability.max_rollbacks = {c.max_rollbacks} reached"
        if life.is_main:
            life.store.add_event(life.run_id, step=step1, kind="rerun", payload=payload)
        what = f"step {step1} rejected ({reason}): {diag.detail if diag else 'no rerun'}"
        if action == "continue":
            loss_now = out.loss if out.loss is not None else global_loss
            self._accept(loss_now)
            return Outcome("ok", out.loss, out.norm, reason)
        if action == "skip":
            self.ledger.skip_update(step1)
            if life.is_main:
                life.store.add_event(life.run_id, step=step1, kind="skip",
                                     payload={"step": step1, "update_skipped": True, "reason": reason})
            return Outcome("skip", reason=reason)
        if action == "rollback":
            self._rollback(st, life, step1, reason)
            return Outcome("rollback", reason=reason)
        if action == "stop" and reason == "nonfinite":  # localised and "diverged", as before; the rerun event
            return Outcome("diverge", reason=what)     # says whether a device was at fault
        return Outcome("stop", reason=what)

    def _accept(self, loss: float) -> None:
        if self.detector is not None:
            self.detector.accept(loss)

    def _policy(self, reason: str, diag: Diagnosis | None, *, rerun_ok: bool) -> str:
        c = self.cfg
        if diag is not None and diag.verdict == "transient" and rerun_ok:
            return c.on_transient
        if diag is not None and diag.verdict == "persistent":
            return c.on_persistent
        if reason == "nonfinite":
            return c.on_nonfinite
        if reason == "spike":
            return c.on_spike
        return c.on_persistent  # replicas that disagree reproducibly without a rank to blame

    def _rerun(self, st: State, step1: int, loss: torch.Tensor, norm: float, snap: Snapshot, fb: ForwardBackward,
               reason: str) -> tuple[Diagnosis, Outcome]:
        """Run the step again (and, if it reproduces, swapped), diagnose, and leave the gradients and buffers of
        the computation the step continues with: the rerun's when it differed (a transient fault) and is
        acceptable, else the original's."""
        world, model = st.world, unwrap(st.model)
        hook = st.wrapped.hook_state
        original = self._computation(st, loss, norm, world.rank)
        after_original = Snapshot()
        after_original.take(model, hook)
        original_grads = [p.grad for p in self.params]

        def again(shard: int) -> Computation:
            for p in self.params:
                p.grad = None
            snap.restore(model)
            l2, n2 = fb(shard, True)
            return self._computation(st, l2, n2, shard)

        rerun = again(world.rank)
        rerun_norm = rerun.grad_norm
        original, rerun = self._comparable(original), self._comparable(rerun)
        originals = world.all_gather(original)
        reruns = world.all_gather(rerun)
        rerun_grads = [p.grad for p in self.params]
        after_rerun = Snapshot()
        after_rerun.take(model, hook)
        first = diagnose(originals, reruns, None, names=self.names, replicas=self.replicas)
        swapped = None
        if first.verdict == "reproducible" and world.size > 1:
            swapped = world.all_gather(again((world.rank + 1) % world.size))
        diag = diagnose(originals, reruns, swapped, names=self.names, replicas=self.replicas)
        if st.wrapped.comm_bytes is not None and hook is None:
            st.wrapped.comm_bytes()  # FSDP2: drop what the reruns' all-gathers added
        if diag.verdict == "transient" and reason == "sampled replay":
            # neither computation was rejected: a third one decides which of the two the fault was in
            third = world.all_gather(self._comparable(again(world.rank)))
            if diagnose(originals, third, None, names=self.names, replicas=self.replicas).verdict != "transient":
                diag = dataclasses.replace(diag, detail=diag.detail + " (in the rerun: a third computation "
                                           "agrees with the original)")
                self._put(original_grads, after_original, model)
                return diag, Outcome(reason=reason)
        rerun_loss = sum(r.loss for r in reruns) / len(reruns)
        use_rerun = (diag.verdict == "transient" and math.isfinite(rerun_loss)
                     and all(math.isfinite(r.grad_norm) for r in reruns)
                     and (self.detector is None or self.detector.check(rerun_loss) is None))
        self._put(*((rerun_grads, after_rerun) if use_rerun else (original_grads, after_original)), model)
        out = Outcome(reason=reason)
        if use_rerun:
            out.loss, out.norm = rerun_loss, rerun_norm
        return diag, out

    def _put(self, grads: list[Any], state: Snapshot, model: torch.nn.Module) -> None:
        """Leave one computation's gradients and buffers in place: the step continues from it."""
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g
        state.restore(model)

    def _comparable(self, c: Computation) -> Computation:
        """``c`` without its gradients while they cannot be compared bit for bit (``unbucketed``)."""
        return dataclasses.replace(c, grads=(), grad_norm=0.0, grad_norms=()) if self.unbucketed else c

    def _rollback(self, st: State, life: RunLifecycle, step1: int, reason: str) -> None:
        """Reload the newest checkpoint, skip the batches around this step's in the ledger (recorded first, so a
        crash cannot lose it), and continue from the checkpoint's step."""
        from ._torch_state import restore_state

        c = self.cfg
        b = self.ledger.batch_for(step1 - 1)
        new = self.ledger.skip_batches(range(max(0, b - c.skip_before), b + c.skip_after + 1))
        if life.is_main:
            life.store.add_event(life.run_id, step=step1, kind="skip",
                                 payload={"batches": new, "reason": reason, "rejected_step": step1})
        self.rollbacks += 1
        restore_state(life, life.run_id, st, allow_restart=False)
        life.step = st.step
        if life.is_main:
            life.store.add_event(life.run_id, step=step1, kind="rollback",
                                 payload={"from_step": step1, "to_step": st.step, "reason": reason,
                                          "batches_skipped": new, "rollback": self.rollbacks})
        self.load_history(life, st)

    def load_history(self, life: RunLifecycle, st: State) -> None:
        """After a resume or a rollback: the detector's history is the stored curve up to the checkpoint's
        step."""
        if self.detector is None:
            return
        losses: Any = None
        if st.world.is_main:
            steps, values = life.store.scalars(life.run_id, verify=False).get("train/loss", ((), ()))
            losses = [float(v) for s, v in zip(steps, values, strict=True) if s <= st.step]
        self.detector.reset(st.world.broadcast(losses))

    # -- after the optimizer step ---------------------------------------------------------------------------------
    def after_step(self, st: State, life: RunLifecycle, step1: int) -> str | None:
        """Record injected faults; compare the replicas' weights when due.  Returns a reason to stop, or None."""
        if self.injector is not None:
            mine = [i.to_dict() for i in self.injector.injections[self._reported:]]
            self._reported = len(self.injector.injections)
            for batch in st.world.all_gather(mine):
                for inj in batch if life.is_main else ():
                    life.store.add_event(life.run_id, step=inj["step"], kind="fault_injected", payload=inj)
        if not (self.replicas and self._due(self.cfg.checksum_every, step1)):
            return None
        rows = st.world.all_gather(digests(self.params))
        odd, cols = odd_in_groups(rows, self.replicas)
        if not cols:
            return None
        tensors = [self.names[i] for i in cols]
        tie = len(self.replicas[0]) == 2
        payload = {"check": "weights", "ranks": odd, "tensors": tensors, "action": self.cfg.on_sdc,
                   "detail": (f"the replicas' weights differ in {', '.join(tensors[:4])}"
                              + (": with two replicas a vote cannot tell which holds the right values" if tie else
                                 f": rank(s) {', '.join(map(str, odd))} differ from the majority"))}
        if life.is_main:
            life.store.add_event(life.run_id, step=step1, kind="sdc", payload=payload)
        return f"step {step1}: {payload['detail']}" if self.cfg.on_sdc == "stop" else None

    def close(self) -> None:
        if self.injector is not None:
            self.injector.remove()
        if self.fingerprints is not None:
            self.fingerprints.remove()
