"""The MoE layers of a model, run by autopar's dropless kernel (`autopar.kernels.moe.MoE`).

A model's MoE modules are recognised by `find_moe_layers`, each described by an `MoESpec`:
the zoo's `SparseMoE`, and any transformers block that holds `experts` (fused gate_up_proj
[E, 2F, H] and down_proj [E, H, F], SwiGLU), a router (`gate` or `router`: one linear map
to E logits, maybe with a bias, maybe a correction bias on it or on the block) and maybe a
shared SwiGLU expert (`shared_expert(s)` or `shared_mlp`, with a sigmoid
`shared_expert_gate` or without). The routing (`autopar.kernels.routing.Router`: softmax or
sigmoid scores, the correction bias on the scores or the logits, group-limited top-k,
normalisation, a scaling factor) is read from the block's attributes where it names them
and chosen by a probe otherwise: the op's output and gradients must equal the block's own
on random weights and inputs, or the block is refused in one sentence, so a family whose
forward differs is never run as the op. While the engine traces, `opaque_moe` has each
recognised module call one custom op, `autopar::moe`, on its own parameters: the op is
opaque to torch.export (its fake kernel gives the output shapes), because with experts
split over ranks the dispatch sizes are data, which no traced graph can hold, and
transformers' per-expert loops do not trace at all (the planner traces the blocks as the
op too, `priced_layers`). `autopar.passes.experts` then puts an `ExpertLayer` in place of
each op node: the kernel, bound to the ep group, on the slices the runtime gives the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import PlanError
from autopar.graph.opaque import MOE_OP_NAME, described, register, stand_in
from autopar.kernels.collectives import AxisGroup, Bound
from autopar.kernels.moe import MoE
from autopar.kernels.recompute import replaying
from autopar.kernels.routing import GROUP_MAX, GROUP_SCORES, SCORES, SIGMOID, SOFTMAX, Router
from autopar.kernels.sparse_moe import SparseMoE
from autopar.modes import CP, DP, EP, TOKENS

_SILU = ("SiLU", "SiLUActivation")  # torch's and transformers' SiLU modules


class MoELayerError(PlanError):
    """An MoE module the kernel cannot compute exactly as the original does."""


@dataclass(frozen=True)
class MoESpec:
    """One MoE module as the kernel sees it. Weight paths are relative to the module, in the
    op's order: `gate` [E, H]; `experts` w1, w3 [E, F, H] and w2 [E, H, F], or (`fused`)
    w1 and w3 stacked as one [E, 2F, H] (transformers) and w2; `shared` (optional) the
    shared expert's w1, w3, w2 and, if it has one, its sigmoid gate [1, H] (Qwen2-MoE; a
    DeepSeek shared expert has none); `gate_bias` the router's bias [E] and `score_bias`
    DeepSeek-V3's correction bias [E] (paths, or "" for none). The op's third argument holds
    the shared tensors, then the gate bias, then the score bias: every tensor each rank holds
    whole. `router` says how the logits choose and weigh the experts."""

    experts: int
    top_k: int
    hidden: int
    ffn: int
    gate: str
    expert_weights: tuple[str, ...]
    shared: tuple[str, ...] = ()
    shared_ffn: int = 0
    router: Router = Router()
    fused: bool = False
    returns_aux: bool = False  # forward(x, return_aux=True) gives the balance loss too
    gate_bias: str = ""
    score_bias: str = ""

    @property
    def shared_gate(self) -> bool:
        """Whether a sigmoid gate weighs the shared expert's output."""
        return len(self.shared) == 4

    def whole(self) -> tuple[str, ...]:
        """The paths of the op's third argument, in order."""
        return self.shared + tuple(p for p in (self.gate_bias, self.score_bias) if p)

    def kernel(self, ep: AxisGroup | None = None, aux_group: AxisGroup | None = None,
               tp: AxisGroup | None = None, aux_replicas: int = 1) -> MoE:
        """The kernel module on meta: its weights are always passed in (`run`)."""
        with torch.device("meta"):
            return MoE(self.hidden, self.ffn, self.experts, self.top_k, ep=ep,
                       aux_group=aux_group, tp=tp, aux_replicas=aux_replicas,
                       router=self.router, shared_ffn=self.shared_ffn,
                       gate_bias=bool(self.gate_bias), shared_gate=self.shared_gate)

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
        names = ("shared_expert.w1.weight", "shared_expert.w3.weight",
                 "shared_expert.w2.weight", "shared_gate.weight")[:len(self.shared)]
        names += ("gate.bias",) * bool(self.gate_bias) + ("score_bias",) * bool(self.score_bias)
        out.update(zip(names, shared, strict=True))
        return out

    def op_args(self, module: nn.Module) -> tuple:
        """The op's tensor arguments: the module's own parameters (and buffers)."""
        get = functools.partial(_attr, module)
        return (get(self.gate), [get(n) for n in self.expert_weights],
                [get(n) for n in self.whole()])


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


def _silu(act: nn.Module | None, where: str) -> None:
    if act is not F.silu and type(act).__name__ not in _SILU:  # (a module or F.silu)
        what = f"the activation {type(act).__name__}" if act is not None else \
            "an activation of its own (no act_fn module)"
        raise MoELayerError(f"{where} uses {what}; autopar's MoE kernel runs SwiGLU experts "
                            "(hidden_act='silu') only.")


def _zoo_spec(m: SparseMoE) -> MoESpec:
    shared = ()
    if m.shared_expert is not None:
        shared = ("shared_expert.w1.weight", "shared_expert.w3.weight",
                  "shared_expert.w2.weight") + (("shared_gate.weight",) if m.shared_gate
                                                is not None else ())
    return MoESpec(m.num_experts, m.top_k, m.w1.size(2), m.w1.size(1), "gate.weight",
                   ("w1", "w3", "w2"), shared, m.shared_expert.w1.out_features if shared else 0,
                   m.router, returns_aux=True, gate_bias="gate.bias" if m.gate.bias is not None
                   else "", score_bias="score_bias" if m.score_bias is not None else "")


# A transformers MoE block: its experts (`experts`, fused gate_up_proj [E, 2F, H] and
# down_proj [E, H, F]), its router (`gate` or `router`: one linear map to E logits, maybe a
# correction bias) and maybe a shared SwiGLU expert (with a sigmoid gate or without)
_ROUTERS = ("gate", "router")
_SHARED = ("shared_expert", "shared_experts", "shared_mlp")
_SHARED_GATE = "shared_expert_gate"
_CORRECTIONS = ("e_score_correction_bias", "expert_bias")
_SCALES = ("routed_scaling_factor", "route_scale", "routed_scale", "router_scaling_factor")
# blocks whose routing the op cannot describe, and why (the probe refuses any other)
_WHY = {
    "PhimoeSparseMoeBlock": "routes with SparseMixer (each expert after the first chosen from a "
                            "masked softmax, its gradient a straight-through estimate)",
    "DeepseekV4SparseMoeBlock": "routes some layers by a hash of the token ids rather than "
                                "by gate scores",
    "Llama4TextMoe": "scales each token by its router score before the experts run, not after",
}
_GROUPS = ("n_group", "num_group", "num_groups", "n_groups")


def _option(modules, names, default=None):
    """The first attribute among `names` that one of `modules` has (a config value)."""
    for m in modules:
        for n in names:
            v = getattr(m, n, None)
            if v is not None and not isinstance(v, (nn.Module, torch.Tensor)):
                return v
    return default


def _router(m: nn.Module, experts: int, hidden: int, where: str) -> tuple[str, str, str]:
    """(gate weight, gate bias or "", correction bias or "") paths of the block's router."""
    name = next((n for n in _ROUTERS if isinstance(getattr(m, n, None), nn.Module)), None)
    if name is None:
        raise MoELayerError(f"{where} has no router module named gate or router that autopar "
                            "recognizes, so expert= cannot split it; drop expert= from the plan.")
    router = getattr(m, name)
    weights = [(p, t) for p, t in router.named_parameters()
               if tuple(t.shape) == (experts, hidden)]
    if len(weights) != 1:
        raise MoELayerError(f"{where} computes its router logits with more than one linear map "
                            f"to {experts} experts ({type(router).__name__}), which autopar's MoE "
                            "op does not describe; drop expert= from the plan.")
    weight = weights[0][0]
    owner = weight.rpartition(".")[0]
    bias = f"{owner}.bias" if owner else "bias"
    # the correction bias: the router's, or the block's own (handed to the router)
    tensors = [(f"{name}.{p}", p) for p, _ in list(router.named_buffers()) +
               list(router.named_parameters())]
    tensors += [(p, p) for p, _ in list(m.named_buffers(recurse=False)) +
                list(m.named_parameters(recurse=False))]
    correction = next((path for path, p in tensors if p.rpartition(".")[2] in _CORRECTIONS),
                      "")
    known = {weight, correction.removeprefix(f"{name}.")} | \
        ({bias} if _has(router, bias) else set())
    extra = [p for p, _ in router.named_parameters() if p not in known]
    extra += [p for p, _ in m.named_parameters(recurse=False) if p != correction]
    if extra:
        raise MoELayerError(f"{where} has router weights beside its linear map ("
                            f"{', '.join(extra)}), which autopar's MoE op does not describe; "
                            "drop expert= from the plan.")
    return f"{name}.{weight}", f"{name}.{bias}" if _has(router, bias) else "", correction


def _has(module: nn.Module, path: str) -> bool:
    try:
        return isinstance(_attr(module, path), torch.Tensor)
    except AttributeError:
        return False


def _shared(m: nn.Module, hidden: int, where: str) -> tuple[tuple[str, ...], int]:
    """(shared expert paths w1, w3, w2 [, gate], width) of the block; ((), 0) for none."""
    name = next((n for n in _SHARED if isinstance(getattr(m, n, None), nn.Module)), None)
    if name is None:
        return (), 0
    mlp = getattr(m, name)
    projections = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in projections) or \
            len(list(mlp.parameters())) != 3:
        raise MoELayerError(f"{where} has a shared expert ({type(mlp).__name__}) that is not a SwiGLU "
                            "of gate_proj, up_proj and down_proj without biases, which is the "
                            "only shared expert autopar's MoE op runs; drop expert= from the "
                            "plan.")
    _silu(mlp.act_fn, where)
    paths = tuple(f"{name}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))
    gate = getattr(m, _SHARED_GATE, None)
    if gate is not None:
        if not (isinstance(gate, nn.Linear) and gate.bias is None and gate.out_features == 1):
            raise MoELayerError(f"{where} has a shared expert gate that is not a linear map to one "
                                "value without bias; drop expert= from the plan.")
        paths += (f"{_SHARED_GATE}.weight",)
    return paths, projections[0].out_features


def _experts(m: nn.Module, where: str) -> tuple[int, int, int]:
    """(E, F, H) of the block's fused experts, refused in one sentence where the op's
    SwiGLU experts [E, 2F, H] and [E, H, F] are not what they compute."""
    experts = m.experts
    up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    flags = {f: getattr(experts, f, False) for f in ("has_bias", "is_transposed",
                                                     "has_post_expert_norm")}
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or \
            getattr(experts, "has_gate", True) is False:
        raise MoELayerError(f"{where} holds experts ({type(experts).__name__}) that are not gated "
                            "SwiGLU experts stored as gate_up_proj and down_proj, which are the "
                            "only experts autopar's MoE op runs; drop expert= from the plan.")
    if flags["has_bias"] or len(list(experts.parameters())) != 2:
        raise MoELayerError(f"{where} holds experts ({type(experts).__name__}) that add biases or hold "
                            "weights beside gate_up_proj and down_proj, which autopar's MoE op's "
                            "experts do not have; drop expert= from the plan.")
    if flags["is_transposed"]:
        raise MoELayerError(f"{where} holds experts ({type(experts).__name__}) that store their weights "
                            "transposed ([E, H, 2F] and [E, F, H]), which autopar's MoE op does "
                            "not split; drop expert= from the plan.")
    if flags["has_post_expert_norm"]:
        raise MoELayerError(f"{where} normalizes its experts' output, which autopar's MoE "
                            "op's experts do not; drop expert= from the plan.")
    _silu(getattr(experts, "act_fn", None), where)
    e, ffn2, hidden = up.shape
    if up.dim() == 3 and down.dim() == 3 and up.shape[1] == down.shape[2] and \
            up.shape[2] == 2 * down.shape[1]:  # [E, H, 2F] and [E, F, H]
        raise MoELayerError(f"{where} holds experts ({type(experts).__name__}) that store their weights "
                            "transposed ([E, H, 2F] and [E, F, H]), which autopar's MoE op does "
                            "not split; drop expert= from the plan.")
    if up.dim() != 3 or ffn2 % 2 or tuple(down.shape) != (e, hidden, ffn2 // 2):
        raise MoELayerError(f"{where} has expert weights gate_up_proj {tuple(up.shape)} and "
                            f"down_proj {tuple(down.shape)} that are not {e} experts [E, 2F, H] and "
                            "[E, H, F] (zero-computation or extra experts), which autopar's MoE "
                            "op does not run; drop expert= from the plan.")
    return e, ffn2 // 2, hidden


def _candidates(m: nn.Module, base: MoESpec) -> list[MoESpec]:
    """The routings the block's attributes allow, the likeliest first: what the probe
    (`_verified`) chooses among."""
    modules = [getattr(m, n) for n in _ROUTERS if isinstance(getattr(m, n, None), nn.Module)]
    modules.append(m)
    norm = _option(modules, ("norm_topk_prob",))
    groups = int(_option(modules, _GROUPS, 1) or 1)
    topk_groups = int(_option(modules, ("topk_group",), groups) or groups)
    scale = float(_option(modules, _SCALES, 1.0) or 1.0)
    scores = (SIGMOID, SOFTMAX) if base.score_bias or \
        _option(modules, ("scoring_func",)) == SIGMOID else SCORES
    grouping = [(1, 1, GROUP_MAX, False)]
    if groups > 1 and base.experts % groups == 0 and 1 <= topk_groups <= groups:
        grouping = [(groups, topk_groups, g, zero) for zero in (False, True)
                    for g in reversed(GROUP_SCORES)] + grouping
    normalize = (bool(norm),) if norm is not None else (True, False)
    corrected = bool(base.score_bias)
    return [dataclasses.replace(base, router=Router(score, n, scale, corrected, g, k, rule,
                                                    logits, zero))
            for logits in ((False, True) if corrected else (False,))
            for score in scores for g, k, rule, zero in grouping for n in normalize]


# ----------------------------------------------------------------------------------------
# The probe: a recognised block computes what the op computes, on random inputs
# ----------------------------------------------------------------------------------------

_PROBE_SHAPE = (2, 24)  # the probe's batch of tokens
_PROBE_WHOLE = 1 << 22  # parameters of a block above which the probe narrows its FFN widths
_PROBE_FFN = 8  # the narrowed width
_TOL = 1e-4
_probed: dict[tuple, MoESpec | str] = {}  # (class, base spec) -> verified spec or refusal


def _verified(m: nn.Module, base: MoESpec, where: str) -> MoESpec:
    """The candidate routing (`_candidates`) under which the op computes the block's
    output and gradients on random weights and inputs, within 1e-4; refused in one sentence
    when none does (or the block returns more than its output). Decided once per block class
    and shapes. A large block is probed with its experts' FFN widths narrowed (the width is
    the weights' own: no routing depends on it), or whole where it does not run narrowed."""
    key = (type(m), base, _settings(m))
    if key not in _probed:
        size = sum(p.numel() for p in m.parameters())
        narrow = dataclasses.replace(base, ffn=min(base.ffn, _PROBE_FFN),
                                     shared_ffn=min(base.shared_ffn, _PROBE_FFN))
        got = _fit(m, narrow, where) if size > _PROBE_WHOLE else None
        if not isinstance(got, MoESpec):
            got = _fit(m, base, where)
        _probed[key] = dataclasses.replace(got, ffn=base.ffn, shared_ffn=base.shared_ffn) \
            if isinstance(got, MoESpec) else got
    got = _probed[key]
    if isinstance(got, str):
        raise MoELayerError(got.replace("{where}", where))
    return got


def _settings(m: nn.Module) -> tuple:
    """The scalar settings of a block, its children and any config they hold (a routing
    option such as topk_method changes what the same class computes)."""
    out = []
    for owner, module in [("", m), *m.named_children()]:
        for k, v in vars(module).items():
            items = v.to_dict().items() if hasattr(v, "to_dict") and k == "config" else [(k, v)]
            out += [(owner, name, repr(x)) for name, x in items
                    if isinstance(x, (bool, int, float, str, type(None)))]
    return tuple(sorted(out))


def _probe_values(m: nn.Module, spec: MoESpec, gen: torch.Generator, device
                  ) -> dict[str, torch.Tensor]:
    """A random float32 stand-in, at a trained weight's scale, for every parameter and
    buffer of `m`, the experts' and shared expert's at the widths of `spec`."""
    f, fs, h = spec.ffn, spec.shared_ffn, spec.hidden
    shapes = dict(zip(spec.expert_weights, ((spec.experts, 2 * f, h), (spec.experts, h, f))))
    shapes.update(zip(spec.shared[:3], ((fs, h), (fs, h), (h, fs))))
    out = {}
    for n, t in list(m.named_parameters()) + list(m.named_buffers()):
        if t is None:
            continue
        shape = shapes.get(n, tuple(t.shape))
        fan = shape[-1] if len(shape) > 1 else 4
        out[n] = (torch.randn(shape, generator=gen) / fan ** 0.5).to(device)
    return out


def _fit(m: nn.Module, base: MoESpec, where: str) -> MoESpec | str:
    param = next(iter(m.parameters()))
    device = torch.device("cpu") if param.device.type == "meta" else param.device
    gen = torch.Generator().manual_seed(0)
    values = _probe_values(m, base, gen, device)
    trained = [n for n, _ in m.named_parameters()]
    for n in trained:
        values[n].requires_grad_(True)
    x = torch.randn((*_PROBE_SHAPE, base.hidden), generator=gen).to(device).requires_grad_()
    dout = torch.randn(x.shape, generator=gen).to(device)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        try:
            out = torch.func.functional_call(m, values, (x,))
        except Exception as e:  # noqa: BLE001 - the block's own forward on a probe
            return (f"{{where}} did not run on a probe batch ({type(e).__name__}: "
                    f"{e}), so autopar cannot check its MoE op against it; drop expert= from "
                    "the plan.")
        if not isinstance(out, torch.Tensor):
            return (f"{{where}} returns {type(out).__name__} rather than its output "
                    "tensor alone (router logits or losses beside it), which autopar's MoE op "
                    "does not give; drop expert= from the plan.")
        wrt = [x] + [values[n] for n in (base.gate, *base.expert_weights, *base.whole())
                     if n in trained]
        expected = torch.autograd.grad((out * dout).sum(), wrt, allow_unused=True)
        for spec in _candidates(m, base):
            got, _ = run(spec.kernel(), spec, x, values[spec.gate],
                         [values[n] for n in spec.expert_weights],
                         [values[n] for n in spec.whole()], False)
            grads = torch.autograd.grad((got * dout).sum(), wrt, allow_unused=True)
            if _close(got, out) and all(_close(a, b) for a, b in zip(grads, expected)):
                return spec
    return ("{where} routes or combines its experts in a way autopar's MoE op "
            "does not compute (no softmax or sigmoid top-k routing it describes gives the "
            "block's output and gradients on random inputs); drop expert= from the plan.")


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return (a is None or not a.any()) and (b is None or not b.any())
    if a.shape != b.shape:
        return False
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm()) <= _TOL * max(float(b.norm()), 1e-6)


def _transformers_spec(m: nn.Module, where: str) -> MoESpec:
    """The spec of a transformers MoE block, checked against the block (`_verified`)."""
    where = f"{where} ({type(m).__name__})"
    if getattr(m, "jitter_noise", 0) or getattr(m, "router_jitter_noise", 0):
        raise MoELayerError(f"{where} multiplies its inputs by random jitter in training "
                            "(router_jitter_noise > 0), which no rank can reproduce for another; "
                            "set router_jitter_noise=0.")
    why = _WHY.get(type(m).__name__)
    if why is not None:
        raise MoELayerError(f"{where} {why}, which autopar's MoE op does "
                            "not compute; drop expert= from the plan.")
    e, ffn, hidden = _experts(m, where)
    gate, gate_bias, score_bias = _router(m, e, hidden, where)
    shared, shared_ffn = _shared(m, hidden, where)
    router = gate.partition(".")[0]
    known = {"experts", router} | {p.partition(".")[0] for p in shared}
    extra = [n for n, c in m.named_children() if n not in known and
             (list(c.parameters()) or not isinstance(c, nn.Identity))]
    if extra:
        raise MoELayerError(f"{where} runs {', '.join(extra)} beside its "
                            "router and experts, which autopar's MoE op does not; drop expert= "
                            "from the plan.")
    top_k = int(_option([getattr(m, router), m], ("top_k", "num_experts_per_tok", "k"), 0))
    if top_k < 1:
        raise MoELayerError(f"{where} names no top_k autopar recognizes, "
                            "so expert= cannot split it; drop expert= from the plan.")
    if top_k > e:
        raise MoELayerError(f"{where} routes each token to top_k={top_k} experts but has {e}; "
                            "top_k must be between 1 and the number of experts.")
    base = MoESpec(e, top_k, hidden, ffn, gate, ("experts.gate_up_proj", "experts.down_proj"),
                   shared, shared_ffn, fused=True, gate_bias=gate_bias, score_bias=score_bias)
    return _verified(m, base, where)


def _is_moe_block(module: nn.Module) -> bool:
    """A module that holds experts (a transformers MoE block, or one autopar may refuse)."""
    return isinstance(getattr(module, "experts", None), nn.Module) and \
        not isinstance(module, SparseMoE)


def spec_of(module: nn.Module, where: str) -> MoESpec | None:
    """The MoESpec of a module autopar runs as an MoE layer; None for any other module; an
    MoE block the op does not compute exactly is refused in one sentence (MoELayerError)."""
    if isinstance(module, SparseMoE):
        if isinstance(module, MoE) and module.ep is not None and module.ep.size > 1:
            raise MoELayerError(f"{where} is an autopar MoE already split over ep; give "
                                "parallelize the one-device model (SparseMoE layers).")
        return _zoo_spec(module)
    if _is_moe_block(module):
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


def priced_layers(model: nn.Module) -> dict[str, MoESpec]:
    """The transformers MoE blocks the planner traces as the op (what the engine runs under
    an expert plan, priced by autopar.cost.layer._moe): a block's own per-expert loop does
    not trace into grouped matmuls the cost model reads. The zoo's SparseMoE traces its own
    grouped matmuls; a model whose blocks the op does not compute keeps its own code."""
    try:
        layers = find_moe_layers(model)
    except MoELayerError:
        return {}
    return {name: spec for name, spec in layers.items()
            if not isinstance(model.get_submodule(name), SparseMoE)}


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
                        "SparseMoE or a transformers block of experts and router); drop "
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
    return stand_in(forward, key)  # (the trace cache keys it by `key`)


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
        if replaying():  # its forward again in the backward (kernels.recompute): the same
            return out   # routing, counted once
        if k.last_routed is not None and self._g().log.enabled:  # (not a shape probe)
            self.runs += 1
            self.routed = k.last_routed if self.routed is None else self.routed + k.last_routed
            done = k.last_tokens_per_expert
            self.computed = done if self.computed is None else self.computed + done
        return out

