"""A mixture-of-experts decoder in the Mixtral layout, and its dropless MoE feed-forward.

Llama's blocks (RMSNorm, rotary embeddings, grouped-query attention) with the SwiGLU
feed-forward replaced by `SparseMoE`: a router picks `top_k` of `n_experts` SwiGLU experts
per token and the output is their weighted sum (Jiang et al. 2024, "Mixtral of Experts",
eq. 1-2). Optional shared experts run on every token behind a sigmoid gate, as Qwen2-MoE.
The first `dense_layers` blocks may keep a dense SwiGLU feed-forward of width `dense_ffn`
instead, as DeepSeek-V3's first three of 61 (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", arXiv 2412.19437, §4.2). With `kv_lora_rank` > 0 the attention is DeepSeek's
multi-head latent attention (`autopar.models.mla`).

`SparseMoE` computes the layer on one device with static shapes only, so torch.export
traces it on the meta device: the token-expert pairs are sorted by expert (a fixed-size
argsort), the experts run as one grouped matmul over the sorted rows (`torch._grouped_mm`,
whose FLOPs are those of the active experts only), and each token sums its top-k results
in slot order. `autopar.kernels.moe.MoE` is the same layer with its experts split over an
expert-parallel group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.llama import Attention, RMSNorm, rope_tables
from autopar.models.mla import MLAttention

SOFTMAX, SIGMOID = "softmax", "sigmoid"
SCORES = (SOFTMAX, SIGMOID)


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_hidden: int  # of each expert
    n_experts: int
    top_k: int
    max_seq: int
    shared_ffn: int = 0  # width of the shared expert (Qwen2-MoE); 0: none
    score: str = SOFTMAX
    normalize_topk: bool = True  # Mixtral renormalises the top-k weights to sum to 1
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dense_layers: int = 0  # the first blocks keep a dense SwiGLU feed-forward (DeepSeek-V3: 3)
    dense_ffn: int = 0  # its width (required when dense_layers > 0)
    # multi-head latent attention (DeepSeek-V3) where kv_lora_rank > 0: the ranks of the
    # query (0: no query bottleneck) and key/value latents, and the head widths
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The width the rotary tables turn: an MLA head's rotary part, else a whole head."""
        return self.qk_rope_head_dim if self.mla else self.dim // self.n_head

    def __post_init__(self):
        if not 0 <= self.dense_layers < self.n_layer:
            raise ValueError(f"MoEConfig: dense_layers={self.dense_layers} must be at least 0 "
                             f"and fewer than n_layer={self.n_layer}, so that one MoE block "
                             "remains (a model of dense blocks only is the llama family).")
        if (self.dense_ffn > 0) != (self.dense_layers > 0) or self.dense_ffn < 0:
            raise ValueError(f"MoEConfig: dense_ffn={self.dense_ffn} must be positive exactly "
                             f"when there are dense layers (dense_layers={self.dense_layers}).")
        if (not self.mla and self.dim % self.n_head) or self.n_head % self.n_kv_head:
            raise ValueError(f"MoEConfig: dim={self.dim} must be divisible by n_head="
                             f"{self.n_head}, and n_head by n_kv_head={self.n_kv_head}.")
        if self.mla and not (self.qk_nope_head_dim and self.qk_rope_head_dim
                             and self.v_head_dim):
            raise ValueError("MoEConfig: multi-head latent attention (kv_lora_rank="
                             f"{self.kv_lora_rank}) needs positive qk_nope_head_dim, "
                             "qk_rope_head_dim and v_head_dim.")
        if not self.mla and self.q_lora_rank:
            raise ValueError(f"MoEConfig: q_lora_rank={self.q_lora_rank} is multi-head latent "
                             "attention's; give kv_lora_rank too, or leave q_lora_rank 0.")
        if self.rope_dim % 2:
            raise ValueError(f"MoEConfig: rotary width {self.rope_dim} must be even "
                             "to rotate pairs.")
        check_routing(self.n_experts, self.top_k, self.score)


def check_routing(experts: int, top_k: int, score: str) -> None:
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                         f"({experts}).")
    if score not in SCORES:
        raise ValueError(f"router score {score!r} is not one of {', '.join(SCORES)}.")


@dataclass(frozen=True)
class Routing:
    """Where each of T tokens goes: `experts` [T, k] (long) with their combine `weights`
    [T, k], and the router's probabilities `probs` [T, E] (float32, summing to 1 per token)
    from which the balance loss is taken."""

    weights: torch.Tensor
    experts: torch.Tensor
    probs: torch.Tensor


def route(logits: torch.Tensor, top_k: int, score: str = SOFTMAX,
          normalize: bool = True) -> Routing:
    """Top-k routing of gate logits [T, E]: softmax (or sigmoid) scores in float32, the k
    largest by torch.topk (so ties fall as torch.topk breaks them), optionally renormalised
    to sum to 1 per token. Sigmoid scores are normalised per token for the balance loss, as
    DeepSeek-V3's sequence-wise balance loss does."""
    check_routing(logits.size(-1), top_k, score)
    logits = logits.float()
    scores = logits.softmax(-1) if score == SOFTMAX else logits.sigmoid()
    weights, experts = torch.topk(scores, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    probs = scores if score == SOFTMAX else scores / scores.sum(-1, keepdim=True)
    return Routing(weights, experts, probs)


def balance_stats(routing: Routing) -> torch.Tensor:
    """[2E + 1] float32: top-k assignments per expert, summed router probabilities per expert,
    and the token count. Sums, so that ranks holding parts of a batch add theirs up."""
    probs = routing.probs
    flat = routing.experts.reshape(-1)
    counts = torch.zeros(probs.size(-1), dtype=torch.float32, device=probs.device).scatter_add(
        0, flat, torch.ones_like(flat, dtype=torch.float32))
    tokens = torch.ones_like(probs[:, :1]).sum(0)
    return torch.cat([counts, probs.sum(0), tokens])


def balance_loss(stats: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4, alpha = 1):
    E * sum_i f_i P_i, f_i the share of top-k assignments sent to expert i per token and P_i
    its mean router probability; as transformers' `load_balancing_loss_func` (Mixtral)."""
    num_experts = (stats.numel() - 1) // 2
    tokens = stats[-1]
    f, p = stats[:num_experts] / tokens, stats[num_experts:2 * num_experts] / tokens
    return num_experts * (f * p).sum()


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

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, *,
                 score: str = SOFTMAX, normalize: bool = True, shared_ffn: int = 0,
                 local_experts: int | None = None):
        super().__init__()
        check_routing(experts, top_k, score)
        self.num_experts, self.top_k, self.score, self.normalize = experts, top_k, score, normalize
        local = experts if local_experts is None else local_experts
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(local, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(local, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, ffn))
        self.shared_expert = SwiGLU(hidden, shared_ffn) if shared_ffn else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if shared_ffn else None
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        for p in self.parameters():
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, H)
        routing = route(self.gate(x), self.top_k, self.score, self.normalize)
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
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
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


class Block(nn.Module):
    """Attention then the MoE feed-forward (`moe`), or with `dense=True` a dense SwiGLU one
    (`ffn`, of width `cfg.dense_ffn`) and no router."""

    def __init__(self, cfg: MoEConfig, dense: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLAttention(cfg) if cfg.mla else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if dense:
            self.ffn = SwiGLU(cfg.dim, cfg.dense_ffn)
        else:
            self.moe = SparseMoE(cfg.dim, cfg.ffn_hidden, cfg.n_experts, cfg.top_k,
                                 score=cfg.score, normalize=cfg.normalize_topk,
                                 shared_ffn=cfg.shared_ffn)
        self.dense = dense

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                return_aux: bool = False):
        """x [B, T, H] -> x, or (x, balance loss) with `return_aux` (None for a dense block)."""
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.dense:
            x = x + self.ffn(self.ffn_norm(x))
            return (x, None) if return_aux else x
        if not return_aux:
            return x + self.moe(self.ffn_norm(x))
        y, aux = self.moe(self.ffn_norm(x), return_aux=True)
        return x + y, aux


class MoETransformer(nn.Module):
    """forward(idx: long [B, T]) -> logits [B, T, vocab_size]; with `return_aux=True` also
    the sum over MoE blocks of their balance losses (Switch adds each router's loss). Blocks
    0 ... dense_layers - 1 are dense, the rest MoE."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, dense=i < cfg.dense_layers)
                                    for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        half = cfg.rope_dim // 2
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq, half), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every weight and the rotary tables (also after `to_empty` from meta)."""
        cfg = self.config
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.rope_dim, cfg.max_seq, cfg.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, SparseMoE):
                for w in (module.w1, module.w3, module.w2):
                    nn.init.normal_(w, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor, return_aux: bool = False):
        T = idx.size(1)
        cos, sin = torch.narrow(self.rope_cos, 0, 0, T), torch.narrow(self.rope_sin, 0, 0, T)
        x = self.tok_embeddings(idx)  # (B, T, H)
        aux = []
        for block in self.blocks:
            if return_aux:
                x, block_aux = block(x, cos, sin, return_aux=True)
                if block_aux is not None:
                    aux.append(block_aux)
            else:
                x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        return (logits, torch.stack(aux).sum()) if return_aux else logits
