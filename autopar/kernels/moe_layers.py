"""The MoE layers of a model, run by autopar's dropless kernel (`autopar.kernels.moe.MoE`).

A model's MoE modules (the zoo's `SparseMoE`, transformers' `MixtralSparseMoeBlock` and
`Qwen2MoeSparseMoeBlock` with its shared expert) are recognised by `find_moe_layers`, each
described by an `MoESpec`. While the engine traces, `opaque_moe` has each of them call one
custom op, `autopar::moe`, on its own parameters: the op is opaque to torch.export (its fake
kernel gives the output shapes), because with experts split over ranks the dispatch sizes are
data, which no traced graph can hold, and transformers' per-expert loops do not trace at all.
`autopar.passes.experts` then puts an `ExpertLayer` in place of each op node: the kernel,
bound to the ep group, on the slices the runtime gives the graph. Every recognised module
computes the kernel's function (same router and top-k ties, sorted dispatch, SwiGLU experts,
combine in slot order; tests/test_moe_runtime.py checks each against the original module).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from autopar.errors import PlanError
from autopar.graph.opaque import MOE_OP_NAME, described, register
from autopar.kernels.collectives import AxisGroup, Bound
from autopar.kernels.moe import MoE
from autopar.models.moe import SOFTMAX, SparseMoE
from autopar.modes import CP, DP, EP, TOKENS

_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' SiLU modules


class MoELayerError(PlanError):
    """An MoE module the kernel cannot compute exactly as the original does."""


@dataclass(frozen=True)
class MoESpec:
    """One MoE module as the kernel sees it. Weight paths are relative to the module, in the
    op's order: `gate` [E, H]; `experts` w1, w3 [E, F, H] and w2 [E, H, F], or (`fused`)
    w1 and w3 stacked as one [E, 2F, H] (transformers) and w2; `shared` (optional) the
    shared expert's w1, w3, w2 and its sigmoid gate [1, H] (Qwen2-MoE)."""

    experts: int
    top_k: int
    hidden: int
    ffn: int
    gate: str
    expert_weights: tuple[str, ...]
    shared: tuple[str, ...] = ()
    shared_ffn: int = 0
    score: str = SOFTMAX
    normalize: bool = True
    fused: bool = False
    returns_aux: bool = False  # forward(x, return_aux=True) gives the balance loss too

    def kernel(self, ep: AxisGroup | None = None, aux_group: AxisGroup | None = None,
               tp: AxisGroup | None = None, aux_replicas: int = 1) -> MoE:
        """The kernel module on meta: its weights are always passed in (`run`)."""
        with torch.device("meta"):
            return MoE(self.hidden, self.ffn, self.experts, self.top_k, ep=ep,
                       aux_group=aux_group, tp=tp, aux_replicas=aux_replicas, score=self.score,
                       normalize=self.normalize, shared_ffn=self.shared_ffn)

    def splits_over(self, size: int) -> bool:
        """Whether every expert's FFN width (and the shared expert's) splits over `size`."""
        return self.ffn % size == 0 and self.shared_ffn % size == 0

    def kernel_weights(self, gate, experts, shared) -> dict[str, torch.Tensor]:
        """The kernel's parameter names -> the tensors the op was given."""
        if self.fused:
            w13, w2 = experts
            # (E, 2F, H): gate rows, then up rows (a tp rank's slice: its gate rows, then its
            # up rows; the layout S(tp)x2 cuts the two blocks separately)
            w1, w3 = w13.chunk(2, dim=1)
        else:
            w1, w3, w2 = experts
        out = {"gate.weight": gate, "w1": w1, "w3": w3, "w2": w2}
        if shared:
            names = ("shared_expert.w1.weight", "shared_expert.w3.weight",
                     "shared_expert.w2.weight", "shared_gate.weight")
            out.update(zip(names, shared, strict=True))
        return out

    def op_args(self, module: nn.Module) -> tuple:
        """The op's tensor arguments: the module's own parameters."""
        get = functools.partial(_attr, module)
        return (get(self.gate), [get(n) for n in self.expert_weights],
                [get(n) for n in self.shared])


def run(kernel: MoE, spec: MoESpec, x, gate, experts, shared, with_aux: bool):
    """The layer on x [..., H] with the given weights -> (out [..., H], balance loss; zero
    when `with_aux` is False)."""
    weights = spec.kernel_weights(gate, experts, shared)
    if with_aux:
        return torch.func.functional_call(kernel, weights, (x,), {"return_aux": True})
    out = torch.func.functional_call(kernel, weights, (x,))
    return out, out.new_zeros((), dtype=torch.float32)


# ----------------------------------------------------------------------------------------
# Recognising a model's MoE modules
# ----------------------------------------------------------------------------------------


def _attr(module: nn.Module, path: str) -> torch.Tensor:
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _silu(act: nn.Module, where: str) -> None:
    if type(act).__name__ not in _SILU:
        raise MoELayerError(f"{where} uses the activation {type(act).__name__}; autopar's MoE "
                            "kernel runs SwiGLU experts (hidden_act='silu') only.")


def _zoo_spec(m: SparseMoE) -> MoESpec:
    shared = ()
    if m.shared_expert is not None:
        shared = ("shared_expert.w1.weight", "shared_expert.w3.weight",
                  "shared_expert.w2.weight", "shared_gate.weight")
    return MoESpec(m.num_experts, m.top_k, m.w1.size(2), m.w1.size(1), "gate.weight",
                   ("w1", "w3", "w2"), shared, m.shared_expert.w1.out_features if shared else 0,
                   m.score, m.normalize, returns_aux=True)


def _transformers_spec(m: nn.Module, where: str) -> MoESpec:
    experts = m.experts
    _silu(experts.act_fn, where)
    if getattr(m, "jitter_noise", 0) > 0:
        raise MoELayerError(f"{where} multiplies its inputs by random jitter in training "
                            "(router_jitter_noise > 0), which no rank can reproduce for another; "
                            "set router_jitter_noise=0.")
    gate = m.gate
    e, ffn2, hidden = experts.gate_up_proj.shape
    shared, shared_ffn = (), 0
    if hasattr(m, "shared_expert"):  # Qwen2-MoE
        _silu(m.shared_expert.act_fn, where)
        shared = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                  "shared_expert.down_proj.weight", "shared_expert_gate.weight")
        shared_ffn = m.shared_expert.gate_proj.out_features
    return MoESpec(e, gate.top_k, hidden, ffn2 // 2, "gate.weight",
                   ("experts.gate_up_proj", "experts.down_proj"), shared, shared_ffn,
                   normalize=bool(getattr(gate, "norm_topk_prob", True)), fused=True)


_TRANSFORMERS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock")


def spec_of(module: nn.Module, where: str) -> MoESpec | None:
    """The MoESpec of a module autopar runs as an MoE layer; None for any other module."""
    if isinstance(module, SparseMoE):
        if isinstance(module, MoE) and module.ep is not None and module.ep.size > 1:
            raise MoELayerError(f"{where} is an autopar MoE already split over ep; give "
                                "parallelize the one-device model (SparseMoE layers).")
        return _zoo_spec(module)
    if type(module).__name__ in _TRANSFORMERS:
        return _transformers_spec(module, where)
    return None


def find_moe_layers(model: nn.Module) -> dict[str, MoESpec]:
    """Module path -> MoESpec of every MoE layer of `model` (outermost only)."""
    config = getattr(model, "config", None)
    found: dict[str, MoESpec] = {}
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in found):
            continue
        spec = spec_of(module, f"MoE layer {name or type(model).__name__}")
        if spec is not None:
            found[name] = spec
    if found and getattr(config, "output_router_logits", False):
        raise MoELayerError(f"{type(model).__name__} adds its router loss from logits its "
                            "gates record per rank; autopar's MoE kernel computes the balance "
                            "loss over the global batch only for the zoo's layers, so set "
                            "config.output_router_logits=False.")
    return found


def expert_layers(model: nn.Module, plan) -> dict[str, MoESpec]:
    """The MoE layers the engine runs as its kernel: split over the plan's ep axis, or with
    ep 1 under a 1D tensor axis (their experts split over tp, `Plan.splits_experts`), each
    checked against the plan in one sentence. {} otherwise, where every rank keeps every
    expert and the model's own code runs, as it does, with ep 1, for an MoE module the kernel
    does not compute (MoELayerError)."""
    if plan is None or not plan.splits_experts():
        return {}
    if plan.ep == 1:
        try:
            return find_moe_layers(model)
        except MoELayerError:
            return {}
    layers = find_moe_layers(model)
    if not layers:
        raise PlanError(f"the plan splits experts over ep={plan.ep} ranks but "
                        f"{type(model).__name__} has no MoE layer autopar runs (the zoo's "
                        "SparseMoE, transformers' Mixtral or Qwen2-MoE sparse blocks); drop "
                        "expert= from the plan.")
    for name, spec in layers.items():
        plan.check_experts(spec.experts, spec.top_k, f"MoE layer {name}")
    return layers


# ----------------------------------------------------------------------------------------
# The opaque op and the traced stand-ins
# ----------------------------------------------------------------------------------------

def spec_key(spec: MoESpec) -> int:
    """The op's integer name for `spec` (the same in every process), registered
    (op arguments are tensors and scalars only; autopar.graph.opaque)."""
    return register(spec)


def spec_for(key: int) -> MoESpec:
    return described(key)


@torch.library.custom_op(MOE_OP_NAME, mutates_args=())
def moe_op(x: torch.Tensor, gate: torch.Tensor, experts: list[torch.Tensor],
           shared: list[torch.Tensor], spec: int, with_aux: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One MoE layer on one device (every expert here): (out, balance loss). Graphs the
    engine runs hold it in place of a model's MoE module until autopar.passes.experts puts
    the expert-parallel kernel there; this eager body has no backward of its own."""
    s = spec_for(spec)
    out, aux = run(s.kernel(), s, x, gate, experts, shared, with_aux)
    return out.clone(), aux.clone()


@moe_op.register_fake
def _(x, gate, experts, shared, spec, with_aux):
    return torch.empty_like(x), x.new_empty((), dtype=torch.float32)


MOE_OP = torch.ops.autopar.moe.default


@contextlib.contextmanager
def opaque_moe(model: nn.Module, layers: dict[str, MoESpec]):
    """While tracing: each MoE module of `layers` calls `autopar::moe` on its parameters (an
    instance-level forward, removed after, so names and the module tree stay the model's)."""
    patched = []
    try:
        for name, spec in layers.items():
            module = model.get_submodule(name)
            module.forward = _stand_in(module, spec, spec_key(spec))
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward


def _stand_in(module: nn.Module, spec: MoESpec, key: int):
    if spec.returns_aux:
        def forward(x, return_aux: bool = False):
            out, aux = moe_op(x, *spec.op_args(module), key, return_aux)
            return (out, aux) if return_aux else out
    else:
        def forward(x):
            return moe_op(x, *spec.op_args(module), key, False)[0]
    return forward


class ExpertLayer(Bound):
    """An `autopar::moe` node of a rewritten graph: the kernel with its experts split over
    the ep axis (and, with `tensor` an axis, each expert's FFN width over it) and its balance
    loss over the data (x cp) ranks. forward(x, gate, *experts, *shared) -> (out, loss). `routed`
    and `computed` add up the routing of the forwards since `reset_load` (every micro-batch
    of a step): this rank's token-expert assignments per expert [E], and the rows its own
    experts computed [E/ep]."""

    def __init__(self, spec: MoESpec, name: str, with_aux: bool, layer: str | None = None,
                 tensor: str | None = None):
        super().__init__(EP)
        self.spec, self.name, self.with_aux = spec, name, with_aux
        self.tensor = tensor  # the axis each expert's FFN width is split over, or None
        self.layer = layer  # the analysed layer it belongs to (where its bytes are counted)
        self.runs = 0  # forwards since reset_load (a pipeline's micro-batches)
        # kept out of the module tree: its meta weights are never used (the graph passes them)
        self.__dict__["kernel"] = spec.kernel()
        self.routed: torch.Tensor | None = None
        self.computed: torch.Tensor | None = None
        # under a pipeline, with the balance loss: its statistics over the step's
        # micro-batches (autopar.kernels.moe.ScheduleBalance; the engine sets it)
        self.balance = None

    def bind(self, groups: dict[str, AxisGroup]) -> None:
        super().bind(groups)
        tp = groups[self.tensor] if self.tensor is not None else None
        # the balance loss's statistics over the ranks that split the tokens: dp x cp (the
        # cp ranks of one sample add the same loss, so its backward is divided by cp)
        tokens = groups.get(TOKENS, groups[DP])
        cp = groups[CP].size if CP in groups else 1
        self.__dict__["kernel"] = self.spec.kernel(self.group, tokens, tp, cp)

    def extra_repr(self) -> str:
        tensor = f", tensor={self.tensor}" if self.tensor is not None else ""
        return f"{self.name}, experts={self.spec.experts}, top_k={self.spec.top_k}, " \
            f"axis={EP}{tensor}"

    def reset_load(self) -> None:
        """Forget the routing counted so far (the engine calls it as a step begins)."""
        self.routed = self.computed = None
        self.runs = 0
        if self.balance is not None:
            self.balance.reset()

    def forward(self, x, gate, *weights):
        n = len(self.spec.expert_weights)
        self.kernel.last_routed = None
        # (a shape probe, logging off, takes no part in the step's statistics)
        self.kernel.schedule = self.balance if self._g().log.enabled else None
        out = run(self.kernel, self.spec, x, gate, list(weights[:n]), list(weights[n:]),
                  self.with_aux)
        k = self.kernel
        if k.last_routed is not None and self._g().log.enabled:  # (not a shape probe)
            self.runs += 1
            self.routed = k.last_routed if self.routed is None else self.routed + k.last_routed
            done = k.last_tokens_per_expert
            self.computed = done if self.computed is None else self.computed + done
        return out

