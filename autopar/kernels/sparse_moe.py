"""The dropless top-k MoE feed-forward on one device (`SparseMoE`) and its SwiGLU experts.

`SparseMoE` computes the layer with static shapes only, so torch.export traces it on the
meta device: the token-expert pairs are sorted by expert (a fixed-size argsort), the experts
run as one grouped matmul over the sorted rows (`torch._grouped_mm`, whose FLOPs are those of
the active experts only), and each token sums its top-k results in slot order.
`autopar.kernels.moe.MoE` is the same layer with its experts split over an expert-parallel
group; the zoo's MoE transformer (`autopar.models.moe`) stacks it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from autopar.kernels.routing import (
    SOFTMAX,
    Router,
    Routing,
    balance_loss,
    balance_stats,
    check_routing,
    route,
)


def is_eager(x: torch.Tensor) -> bool:
    """A real tensor run eagerly (not a fake or meta tensor under tracing)."""
    return type(x) in (torch.Tensor, nn.Parameter) and x.device.type != "meta" \
        and not torch.compiler.is_compiling()


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs (forward and backward) on this device and dtype."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
        w = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        torch._grouped_mm(x, w, offs=offs).backward(torch.ones(4, 8, dtype=dtype,
                                                               device=device_type))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _grouped_mm_fits(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    # row strides of 16 bytes, as the kernels require
    aligned = all(w.size(1) * w.element_size() % 16 == 0 and w.size(2) * w.element_size() % 16
                  == 0 for w in weights)
    if not is_eager(x):  # its meta kernel, which fake tensors run, takes bfloat16 only
        return aligned and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16
    return aligned and _grouped_mm_runs(x.device.type, x.dtype)


def expert_ffn(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
               w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert: xs [N, H], counts [E] rows per expert (in
    expert order, summing to N), w1, w3 [E, F, H], w2 [E, H, F] -> [N, H].

    One grouped matmul per weight where torch._grouped_mm runs; else, eagerly, a loop over
    the experts; else (a trace in a dtype or width it does not take) every expert on every
    row, masked, which computes the same values with E times the FLOPs.
    """
    if _grouped_mm_fits(xs, w1, w2):
        offs = counts.cumsum(0).to(torch.int32)

        def mm(a, w):
            return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)

        return mm(F.silu(mm(xs, w1)) * mm(xs, w3), w2)
    if is_eager(xs):
        parts = torch.split(xs, counts.tolist())
        return torch.cat([F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e])
                          for e, part in enumerate(parts)])
    ids = torch.repeat_interleave(torch.arange(w1.size(0), device=xs.device), counts,
                                  output_size=xs.size(0))
    out = xs.new_zeros(xs.shape[0], w2.size(1))
    for e in range(w1.size(0)):
        y = F.linear(F.silu(F.linear(xs, w1[e])) * F.linear(xs, w3[e]), w2[e])
        out = out + (ids == e).unsqueeze(-1).to(y.dtype) * y
    return out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Dropless top-k MoE feed-forward on one device: x [..., H] -> [..., H].

    Experts are stacked weights w1, w3 [E, F, H] and w2 [E, H, F] (Mixtral's gate, up and
    down projections). `forward(x, return_aux=True)` also returns the balance loss.
    `last_tokens_per_expert` holds the rows each expert computed in the last eager forward.
    """

    # written by an eager forward for the expert-load report, never read by one: a trace
    # does not depend on it (graph/trace_cache.py leaves it out of a module's fingerprint)
    autopar_untraced_state = frozenset({"last_tokens_per_expert"})

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *,
                 score: str = SOFTMAX, normalize: bool = True, shared_ffn: int = 0,
                 local_experts: int | None = None, router: Router | None = None,
                 gate_bias: bool = False, shared_gate: bool = True):
        super().__init__()
        self.router = Router(score, normalize) if router is None else router
        check_routing(experts, top_k, self.router.score)
        if experts % self.router.groups:
            raise ValueError(f"{experts} experts do not form {self.router.groups} groups of "
                             "equal size; choose a group count that divides the experts.")
        self.num_experts, self.top_k = experts, top_k
        local = experts if local_experts is None else local_experts
        self.gate = nn.Linear(hidden, experts, bias=gate_bias)
        self.w1 = nn.Parameter(torch.empty(local, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(local, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, ffn))
        # DeepSeek-V3's correction bias for the choice (a buffer: load balancing sets it)
        self.register_buffer("score_bias", torch.zeros(experts) if self.router.corrected
                             else None)
        self.shared_expert = SwiGLU(hidden, shared_ffn) if shared_ffn else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_ffn and shared_gate \
            else None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        routing = route(self.gate(x), self.top_k, router=self.router,
                        correction=self.score_bias)
        k = self.top_k
        flat = routing.experts.reshape(-1)  # (T*k,) token-major
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order within
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add(
            0, flat, torch.ones_like(flat))
        xe = self.enter_experts(x)
        ys = self.leave_experts(self.run_experts(xe.index_select(0, order // k), counts))
        y = ys.index_select(0, torch.argsort(order)).view(-1, k, shape[-1])  # (T, k, H)
        out = (y.float() * routing.weights.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.leave_experts(self.shared_expert(self.enter_experts(x)))  # (T, H)
            out = out + (shared if self.shared_gate is None else
                         torch.sigmoid(self.shared_gate(x)) * shared)
        out = out.view(shape)
        if not return_aux:
            return out
        return out, self.balance_loss(routing)

    def enter_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens as the experts (routed or shared) read them: x itself on one device (the
        kernel's tensor-parallel experts sum its gradient over their ranks here)."""
        return x

    def leave_experts(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' output rows before the combine: y itself on one device (the kernel's
        tensor-parallel experts all-reduce their partial sums here)."""
        return y

    def run_experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts on rows grouped by expert: xs [T*k, H], counts [E] -> [T*k, H]."""
        if is_eager(xs):
            self.last_tokens_per_expert = counts.detach().clone()
        return expert_ffn(xs, counts, self.w1, self.w3, self.w2)

    def balance_loss(self, routing: Routing) -> torch.Tensor:
        """The balance loss of this batch (the kernel's subclass takes it over its group)."""
        return balance_loss(balance_stats(routing))
