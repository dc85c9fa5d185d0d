"""``EmulatedExperts``: the expert GEMMs of a Mixtral-layout mixture-of-experts block, emulated per a ``LinearRecipe``.

A transformers MoE "experts" module (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``DeepseekV3Experts``, ... about 55 families in transformers 5.24) stores every expert's weights in two 3-D
Parameters::

    gate_up_proj  [E, 2*I, H]     expert e's gate and up projections, stacked: W_gu[e] = [W_gate[e]; W_up[e]]
    down_proj     [E, H, I]       expert e's down projection W_d[e]

and, for the tokens ``T_e`` the router sent to expert ``e`` (rows of ``hidden_states`` [T, H]), computes::

    gate, up = split(x_e @ W_gu[e]^T)          x_e = hidden_states[T_e]       [M_e, H] @ [H, 2I] -> [M_e, 2I]
    h_e      = act(gate) * up                                                  [M_e, I]
    y_e      = (h_e @ W_d[e]^T) * p_e          p_e = the router's top-k weight [M_e, I] @ [I, H]  -> [M_e, H]
    out[T_e] += y_e                            (index_add_)

Each of the two products is a linear layer without bias, so each has the three GEMMs of ``EmulatedLinear``
(nn/_linear.py), here per expert::

    forward      Y  = Q(X) @ Q(W)^T          X = x_e or h_e (M_e rows),  W = W_gu[e] or W_d[e]
    grad_input   dX = Q(dY) @ Q(W^T)^T
    grad_weight  dW = Q(dY^T) @ Q(X^T)^T     dW lands in row e of the 3-D Parameter's gradient

so an MoE block of E experts runs 2*E emulated linears, 6*E GEMMs (only for the experts some token was routed to:
an expert without tokens runs no GEMM and its rows of the weight gradients are zero, as in the original).

Per-expert scaling: each GEMM is quantized exactly as ``EmulatedLinear(weight=W_gu[e])`` (or ``W_d[e]``) would
quantize it, so a tensorwise scale is the amax of *one expert's* weight, and of *one expert's token group*
``x_e`` / ``h_e`` / ``dY_e`` (the expert's GEMM M-dimension is the number of tokens routed to it), never of the
whole 3-D tensor or of all tokens.  This is what a grouped FP8 GEMM with one scale per group does; a single scale
over all experts would let one expert's outlier crush the resolution of every other expert.  Row-wise, block and
MX scales are per row or block of the reduction dimension; in grad_weight that dimension is the expert's own
tokens, so its blocks are per expert too (a block never mixes two experts' tokens).

Bit-exactness: output and the gradients of ``hidden_states``, ``gate_up_proj``, ``down_proj`` and
``top_k_weights`` equal (``torch.equal``) a loop that runs, for every hit expert, an ``EmulatedLinear`` whose
weight is ``gate_up_proj[e]`` and one whose weight is ``down_proj[e]`` (named ``{name}.{e}.gate_up_proj`` and
``{name}.{e}.down_proj``, same seed), because each expert GEMM *is* ``EmulatedLinear``'s autograd function.

The router (``MixtralTopKRouter`` & co: ``weight`` [E, H] through ``F.linear`` and a softmax/top-k) is not part of
this module and is left in float32: it is a tiny GEMM (N = E) whose output decides, through a discrete top-k,
where every token goes; quantization noise there flips routing decisions and load balance rather than adding
small errors; DeepSeek-V3's FP8 training keeps its MoE gating in BF16/FP32 for the same reason.
Convert it explicitly if a recipe wants it emulated.

Which original: transformers dispatches an experts module's forward on ``config._experts_implementation``
("eager", "grouped_mm" -- the default where it can run, CPU included --, "batched_mm").  This module always computes
the eager loop above (per-expert ``F.linear``, ``index_add_``); the float32 recipe reproduces the eager loop's
output and gradients bit for bit.  grouped_mm and batched_mm sum a token's k expert outputs in another order
(``.sum(dim=1)`` instead of ``index_add_`` expert by expert); on CPU the tiny Mixtral's grouped_mm output equals
the eager loop's for k = 2 and is a few ulps apart for k = 4.

Stochastic rounding: one random stream per expert GEMM operand, ``(seed, "{name}.{e}.{proj}", GEMM, operand,
step)`` with one step counter for the whole module (buffer ``lp_step``, advanced once per training forward, for
every expert, hit or not).  Delayed scaling: one amax history per expert, projection and tensor role, stacked in
buffers ``amax_history_{proj}_{role}`` of shape [E, history_len]; an expert's row is recorded only in steps where
it receives tokens (as its own ``EmulatedLinear`` would be).  Those buffers exist only when the recipe needs them,
so a float module's ``state_dict`` keys are unchanged otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from .._errors import UsageError
from ..quant import _random
from ..recipes import LinearRecipe
from ._linear import EmulatedLinear, Keys, _copy_module_state, _Ctx, _LinearFn, _Plan, _plan_for, delayed_roles

PROJECTIONS = ("gate_up_proj", "down_proj")
# Plain attributes of a transformers experts module (set by ``@use_experts_implementation`` or its __init__) that
# code around it may read; carried over to the replacement.
_ATTRS = ("config", "num_experts", "hidden_dim", "intermediate_dim", "has_gate", "has_bias", "has_post_expert_norm",
          "is_transposed", "is_concatenated", "_is_expert_parallel")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a Mixtral-layout experts module (``EmulatedExperts.from_module`` can replace it).

    That is: a class named ``*Experts`` with 3-D Parameters ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]
    (not transposed, no biases), an ``act_fn``, and the default gating ``act_fn(gate) * up`` (families that define
    their own ``_apply_gate``, e.g. gpt_oss's clamped SwiGLU with biases and transposed weights, do not qualify).
    Transformers is not imported.
    """
    if isinstance(module, EmulatedExperts) or not type(module).__name__.endswith("Experts"):
        return False
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3):
        return False
    e, two_i, h = gu.shape
    if dn.shape[0] != e or dn.shape[1] != h or two_i != 2 * dn.shape[2]:
        return False
    if not callable(getattr(module, "act_fn", None)):
        return False
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return False
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return False
    if any(n.endswith("_bias") for n, _ in module.named_parameters(recurse=False)):
        return False
    gate = getattr(type(module), "_apply_gate", None)
    return gate is None or getattr(gate, "__name__", "") == "_default_apply_gate"


class _ExpertGemm:
    """What ``_LinearFn`` reads from its ``EmulatedLinear`` (recipe, plan, delayed amax), for one expert's
    projection: the recipe and plan are the parent's, the amax history is row ``e`` of the parent's buffer."""

    input_after_mask = False

    def __init__(self, parent: EmulatedExperts, proj: str, e: int) -> None:
        self.parent, self.proj, self.e = parent, proj, e

    @property
    def _delayed(self) -> dict[str, int]:
        return self.parent._delayed

    @property
    def recipe(self) -> LinearRecipe:
        return self.parent.recipe

    def _plan(self) -> _Plan:
        return self.parent._plan()

    def _delayed_amax(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.parent._delayed_amax(self.proj, self.e, tensors)


class EmulatedExperts(nn.Module):
    """A Mixtral-layout experts module whose per-expert GEMMs follow a ``LinearRecipe`` (module docstring).

    Build with ``from_module``; it shares the original's ``gate_up_proj`` / ``down_proj`` Parameter objects and
    ``act_fn``, takes the same ``forward(hidden_states, top_k_index, top_k_weights)`` and computes what the
    original's eager loop computes, with each expert GEMM emulated.  ``to_module`` gives the original back.
    """

    recipe: LinearRecipe
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Callable[[torch.Tensor], torch.Tensor]
    _original: nn.Module | None

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter,
                 act_fn: Callable[[torch.Tensor], torch.Tensor], recipe: LinearRecipe, *, seed: int = 0,
                 name: str = "") -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn
        self.num_experts = gate_up_proj.shape[0]
        self.hidden_dim = gate_up_proj.shape[2]
        self.intermediate_dim = down_proj.shape[2]
        object.__setattr__(self, "_original", None)  # not a submodule: its Parameters are ours already
        self._setup(recipe, seed, name)

    def _setup(self, recipe: LinearRecipe, seed: int, name: str) -> None:
        self.recipe = recipe
        self._plan_cache = (recipe, _plan_for(recipe))
        self.lowprec_name = name
        self.seed = seed
        ops = recipe.operands()
        self._delayed, self._algorithm = delayed_roles(recipe)
        dev = self.gate_up_proj.device
        for proj in PROJECTIONS:
            for role, n in self._delayed.items():
                self.register_buffer(f"amax_history_{proj}_{role}",
                                     torch.zeros(self.num_experts, n, dtype=torch.float32, device=dev))
        self._stochastic = any(op.spec is not None and op.spec.rounding == "stochastic" for op in ops.values())
        # Base keys per (expert, projection, GEMM, operand): the streams of EmulatedLinear(name="{name}.{e}.{proj}")
        self._base_keys: dict[tuple[int, str], Keys] = {}
        if self._stochastic:
            for e in range(self.num_experts):
                for proj in PROJECTIONS:
                    sub = f"{name}.{e}.{proj}" if name else f"{e}.{proj}"
                    self._base_keys[(e, proj)] = {
                        key: _random.key_tensor(_random.stream_seed(seed, sub, *key), dev) for key in ops}
            self.register_buffer("lp_step", torch.zeros((), dtype=torch.int64, device=dev))
        self._gemms = {(e, proj): _ExpertGemm(self, proj, e) for e in range(self.num_experts) for proj in PROJECTIONS}

    @classmethod
    def from_module(cls, module: nn.Module, recipe: LinearRecipe, *, seed: int, name: str) -> EmulatedExperts:
        """An EmulatedExperts replacing ``module`` (``is_experts``), sharing its Parameters and ``act_fn``.

        ``name`` is the module's qualified name in the model (it names the random streams); ``seed`` the recipe
        seed.  Hooks, the training flag and the plain attributes transformers sets (``config``, ``num_experts``,
        ...) are carried over; ``to_module`` returns ``module`` itself.
        """
        if not is_experts(module):
            raise UsageError(
                f"{type(module).__name__} is not a Mixtral-layout experts module (3-D gate_up_proj [E, 2I, H] and "
                "down_proj [E, H, I] Parameters, act_fn, default gating, no biases); it cannot be emulated as one"
            )
        if getattr(module, "_is_expert_parallel", False):
            raise UsageError(f"{type(module).__name__} is expert-parallel; EmulatedExperts supports local experts "
                             "only (convert before sharding experts)")
        gu, dn = cast(nn.Parameter, module.gate_up_proj), cast(nn.Parameter, module.down_proj)
        new = cls(gu, dn, cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn), recipe, seed=seed, name=name)
        for attr in _ATTRS:
            if attr in module.__dict__:
                object.__setattr__(new, attr, module.__dict__[attr])
        _copy_module_state(module, new)
        object.__setattr__(new, "_original", module)
        return new

    def to_module(self) -> nn.Module:
        """The original module object (``from_module``), holding this module's current Parameters."""
        orig = self._original
        if orig is None:
            raise UsageError("this EmulatedExperts was not built with from_module: there is no original to restore")
        orig.gate_up_proj = self.gate_up_proj
        orig.down_proj = self.down_proj
        _copy_module_state(self, orig)
        return orig

    def _plan(self) -> _Plan:
        cached = self._plan_cache
        if cached[0] is not self.recipe:
            cached = self._plan_cache = (self.recipe, _plan_for(self.recipe))
        return cached[1]

    def _delayed_amax(self, proj: str, e: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``EmulatedLinear._delayed_amax`` on row ``e`` of ``amax_history_{proj}_{role}``.

        No data-parallel first-step reduction (``EmulatedLinear.amax_reduce``): ranks route different tokens, so an
        expert may run on one rank and not another, and a collective here could deadlock.
        """
        out: dict[str, torch.Tensor] = {}
        for role, t in tensors.items():
            if role not in self._delayed:
                continue
            bname = f"amax_history_{proj}_{role}"
            buf = self._buffers[bname]
            assert buf is not None
            hist = buf[e]
            with torch.no_grad():
                current = t.abs().amax() if t.numel() else t.new_zeros(())
                past = hist.amax() if self._algorithm[role] == "max" else hist[0]
                out[role] = torch.where(past > 0, past, current)
                if self.training:  # a new tensor, not in place (as EmulatedLinear)
                    row = torch.cat([current.reshape(1), hist[:-1]]).reshape(1, -1)
                    self._buffers[bname] = torch.cat([buf[:e], row, buf[e + 1:]])
        return out

    def _keys(self) -> Callable[[int, str], Keys | None]:
        if not self._stochastic:
            return lambda e, proj: None
        step = self._buffers["lp_step"]
        assert step is not None
        if self.training:  # one step for every expert; eval reuses the current step's streams
            step = step + 1
            self._buffers["lp_step"] = step

        def keys(e: int, proj: str) -> Keys:
            base = self._base_keys[(e, proj)]
            return {k: _random.derive_keys(b.to(step.device), step) for k, b in base.items()}

        return keys

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, e: int, proj: str, keys: Keys | None) -> torch.Tensor:
        """``x @ weight^T`` as ``EmulatedLinear`` computes it (its autograd function, this expert's state)."""
        ctx = _Ctx(cast(EmulatedLinear, self._gemms[(e, proj)]), keys)  # duck-typed: recipe, _plan, _delayed_amax
        return cast(torch.Tensor, _LinearFn.apply(x, weight, None, ctx))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [T, H], ``top_k_index`` / ``top_k_weights`` [T, k] -> [T, H] (the original's eager
        loop; index ``num_experts``, the expert-parallel sentinel, is skipped)."""
        keys = self._keys()
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        hit = [idx[0] for idx in expert_hit.tolist() if idx[0] != self.num_experts]
        # Each expert's [N, K] weight as a view of one unbind per projection, not one select per expert: autograd
        # then stacks the hit experts' weight gradients (zeros for the others) in one pass, where E selects would
        # each fill a zero [E, N, K] gradient and add them up.  The same values: every row is one expert's dW.
        gate_up = self.gate_up_proj.unbind(0) if hit else ()
        down = self.down_proj.unbind(0) if hit else ()
        for e in hit:
            top_k_pos, token_idx = torch.where(expert_mask[e])
            x = hidden_states[token_idx]
            gate, up = self._linear(x, gate_up[e], e, "gate_up_proj", keys(e, "gate_up_proj")).chunk(2, -1)
            h = self.act_fn(gate) * up
            y = self._linear(h, down[e], e, "down_proj", keys(e, "down_proj"))
            y = y * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # The original module's state dict has no lowprec buffers: keep their current values instead of failing.
        for bname, buf in self._buffers.items():
            if buf is not None and prefix + bname not in state_dict:
                state_dict[prefix + bname] = buf
        super()._load_from_state_dict(state_dict, prefix, *args)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, lowprec={self.lowprec_name or 'experts'}")
