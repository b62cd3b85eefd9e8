"""A mixture-of-experts decoder in the Mixtral layout.

Llama's blocks (RMSNorm, rotary embeddings, grouped-query attention) with the SwiGLU
feed-forward replaced by `SparseMoE`: a router picks `top_k` of `n_experts` SwiGLU experts
per token and the output is their weighted sum (Jiang et al. 2024, "Mixtral of Experts",
eq. 1-2). Optional shared experts run on every token behind a sigmoid gate, as Qwen2-MoE.
The first `dense_layers` blocks may keep a dense SwiGLU feed-forward of width `dense_ffn`
instead, as DeepSeek-V3's first three of 61 (DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report", arXiv 2412.19437, §4.2). With `kv_lora_rank` > 0 the attention is DeepSeek's
multi-head latent attention (`autopar.models.mla`). The layer itself (`SparseMoE`, the
dropless feed-forward on one device) and its routing live in `autopar.kernels.sparse_moe`
and `autopar.kernels.routing`, which the expert-parallel kernel and the cost model share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.kernels.routing import SOFTMAX, check_routing
from autopar.kernels.sparse_moe import SparseMoE, SwiGLU
from autopar.models.llama import Attention, RMSNorm, rope_tables
from autopar.models.mla import MLAttention


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
