"""``RunConfig``: one training run (or one run per seed) described as data, read from TOML.

A run config names a model (a zoo task or a ``package.module:function`` entry point returning a ``Task``), the
training hyper-parameters, the numerics (a recipe name, a hardware profile, or an inline recipe table), the seeds,
and where runs are recorded.  Fields left out take the task's defaults (``Task.defaults``) when the run starts;
the run records the fully resolved config, so a stored run always says exactly what was trained.

Example::

    model = "mlp-digits"
    recipe = "fp8-tensorwise"      # or a [recipe] table with the fields of lowprec.Recipe
    seeds = [0, 1, 2]
    steps = 300
    batch_size = 64

    [optimizer]
    name = "adamw"
    lr = 3e-3

    [schedule]
    name = "cosine"
    warmup_steps = 20

Every validation error names the field, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Literal

from .. import recipes
from .._checks import check_float, check_int, check_literal, literal_values
from .._errors import UsageError
from .._parse import MAX_NESTING as MAX_NESTING  # re-exported: the limit config errors name
from .._parse import parse_json, parse_toml, read_text_file
from ..recipes import Recipe
from ..reliability._config import ReliabilityConfig
from ..reliability._fault import Fault

DEFAULT_STORE = "lowprec-runs/runs.db"
OptimizerName = Literal["adamw", "sgd"]
ScheduleName = Literal["constant", "cosine", "linear"]
Strategy = Literal["single", "ddp", "fsdp2", "hsdp"]
DistBackend = Literal["auto", "gloo", "nccl"]
Framework = Literal["torch", "jax"]
Device = Literal["auto", "cpu", "cuda", "xla"]
PipelineSchedule = Literal["1f1b", "gpipe"]
OPTIMIZERS = literal_values(OptimizerName)
SCHEDULES = literal_values(ScheduleName)
STRATEGIES = literal_values(Strategy)
BACKENDS = literal_values(DistBackend)
FRAMEWORKS = literal_values(Framework)
DEVICES = literal_values(Device)
MAX_STEPS = 10**9
"""Upper bound of ``steps`` (and of the other step counts): a billion optimizer steps is weeks at a millisecond a
step and years at the emulated GEMMs' pace, and every step stores a row per scalar; a larger value (``1e15``) is a
typo, refused before any work rather than failing in the store or never ending."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The torch optimizer that computes each float32 update (the recipe decides how it is stored)."""

    name: OptimizerName | None = None
    """"adamw" or "sgd" (with momentum); default: the task's."""
    lr: float | None = None
    """Peak learning rate; default: the task's."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    momentum: float = 0.9
    """SGD's momentum."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value (None or 0: no clipping).  The norm is recorded either way."""

    def __post_init__(self) -> None:
        if self.name is not None:
            check_literal(self.name, "optimizer.name", OptimizerName)
        if self.lr is not None:
            check_float(self.lr, "optimizer.lr", 0.0, open_lo=True)
        check_float(self.weight_decay, "optimizer.weight_decay", 0.0)
        if not (isinstance(self.betas, tuple) and len(self.betas) == 2):
            raise UsageError(f"optimizer.betas must be two numbers [beta1, beta2]; got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_float(b, f"optimizer.betas[{i}]", 0.0, 1.0)
        check_float(self.eps, "optimizer.eps", 0.0, open_lo=True)
        check_float(self.momentum, "optimizer.momentum", 0.0, 1.0)
        if self.grad_clip is not None:
            check_float(self.grad_clip, "optimizer.grad_clip", 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Learning rate over steps: linear warm-up from 0, then constant, cosine or linear decay to
    ``min_lr_ratio * lr`` at the last step."""

    name: ScheduleName = "cosine"
    warmup_steps: int | None = None
    """Default: the task's."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        check_literal(self.name, "schedule.name", ScheduleName)
        if self.warmup_steps is not None:
            check_int(self.warmup_steps, "schedule.warmup_steps", 0, MAX_STEPS)
        check_float(self.min_lr_ratio, "schedule.min_lr_ratio", 0.0, 1.0)

    def lr_at(self, step: int, *, lr: float, steps: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based) of ``steps``."""
        warm = self.warmup_steps or 0
        if step < warm:
            return lr * (step + 1) / warm
        if self.name == "constant" or steps <= warm:
            return lr
        t = (step - warm) / max(1, steps - warm - 1)
        lo = lr * self.min_lr_ratio
        if self.name == "linear":
            return lr - (lr - lo) * t
        return lo + 0.5 * (lr - lo) * (1.0 + math.cos(math.pi * t))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout: one process, or ``world_size`` torchrun processes on a device mesh of pipeline, data
    (replicate, shard) and tensor parallel degrees (torchtitan's; ``_mesh`` explains the mesh and which rows each
    rank trains on).  ``world_size = pp x dp_replicate x dp_shard x tp``; the data-parallel degrees follow from
    ``strategy``, ``world_size``, ``tp`` and ``pp`` unless given."""

    strategy: Strategy = "single"
    """"single", "ddp" (DistributedDataParallel) or "fsdp2" (``fully_shard`` with the recipe's mixed-precision
    policy); with ddp and fsdp2 each rank trains on its 1/world_size of every batch.  With ``tp`` or ``pp``: what
    the data-parallel ranks do ("ddp": replicate, "fsdp2": shard, "hsdp": both); with no data-parallel ranks left
    (``world_size = tp x pp``) use "ddp"."""
    world_size: int = 1
    """Processes on this node (``lowprec run`` launches torchrun with this many)."""
    backend: DistBackend = "auto"
    """"auto" (NCCL with CUDA, else gloo), "gloo" or "nccl"."""
    max_restarts: int = 0
    """torchrun elastic restarts: a failed worker group restarts from the newest checkpoint."""
    master_port: int | None = None
    """Rendezvous port on 127.0.0.1 (default: a free one)."""
    mesh_shape: tuple[int, int] | None = None
    """"hsdp": (replicas, shards per replica); their product is the data-parallel degree (the world size without
    tp or pp)."""
    tp: int = 1
    """Tensor-parallel degree (torchtitan's ``tensor_parallel_degree``): Megatron column/row sharding of every
    block's linears (``lowprec.distributed.gpt_plan`` for the zoo GPT, ``llama_plan`` for Llama-style models); it
    must divide the attention heads and the sharded linear dimensions (and keep MX blocks inside shards)."""
    pp: int = 1
    """Pipeline-parallel degree (``pipeline_parallel_degree``): the model's pieces cut into ``pp`` stages balanced
    by parameter count (``lowprec.distributed.Pipeline``)."""
    dp_replicate: int | None = None
    """Data-parallel replicas (``data_parallel_replicate_degree``); default: from ``strategy`` (ddp: all the
    data-parallel ranks; hsdp: ``mesh_shape[0]``)."""
    dp_shard: int | None = None
    """Data-parallel shards (``data_parallel_shard_degree``); default: from ``strategy`` (fsdp2: all the
    data-parallel ranks; hsdp: ``mesh_shape[1]``)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """"1f1b" or "gpipe" (``torch.distributed.pipelining``'s ``Schedule1F1B`` / ``ScheduleGPipe``)."""
    microbatches: int | None = None
    """Microbatches per pipeline step (default: ``pp``; "1f1b" needs at least ``pp``); the batch each
    data-parallel rank trains on must divide into them."""
    sequence_parallel: bool = False
    """With ``tp``: keep the residual stream split along the sequence between blocks (norms on local tokens,
    activations all-gathered in the recipe's format)."""

    def __post_init__(self) -> None:
        check_literal(self.strategy, "parallel.strategy", Strategy)
        check_int(self.world_size, "parallel.world_size", 1, 1 if self.strategy == "single" else 1024)
        check_literal(self.backend, "parallel.backend", DistBackend)
        check_int(self.max_restarts, "parallel.max_restarts", 0, 100)
        if self.master_port is not None:
            check_int(self.master_port, "parallel.master_port", 1024, 65535)
        for field in ("tp", "pp"):
            check_int(getattr(self, field), f"parallel.{field}", 1, 1024)
        for field in ("dp_replicate", "dp_shard", "microbatches"):
            if getattr(self, field) is not None:
                check_int(getattr(self, field), f"parallel.{field}", 1, 1 << 20)
        check_literal(self.pp_schedule, "parallel.pp_schedule", PipelineSchedule)
        if not isinstance(self.sequence_parallel, bool):
            raise UsageError(f"parallel.sequence_parallel must be true or false; got {self.sequence_parallel!r}")
        by_degrees = self.dp_replicate is not None and self.dp_shard is not None  # hsdp without mesh_shape
        if self.mesh_shape is not None or (self.strategy == "hsdp" and not by_degrees):
            m = self.mesh_shape
            if self.strategy != "hsdp":
                raise UsageError(f"parallel.mesh_shape is for strategy 'hsdp'; got strategy {self.strategy!r}")
            if not (isinstance(m, tuple) and len(m) == 2 and all(isinstance(v, int) and v >= 1 for v in m)):
                raise UsageError(f"parallel.mesh_shape must be [replicas, shards] (two integers >= 1); got {m!r}")
            if m[0] * m[1] != self.world_size and self.tp * self.pp == 1:
                raise UsageError(f"parallel.mesh_shape {list(m)} has {m[0] * m[1]} ranks but parallel.world_size "
                                 f"is {self.world_size}: make replicas x shards equal the world size")
        from ._mesh import check_degrees

        check_degrees(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; the mesh fields (``tp`` .. ``sequence_parallel``) only when they differ from their defaults,
        so a data-parallel config's data (and the digests kept of it) is the same as before they existed."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _MESH_FIELDS and v == f.default:
                continue
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


_MESH_FIELDS = ("tp", "pp", "dp_replicate", "dp_shard", "pp_schedule", "microbatches", "sequence_parallel")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """When to save a checkpoint (atomically, with a checksum) for ``lowprec run --resume``."""

    interval: int = 0
    """Save every this many steps (0: only at the end of the run)."""
    keep: int = 2
    """Keep the newest this many checkpoints of a run."""

    def __post_init__(self) -> None:
        check_int(self.interval, "checkpoint.interval", 0, MAX_STEPS)
        check_int(self.keep, "checkpoint.keep", 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatsConfig:
    """Per-layer tensor statistics (``lowprec.numerics.StatsObserver``), recorded as ``stats/<module>/<role>/<stat>``
    scalars; off by default.  They never change the training numerics."""

    every: int | None = None
    """Sample every this many steps (None: off)."""
    what_if: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra specs to measure the GEMM operands with (name -> spec name), e.g. {mxfp4 = "mxfp4"}."""

    def __post_init__(self) -> None:
        if self.every is not None:
            check_int(self.every, "stats.every", 1, MAX_STEPS)
        if not isinstance(self.what_if, dict):
            raise UsageError(f"stats.what_if must be a table of name = spec; got {self.what_if!r}")
        from ..quant import QuantSpec

        for name, spec in self.what_if.items():
            if not name or any(c in name for c in "/@ "):
                raise UsageError(f"stats.what_if name {name!r} must be non-empty without '/', '@' or spaces")
            if not isinstance(spec, str) or spec not in QuantSpec.names():
                raise UsageError(f"stats.what_if.{name} must be a spec name ({', '.join(QuantSpec.names())}); "
                                 f"got {spec!r}")


_TABLES: dict[str, type] = {
    "stats": StatsConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "reliability": ReliabilityConfig,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A training run as data.  ``None`` fields take the task's defaults when the run starts (``resolve``)."""

    model: str
    """A zoo task name (``lowprec.runs.zoo.names()``) or ``"package.module:function"`` returning a ``Task``."""
    model_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword options for the task builder (e.g. ``hidden = 256``)."""
    name: str | None = None
    """Label of the run(s); default ``"<model> <recipe>"``."""
    group: str | None = None
    """Group label in the run store (a comparison selects runs by group); default: the name."""
    framework: Framework = "torch"
    """"torch" (the default) or "jax" (``lowprec.jax``: the same task, batches, initial weights, recipe and
    optimizer, trained by ``lowprec.runs._jax_runner``; single process, mlp-digits, no checkpoints/resume)."""
    seeds: tuple[int, ...] = (0,)
    """One run per seed.  ``seed = 3`` in TOML is ``seeds = [3]``."""
    steps: int | None = None
    batch_size: int | None = None
    eval_interval: int | None = None
    recipe: Recipe = dataclasses.field(default_factory=lambda: recipes.get("fp32"))
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    parallel: ParallelConfig = ParallelConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    stats: StatsConfig = StatsConfig()
    reliability: ReliabilityConfig = ReliabilityConfig()
    """Rejected-step reruns, spike rollback, silent-data-corruption checks (``lowprec.reliability._config``)."""
    faults: tuple[Fault, ...] = ()
    """``[[faults]]``: faults to inject (``lowprec.reliability.Fault``; ``step`` is the 1-based step number the
    store records), to test that the checks catch them."""
    store: str = DEFAULT_STORE
    """Path of the SQLite run store (checkpoints go next to it, under ``checkpoints/<run id>/``)."""
    threads: int | None = None
    """torch intra-op threads (None: leave torch's default)."""
    device: Device = "auto"
    """Where the model and its batches live: "cpu", "cuda", "xla" or "auto" (CUDA when available, else CPU; under
    data parallelism the process group's: CUDA with NCCL, CPU with gloo).  "cuda" without a usable GPU, and "xla"
    without torch_xla installed, are refused before any work; "xla" (torch_xla's device, ``runs._xla``) trains in
    one process.  The manifest records the device used (``hardware.device``; "xla" also ``hardware.torch_xla``)."""
    config_dir: str | None = dataclasses.field(default=None, compare=False)
    """The folder of the config file (``load`` sets it): on ``sys.path`` while the model is resolved, so ``model =
    "mytask:make"`` finds ``mytask.py`` next to the config.  Not part of ``to_dict`` (it says where the files are,
    not what is trained); the manifest records it as ``config_dir``."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise UsageError(f"model must be a zoo task name or 'package.module:function'; got {self.model!r}")
        if not isinstance(self.model_options, dict):
            raise UsageError(f"model_options must be a table; got {self.model_options!r}")
        for field in ("name", "group"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise UsageError(f"{field} must be a non-empty string; got {v!r}")
        check_literal(self.framework, "framework", Framework)
        if self.framework == "jax" and self.parallel.strategy != "single":
            raise UsageError(f"framework = \"jax\" trains in one process; got parallel.strategy "
                             f"{self.parallel.strategy!r}: set parallel.strategy = \"single\" (data-parallel JAX "
                             "is lowprec.jax.data_parallel, see docs/jax.md)")
        if not isinstance(self.seeds, tuple) or not self.seeds:
            raise UsageError(f"seeds must be a non-empty list of integers; got {self.seeds!r}")
        for i, s in enumerate(self.seeds):
            check_int(s, f"seeds[{i}]", 0, 2**31 - 1)
        if len(set(self.seeds)) != len(self.seeds):
            raise UsageError(f"seeds must be distinct; got {list(self.seeds)}")
        for field in ("steps", "eval_interval"):
            v = getattr(self, field)
            if v is not None:
                check_int(v, field, 1)
                if v > MAX_STEPS:
                    raise UsageError(f"{field} must be at most {MAX_STEPS:_} (10**9); got {v:_}: a billion steps "
                                     "is already weeks of training, and each step stores its scalars, so this is "
                                     "most likely a typo")
        if self.batch_size is not None:
            check_int(self.batch_size, "batch_size", 1)
        if not isinstance(self.recipe, Recipe):
            raise UsageError(f"recipe must be a lowprec.Recipe; got {type(self.recipe).__name__}")
        if not isinstance(self.store, str) or not self.store:
            raise UsageError(f"store must be a path; got {self.store!r}")
        if self.threads is not None:
            check_int(self.threads, "threads", 1)
        check_literal(self.device, "device", Device)
        if self.device == "xla":
            from ._xla import check_layout

            check_layout(self.framework, self.parallel.world_size, self.parallel.strategy)
        if self.framework == "jax" and self.device == "cuda":
            raise UsageError("framework = \"jax\" runs on JAX's default backend, which device does not choose; "
                             "set device = \"auto\" (the manifest records the JAX platform) or framework = "
                             "\"torch\"")
        if not isinstance(self.faults, tuple) or not all(isinstance(f, Fault) for f in self.faults):
            raise UsageError(f"faults must be a list of [[faults]] tables; got {self.faults!r}")
        if self.framework == "jax" and (self.faults or self.reliability != ReliabilityConfig()):
            raise UsageError("[[faults]] and [reliability] are PyTorch runner features; remove them or set "
                             "framework = \"torch\"")
        if self.config_dir is not None and (not isinstance(self.config_dir, str) or not self.config_dir):
            raise UsageError(f"config_dir must be a folder path; got {self.config_dir!r}")

    @property
    def label(self) -> str:
        p = self.parallel
        layout = "" if p.strategy == "single" else f" {p.strategy}x{p.world_size}"
        if p.tp * p.pp > 1:  # e.g. "tp2", "pp2 x dp_shard2"
            from ._mesh import layout_of

            layout = f" {layout_of(p).describe()}"
        framework = "" if self.framework == "torch" else f" [{self.framework}]"  # a JAX run is another experiment
        return self.name or f"{self.model} {self.recipe.name}{layout}{framework}"

    def for_seed(self, seed: int) -> RunConfig:
        """The config of the single run with ``seed``."""
        return dataclasses.replace(self, seeds=(seed,))

    def resolve(self, defaults: dict[str, Any]) -> RunConfig:
        """Fill every ``None`` field from a task's ``defaults`` (keys steps, batch_size, eval_interval, lr,
        optimizer, warmup_steps)."""
        def pick(value: Any, key: str, fallback: Any) -> Any:
            return value if value is not None else defaults.get(key, fallback)

        steps = pick(self.steps, "steps", 100)
        return dataclasses.replace(
            self,
            steps=steps,
            batch_size=pick(self.batch_size, "batch_size", 32),
            eval_interval=pick(self.eval_interval, "eval_interval", max(1, steps // 10)),
            optimizer=dataclasses.replace(
                self.optimizer,
                name=pick(self.optimizer.name, "optimizer", "adamw"),
                lr=pick(self.optimizer.lr, "lr", 1e-3),
            ),
            schedule=dataclasses.replace(
                self.schedule, warmup_steps=pick(self.schedule.warmup_steps, "warmup_steps", 0)
            ),
        )

    # ------------------------------------------------------------------------------------------- serialising
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (``recipe`` as a full recipe table, ``seeds`` as a list).  ``config_dir`` is left
        out, and so is ``device`` when it is "auto": a default config's data (and the digest a baseline keeps of
        it) is the same as before the field existed."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "config_dir" or (f.name == "device" and v == "auto"):
                continue
            if (f.name == "faults" and not v) or (f.name == "reliability" and v == ReliabilityConfig()):
                continue  # left out when unused: older configs' data (and digests) stay the same
            if f.name == "recipe":
                v = v.to_dict()
            elif f.name == "reliability":
                v = v.to_dict()
            elif f.name == "faults":
                v = [x.to_dict() for x in v]
            elif f.name == "parallel":
                v = v.to_dict()
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                v = {k: list(x) if isinstance(x, tuple) else x for k, x in dataclasses.asdict(v).items()}
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "config") -> RunConfig:
        """Strict conversion from plain data; errors start with ``where`` and name the field."""
        try:
            return _from_dict(data)
        except ValueError as e:
            raise UsageError(f"{where}: {e}") from None

    @classmethod
    def from_toml(cls, text: str, *, where: str = "config") -> RunConfig:
        """Parse (``parse_toml``: invalid or too deeply nested TOML is a ValueError) and validate."""
        return cls.from_dict(parse_toml(text, where=where), where=where)


def check_declared(config: RunConfig, *, where: str | None = None) -> None:
    """The checks of a config as a user declares it (a config file, the command line), on top of the field checks
    every ``RunConfig`` passes: a ``schedule.warmup_steps`` above ``steps`` (the learning rate would never reach
    ``optimizer.lr``: the whole run would be warm-up), and a ``stats.what_if`` table without ``stats.every`` (it
    would measure nothing) are refused.  Not ``RunConfig`` invariants: runs stored before these checks (a short
    ``steps`` with a task's longer default warm-up) must still read back and resume."""
    msg = None
    warm = config.schedule.warmup_steps
    if config.steps is not None and warm is not None and warm > config.steps:
        msg = (f"schedule.warmup_steps = {warm} is more than steps = {config.steps}: the learning rate would never "
               f"reach optimizer.lr (the whole run would be warm-up); set warmup_steps <= {config.steps} or raise "
               "steps")
    elif config.reliability.rolls_back() and not config.checkpoint.interval:
        from ..reliability._config import check_rollback

        try:
            check_rollback(config.reliability, config.checkpoint.interval)
        except UsageError as e:
            msg = str(e)
    elif config.stats.what_if and config.stats.every is None and config.recipe.fallback is None:
        msg = (f"stats.what_if {sorted(config.stats.what_if)} is measured only when statistics are sampled, and "
               "stats.every is not set: add stats.every = N (sample every N steps)")
    if msg:
        raise UsageError(f"{where}: {msg}" if where else msg)


def load(path: str | Path) -> RunConfig:
    """Read and validate a run config file: TOML, or JSON when the name ends in ``.json`` (the form
    ``RunConfig.to_json`` writes and ``python -m lowprec.train`` reads), with ``check_declared``; its
    ``config_dir`` is the file's folder (absolute)."""
    p = Path(path)
    text = read_text_file(p, "config")
    if p.suffix.lower() == ".json":
        config = RunConfig.from_dict(parse_json(text, where=str(p)), where=str(p))
    else:
        config = RunConfig.from_toml(text, where=str(p))
    check_declared(config, where=str(p))
    return dataclasses.replace(config, config_dir=str(p.resolve().parent))


def _table(cls: type, value: Any, field: str) -> Any:
    if not isinstance(value, dict):
        raise UsageError(f"{field} must be a table; got {value!r}")
    allowed = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(value) - allowed)
    if extra:
        raise UsageError(f"{field}: unknown key(s) {extra}; allowed: {sorted(allowed)}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    return cls(**kw)


def _recipe(value: Any) -> Recipe:
    if isinstance(value, Recipe):
        return value
    if isinstance(value, str):
        return recipes.get(value)
    if isinstance(value, dict):
        return Recipe.from_dict(value)
    raise UsageError(f"recipe must be a recipe name ({', '.join(recipes.names())}) or a table; got {value!r}")


def _from_dict(data: dict[str, Any]) -> RunConfig:
    if not isinstance(data, dict):
        raise UsageError(f"must be a table; got {type(data).__name__}")
    data = dict(data)
    allowed = {f.name for f in dataclasses.fields(RunConfig)} | {"seed"}
    extra = sorted(set(data) - allowed)
    if extra:
        recipe_keys = sorted(set(extra) & {f.name for f in dataclasses.fields(Recipe)})
        hint = ""
        if recipe_keys:
            hint = (f"; {recipe_keys} are fields of a recipe (pasted from lowprec recipes --show?): put the recipe "
                    "under a [recipe] table ([recipe] for its top-level keys, [recipe.linear...] for its "
                    "[linear...] tables), or write recipe = \"NAME\", or pass --recipe FILE.toml")
        raise UsageError(f"unknown key(s) {extra}; allowed: {sorted(allowed)}{hint}")
    if "model" not in data:
        raise UsageError("model is required: a zoo task name or 'package.module:function'")
    if "seed" in data:
        if "seeds" in data:
            raise UsageError("give either seed or seeds, not both")
        data["seeds"] = [data.pop("seed")]
    if "seeds" in data:
        if not isinstance(data["seeds"], list):
            raise UsageError(f"seeds must be a list of integers; got {data['seeds']!r}")
        data["seeds"] = tuple(data["seeds"])
    if "recipe" in data:
        data["recipe"] = _recipe(data["recipe"])
    for key, cls in _TABLES.items():
        if key in data:
            data[key] = _table(cls, data[key], key)
    if "faults" in data:
        faults = data["faults"]
        if not isinstance(faults, list) or not all(isinstance(f, dict) for f in faults):
            raise UsageError(f"faults must be a list of [[faults]] tables; got {faults!r}")
        data["faults"] = tuple(Fault.from_dict(f) for f in faults)
    return RunConfig(**data)
