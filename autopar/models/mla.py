"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention.

Queries and keys/values each pass through a low-rank bottleneck: x -> a latent of rank
`q_lora_rank` (`kv_lora_rank`), RMSNorm, then an up-projection to every head. Each query
and key head is a position-free part of `qk_nope_head_dim` and a rotary part of
`qk_rope_head_dim`; the keys' rotary part is one head shared by all heads, projected from
x beside the kv latent (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv
2412.19437, §2.1.1, eq. 1-11). Values are `v_head_dim` wide. Every projection is a plain
linear, so the planner prices each at its own shape.
"""

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.llama import RMSNorm, apply_rope


class MLAttention(nn.Module):
    """x [B, T, dim] -> [B, T, dim]; cos and sin are [T, qk_rope_head_dim // 2]."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head = cfg.n_head
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
            cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        q_width = cfg.n_head * (self.nope + self.rope)
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, q_width, bias=False)
        else:  # DeepSeek-V2-Lite: queries projected directly
            self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.n_head * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_head * self.v_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, H = x.size(0), x.size(1), self.n_head
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        q = q.view(B, T, H, self.nope + self.rope).transpose(1, 2)  # (B, H, T, nope + rope)
        q_nope, q_rope = torch.split(q, [self.nope, self.rope], dim=-1)
        latent, k_rope = torch.split(self.wkv_a(x), [self.kv_rank, self.rope], dim=-1)
        k_rope = k_rope.view(B, 1, T, self.rope)  # one rotary key head for all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(B, T, H, self.nope + self.v_dim)
        k_nope, v = torch.split(kv.transpose(1, 2), [self.nope, self.v_dim], dim=-1)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, H, T, self.rope)), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, v_dim)
        return self.wo(y.transpose(1, 2).reshape(B, T, H * self.v_dim))
