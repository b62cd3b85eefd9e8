"""Llama: a decoder-only transformer in the LLaMA / LLaMA-2 / Llama-3 layout.

RMSNorm before each sublayer, rotary position embeddings on queries and keys,
grouped-query attention (fewer key/value heads than query heads) and a SwiGLU
feed-forward. No linear has a bias. Options cover the family's later members: heads
wider than dim / n_head and an RMSNorm over each query and key head (Qwen3), and
Llama 3.1's rescaled rotary frequencies for its 128K context.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's rotary frequencies for a longer context (its released `rope_scaling`):
    wavelengths shorter than original_max_seq / high_freq_factor are kept, those longer than
    original_max_seq / low_freq_factor divided by `factor`, the band between interpolated."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_kv_head: int
    dim: int
    ffn_hidden: int
    max_seq: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    head_dim: int = 0  # width of each head; 0: dim // n_head
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        # a spec gives 0/1 for the flags
        object.__setattr__(self, "tie_embeddings", bool(self.tie_embeddings))
        object.__setattr__(self, "qk_norm", bool(self.qk_norm))
        if not self.head_dim and self.dim % self.n_head:
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must be divisible by n_head={self.n_head} "
                "(or give head_dim)."
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig: n_head={self.n_head} must be a multiple of "
                f"n_kv_head={self.n_kv_head}."
            )
        if head_width(self) % 2:
            raise ValueError(
                f"LlamaConfig: head dim {head_width(self)} must be even to rotate pairs."
            )


def head_width(cfg) -> int:
    """The width of one attention head: `cfg.head_dim` where given, else dim / n_head."""
    return getattr(cfg, "head_dim", 0) or cfg.dim // cfg.n_head


def rope_tables(head_dim: int, max_seq: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, each [max_seq, head_dim // 2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        wavelength = 2 * math.pi / inv_freq
        old = scaling.original_max_seq
        # 0 at the long-wavelength edge of the band, 1 at its short edge
        blend = ((old / wavelength - scaling.low_freq_factor)
                 / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
        inv_freq = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    angles = torch.outer(torch.arange(max_seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by position; the first half of each head pairs with the second.

    Real arithmetic instead of complex numbers, so that export and the sharding passes
    only ever see real tensors.
    """
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, n_kv_head, T, head_dim] -> [B, n_kv_head * rep, T, head_dim].

    Key/value head j serves the rep consecutive query heads j * rep ... j * rep + rep - 1.
    """
    B, n_kv_head, T, head_dim = x.size(0), x.size(1), x.size(2), x.size(3)
    x = x[:, :, None].expand(B, n_kv_head, rep, T, head_dim)
    return x.reshape(B, n_kv_head * rep, T, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: the mean of squares loses too much in bf16.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.n_kv_head = cfg.n_kv_head
        self.head_dim = head_width(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.dim, bias=False)
        qk_norm = getattr(cfg, "qk_norm", False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T = x.size(0), x.size(1)
        q = self.wq(x).view(B, T, self.n_head, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_head // self.n_kv_head
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """forward(idx: long [B, T]) -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived from the config, so kept out of the state dict.
        head_dim = head_width(cfg)
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq, head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq, head_dim // 2), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Fill every weight and the rotary tables; also materializes a model
        that was built on the meta device and moved with ``to_empty``."""
        cfg = self.config
        # to_empty() gives each module a parameter of its own, which breaks the tie.
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(head_width(cfg), cfg.max_seq, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # narrow rather than a slice: torch.fx hands buffers over as plain tensors,
        # and a plain tensor cannot be sliced by a traced length.
        T = idx.size(1)
        cos, sin = torch.narrow(self.rope_cos, 0, 0, T), torch.narrow(self.rope_sin, 0, 0, T)
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.output(self.norm(x))
